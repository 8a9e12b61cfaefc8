"""The worker's end of the worker channel (:mod:`workers.channel_wire`): a ``PoolWorker``'s
per-layer data calls served over a Unix socket, their tensors in an arena the caller maps
too.

One thread accepts connections; each connection gets a thread of its own and brings its
own arena: in its first message (the hello) the caller names the worker's token (handed
out over Ray, :meth:`ChannelServer.address`) and the /dev/shm file it created; the server
checks the file (a regular file of this user, of the announced size), maps it and, for a
CUDA pool, page-locks it (``workers.cuda_pinning``), so the pool reads the call's inputs
and writes its outputs by DMA. Calls on one connection run one at a time, in order; the
calls of all connections and of Ray run one at a time on the pool (the worker's lock).

Only the per-layer data methods (:data:`CHANNEL_METHODS`) are served: their results are no
larger than their inputs, and running one twice has the effect of running it once (the
same K/V into the same slots), so a caller whose connection broke mid-call may safely send
it again over Ray.
"""

from __future__ import annotations

import atexit
import contextlib
import hmac
import logging
import mmap
import os
import pickle
import secrets
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.channel_wire import (
    HEADER,
    ArenaFull,
    ArenaLayout,
    ArenaViews,
    ChannelProtocolError,
    decode,
    encode,
    frame,
)
from workers.cuda_pinning import pin, unpin

__all__ = ["CHANNEL_METHODS", "ChannelAddress", "ChannelServer", "Hello"]

log = logging.getLogger("kvcache.channel")

CHANNEL_METHODS = frozenset(
    {
        "write",
        "attend",
        "write_and_attend",
        "write_and_attend_pages",
        "attend_pages",
        "reference_attend",
    }
)

# Requests carry only small values (tensors are in the arena); a longer frame is an error.
_MAX_REQUEST_BYTES = 64 << 20


@dataclass(frozen=True)
class ChannelAddress:
    """Where a worker's channel listens, as :meth:`ChannelServer.address` hands it out.

    Attributes:
        node_id: the Ray node the worker runs on (None outside Ray): only a caller on the
            same node can map the arena and reach the socket.
        socket_path: the Unix socket.
        token: the secret a connection's hello must name.
    """

    node_id: str | None
    socket_path: str
    token: str


@dataclass(frozen=True)
class Hello:
    """A connection's first message.

    Attributes:
        token: ChannelAddress.token.
        arena_path: the caller's arena file (it unlinks the file once the hello is answered).
        arena_bytes: the file's size.
    """

    token: str
    arena_path: str
    arena_bytes: int


Call = Callable[[str, tuple[Any, ...], dict[str, Any]], Any]


class ChannelServer:
    """Serves ``call(method, args, kwargs)`` (a PoolWorker's data methods, results unpacked)
    to callers on this node.

    Args:
        call: runs one data call (the worker serialises it with its other calls).
        pin_for_cuda: page-lock each arena for CUDA (a GPU pool).
        node_id: the Ray node of this process (None outside Ray).
        name: for thread names and logs (the worker id).
    """

    def __init__(self, call: Call, *, pin_for_cuda: bool, node_id: str | None, name: str) -> None:
        self._call = call
        self._pin = pin_for_cuda
        self._name = name
        self._dir = tempfile.mkdtemp(prefix="kvcache-channel-")  # mode 0700
        path = os.path.join(self._dir, "socket")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(16)
        self._address = ChannelAddress(node_id, path, secrets.token_hex(16))
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept_forever, name=f"kvchannel-{name}", daemon=True).start()
        atexit.register(self.close)

    def address(self) -> ChannelAddress:
        """Where to connect, with the token."""
        return self._address

    def close(self) -> None:
        """Stop accepting, drop every connection (their calls in flight finish first) and
        remove the socket's directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- internals ----------------------------------------------------------------------

    def _accept_forever(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name=f"kvchannel-{self._name}-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        arena: _Arena | None = None
        try:
            hello = _read(conn)
            if hello is None:
                return
            try:
                arena = self._open_arena(pickle.loads(hello))
            except Exception as exc:
                log.warning("worker channel refused a connection: %s", exc)
                conn.sendall(frame(pickle.dumps((False, f"{type(exc).__name__}: {exc}"))))
                return
            conn.sendall(frame(pickle.dumps((True, arena.pinned))))
            while (request := _read(conn)) is not None:
                conn.sendall(frame(self._answer(arena.views, request)))
        except (OSError, ChannelProtocolError) as exc:
            if not self._closed:
                log.info("worker channel connection ended: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()
            if arena is not None:
                arena.close()

    def _open_arena(self, hello: object) -> _Arena:
        if not isinstance(hello, Hello):
            raise ChannelProtocolError("the first message is not a hello")
        if not hmac.compare_digest(hello.token, self._address.token):
            raise PermissionError("wrong token")
        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(hello.arena_path, flags)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise PermissionError(f"{hello.arena_path} is not a regular file of this user")
            if info.st_size != hello.arena_bytes or hello.arena_bytes <= 0:
                raise ChannelProtocolError(
                    f"{hello.arena_path} has {info.st_size} bytes, the hello says "
                    f"{hello.arena_bytes}"
                )
            return _Arena(mmap.mmap(fd, hello.arena_bytes), self._pin)
        finally:
            os.close(fd)

    def _answer(self, views: ArenaViews, request: bytes) -> bytes:
        """The reply to one request (an error reply for a malformed one or a failed call)."""
        try:
            method, args, kwargs, free_from = pickle.loads(request)
            if method not in CHANNEL_METHODS:
                raise ChannelProtocolError(f"{method!r} is not served over the channel")
            result = self._call(method, decode(tuple(args), views), decode(dict(kwargs), views))
        except Exception as exc:
            return pickle.dumps((False, _sendable(exc)))
        try:
            value = encode(result, ArenaLayout(views, free_from).place)
        except ArenaFull:
            value = result  # rare (results are no larger than inputs): sent in the message
        return pickle.dumps((True, value), protocol=pickle.HIGHEST_PROTOCOL)


class _Arena:
    """A connection's arena as mapped here: the mapping and a uint8 tensor over it, pinned
    for CUDA when asked (and accepted)."""

    def __init__(self, mm: mmap.mmap, pin_for_cuda: bool) -> None:
        self.mm = mm
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self.pinned = pin(self.tensor) if pin_for_cuda else False
        self.views = ArenaViews(self.tensor)

    def close(self) -> None:
        if self.pinned:
            unpin(self.tensor)
            self.pinned = False
        del self.tensor, self.views
        try:
            self.mm.close()
        except BufferError:
            # A view of it is still referenced somewhere: the mapping goes when that does.
            log.warning("a worker channel's arena is still in use; left mapped")


def _read(conn: socket.socket) -> bytes | None:
    """One message; None when the caller closed the connection between messages."""
    head = _read_exactly(conn, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > _MAX_REQUEST_BYTES:
        raise ChannelProtocolError(f"a request of {n} bytes (at most {_MAX_REQUEST_BYTES})")
    body = _read_exactly(conn, n)
    if body is None:
        raise ChannelProtocolError("the connection closed inside a message")
    return body


def _read_exactly(conn: socket.socket, n: int) -> bytes | None:
    if n == 0:
        return b""
    chunks = []
    left = n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            if left == n:
                return None
            raise ChannelProtocolError("the connection closed inside a message")
        chunks.append(chunk)
        left -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _sendable(exc: Exception) -> Exception:
    """``exc`` if it survives a pickle round trip (the caller re-raises it as it is), else
    a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
