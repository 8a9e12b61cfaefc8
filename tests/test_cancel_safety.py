"""`cancel_safety.run_to_completion`: what it awaits always finishes, and a cancellation of
the caller lands only afterwards."""

from __future__ import annotations

import asyncio

import pytest

from cache_service.engine.cancel_safety import run_to_completion


def test_a_result_or_an_error_comes_back_as_from_a_plain_await() -> None:
    async def scenario() -> None:
        async def value() -> int:
            await asyncio.sleep(0)
            return 7

        async def fails() -> None:
            await asyncio.sleep(0)
            raise ValueError("bad")

        assert await run_to_completion(value()) == 7
        with pytest.raises(ValueError, match="bad"):
            await run_to_completion(fails())
        done = asyncio.get_running_loop().create_future()
        done.set_result("ready")
        assert await run_to_completion(done) == "ready"  # already finished: no wait

    asyncio.run(scenario())


@pytest.mark.parametrize("cancels", [1, 3])
def test_a_cancelled_caller_waits_for_the_work_then_is_cancelled(cancels: int) -> None:
    async def scenario() -> None:
        gate = asyncio.Event()
        finished = []

        async def work() -> str:
            await gate.wait()
            finished.append(True)
            return "written"

        inner = asyncio.ensure_future(work())
        caller = asyncio.ensure_future(run_to_completion(inner))
        await asyncio.sleep(0)
        for _ in range(cancels):  # a deadline, then the client going away, ...
            caller.cancel()
            await asyncio.sleep(0)
        assert not caller.done() and not inner.cancelled()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert finished == [True] and inner.result() == "written"

    asyncio.run(scenario())


def test_the_work_failing_after_a_cancellation_leaves_no_unretrieved_error() -> None:
    async def scenario() -> list[dict[str, object]]:
        errors: list[dict[str, object]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        gate = asyncio.Event()

        async def work() -> None:
            await gate.wait()
            raise RuntimeError("worker lost")

        caller = asyncio.ensure_future(run_to_completion(work()))
        await asyncio.sleep(0)
        caller.cancel()
        await asyncio.sleep(0)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        return errors

    import gc

    errors = asyncio.run(scenario())
    gc.collect()
    assert errors == []
