"""A call commits entirely and answers OK, or answers an error and commits nothing, also
when its deadline passes mid-call, on every transport (unary, Session stream, local
session); a request id makes a retried call apply once.

A real server on a loopback port over a real in-process pool; the pool is made slow by a
delay injected in front of its data calls (`Recording`), so a call's deadline passes
while its worker round runs.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from service_support import HQ, LAYOUT, Mirror, ServiceHarness, service_config

from cache_service.client import AppendAttendItem, DeadlineExceededError, KVCacheClient
from cache_service.engine.worker_clients import LocalWorkerClient
from workers.config import PoolConfig

pytestmark = pytest.mark.timeout(180)

TRANSPORTS = ("unary", "session", "local")
TIMEOUT_S = 0.3
SLOW_S = 3 * TIMEOUT_S  # a round this slow always ends past the call's deadline


_DATA_CALLS = frozenset(("write", "run_round"))


class Slowed:
    """A real pool whose data calls (writes, attention rounds) first wait `delays` in turn
    (cycled), seconds; everything else goes straight to the pool."""

    def __init__(self, inner: Any, delays: list[float]) -> None:
        self.inner = inner
        self._delays = itertools.cycle(delays)

    @property
    def worker_id(self) -> str:
        return self.inner.worker_id

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if name not in _DATA_CALLS:
            return target

        async def slowed(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(next(self._delays))
            return await target(*args, **kwargs)

        return slowed


def _client(h: ServiceHarness, transport: str, grace_s: float) -> KVCacheClient:
    return KVCacheClient(
        h.address,
        session=transport != "unary",
        local_session=True if transport == "local" else False,
        shared_memory=False,
        deadline_grace_s=grace_s,
        max_attempts=20,
    )


def _settle(h: ServiceHarness) -> None:
    """Until no call is in flight on the server (a call refused for its deadline may still
    wait for its round when the client has its answer)."""
    while h.call(h.coordinator.block_manager.unfinished_writes):
        time.sleep(0.02)


def _written(h: ServiceHarness, seq_id: str) -> tuple[int, ...]:
    return h.call(h.coordinator.block_manager.sequence_info, "default", seq_id).written


@pytest.mark.parametrize("grace_s", [2.0, 0.1], ids=["verdict-in-grace", "verdict-asked-again"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_call_past_its_deadline_mid_call_is_applied_iff_it_answers_ok(
    transport: str, grace_s: float
) -> None:
    """Every call answers OK (then its token is written and its output is attention over
    exactly the OK calls' tokens) or DEADLINE_EXCEEDED (then nothing changed); the written
    length equals the OK count after every call. Slow rounds always miss the deadline."""
    delays = [0.0, SLOW_S, 0.0, 0.0, SLOW_S]
    worker = Slowed(LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=64)), delays)
    g = torch.Generator().manual_seed(7)
    with (
        ServiceHarness(service_config(), [worker]) as h,
        _client(h, transport, grace_s) as client,
    ):
        seq = client.create_sequence()
        mirror = Mirror(seq.seq_id, LAYOUT.num_layers)
        ok = late = 0
        for step in range(len(delays) * 3):
            k = torch.randn((1, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=g)
            v = torch.randn((1, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=g)
            q = torch.randn((1, 1, HQ, LAYOUT.head_dim), generator=g)
            try:
                out = client.append_attend_batch(
                    0, [seq.seq_id], [[step]], k, v, q, timeout_s=TIMEOUT_S
                )
            except DeadlineExceededError:
                late += 1
            else:
                ok += 1
                mirror.add(0, k[0], v[0])
                ref, _ = mirror.reference(0, q[0])
                torch.testing.assert_close(out[0].double(), ref, atol=1e-4, rtol=1e-4)
            assert _written(h, seq.seq_id)[0] == ok, f"call {step}: written != OK calls"
        _settle(h)
        assert _written(h, seq.seq_id)[0] == ok
        h.check_integrity()
        # Each slow round missed its deadline; every call ended one way or the other.
        assert late >= delays.count(SLOW_S) * 3
        assert ok + late == len(delays) * 3


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_retried_request_id_applies_once_and_answers_the_first_output(transport: str) -> None:
    worker = LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=64))
    g = torch.Generator().manual_seed(3)
    with (
        ServiceHarness(service_config(), [worker]) as h,
        _client(h, transport, 1.0) as client,
    ):
        seq = client.create_sequence()
        k = torch.randn((1, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=g)
        v = torch.randn((1, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=g)
        q = torch.randn((1, 1, HQ, LAYOUT.head_dim), generator=g)
        first = client.append_attend_batch(0, [seq.seq_id], [[5]], k, v, q, request_id="step-1")
        again = client.append_attend_batch(0, [seq.seq_id], [[5]], k, v, q, request_id="step-1")
        torch.testing.assert_close(again, first, atol=0, rtol=0)
        assert _written(h, seq.seq_id) == (1, 0)
        # Another id is another call.
        client.append_attend_batch(0, [seq.seq_id], [[6]], k, v, q, request_id="step-2")
        assert _written(h, seq.seq_id) == (2, 0)
        # Append and the unary AppendAttend, retried, apply once too.
        for _ in range(2):
            client.append(seq.seq_id, [5], k[0], v[0], layer=1, request_id="append-1")
        assert _written(h, seq.seq_id) == (2, 1)
        item = AppendAttendItem(seq.seq_id, [6], k[0], v[0], q[0])
        first = client.append_attend(1, [item], request_id="aa-1")
        again = client.append_attend(1, [item], request_id="aa-1")
        torch.testing.assert_close(again, first, atol=0, rtol=0)
        assert _written(h, seq.seq_id) == (2, 2)
        h.check_integrity()


def test_a_retried_create_returns_the_same_sequence_also_after_a_restart(tmp_path: Path) -> None:
    store = str(tmp_path / "meta.db")
    workers = [LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=64))]
    h = ServiceHarness(service_config(store_path=store), workers)
    try:
        with KVCacheClient(h.address) as client:
            a = client.create_sequence(request_id="create-1")
            b = client.create_sequence(request_id="create-1")
            assert a.seq_id == b.seq_id
            fork = client.fork(a.seq_id, request_id="fork-1")
            assert client.fork(a.seq_id, request_id="fork-1").seq_id == fork.seq_id
            assert {e.seq_id for e in client.list_sequences()} == {a.seq_id, fork.seq_id}
    finally:
        h.workers = None  # the pool outlives the coordinator, like a detached actor
        h.stop()
    h = ServiceHarness(service_config(store_path=store), workers)
    try:
        with KVCacheClient(h.address) as client:
            again = client.create_sequence(request_id="create-1")
            assert again.seq_id == a.seq_id
            assert client.create_sequence(request_id="create-2").seq_id != a.seq_id
            assert len(client.list_sequences()) == 3
        h.check_integrity()
    finally:
        h.stop()


def test_a_call_already_past_its_deadline_changes_nothing() -> None:
    """A retry asking for a verdict the server never had: DEADLINE_EXCEEDED, remembered, so
    the same request id arriving later is not applied either."""
    worker = LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=64))
    with (
        ServiceHarness(service_config(), [worker]) as h,
        KVCacheClient(h.address, session=False) as client,
    ):
        seq = client.create_sequence()
        k = torch.zeros((1, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim))
        q = torch.zeros((1, 1, HQ, LAYOUT.head_dim))
        from cache_service.wire.request_codec import call_fields, encode_append_attend_batch

        body = encode_append_attend_batch(0, [seq.seq_id], [[1]], k, k, q, False)
        late = body + call_fields("lost-1", 1)
        with pytest.raises(Exception) as caught:
            client._append_attend_batch_raw(late, timeout=5)
        assert "DEADLINE_EXCEEDED" in str(caught.value)
        # The same id with a fresh deadline: still not applied.
        fresh = body + call_fields("lost-1", 5_000_000)
        with pytest.raises(Exception) as caught:
            client._append_attend_batch_raw(fresh, timeout=5)
        assert "DEADLINE_EXCEEDED" in str(caught.value)
        assert _written(h, seq.seq_id) == (0, 0)
        h.check_integrity()


def test_the_commit_deadline_is_the_earlier_one_and_keeps_a_reply_margin() -> None:
    from cache_service.engine.call_deadline import (
        REPLY_MARGIN_S,
        REPLY_MARGIN_SHARE,
        check_deadline,
        commit_deadline,
    )
    from cache_service.errors import DeadlinePassed

    assert commit_deadline(0, None) == 0.0  # no deadline at all
    before = time.monotonic()
    # timeout_us wins when it is the earlier; the gRPC deadline counts in full then.
    assert before + 0.3 <= commit_deadline(300_000, 2.0) <= time.monotonic() + 0.3
    assert before + 0.2 <= commit_deadline(900_000, 0.2) <= time.monotonic() + 0.2
    # Without timeout_us the gRPC deadline counts less the reply margin.
    for left in (1.0, 0.1):
        margin = min(REPLY_MARGIN_S, left * REPLY_MARGIN_SHARE)
        got = commit_deadline(0, left)
        assert before + left - margin <= got <= time.monotonic() + left - margin
    check_deadline(0.0)
    check_deadline(time.monotonic() + 60)
    with pytest.raises(DeadlinePassed, match="nothing was changed"):
        check_deadline(time.monotonic() - 1)
