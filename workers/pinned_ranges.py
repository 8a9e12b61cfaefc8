"""Host memory the process page-locked for CUDA itself, as address ranges told by the code
that locks it, so a hot path can ask "is this tensor pinned?" without asking the driver.

Why: ``Tensor.is_pinned()`` asks the CUDA driver every time (torch looks for a device with
a primary context, then calls cudaPointerGetAttributes): about 5 us per tensor on the
H200 host, three tensors per decode-graph replay. The inputs on that path are views into
a few long-lived shared regions that the server registered with ``cudaHostRegister``
(workers.cuda_pinning). The owner of each registration tells this registry:
`PinnedRanges.add` right after cudaHostRegister succeeded, `PinnedRanges.remove` right
before cudaHostUnregister. So the registry is exact for the memory it holds, and never
needs invalidating by guesswork (an address range learned from ``is_pinned()`` answers
could not tell when its memory is unmapped and the address reused).

What it is not: a record of all pinned memory (torch's own pinned allocations are not in
it); a miss means "ask ``is_pinned()``", not "pageable". And correctness never depends on
it: a pool given "pinned" for pageable memory copies with ``non_blocking=True``, which
CUDA then performs synchronously with respect to the host (cudaMemcpyAsync from pageable
memory returns once the bytes left it), and the pool waits for its copies before it
returns anyway; given "not pinned" for pinned memory, it stages the bytes through its own
pinned buffer (a CPU copy). Either is slower, neither is wrong.
"""

from __future__ import annotations

import bisect
import threading
from typing import Generic, TypeVar

__all__ = ["REGISTERED", "AddressRanges", "PinnedRanges"]

_V = TypeVar("_V")


class AddressRanges(Generic[_V]):
    """Disjoint address ranges ``[start, start + nbytes)`` of host memory, each with a value
    (what the range is: None for a bare pinned range, a file's path for a shared file).

    Thread-safe: changes take a lock and publish a new immutable snapshot, which readers
    (`covers`, `find`) take with one attribute read, lock-free.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ends: dict[int, tuple[int, _V | None]] = {}  # start -> (end exclusive, value)
        # (starts sorted, (end, value) in the same order): what the readers read.
        self._snapshot: tuple[tuple[int, ...], tuple[tuple[int, _V | None], ...]] = ((), ())
        self._values: frozenset[_V | None] = frozenset()
        self.version = 0  # changes with every change of the ranges held

    def __len__(self) -> int:
        """Ranges held."""
        return len(self._snapshot[0])

    def add(self, start: int, nbytes: int, value: _V | None = None) -> None:
        """Record ``[start, start + nbytes)`` (addresses and bytes) with ``value``.

        A range overlapping one held is not recorded (CUDA refuses overlapping
        registrations and no two mappings share addresses, so this is a caller's mistake;
        the readers then keep answering from the ranges they have, and a tensor in the new
        one is a miss).

        Raises:
            ValueError: nbytes < 1 or start < 0.
        """
        if nbytes < 1 or start < 0:
            raise ValueError(
                f"an address range needs start >= 0 and nbytes >= 1: {start}, {nbytes}"
            )
        end = start + nbytes
        with self._lock:
            if any(s < end and start < e for s, (e, _) in self._ends.items()):
                return
            self._ends[start] = (end, value)
            self._publish()

    def remove(self, start: int) -> None:
        """Forget the range starting at `start` (a no-op when none does)."""
        with self._lock:
            if self._ends.pop(start, None) is not None:
                self._publish()

    def covers(self, start: int, nbytes: int) -> bool:
        """Whether ``[start, start + nbytes)`` (nbytes >= 1) lies within one range held."""
        return self.find(start, nbytes) is not None

    def find(self, start: int, nbytes: int) -> tuple[int, _V | None] | None:
        """(the range's start, its value) of the one range holding ``[start, start +
        nbytes)`` (nbytes >= 1); None when no range holds all of it."""
        starts, ends = self._snapshot
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or start + nbytes > ends[i][0]:
            return None
        return starts[i], ends[i][1]

    def holds_value(self, value: _V) -> bool:
        """Whether a range held has ``value``."""
        return value in self._values

    def _publish(self) -> None:
        """A new snapshot of `_ends` (under the lock)."""
        starts = tuple(sorted(self._ends))
        self._snapshot = (starts, tuple(self._ends[s] for s in starts))
        self._values = frozenset(v for _, v in self._ends.values())
        self.version += 1


class PinnedRanges(AddressRanges[None]):
    """Host memory page-locked for CUDA by this process (see the module's docstring); the
    owner of each registration adds its range right after cudaHostRegister succeeded and
    removes it right before cudaHostUnregister."""


# The process's registrations (workers.cuda_pinning keeps it up to date).
REGISTERED = PinnedRanges()
