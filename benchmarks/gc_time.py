"""Time the garbage collector spends, per generation, in this process (a benchmark
diagnostic): `GCTimer` hooks `gc.callbacks` while entered; `line()` says how many
collections of each generation ran and how long they took in all, and the longest.

The collector runs on whichever thread allocates; in the service that is mostly the
event-loop thread, where a full collection stalls every client at once.
"""

from __future__ import annotations

import gc
import time
from typing import Any

__all__ = ["GCTimer"]


class GCTimer:
    """Collections and their seconds per generation while entered (re-entrant: `reset`
    starts a new count)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0
        self._started: float | None = None

    def _hook(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            spent = time.perf_counter() - self._started
            self._started = None
            generation = info["generation"]
            self.counts[generation] += 1
            self.seconds[generation] += spent
            self.longest = max(self.longest, spent)

    def reset(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0

    def __enter__(self) -> GCTimer:
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._hook)

    def line(self) -> str:
        """e.g. "gc 120/11/2 collections, 14.2 ms (full 9.1 ms), longest 4.6 ms"."""
        counts = "/".join(map(str, self.counts))
        return (
            f"gc {counts} collections, {sum(self.seconds) * 1e3:.1f} ms "
            f"(full {self.seconds[2] * 1e3:.1f} ms), longest {self.longest * 1e3:.1f} ms"
        )
