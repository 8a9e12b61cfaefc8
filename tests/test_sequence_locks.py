"""cache_service.engine.sequence_locks: batches of per-sequence locks (pure asyncio logic)."""

from __future__ import annotations

import asyncio
import random

import pytest

from cache_service.engine.sequence_locks import SequenceLocks


async def _waiting_batch(
    locks: SequenceLocks, held: list[str], wanted: list[str]
) -> asyncio.Task[None]:
    """`held` taken, then a task acquiring `wanted`, left waiting."""
    await locks.acquire(held)
    task = asyncio.create_task(locks.acquire(wanted))
    await asyncio.sleep(0)
    return task


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel `task` and see it end cancelled."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_free_batch_is_taken_at_once_and_an_overlapping_one_waits_for_it() -> None:
    async def scenario() -> None:
        locks = SequenceLocks()
        order: list[str] = []
        await locks.acquire(["a", "b", "c"])
        assert all(locks.held(s) for s in "abc")

        async def second() -> None:
            async with locks.holding(["c", "d"]):
                order.append("second")

        async with locks.holding(["x", "y"]):  # disjoint: no wait
            order.append("disjoint")
        task = asyncio.create_task(second())
        await asyncio.sleep(0)
        # Waiting for "c", the first of its ids: "d", after it, is not taken yet.
        assert order == ["disjoint"] and not locks.held("d") and not task.done()
        locks.release(["a", "b", "c"])
        await task
        assert order == ["disjoint", "second"]
        assert not any(locks.held(s) for s in "abcdxy")
        assert locks._waiters == {}

    asyncio.run(scenario())


def test_waiters_are_served_first_come_first_served_and_a_free_batch_never_overtakes() -> None:
    async def scenario() -> None:
        locks = SequenceLocks()
        served: list[int] = []
        await locks.acquire(["s"])

        async def waiter(n: int) -> None:
            async with locks.holding(["s"]):
                served.append(n)
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(waiter(n)) for n in range(4)]
        await asyncio.sleep(0)
        # Held with waiters: a batch naming it must queue too, after them.
        late = asyncio.create_task(waiter(99))
        await asyncio.sleep(0)
        locks.release(["s"])
        await asyncio.gather(*tasks, late)
        assert served == [0, 1, 2, 3, 99]
        assert not locks.held("s") and locks._waiters == {}

    asyncio.run(scenario())


def test_a_batch_cancelled_while_waiting_holds_nothing_and_is_skipped() -> None:
    async def scenario() -> None:
        locks = SequenceLocks()
        # Takes "a" at once, then waits for "b": cancelled there, it gives "a" back.
        task = await _waiting_batch(locks, ["b"], ["a", "b"])
        assert locks.held("a")
        await _cancelled(task)
        assert not locks.held("a") and locks.held("b")
        after = asyncio.create_task(locks.acquire(["b"]))
        await asyncio.sleep(0)
        locks.release(["b"])  # the cancelled waiter is skipped: "b" goes to `after`
        await after
        assert locks.held("b")
        locks.release(["b"])
        assert not locks.held("b") and locks._waiters == {}

    asyncio.run(scenario())


def test_a_lock_handed_over_as_its_waiter_is_cancelled_is_given_back() -> None:
    async def scenario() -> None:
        locks = SequenceLocks()
        task = await _waiting_batch(locks, ["a"], ["a"])
        locks.release(["a"])  # handed to the task, which has not resumed yet
        assert locks.held("a")
        await _cancelled(task)  # ... which is cancelled before it does
        assert not locks.held("a") and locks._waiters == {}

    asyncio.run(scenario())


def test_random_overlapping_batches_never_share_a_sequence_and_all_finish() -> None:
    # Sorted batches over a few ids, some cancelled midway: no id is ever held by two
    # batches, nobody deadlocks, and nothing stays held at the end.
    async def scenario() -> None:
        locks = SequenceLocks()
        rng = random.Random(3)
        ids = [f"s{i}" for i in range(6)]
        inside: set[str] = set()
        finished = 0

        async def batch(order: list[str]) -> None:
            nonlocal finished
            async with locks.holding(order):
                assert inside.isdisjoint(order)
                inside.update(order)
                try:
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
                finally:  # also when cancelled inside
                    inside.difference_update(order)
            finished += 1

        tasks = []
        for _ in range(300):
            order = sorted(rng.sample(ids, rng.randint(1, 4)))
            tasks.append(asyncio.create_task(batch(order)))
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        for t in rng.sample(tasks, 30):
            t.cancel()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
        assert finished + cancelled == 300 and finished >= 270
        assert not inside and not any(locks.held(s) for s in ids)
        assert locks._waiters == {}

    asyncio.run(scenario())


def test_try_acquire_takes_a_free_batch_now_and_nothing_of_a_held_one() -> None:
    locks = SequenceLocks()
    assert locks.try_acquire(["a", "b"])
    assert locks.held("a") and locks.held("b")
    assert not locks.try_acquire(["b", "c"])  # "b" is held: none taken, "c" included
    assert not locks.held("c")
    locks.release(["a", "b"])
    assert locks.try_acquire(["b", "c"])
