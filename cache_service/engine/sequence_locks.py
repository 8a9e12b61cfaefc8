"""Per-sequence mutual exclusion for the coordinator, taken a whole batch at a time.

Every call that reads or changes a sequence holds that sequence's lock while it runs, so
a call on a sequence waits for the one in flight on it (and a free waits for both). A
decode step's call names every sequence of the batch: 32 locks per layer at batch 32. With
one ``asyncio.Lock`` per sequence that cost 64 awaited acquire and release calls per
layer, tens of microseconds of the coordinator's event loop; here a batch whose sequences
are all free is taken with one set operation, and only a batch that meets a held sequence
waits, sequence by sequence in the caller's order (sorted: two batches can then never
wait for each other).

A sequence with waiters is never free: its holder hands it straight to the first waiter
still waiting (first come, first served), so a batch taken at once never overtakes one.

A holder that waits for nobody but its client (a step lease, `step_leases`) is told when
someone waits for one of its sequences (`on_contended`), and gives them back.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from types import TracebackType

__all__ = ["SequenceLocks"]


class SequenceLocks:
    """Locks named by sequence id (not reentrant). One event loop's tasks only."""

    def __init__(self) -> None:
        self._held: set[str] = set()
        self._waiters: dict[str, collections.deque[asyncio.Future[None]]] = {}
        # Called with a held sequence's id when a caller starts waiting for it.
        self.on_contended: Callable[[str], None] | None = None

    def holding(self, order: Sequence[str]) -> _Holding:
        """``async with locks.holding(order)``: the locks of ``order`` (distinct ids,
        sorted) from entry to exit."""
        return _Holding(self, order)

    def held(self, seq_id: str) -> bool:
        """Whether ``seq_id``'s lock is held."""
        return seq_id in self._held

    def try_acquire(self, order: Sequence[str]) -> bool:
        """Take the locks of ``order`` now if none of them is held (then True); else take
        none and return False (the caller waits with `acquire`)."""
        held = self._held
        if held.isdisjoint(order):
            held.update(order)
            return True
        return False

    async def acquire(self, order: Sequence[str]) -> None:
        """Take the locks of ``order`` (distinct ids, sorted), waiting for held ones in
        that order; cancelled while waiting, it holds none of them."""
        held = self._held
        if held.isdisjoint(order):
            held.update(order)
            return
        taken: list[str] = []
        for seq_id in order:
            if seq_id not in held:
                held.add(seq_id)
                taken.append(seq_id)
                continue
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(seq_id, collections.deque()).append(waiter)
            if self.on_contended is not None:
                self.on_contended(seq_id)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    taken.append(seq_id)  # handed over just as the wait ended
                else:
                    waiter.cancel()  # the holder's release skips it
                self.release(taken)
                raise
            taken.append(seq_id)  # handed over by its holder: still in `held`

    def release(self, order: Sequence[str]) -> None:
        """Give back the locks of ``order``: each to its first live waiter, else free."""
        if not self._waiters:  # nobody waits for any lock: one set operation
            self._held.difference_update(order)
            return
        for seq_id in order:
            queue = self._waiters.get(seq_id)
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # stays held: it is the waiter's now
                    break
            else:
                self._held.discard(seq_id)
                if queue is not None:
                    del self._waiters[seq_id]


class _Holding:
    """The async context manager of :meth:`SequenceLocks.holding`."""

    __slots__ = ("_locks", "_order")

    def __init__(self, locks: SequenceLocks, order: Sequence[str]) -> None:
        self._locks = locks
        self._order = order

    async def __aenter__(self) -> None:
        await self._locks.acquire(self._order)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._locks.release(self._order)
