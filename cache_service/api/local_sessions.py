"""Local sessions: a Session stream's messages over a Unix domain socket, without gRPC.

A client on the server's host makes one append-and-attend call per layer; over gRPC each
call's messages cross several threads in both processes (the client's request thread and
channel poller, the server's completion-queue poller and event loop), which on a GPU host
costs more than the whole call's work on the pool. A local session carries the same
SessionRequest / SessionResponse bytes over a Unix domain socket that the event loop reads
itself: the request wakes the loop directly, and the reply is one write.

Same contract as the Session stream (`KVCacheServicer.Session`): calls answered one at a
time, in order, each with its reply or its error status; the same authentication (a
bearer token in the hello); the same draining at shutdown (refuse new sessions, end each
one after its call in flight). The socket lives in a fresh directory only the server's
user can enter (mode 0700), like the shared-memory regions that same-host clients map.
Wire format: LocalSessionHello in proto/kvcache/v1/kvcache.proto.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.api.auth import Principal, principal_scope
from cache_service.engine.call_origin import origin_scope
from cache_service.engine.eager_tasks import start_eagerly
from cache_service.wire.local_frames import FrameBuffer, FrameError, frame
from cache_service.wire.session_codec import session_error
from workers.owned_files import make_owned_dir, reclaim_orphans, remove_owned_dir

__all__ = ["SOCKET_NAME", "Authenticate", "LocalSessions", "hello_status"]

log = logging.getLogger("kvcache.local_sessions")

SOCKET_NAME = "session.sock"
# The socket's folder: "<parent>/kvcache-local-<owner>-<random>" (workers.owned_files).
DIR_PREFIX = "kvcache-local-"
# sockaddr_un's sun_path holds 108 bytes with the terminating NUL.
_MAX_PATH_BYTES = 107

# authorization header value ("Bearer <token>" or "") -> (principal or None, status, message)
Authenticate = Callable[[str], tuple[Principal | None, grpc.StatusCode, str]]
# (request, tenant) -> the encoded SessionResponse
ServeCall = Callable[[pb.SessionRequest, str], Awaitable[bytes]]
# (request, tenant, connection id, answer) -> whether the call was taken without a task;
# if so `answer` gets its encoded SessionResponse once, later
# (`KVCacheServicer.session_call_now`)
ServeNow = Callable[[pb.SessionRequest, str, int, Callable[[bytes], None]], bool]


def hello_status(code: grpc.StatusCode, message: str = "") -> bytes:
    """The server's answer to a LocalSessionHello: a CallError (code 0 accepts)."""
    return pb.CallError(code=code.value[0], message=message).SerializeToString()


class LocalSessions:
    """The server side: a Unix domain socket whose connections are local sessions.

    Args:
        serve_call: answers one SessionRequest of a tenant with the encoded
            SessionResponse (`KVCacheServicer._session_call`: errors become replies).
        authenticate: decides a hello's authorization value (no authentication: accept
            everyone as the default tenant).
        default_tenant: the tenant of sessions whose principal is None.
        max_message_bytes: the longest message accepted (server.max_message_bytes).
        max_sessions: sessions open at once; a hello beyond it is refused with
            RESOURCE_EXHAUSTED.
        on_change: called with the number of open sessions after each change (metrics).
        serve_now: offered each call first; a call it takes is answered from a callback
            instead of a task (a decode step's repeated layers: see `ServeNow`).
    """

    def __init__(
        self,
        serve_call: ServeCall,
        authenticate: Authenticate,
        default_tenant: str,
        max_message_bytes: int,
        max_sessions: int = 1024,
        on_change: Callable[[int], None] | None = None,
        serve_now: ServeNow | None = None,
    ) -> None:
        self._serve_call = serve_call
        self._serve_now = serve_now
        self._authenticate = authenticate
        self._default_tenant = default_tenant
        self._max_message = max_message_bytes
        self._max_sessions = max_sessions
        self._on_change = on_change
        self._server: asyncio.AbstractServer | None = None
        self._directory: str | None = None
        self._directory_lock = -1  # the descriptor holding the directory's ownership lock
        self._connections: set[_Connection] = set()
        self._draining = False
        self.calls = 0  # calls answered (tests and diagnostics)
        self.calls_now = 0  # of them, answered by `serve_now`

    @property
    def path(self) -> str | None:
        """The socket's path while serving, else None."""
        if self._server is None or self._directory is None:
            return None
        return os.path.join(self._directory, SOCKET_NAME)

    @property
    def open_sessions(self) -> int:
        """Sessions whose hello was accepted and that are not closed."""
        return sum(1 for c in self._connections if c.accepted)

    async def start(self, parent: str | None = None) -> str:
        """Listen on a socket in a new private directory under `parent` (default: the
        system's temporary directory); returns the socket's path.

        Raises:
            ValueError: the path would be too long for a Unix domain socket.
            OSError: the directory or the socket could not be made.
        """
        # A folder of a server that was killed is never removed by it: the first server to
        # start after it removes it (this server holds its own's lock: workers.owned_files).
        reclaim_orphans(parent or tempfile.gettempdir(), DIR_PREFIX)
        directory, lock = make_owned_dir(parent, DIR_PREFIX)  # mode 0700
        path = os.path.join(directory, SOCKET_NAME)
        try:
            if len(os.fsencode(path)) > _MAX_PATH_BYTES:
                raise ValueError(
                    f"the local session socket's path {path!r} is longer than a Unix socket "
                    f"allows ({_MAX_PATH_BYTES} bytes): choose a shorter "
                    "server.local_session_dir"
                )
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(lambda: _Connection(self), path)
            os.chmod(path, 0o600)
        except BaseException:
            remove_owned_dir(directory, lock)
            raise
        self._directory, self._directory_lock = directory, lock
        return path

    def end(self) -> None:
        """Shutting down: refuse new hellos, close idle sessions now and each busy one
        after its call in flight is answered."""
        self._draining = True
        for conn in list(self._connections):
            if not conn.busy:
                conn.close()

    async def close(self, grace_s: float) -> None:
        """Stop listening, end every session (waiting up to grace_s for calls in flight)
        and delete the socket's directory."""
        self.end()
        if self._server is not None:
            self._server.close()
        busy = [c.done for c in self._connections if c.busy]
        if busy:
            await asyncio.wait(busy, timeout=grace_s)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
            self._server = None
        if self._directory is not None:
            remove_owned_dir(self._directory, self._directory_lock)
            self._directory, self._directory_lock = None, -1

    # -- used by _Connection ---------------------------------------------------------------

    def _admit(self, conn: _Connection, hello: pb.LocalSessionHello) -> tuple[grpc.StatusCode, str]:
        if self._draining:
            return grpc.StatusCode.UNAVAILABLE, "the server is shutting down"
        principal, code, message = self._authenticate(hello.authorization)
        if code is not grpc.StatusCode.OK:
            return code, message
        if self.open_sessions >= self._max_sessions:
            return (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many local sessions open ({self._max_sessions}); close idle clients "
                "or use the gRPC Session stream",
            )
        conn.principal = principal
        conn.tenant = principal.tenant if principal is not None else self._default_tenant
        return grpc.StatusCode.OK, ""

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.open_sessions)


# Messages received and not yet answered past which a connection's socket is not read
# until half of them are: a client sending ahead is then held back by the socket's buffer
# rather than by memory here. A client waits for each reply, so reading normally stays on
# (pausing and resuming around every call would cost two epoll changes a call).
_MAX_QUEUED = 16


class _Connection(asyncio.Protocol):
    """One client's local session: a hello, then calls answered one at a time, in order."""

    def __init__(self, owner: LocalSessions) -> None:
        self._owner = owner
        self._frames = FrameBuffer(owner._max_message)
        self._queue: collections.deque[bytes] = collections.deque()
        self._transport: asyncio.Transport | None = None
        self._closing = False
        self._paused = False
        self.accepted = False
        self.busy = False
        self.principal: Principal | None = None
        self.tenant = ""
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._owner._connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            self._queue.extend(self._frames.feed(data))
        except FrameError as exc:
            self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return
        if len(self._queue) >= _MAX_QUEUED and self._transport is not None:
            self._transport.pause_reading()
            self._paused = True
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._owner._connections.discard(self)
        if self.accepted:
            self.accepted = False
            self._owner._changed()
        if not self.busy and not self.done.done():
            self.done.set_result(None)

    # -- calls -----------------------------------------------------------------------------

    def _next(self) -> None:
        """Answer the next message received, unless a call is in flight."""
        while self._queue and not self.busy and not self._closing:
            message = self._queue.popleft()
            if not self.accepted:
                self._hello(message)
                continue
            self.busy = True
            serve_now = self._owner._serve_now
            if serve_now is None:
                self._start(message)
                return
            try:
                request = pb.SessionRequest.FromString(message)
            except DecodeError:
                self._start(message)  # `_call` answers it
                return
            if not self._served_now(serve_now, request):
                self._start(request)
            return

    def _served_now(self, serve_now: ServeNow, request: pb.SessionRequest) -> bool:
        """Whether `serve_now` took the call (a failure there is a bug: logged, and the
        call goes the usual way)."""
        try:
            return serve_now(request, self.tenant, id(self), self._answered_now)
        except Exception:
            log.exception("serving a local session call without a task failed")
            return False

    def _start(self, message: bytes | pb.SessionRequest) -> None:
        """Serve a call the usual way: in a task (eager: on Python 3.12 it runs inline until
        it waits)."""
        task = start_eagerly(self._call(message))
        task.add_done_callback(self._call_done)

    def _answered_now(self, reply: bytes) -> None:
        """`serve_now`'s answer to a call it took."""
        self._owner.calls += 1
        self._owner.calls_now += 1
        self._write(reply)
        self._finished()

    def _hello(self, message: bytes) -> None:
        try:
            hello = pb.LocalSessionHello.FromString(message)
        except DecodeError:
            self._refuse(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a LocalSessionHello"
            )
            return
        code, text = self._owner._admit(self, hello)
        if code is not grpc.StatusCode.OK:
            self._refuse(code, text)
            return
        self.accepted = True
        self._write(hello_status(grpc.StatusCode.OK))
        self._owner._changed()

    async def _call(self, message: bytes | pb.SessionRequest) -> None:
        try:
            request = (
                message if type(message) is not bytes else pb.SessionRequest.FromString(message)
            )
        except DecodeError:
            # As on the gRPC stream: a message that does not parse ends the session.
            self._write(
                session_error(
                    0,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "a message of the local session is not a SessionRequest",
                )
            )
            self.close()
            return
        # Handlers below look up the caller (stats visibility, say) in this context, and
        # the batcher counts this connection's calls as one client's (call_origin).
        with principal_scope(self.principal), origin_scope(id(self)):
            reply = await self._owner._serve_call(request, self.tenant)
        self._owner.calls += 1
        self._write(reply)

    def _call_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # _serve_call turns every error into a reply; reaching here is a bug.
            log.error("local session call failed", exc_info=task.exception())
            self.close()
        self._finished()

    def _finished(self) -> None:
        """The call in flight was answered: on to the next (or end, if closing)."""
        self.busy = False
        if self._closing:
            if not self.done.done():
                self.done.set_result(None)
            return
        if self._owner._draining:
            self.close()
            return
        if self._paused and len(self._queue) <= _MAX_QUEUED // 2 and self._transport is not None:
            self._transport.resume_reading()
            self._paused = False
        self._next()

    # -- output ----------------------------------------------------------------------------

    def _write(self, payload: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame(payload))

    def _refuse(self, code: grpc.StatusCode, message: str) -> None:
        """Answer with an error status (a CallError before the hello was accepted, else a
        SessionResponse for call 0) and close."""
        if self.accepted:
            self._write(session_error(0, code, message))
        else:
            self._write(hello_status(code, message))
        self.close()

    def close(self) -> None:
        """Close after what was written is sent (a call in flight still finishes on the
        server; its reply is dropped)."""
        self._closing = True
        self._queue.clear()
        if self._transport is not None:
            self._transport.close()
