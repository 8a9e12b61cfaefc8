"""Local sessions: Session messages over the server's Unix domain socket (no gRPC).

The framing is checked as pure logic; everything else against a real server: the socket
is private to the server's user, hellos are authenticated like gRPC calls (tenants stay
apart), bad bytes get an error status and a closed socket and change nothing, clients
fall back to the gRPC stream where no socket can be reached, the sessions are counted in
the metrics, and a server with local sessions turned off offers none. (The calls' results,
errors, deadlines, threads and shutdown over a local session: test_session, `transport`.)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import struct
import threading
import time

import grpc
import pytest
import torch
from service_support import (
    HQ,
    LAYOUT,
    ServiceHarness,
    decode_with_twins,
    local_workers,
    service_config,
)

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.client import (
    InternalError,
    InvalidArgumentError,
    KVCacheClient,
    LocalSessionUnavailable,
    NotFoundError,
    UnauthenticatedError,
)
from cache_service.client.call_stream import StreamBroken
from cache_service.client.local_session_stream import LocalSessionStream, LocalSessionUnreachable
from cache_service.wire.local_frames import FrameBuffer, FrameError, frame
from cache_service.wire.session_codec import APPEND_ATTEND_BATCH, session_message

pytestmark = pytest.mark.timeout(60)

D, HKV, NL = LAYOUT.head_dim, LAYOUT.num_kv_heads, LAYOUT.num_layers
TOKEN_A = "token-of-acme-0123456789"
TOKEN_B = "token-of-globex-abcdefgh"


# ------------------------------------------------------------------------------ framing


def test_frames_come_out_whole_however_the_bytes_are_cut() -> None:
    messages = [b"", b"a", b"hello" * 100, bytes(range(256))]
    stream = b"".join(frame(m) for m in messages)
    for cut in (1, 3, 4, 5, 7, 64, len(stream)):
        buf = FrameBuffer(max_bytes=1000)
        got = []
        for i in range(0, len(stream), cut):
            got += buf.feed(stream[i : i + cut])
        assert got == messages, cut
        assert buf.pending_bytes == 0


def test_a_frame_longer_than_the_limit_is_refused_before_its_bytes_arrive() -> None:
    buf = FrameBuffer(max_bytes=10)
    assert buf.feed(frame(b"x" * 10)) == [b"x" * 10]
    with pytest.raises(FrameError, match="11 bytes is longer than the limit of 10"):
        buf.feed(struct.pack("<I", 11))
    with pytest.raises(ValueError, match="max_bytes"):
        FrameBuffer(0)


# ------------------------------------------------------------------------------ a server


@pytest.fixture(scope="module")
def svc():
    with ServiceHarness(
        service_config(**{"metrics.enabled": True, "metrics.port": 0}), local_workers(1, 64)
    ) as harness:
        yield harness


def _batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, HKV, D, generator=gen), torch.randn(n, 1, HQ, D, generator=gen)


class _Raw:
    """A raw connection to a local session socket, reading whole messages."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self._buf = FrameBuffer(1 << 20)
        self._got: list[bytes] = []

    def __enter__(self) -> _Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> bytes | None:
        """The next message, or None when the server closed the socket first."""
        while not self._got:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self._got += self._buf.feed(chunk)
        return self._got.pop(0)

    def closed(self) -> bool:
        return not self._got and self.sock.recv(1) == b""

    def hello(self, authorization: str = "") -> pb.CallError:
        self.send(frame(pb.LocalSessionHello(authorization=authorization).SerializeToString()))
        answer = self.read()
        assert answer is not None
        return pb.CallError.FromString(answer)


def test_the_socket_is_private_and_named_in_get_info(svc) -> None:
    path = svc.service.local_sessions.path
    assert path and os.path.exists(path)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with KVCacheClient(svc.address) as client:
        assert client.info().local_session_socket == path


def test_a_client_on_this_host_uses_it_by_default_and_matches_grpc(svc) -> None:
    k, q = _batch(2)
    outs = {}
    for local in (True, False):
        with KVCacheClient(svc.address, local_session="auto" if local else False) as client:
            ids = [client.create_sequence().seq_id for _ in range(2)]
            before = svc.service.local_sessions.calls
            outs[local] = [client.append_attend_batch(0, ids, [[1], [2]], k, k, q)]
            outs[local].append(client.attend_batch(0, ids, q))
            assert client.local_session_active is local
            assert svc.service.local_sessions.calls - before == (2 if local else 0)
            for s in ids:
                client.free(s)
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False], strict=True))
    svc.check_integrity()


@pytest.mark.parametrize("callbacks", [True, False], ids=["callbacks", "tasks-only"])
def test_a_decode_steps_later_layers_are_answered_without_a_task(monkeypatch, callbacks) -> None:
    # On a server that reads shared memory in place (as a GPU server does), every layer of
    # a local session's decode step after the first is a decode-memo hit the coordinator
    # repeats: answered from its round's callback (`serve_now`), bit for bit what the same
    # calls answer the usual way (a twin client sending bytes). With
    # server.local_session_callbacks off, every call takes a task, with the same answers.
    import cache_service.api.service as service_mod

    real = service_mod.SharedRegions
    monkeypatch.setattr(
        service_mod, "SharedRegions", lambda *a, **k: real(*a, **{**k, "zero_copy": True})
    )
    steps = 3
    config = service_config(**{"server.local_session_callbacks": callbacks})
    with ServiceHarness(config, local_workers(1, 64)) as harness:
        local = harness.service.local_sessions
        with (
            KVCacheClient(harness.address) as shm,
            KVCacheClient(harness.address, shared_memory=False) as plain,
        ):
            before, before_now = local.calls, local.calls_now
            gen = torch.Generator().manual_seed(8)
            ids, twins = decode_with_twins(shm, plain, 3, steps, gen)
            assert shm.local_session_active and plain.local_session_active
            assert local.calls_now - before_now == (steps * (NL - 1) if callbacks else 0)
            assert local.calls - before == 2 * steps * NL
            for s in ids + twins:
                shm.free(s)
        harness.check_integrity()


def test_a_call_answered_without_a_task_fails_with_its_status_and_changes_nothing(
    monkeypatch,
) -> None:
    # A repeated layer's call that fails in its round (a fault injected into the worker)
    # is answered from the callback with its error status; its writes are cancelled, the
    # session goes on, and the same call then succeeds.
    import cache_service.api.service as service_mod

    real = service_mod.SharedRegions
    monkeypatch.setattr(
        service_mod, "SharedRegions", lambda *a, **k: real(*a, **{**k, "zero_copy": True})
    )
    with ServiceHarness(service_config(), local_workers(1, 64)) as harness:
        local = harness.service.local_sessions
        (worker,) = harness.service.coordinator._clients.values()
        with KVCacheClient(harness.address) as client:
            ids = [client.create_sequence().seq_id for _ in range(2)]
            k, q = _batch(2)
            client.append_attend_batch(0, ids, [[1], [2]], k, k, q)  # plans the step
            working = worker.run_round

            async def faulty(*args, **kwargs):
                raise RuntimeError("an injected worker fault")

            monkeypatch.setattr(worker, "run_round", faulty)
            before = local.calls_now
            with pytest.raises(InternalError):
                client.append_attend_batch(1, ids, [[1], [2]], k, k, q)
            assert local.calls_now == before + 1  # answered from the callback
            for s in ids:
                assert harness.service.coordinator.block_manager.sequence_info(
                    "default", s
                ).written == (1, 0)
            monkeypatch.setattr(worker, "run_round", working)
            out = client.append_attend_batch(1, ids, [[1], [2]], k, k, q)
            assert local.calls_now == before + 2 and out.shape == q.shape
            for s in ids:
                client.free(s)
        harness.check_integrity()


def test_raw_messages_are_answered_in_order_with_their_call_ids(svc) -> None:
    with _Raw(svc.service.local_sessions.path) as raw:
        assert raw.hello().code == 0
        empty = pb.SessionRequest(call_id=41).SerializeToString()
        bad_layer = pb.SessionRequest(
            call_id=42, attend_batch=pb.AttendBatchRequest(layer=NL, seq_ids=["x"])
        ).SerializeToString()
        raw.send(frame(empty) + frame(bad_layer))  # sent ahead: still one at a time
        replies = [pb.SessionResponse.FromString(raw.read()) for _ in range(2)]
        assert [r.call_id for r in replies] == [41, 42]
        assert replies[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "carries no call" in replies[0].error.message
        assert replies[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "query.dtype" in replies[1].error.message


def test_a_client_sending_far_ahead_gets_every_reply_in_order(svc) -> None:
    """More messages at once than the server queues before it stops reading the socket:
    it reads on as it answers, and every call is answered once, in order."""
    with _Raw(svc.service.local_sessions.path) as raw:
        assert raw.hello().code == 0
        raw.send(
            b"".join(frame(pb.SessionRequest(call_id=i).SerializeToString()) for i in range(1, 101))
        )
        ids = [pb.SessionResponse.FromString(raw.read()).call_id for _ in range(100)]
        assert ids == list(range(1, 101))


@pytest.mark.parametrize(
    ("first", "code", "text"),
    [
        (frame(b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT, "LocalSessionHello"),
        (struct.pack("<I", 1 << 31), grpc.StatusCode.RESOURCE_EXHAUSTED, "longer than the limit"),
    ],
)
def test_a_bad_hello_gets_an_error_status_and_a_closed_socket(svc, first, code, text) -> None:
    with _Raw(svc.service.local_sessions.path) as raw:
        raw.send(first)
        answer = pb.CallError.FromString(raw.read())
        assert answer.code == code.value[0] and text in answer.message
        assert raw.closed()


def test_bad_bytes_after_the_hello_end_the_session_and_change_nothing(svc) -> None:
    before = svc.stats()
    for bad in (frame(b"\xff\xff\xff"), struct.pack("<I", 1 << 31)):
        with _Raw(svc.service.local_sessions.path) as raw:
            assert raw.hello().code == 0
            raw.send(bad)
            reply = pb.SessionResponse.FromString(raw.read())
            assert reply.call_id == 0
            assert reply.error.code in (
                grpc.StatusCode.INVALID_ARGUMENT.value[0],
                grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
            )
            assert raw.closed()
    assert svc.stats() == before
    svc.check_integrity()


def test_a_failed_call_over_a_local_session_changes_nothing(svc) -> None:
    k, q = _batch(2)
    with KVCacheClient(svc.address, local_session=True, shared_memory=False) as client:
        ids = [client.create_sequence().seq_id for _ in range(2)]
        client.append_attend_batch(0, ids, [[1], [2]], k, k, q)
        before = svc.stats()
        with pytest.raises(NotFoundError, match="nope"):
            client.append_attend_batch(0, [ids[0], "nope"], [[3], [3]], k, k, q)
        with pytest.raises(InvalidArgumentError, match="NaN"):
            client.append_attend_batch(0, ids, [[3], [3]], k, k * float("nan"), q)
        assert svc.stats() == before
        svc.check_integrity()
        for s in ids:
            client.free(s)


def test_the_sessions_open_are_a_gauge(svc) -> None:
    def gauge() -> float:
        for metric in svc.service.metrics.local_sessions.collect():
            return metric.samples[0].value
        raise AssertionError("no samples")

    def settles_at(value: float) -> None:
        deadline = time.monotonic() + 10
        while gauge() != value:  # the server sees a socket close a moment later
            assert time.monotonic() < deadline, (gauge(), value)
            time.sleep(0.01)

    settles_at(0)  # earlier tests' clients are closed
    k, q = _batch(1)
    with KVCacheClient(svc.address, local_session=True) as client:
        s = client.create_sequence().seq_id
        client.append_attend_batch(0, [s], [[1]], k, k, q)
        assert gauge() == 1
        client.free(s)
    settles_at(0)


def test_an_unreachable_socket_sends_nothing_and_the_client_falls_back(svc, tmp_path) -> None:
    stream = LocalSessionStream(str(tmp_path / "absent.sock"), "", 1 << 20)
    with pytest.raises(LocalSessionUnreachable, match="no local session"):
        stream.call(b"x", 1.0)
    k, q = _batch(1)
    with KVCacheClient(svc.address) as client:
        s = client.create_sequence().seq_id
        client.append_attend_batch(0, [s], [[1]], k, k, q)
        assert client.local_session_active
        # The socket this client knew is gone (as after a server restart): the call goes
        # over gRPC, and the next one looks the socket up again.
        client._local.path = str(tmp_path / "gone.sock")
        client._local._drop()
        out = client.append_attend_batch(1, [s], [[1]], k, k, q)
        assert out.shape == (1, 1, HQ, D)
        assert not client.local_session_active
        client.append_attend_batch(0, [s], [[2]], k, k, q)  # the next position
        assert client.local_session_active
        client.free(s)
    svc.check_integrity()


def test_a_local_session_waits_no_longer_than_its_deadline(tmp_path) -> None:
    """Against a socket that accepts the hello and never answers a call."""
    path = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            FrameBuffer(1 << 20).feed(conn.recv(1 << 16))
            conn.sendall(frame(pb.CallError(code=0).SerializeToString()))
            conn.recv(1 << 16)  # the call: never answered
            conn.recv(1 << 16)  # until the client hangs up

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    stream = LocalSessionStream(path, "", 1 << 20)
    t0 = time.monotonic()
    with pytest.raises(StreamBroken) as info:
        stream.call(session_message(1, APPEND_ATTEND_BATCH, b""), 0.3)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.25 < time.monotonic() - t0 < 5
    assert stream._sock is None  # dropped; the next call connects again
    thread.join(5)
    listener.close()


# ------------------------------------------------------------------------------ auth, config


@pytest.fixture(scope="module")
def authed(tmp_path_factory: pytest.TempPathFactory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {TOKEN_A: "acme", TOKEN_B: "globex"}}))
    with ServiceHarness(service_config(auth_file=str(tokens)), local_workers(1, 32)) as h:
        yield h


def test_a_hello_is_authenticated_like_a_grpc_call(authed) -> None:
    path = authed.service.local_sessions.path
    for authorization in ("", "Bearer wrong-token", f"Basic {TOKEN_A}"):
        with _Raw(path) as raw:
            answer = raw.hello(authorization)
            assert answer.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert answer.message
            assert raw.closed()
    with pytest.raises(UnauthenticatedError):
        with KVCacheClient(authed.address, token="wrong-token", local_session=True) as client:
            client.attend_batch(0, ["x"], torch.randn(1, 1, HQ, D))


def test_tenants_stay_apart_over_local_sessions(authed) -> None:
    k, q = _batch(1)
    with (
        KVCacheClient(authed.address, token=TOKEN_A, local_session=True) as a,
        KVCacheClient(authed.address, token=TOKEN_B, local_session=True) as b,
    ):
        s = a.create_sequence().seq_id
        a.append_attend_batch(0, [s], [[1]], k, k, q)
        assert a.local_session_active
        before = authed.stats()
        with pytest.raises(NotFoundError):
            b.append_attend_batch(0, [s], [[2]], k, k, q)
        with pytest.raises(NotFoundError):
            b.attend_batch(0, [s], q)
        assert b.local_session_active
        assert authed.stats() == before
        a.free(s)
    authed.check_integrity()


def test_a_server_with_local_sessions_off_offers_none() -> None:
    config = service_config(**{"server.local_sessions": False})
    with ServiceHarness(config, local_workers(1, 16)) as h:
        assert h.service.local_sessions is None
        k, q = _batch(1)
        with KVCacheClient(h.address) as client:
            assert client.info().local_session_socket == ""
            s = client.create_sequence().seq_id
            client.append_attend_batch(0, [s], [[1]], k, k, q)  # over the gRPC stream
            assert not client.local_session_active
            client.free(s)
        with KVCacheClient(h.address, local_session=True) as client:
            with pytest.raises(LocalSessionUnavailable, match="offers no local session"):
                client.attend_batch(0, ["x"], q)


def test_stopping_the_server_deletes_the_socket_and_its_directory() -> None:
    h = ServiceHarness(service_config(), local_workers(1, 16))
    path = h.service.local_sessions.path
    assert os.path.exists(path)
    h.stop()
    assert not os.path.exists(os.path.dirname(path))


def test_the_socket_directory_must_give_a_short_enough_path(tmp_path) -> None:
    from cache_service.api.local_sessions import LocalSessions

    async def start(parent: str) -> None:
        sessions = LocalSessions(None, None, "default", 1024)  # type: ignore[arg-type]
        await sessions.start(parent)

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    with pytest.raises(ValueError, match="longer than a Unix socket allows"):
        asyncio.run(start(str(deep)))
    assert os.listdir(deep) == []  # nothing left behind


def test_a_named_socket_directory_that_cannot_be_used_fails_the_start(tmp_path) -> None:
    config = service_config(**{"server.local_session_dir": str(tmp_path / "missing")})
    with pytest.raises(FileNotFoundError):
        ServiceHarness(config, local_workers(1, 16))


def test_without_a_usable_temporary_directory_the_server_serves_over_grpc(
    monkeypatch, tmp_path
) -> None:
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with ServiceHarness(service_config(), local_workers(1, 16)) as h:
        assert h.service.local_sessions is None
        k, q = _batch(1)
        with KVCacheClient(h.address) as client:
            assert client.info().local_session_socket == ""
            s = client.create_sequence().seq_id
            client.append_attend_batch(0, [s], [[1]], k, k, q)
            assert not client.local_session_active
            client.free(s)


class _Sessions:
    """A LocalSessions on its own event-loop thread, answering every call with an echo."""

    def __init__(self, parent: str | None, max_sessions: int) -> None:
        from cache_service.api.local_sessions import LocalSessions

        async def serve_call(request: pb.SessionRequest, tenant: str) -> bytes:
            return pb.SessionResponse(call_id=request.call_id).SerializeToString()

        def accept(authorization: str):
            return None, grpc.StatusCode.OK, ""

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sessions = LocalSessions(serve_call, accept, "default", 1 << 20, max_sessions)
        self.path = self.run(self.sessions.start(parent))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.run(self.sessions.close(1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_sessions_past_the_limit_and_while_draining_are_refused() -> None:
    s = _Sessions(None, max_sessions=1)  # the system's temporary folder: a short path
    try:
        with _Raw(s.path) as first, _Raw(s.path) as second:
            assert first.hello().code == 0
            refused = second.hello()
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "too many local sessions open (1)" in refused.message
            assert second.closed()
            first.send(frame(pb.SessionRequest(call_id=7).SerializeToString()))
            assert pb.SessionResponse.FromString(first.read()).call_id == 7
            s.loop.call_soon_threadsafe(s.sessions.end)  # shutting down
            assert first.closed()  # idle: closed at once
        with _Raw(s.path) as late:
            answer = late.hello()
            assert answer.code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert "shutting down" in answer.message
    finally:
        s.close()
    assert not os.path.exists(s.path)
