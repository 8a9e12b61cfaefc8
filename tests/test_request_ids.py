"""RequestLedger: the outcome of a request id is applied once and replayed (pure logic, a
test clock)."""

from __future__ import annotations

import asyncio

import pytest

from cache_service.engine.request_ids import (
    MAX_REQUEST_ID_BYTES,
    RequestLedger,
    check_request_id,
    request_seq_id,
)
from cache_service.errors import AlreadyApplied, DeadlinePassed, InvalidRequest, PoolExhausted


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _counting() -> tuple[list[int], object]:
    runs: list[int] = []

    async def call() -> bytes:
        runs.append(1)
        return b"reply-%d" % len(runs)

    return runs, call


def test_a_repeat_answers_the_first_reply_without_running_again() -> None:
    async def main() -> None:
        ledger = RequestLedger(clock=Clock())
        runs, call = _counting()
        assert await ledger.run("t", "r1", call) == b"reply-1"
        assert await ledger.run("t", "r1", call) == b"reply-1"
        assert await ledger.run("other-tenant", "r1", call) == b"reply-2"
        assert len(runs) == 2

    asyncio.run(main())


def test_a_failed_call_is_forgotten_and_a_deadline_is_remembered() -> None:
    async def main() -> None:
        clock = Clock()
        ledger = RequestLedger(clock=clock)

        async def full() -> bytes:
            raise PoolExhausted("no room")

        with pytest.raises(PoolExhausted):
            await ledger.run("t", "r", full)
        runs, call = _counting()
        assert await ledger.run("t", "r", call) == b"reply-1"  # ran afresh

        async def late() -> bytes:
            raise DeadlinePassed("late")

        with pytest.raises(DeadlinePassed):
            await ledger.run("t", "d", late)
        with pytest.raises(DeadlinePassed):
            await ledger.run("t", "d", call, deadline=clock.now + 60)
        # An unknown id whose deadline already passed is refused, and that is remembered.
        with pytest.raises(DeadlinePassed):
            await ledger.run("t", "x", call, deadline=clock.now - 1)
        with pytest.raises(DeadlinePassed):
            await ledger.run("t", "x", call, deadline=clock.now + 60)
        assert len(runs) == 1

    asyncio.run(main())


def test_a_repeat_waits_for_the_running_call_or_answers_once_its_deadline_passed() -> None:
    async def main() -> None:
        clock = Clock()
        ledger = RequestLedger(clock=clock)
        gate = asyncio.Event()
        runs: list[int] = []

        async def slow() -> bytes:
            runs.append(1)
            await gate.wait()
            return b"done"

        first = asyncio.create_task(ledger.run("t", "r", slow, deadline=clock.now + 5))
        await asyncio.sleep(0)
        repeat = asyncio.create_task(ledger.run("t", "r", slow))
        await asyncio.sleep(0)
        assert not repeat.done()
        gate.set()
        assert await first == b"done" and await repeat == b"done"
        assert len(runs) == 1
        # A running call past its deadline can no longer commit: a repeat says so at once.
        gate.clear()
        held = asyncio.create_task(ledger.run("t", "h", slow, deadline=clock.now + 5))
        await asyncio.sleep(0)
        clock.now += 6
        with pytest.raises(DeadlinePassed):
            await ledger.run("t", "h", slow)
        gate.set()
        await held

    asyncio.run(main())


def test_ids_expire_after_the_ttl_and_replies_beyond_the_budget_become_already_applied() -> None:
    async def main() -> None:
        clock = Clock()
        ledger = RequestLedger(ttl_s=10, max_ids=3, max_reply_bytes=16, clock=clock)

        def returning(reply: bytes):
            async def call() -> bytes:
                return reply

            return call

        await ledger.run("t", "a", returning(b"x" * 10))
        await ledger.run("t", "b", returning(b"y" * 10))  # over 16 bytes: a's reply goes
        with pytest.raises(AlreadyApplied, match="'a'"):
            await ledger.run("t", "a", returning(b"again"))
        assert await ledger.run("t", "b", returning(b"again")) == b"y" * 10
        await ledger.run("t", "c", returning(b""))
        await ledger.run("t", "d", returning(b""))  # max_ids 3: the oldest (a) goes
        assert not ledger.known("t", "a") and len(ledger) == 3
        clock.now += 11
        await ledger.run("t", "e", returning(b""))
        assert len(ledger) == 1 and ledger.known("t", "e")

    asyncio.run(main())


def test_request_ids_are_bounded_and_derived_ids_differ_by_tenant() -> None:
    assert check_request_id("x" * MAX_REQUEST_ID_BYTES) == "x" * MAX_REQUEST_ID_BYTES
    with pytest.raises(InvalidRequest, match="request_id"):
        check_request_id("x" * (MAX_REQUEST_ID_BYTES + 1))
    with pytest.raises(InvalidRequest):
        check_request_id("é" * 65)  # 130 bytes
    a, b = request_seq_id("acme", "r1"), request_seq_id("globex", "r1")
    assert a != b and a == request_seq_id("acme", "r1") and len(a) == 22
