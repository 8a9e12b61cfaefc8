"""RunningChecks: what voids a check running beside the traffic, and its slots."""

from __future__ import annotations

import asyncio

import pytest

from cache_service.engine.running_checks import RunningCheck, RunningChecks


def check(seqs: set[str], blocks: dict[str, set[int]]) -> RunningCheck:
    return RunningCheck(frozenset(seqs), {w: frozenset(b) for w, b in blocks.items()})


def test_released_blocks_void_only_the_checks_reading_them_on_that_worker() -> None:
    async def main() -> None:
        checks = RunningChecks(limit=4)
        gate = asyncio.Event()
        a = check({"a"}, {"w0": {1, 2}, "w1": {7}})
        b = check({"b"}, {"w0": {3}})
        for c in (a, b):
            await checks.start(c, gate.wait)
        assert len(checks) == 2
        checks.blocks_released({"w1": [1, 2, 3]})  # the same ids on another worker
        assert a.valid() and b.valid()
        checks.blocks_released({"w0": [9, 2]})
        assert not a.valid() and b.valid()
        gate.set()
        await checks.wait()
        assert len(checks) == 0
        # Finished checks are forgotten: later releases touch nothing.
        checks.blocks_released({"w0": [3]})
        assert b.valid()

    asyncio.run(main())


def test_cancelled_writes_void_the_checks_of_those_sequences() -> None:
    async def main() -> None:
        checks = RunningChecks()
        gate = asyncio.Event()
        a, b = check({"a", "x"}, {"w0": {1}}), check({"b"}, {"w0": {1}})
        for c in (a, b):
            await checks.start(c, gate.wait)
        checks.writes_cancelled(["x", "zz"])
        assert not a.valid() and b.valid()
        gate.set()
        await checks.wait()

    asyncio.run(main())


def test_a_check_without_a_free_slot_waits_registered() -> None:
    async def main() -> None:
        checks = RunningChecks(limit=1)
        first_gate, ran = asyncio.Event(), []
        first = check({"a"}, {"w0": {1}})
        await checks.start(first, first_gate.wait)

        async def second_run() -> None:
            ran.append("second")

        second = check({"b"}, {"w0": {2}})
        starting = asyncio.ensure_future(checks.start(second, second_run))
        await asyncio.sleep(0.01)
        assert not starting.done() and ran == []
        # Waiting for its slot, it is already registered: a change now voids it.
        checks.blocks_released({"w0": [2]})
        assert not second.valid()
        first_gate.set()
        await starting
        await checks.wait()
        assert ran == ["second"] and len(checks) == 0

    asyncio.run(main())


def test_a_failing_check_frees_its_slot() -> None:
    async def main() -> None:
        checks = RunningChecks(limit=1)

        async def boom() -> None:
            raise RuntimeError("worker gone")

        task = await checks.start(check({"a"}, {}), boom)
        await asyncio.wait({task})
        assert isinstance(task.exception(), RuntimeError)
        ran = []

        async def ok() -> None:
            ran.append(1)

        await checks.start(check({"b"}, {}), ok)
        await checks.wait()
        assert ran == [1]

    asyncio.run(main())


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_the_limit_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="limit must be a positive int"):
        RunningChecks(limit=bad)  # type: ignore[arg-type]
