"""A client's session calls over the server's local socket (the client side of
`local_sessions`), with the interface of `call_stream.CallStream`.

One call at a time: `call` takes the lock without waiting and returns None when another
thread holds it (the caller then makes a unary call), as `CallStream` does. The socket
blocks the calling thread itself (no helper threads): the request is one send, the reply
one or two receives.

Deadlines: each call's receive waits at most its remaining budget; a call past it closes
the connection (the server drops the late reply) and raises DEADLINE_EXCEEDED, and the
next call connects again. A connection the server closed (shutdown, restart) fails the
call in flight with UNAVAILABLE; whether the server ran the call is then unknown, as on a
broken gRPC stream.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.client.call_stream import StreamBroken
from cache_service.wire.local_frames import FrameBuffer, FrameError, frame
from cache_service.wire.session_codec import status_from_number

__all__ = [
    "LocalSessionStream",
    "LocalSessionUnavailable",
    "LocalSessionUnreachable",
    "PendingReply",
]

_RECV_BYTES = 1 << 16


class LocalSessionUnavailable(RuntimeError):
    """A client required a local session (``local_session=True``) and there is none: the
    server offers no socket, or this process cannot reach it."""


class LocalSessionUnreachable(OSError):
    """The socket could not be connected to (no such file, refused, not permitted): the
    client is on another host, another user, or the server is gone."""


class LocalSessionStream:
    """Session calls over a Unix domain socket; connects on the first call.

    Args:
        path: the server's socket (GetInfoResponse.local_session_socket).
        authorization: the hello's authorization value ("Bearer <token>", or "").
        max_message_bytes: the longest reply accepted, bytes.
    """

    def __init__(self, path: str, authorization: str, max_message_bytes: int) -> None:
        self.path = path
        self._authorization = authorization
        self._max_message = max_message_bytes
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._frames: FrameBuffer | None = None
        self._closed = False

    def connect(self, timeout_s: float) -> tuple[socket.socket, FrameBuffer]:
        """Connect and say hello, unless connected; returns the connection and its
        receive buffer.

        Raises:
            LocalSessionUnreachable: nothing to connect to here.
            StreamBroken: the server refused the session (its status: UNAUTHENTICATED,
                UNAVAILABLE, RESOURCE_EXHAUSTED) or broke off the hello.
        """
        if self._sock is not None and self._frames is not None:
            return self._sock, self._frames
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            try:
                sock.connect(self.path)
            except (FileNotFoundError, ConnectionRefusedError, PermissionError) as exc:
                raise LocalSessionUnreachable(
                    f"no local session at {self.path!r}: {exc.strerror or exc}"
                ) from None
            frames = FrameBuffer(self._max_message)
            hello = pb.LocalSessionHello(authorization=self._authorization)
            answer = pb.CallError.FromString(
                _exchange(sock, frames, frame(hello.SerializeToString()), timeout_s)
            )
            if answer.code != grpc.StatusCode.OK.value[0]:
                raise StreamBroken(
                    status_from_number(answer.code), answer.message or "session refused"
                )
        except BaseException:
            sock.close()
            raise
        self._sock, self._frames = sock, frames
        return sock, frames

    def call(self, request: bytes, timeout_s: float) -> bytes | None:
        """Send one encoded `SessionRequest` and return the encoded `SessionResponse`.

        Returns:
            The reply's bytes; None when another thread's call holds the session.

        Raises:
            StreamBroken: the session failed or the deadline passed (the connection is
                dropped; the next call connects again). LocalSessionUnreachable: the
                socket is gone (nothing was sent).
        """
        pending = self.start(request, timeout_s)
        return None if pending is None else pending.result()

    def start(self, request: bytes, timeout_s: float) -> PendingReply | None:
        """Send one encoded `SessionRequest` and return at once; the reply is read by
        `PendingReply.result`, and the session is this call's until then (another
        thread's call meanwhile gets None and goes unary). A caller overlaps its own work
        with the server's this way.

        Returns:
            The call in flight; None when another thread's call holds the session.

        Raises:
            As `call` (for the send).
        """
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed:
                raise StreamBroken(grpc.StatusCode.CANCELLED, "the client was closed")
            deadline = time.monotonic() + timeout_s
            sock, frames = self.connect(timeout_s)
            try:
                _send(sock, frame(request), timeout_s)
            except BaseException:
                self._drop()
                raise
        except BaseException:
            self._lock.release()
            raise
        return PendingReply(self, sock, frames, deadline, timeout_s)

    def close(self) -> None:
        """Close the connection (after the call in flight)."""
        with self._lock:
            self._closed = True
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._frames = None


class PendingReply:
    """A local session call whose request is sent and whose reply is not read yet
    (`LocalSessionStream.start`); `result` must be called once, and frees the session."""

    def __init__(
        self,
        stream: LocalSessionStream,
        sock: socket.socket,
        frames: FrameBuffer,
        deadline: float,
        timeout_s: float,
    ) -> None:
        self._stream = stream
        self._sock = sock
        self._frames = frames
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._done = False

    def result(self) -> bytes:
        """The encoded `SessionResponse`.

        Raises:
            StreamBroken: as `LocalSessionStream.call`; RuntimeError: read twice.
        """
        if self._done:
            raise RuntimeError("this session call's reply was read already")
        self._done = True
        try:
            return _receive(self._sock, self._frames, self._deadline, self._timeout_s)
        except BaseException:
            self._stream._drop()
            raise
        finally:
            self._stream._lock.release()


def _exchange(sock: socket.socket, frames: FrameBuffer, data: bytes, timeout_s: float) -> bytes:
    """Send ``data`` and return the next whole message received (see `_send`, `_receive`)."""
    deadline = time.monotonic() + timeout_s
    _send(sock, data, timeout_s)
    return _receive(sock, frames, deadline, timeout_s)


def _send(sock: socket.socket, data: bytes, timeout_s: float) -> None:
    """Send ``data`` within `timeout_s`.

    Raises:
        StreamBroken: DEADLINE_EXCEEDED past `timeout_s`; UNAVAILABLE when the connection
            failed.
    """
    try:
        sock.settimeout(max(timeout_s, 1e-3))
        sock.sendall(data)
    except TimeoutError:
        raise StreamBroken(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"could not send within {timeout_s:.3f} s (the local session was closed)",
        ) from None
    except OSError as exc:
        raise StreamBroken(
            grpc.StatusCode.UNAVAILABLE, f"the local session failed: {exc.strerror or exc}"
        ) from None


def _receive(sock: socket.socket, frames: FrameBuffer, deadline: float, timeout_s: float) -> bytes:
    """The next whole message received before `deadline` (`time.monotonic`; `timeout_s`
    is the call's budget, for the message).

    Raises:
        StreamBroken: DEADLINE_EXCEEDED past the deadline; UNAVAILABLE when the server
            closed the connection; RESOURCE_EXHAUSTED for a reply over the size limit.
    """
    try:
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            chunk = sock.recv(_RECV_BYTES)
            if not chunk:
                raise StreamBroken(
                    grpc.StatusCode.UNAVAILABLE,
                    "the server closed the local session (shutting down or restarted)",
                )
            messages = frames.feed(chunk)
            if messages:
                # One call in flight at a time: nothing else can follow its reply.
                return messages[0]
    except TimeoutError:
        raise StreamBroken(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no reply within {timeout_s:.3f} s (the local session was closed)",
        ) from None
    except FrameError as exc:
        raise StreamBroken(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
    except OSError as exc:
        raise StreamBroken(
            grpc.StatusCode.UNAVAILABLE, f"the local session failed: {exc.strerror or exc}"
        ) from None
