"""Online correctness checks running beside the traffic, and what voids them.

The coordinator answers a sampled round's callers first and checks the round afterwards
(`cache_service.engine.correctness_check`), so the check must learn of anything that could change
the blocks it reads before its workers read them:

- a block it reads goes free (`BlockManager.take_released`: a freed sequence, a
  copy-on-write copy replacing a shared block whose other users left, an eviction): the
  block may be poisoned or handed to another owner and written;
- a write of one of its sequences is cancelled (`Coordinator._cancel_writes`): the
  positions it reserved may be written again with other values.

Either marks the check void; its result is discarded rather than judged. A check is
registered while its round's callers still hold their sequences (nothing can have changed
yet) and then waits for one of a few slots, so checks sampled faster than the workers
recompute them hold back their rounds instead of piling up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["RunningCheck", "RunningChecks"]


@dataclass(eq=False)
class RunningCheck:
    """One check in flight.

    Attributes:
        seq_ids: the round's sequences.
        blocks: the blocks the check reads, per worker.
        void: whether something changed under it (see the module docstring).
    """

    seq_ids: frozenset[str]
    blocks: Mapping[str, frozenset[int]]
    void: bool = False

    def valid(self) -> bool:
        """Whether the check may still judge (nothing it reads changed)."""
        return not self.void


class RunningChecks:
    """The checks in flight, at most `limit` running at once.

    Args:
        limit: checks running at once (>= 1); a round whose check finds no free slot holds
            its callers until one frees.
    """

    def __init__(self, limit: int = 2) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        self._checks: set[RunningCheck] = set()
        self._slots = asyncio.Semaphore(limit)
        self._tasks: set[asyncio.Task[object]] = set()

    def __len__(self) -> int:
        return len(self._checks)

    async def start(
        self, check: RunningCheck, run: Callable[[], Awaitable[object]]
    ) -> asyncio.Task[object]:
        """Register `check` (from now on a change voids it), wait for a slot, then run
        ``run()`` in a task of its own, which frees the slot and forgets the check when done.
        """
        self._checks.add(check)
        try:
            await self._slots.acquire()
        except BaseException:
            self._checks.discard(check)
            raise

        async def running() -> object:
            try:
                return await run()
            finally:
                self._checks.discard(check)
                self._slots.release()

        task = asyncio.get_running_loop().create_task(running())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def blocks_released(self, released: Mapping[str, Iterable[int]]) -> None:
        """Void the checks reading any of these blocks (per worker) that went free."""
        if not self._checks:
            return
        for worker_id, blocks in released.items():
            hit = [c for c in self._checks if not c.void and worker_id in c.blocks]
            if not hit:
                continue
            freed = set(blocks)
            for check in hit:
                if not freed.isdisjoint(check.blocks[worker_id]):
                    check.void = True

    def writes_cancelled(self, seq_ids: Iterable[str]) -> None:
        """Void the checks of rounds holding any of these sequences."""
        if not self._checks:
            return
        cancelled = set(seq_ids)
        for check in self._checks:
            if not cancelled.isdisjoint(check.seq_ids):
                check.void = True

    async def wait(self) -> None:
        """Until every check started so far has finished (tests, shutdown)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
