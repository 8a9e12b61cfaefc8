"""The `Session` stream over a real port: batch calls as messages of one stream give what
their unary RPCs give (outputs equal to dense attention, the same errors), a failed call
leaves the stream open and the state unchanged, deadlines, old servers, concurrent threads
and shutdown are handled. Tests taking `transport` run over the gRPC stream and over a
local session (the same messages on the server's Unix socket; test_local_sessions)."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
import torch
from service_support import (
    HQ,
    LAYOUT,
    Mirror,
    Recording,
    ServiceHarness,
    local_workers,
    service_config,
)

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.client import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheClient,
    NotFoundError,
    UnavailableError,
)
from cache_service.client.call_stream import CallStream
from cache_service.wire.session_codec import APPEND_ATTEND_BATCH, session_message

D, HKV, NL = LAYOUT.head_dim, LAYOUT.num_kv_heads, LAYOUT.num_layers
SERVICE = "kvcache.v1.KVCache"


# How a test's client carries its session: KVCacheClient's local_session.
TRANSPORTS = {"grpc": False, "local": True}


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request) -> str:
    return request.param


def session_of(client: KVCacheClient, transport: str) -> object:
    """The object carrying the client's session calls now."""
    return client._local if transport == "local" else client._session


@pytest.fixture(scope="module")
def svc():
    with ServiceHarness(service_config(**{"metrics.enabled": True, "metrics.port": 0}),
                        local_workers(1, 128)) as harness:  # fmt: skip
        yield harness


def counts(svc: ServiceHarness) -> dict[tuple[str, str], float]:
    """RPC and session-call counts by (method, code)."""
    out = {}
    for metric in svc.service.metrics.rpc_requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[(sample.labels["method"], sample.labels["code"])] = sample.value
    return out


def decode_steps(
    client: KVCacheClient, n_seqs: int, steps: int, seed: int, *, bitwise: bool = True
) -> None:
    """Decode steps through `client`, every output checked against dense attention and each
    attend_batch against the step's append_attend_batch: bit for bit, or to float32 rounding
    without `bitwise` (for concurrent callers: other threads' calls coalesced beside either
    call pad its batch to other lengths, which sums in another order)."""
    gen = torch.Generator().manual_seed(seed)
    mirrors = [Mirror(client.create_sequence().seq_id, NL) for _ in range(n_seqs)]
    ids = [m.seq_id for m in mirrors]
    for step in range(steps):
        tokens = [[100 + step]] * n_seqs
        for layer in range(NL):
            k = torch.randn(n_seqs, 1, HKV, D, generator=gen)
            v = torch.randn(n_seqs, 1, HKV, D, generator=gen)
            q = torch.randn(n_seqs, 1, HQ, D, generator=gen)
            out = client.append_attend_batch(layer, ids, tokens, k, v, q)
            for i, m in enumerate(mirrors):
                m.add(layer, k[i], v[i])
                ref, _ = m.reference(layer, q[i])
                assert torch.allclose(out[i].double(), ref, atol=1e-5), (step, layer, i)
            att = client.attend_batch(layer, ids, q)
            if bitwise:
                assert torch.equal(att, out)
            else:
                torch.testing.assert_close(att, out, rtol=1e-5, atol=2e-6)
    for m in mirrors:
        client.free(m.seq_id)


@pytest.mark.parametrize("shared_memory", [False, "auto"])
def test_session_calls_equal_dense_attention_and_use_one_stream(
    svc, shared_memory, transport
) -> None:
    before = counts(svc)
    local_before = svc.service.local_sessions.calls
    with KVCacheClient(
        svc.address, shared_memory=shared_memory, local_session=TRANSPORTS[transport]
    ) as client:
        decode_steps(client, n_seqs=3, steps=6, seed=1)
        assert client.local_session_active is (transport == "local")

    def grew(key: tuple[str, str]) -> float:
        return after.get(key, 0) - before.get(key, 0)

    # The stream is recorded when the server sees it end, a moment after the client closed.
    deadline = time.monotonic() + (10 if transport == "grpc" else 0.2)
    while True:
        after = counts(svc)
        if grew(("Session", "OK")) + grew(("Session", "CANCELLED")) or time.monotonic() > deadline:
            break
        time.sleep(0.01)

    assert grew(("Session.AppendAttendBatch", "OK")) == 6 * NL
    assert grew(("Session.AttendBatch", "OK")) == 6 * NL
    assert grew(("AppendAttendBatch", "OK")) == 0  # nothing went unary
    streams = grew(("Session", "OK")) + grew(("Session", "CANCELLED"))
    local_calls = svc.service.local_sessions.calls - local_before
    if transport == "grpc":
        assert (streams, local_calls) == (1, 0)  # one stream
    else:
        assert (streams, local_calls) == (0, 2 * 6 * NL)  # every call on the socket
    svc.check_integrity()


def test_a_failed_call_answers_its_status_keeps_the_stream_and_changes_nothing(
    svc, transport
) -> None:
    with KVCacheClient(
        svc.address, shared_memory=False, local_session=TRANSPORTS[transport]
    ) as client:
        ids = [client.create_sequence().seq_id for _ in range(2)]
        k = torch.randn(2, 1, HKV, D)
        q = torch.randn(2, 1, HQ, D)
        client.append_attend_batch(0, ids, [[1], [2]], k, k, q)
        before = svc.stats()
        stream = session_of(client, transport)
        assert stream is not None
        with pytest.raises(NotFoundError, match="nope"):
            client.append_attend_batch(0, [ids[0], "nope"], [[3], [3]], k, k, q)
        with pytest.raises(InvalidArgumentError, match="layer"):
            client.append_attend_batch(NL + 3, ids, [[3], [3]], k, k, q)
        with pytest.raises(
            InvalidArgumentError, match=r"items\[1\]: position 0 holds token 2, got 9"
        ):
            client.append_attend_batch(1, ids, [[1], [9]], k, k, q)  # layer 1 differs
        with pytest.raises(FailedPreconditionError):
            client.attend_batch(1, ids, q)  # layer 1 not written yet
        assert svc.stats() == before
        svc.check_integrity()
        assert session_of(client, transport) is stream
        out = client.append_attend_batch(1, ids, [[1], [2]], k, k, q)  # still serving
        assert out.shape == (2, 1, HQ, D)
        for s in ids:
            client.free(s)


def test_raw_session_messages_echo_their_call_ids_and_refuse_an_empty_call(svc) -> None:
    channel = grpc.insecure_channel(svc.address)
    try:
        stream = channel.stream_stream(
            f"/{SERVICE}/Session",
            request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionResponse.FromString,
        )
        empty = pb.SessionRequest(call_id=41)
        bad_layer = pb.SessionRequest(
            call_id=42, attend_batch=pb.AttendBatchRequest(layer=NL, seq_ids=["x"])
        )
        replies = list(stream(iter([empty, bad_layer]), timeout=10))
        assert [r.call_id for r in replies] == [41, 42]
        assert replies[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "carries no call" in replies[0].error.message
        assert replies[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        # Bytes that are no SessionRequest end the stream with INVALID_ARGUMENT.
        raw = channel.stream_stream(f"/{SERVICE}/Session")
        with pytest.raises(grpc.RpcError) as info:
            list(raw(iter([b"\xff\xff\xff"]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()


def test_a_call_past_its_deadline_fails_and_the_next_opens_a_new_stream(transport) -> None:
    hold = threading.Event()
    workers = [Recording(w, hold_first=hold) for w in local_workers(1, 64)]
    with ServiceHarness(service_config(), workers) as svc:
        with KVCacheClient(
            svc.address, shared_memory=False, local_session=TRANSPORTS[transport]
        ) as client:
            ids = [client.create_sequence().seq_id]
            k = torch.randn(1, 1, HKV, D)
            q = torch.randn(1, 1, HQ, D)
            # No reply within the grace: the client asks for the verdict, and the server
            # answers that the held call can no longer commit.
            with pytest.raises(DeadlineExceededError, match="passed before it could commit"):
                client.append_attend_batch(0, ids, [[5]], k, k, q, timeout_s=0.3)
            hold.set()
            if transport == "grpc":
                assert client._session._responses is None  # the late stream was dropped
            else:
                assert client._local._sock is None  # the late connection was dropped
            # The cancelled call is not written (the coordinator rolled it back or never
            # committed it); the next call writes position 0 afresh.
            deadline = time.monotonic() + 10
            while svc.call(svc.coordinator.block_manager.unfinished_writes):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            out = client.append_attend_batch(0, ids, [[5]], k, k, q)
            assert out.shape == (1, 1, HQ, D)
            svc.check_integrity()


def test_a_sessions_calls_name_its_connection_to_the_batcher(svc, transport) -> None:
    # The batcher counts a client's parts by its connection (call_origin): every call of
    # one session names the same origin, two clients' sessions different ones, and a
    # unary call none (the batcher then goes by the first sequence).
    import cache_service.engine.batching as batching

    seen: list[tuple[str, int | None]] = []
    real = batching.Batcher.submit

    def spy(self: Any, part: Any) -> None:
        seen.append((part.seq_ids[0], part.origin))
        real(self, part)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batching.Batcher, "submit", spy)
        with (
            KVCacheClient(svc.address, local_session=TRANSPORTS[transport]) as first,
            KVCacheClient(svc.address, local_session=TRANSPORTS[transport]) as second,
            KVCacheClient(svc.address, session=False) as unary,
        ):
            for client in (first, second, unary):
                decode_steps(client, 2, 2, seed=5)
    by_seq: dict[str, set[int | None]] = {}
    for seq, origin in seen:
        by_seq.setdefault(seq, set()).add(origin)
    origins = [by_seq[s] for s in dict.fromkeys(seq for seq, _ in seen)]
    assert len(origins) == 3  # one batch of sequences per client
    (a,), (b,), (c,) = origins
    assert isinstance(a, int) and isinstance(b, int) and a != b
    assert c is None


def test_a_server_without_sessions_gets_unary_calls(svc) -> None:
    with KVCacheClient(svc.address, shared_memory=False, local_session=False) as client:
        # What an older server answers: UNIMPLEMENTED for the Session method.
        client._session = CallStream(client._channel.stream_stream(f"/{SERVICE}/NoSuchSession"))
        ids = [client.create_sequence().seq_id]
        before = counts(svc)
        k = torch.randn(1, 1, HKV, D)
        out = client.append_attend_batch(0, ids, [[1]], k, k, torch.randn(1, 1, HQ, D))
        assert out.shape == (1, 1, HQ, D)
        assert client._session is None
        after = counts(svc)
        assert after[("AppendAttendBatch", "OK")] - before.get(("AppendAttendBatch", "OK"), 0) == 1
        client.free(ids[0])


def test_threads_sharing_a_client_never_wait_for_each_others_calls(svc, transport) -> None:
    errors: list[BaseException] = []
    with KVCacheClient(svc.address, local_session=TRANSPORTS[transport]) as client:

        def run(seed: int) -> None:
            try:
                decode_steps(client, n_seqs=2, steps=3, seed=seed, bitwise=False)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    svc.check_integrity()


def test_shutdown_ends_idle_sessions_with_unavailable_without_waiting_for_the_grace(
    transport,
) -> None:
    svc = ServiceHarness(service_config(**{"server.shutdown_grace_s": 30.0}), local_workers(1, 32))
    client = KVCacheClient(svc.address, shared_memory=False, local_session=TRANSPORTS[transport])
    try:
        ids = [client.create_sequence().seq_id]
        k = torch.randn(1, 1, HKV, D)
        client.append_attend_batch(0, ids, [[1]], k, k, torch.randn(1, 1, HQ, D))
        t0 = time.monotonic()
        svc.run(svc.service.stop())  # its default grace: 30 s
        assert time.monotonic() - t0 < 20  # the idle session did not hold the server
        with pytest.raises(UnavailableError):
            client.append_attend_batch(1, ids, [[1]], k, k, torch.randn(1, 1, HQ, D))
    finally:
        client.close()
        svc.loop.call_soon_threadsafe(svc.loop.stop)


def test_a_session_message_wraps_the_unary_request_bytes() -> None:
    inner = pb.AppendAttendBatchRequest(layer=2, seq_ids=["a"]).SerializeToString()
    msg = pb.SessionRequest.FromString(session_message(7, APPEND_ATTEND_BATCH, inner))
    assert msg.call_id == 7 and msg.append_attend_batch.seq_ids == ["a"]
    with pytest.raises(ValueError, match="field number"):
        session_message(1, 9, inner)
