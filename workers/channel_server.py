"""The worker's end of the worker channel (:mod:`workers.channel_wire`): a ``PoolWorker``'s
per-layer data calls served over a Unix socket (callers on this node, the tensors in an
arena of shared memory) or over TCP (callers on other nodes, the tensors in the messages).

One thread accepts connections per listener; each connection gets a thread of its own and
an arena of its own. Its first message, the hello (JSON, nothing is unpickled before it
passed), names the worker's token (handed out over Ray, :meth:`ChannelServer.address`)
and either the /dev/shm file the caller created (Unix socket only; the server checks it
is a regular file of this user and of the announced size, and maps it) or the size of a
private arena for tensors that travel in the messages. For a CUDA pool either arena is
page-locked (``workers.cuda_pinning``, or a pinned allocation), so the pool reads the
call's inputs and writes its outputs by DMA. On a shared arena's connection a request may
also name tensors in the coordinator's shared files (its clients' regions, announced by
path and size the first time): the connection maps each (the same checks as the arena's
file), page-locks it for CUDA, and unmaps it when a request says the coordinator deleted
it, when an idle connection finds it deleted (every `SWEEP_INTERVAL_S`), or when the
connection ends. A connection keeps the last full request it answered, decoded, so the
caller can have it run again with other plain arguments (a repeat: a decode step's other
layers, spared pickling and decoding, see ``workers.channel_wire``). Calls on one
connection run one at a time, in order; the calls of all connections and of Ray run one
at a time on the pool (the worker's lock).

Only the per-layer data methods (:data:`CHANNEL_METHODS`) are served: their results are no
larger than their inputs, and running one twice has the effect of running it once (the
same K/V into the same slots), so a caller whose connection broke mid-call may safely send
it again over Ray.
"""

from __future__ import annotations

import atexit
import contextlib
import hmac
import json
import logging
import mmap
import os
import pickle
import secrets
import select
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.channel_wire import (
    HEADER,
    MAX_HELLO_BYTES,
    ArenaFull,
    ArenaLayout,
    ArenaTensor,
    ArenaViews,
    ChannelProtocolError,
    FileTensor,
    RepeatUnavailable,
    SharedFileUnavailable,
    frame,
    join,
    repeated,
    split,
)
from workers.cuda_pinning import pin, unpin
from workers.transport import dtype_name

__all__ = [
    "CHANNEL_METHODS",
    "MAX_FILES",
    "MAX_PRIVATE_ARENA_BYTES",
    "ChannelAddress",
    "ChannelServer",
]

log = logging.getLogger("kvcache.channel")

CHANNEL_METHODS = frozenset({"write", "run_round", "reference_attend"})

# Each server's socket lives in a directory of its own, "<temp dir>/<_DIR_PREFIX>xxxx";
# one without a listening server and unchanged this long is removed by the next server.
_DIR_PREFIX = "kvcache-channel-"
_STALE_AFTER_S = 60.0

# Requests carry only small values besides their payload; a longer message is an error.
_MAX_MESSAGE_BYTES = 64 << 20
# The largest private arena (TCP connections) a hello may ask for.
MAX_PRIVATE_ARENA_BYTES = 1 << 30
# Shared files mapped per connection at most (a coordinator names fewer: its clients'
# regions in use; it copies instead past its own limit).
MAX_FILES = 64
# How often an idle connection with shared files mapped looks for deleted ones, seconds.
SWEEP_INTERVAL_S = 5.0


@dataclass(frozen=True)
class ChannelAddress:
    """Where a worker's channel listens, as :meth:`ChannelServer.address` hands it out.

    Attributes:
        node_id: the Ray node the worker runs on (None outside Ray): a caller on the same
            node uses the Unix socket and shared memory.
        socket_path: the Unix socket.
        token: the secret a connection's hello must name.
        tcp_host, tcp_port: the TCP listener for callers on other nodes (None: none).
    """

    node_id: str | None
    socket_path: str
    token: str
    tcp_host: str | None = None
    tcp_port: int | None = None


Call = Callable[[str, tuple[Any, ...], dict[str, Any]], Any]


class ChannelServer:
    """Serves ``call(method, args, kwargs)`` (a PoolWorker's data methods, results unpacked).

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
        _remove_stale_sockets()
        self._dir = tempfile.mkdtemp(prefix=_DIR_PREFIX)  # mode 0700
        path = os.path.join(self._dir, "socket")
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(path)
        unix.listen(16)
        self._address = ChannelAddress(node_id, path, secrets.token_hex(16))
        self._listeners: list[socket.socket] = [unix]
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        self._start_accepting(unix, tcp=False)
        atexit.register(self.close)

    def address(self) -> ChannelAddress:
        """Where to connect, with the token."""
        return self._address

    def listen_tcp(self, host: str) -> ChannelAddress:
        """Also accept callers of other nodes on ``host`` (this node's address; a free
        port); the address with the TCP listener. Once: later calls return it as it is."""
        with self._lock:
            if self._address.tcp_host is not None:
                return self._address
            tcp = socket.create_server((host, 0))
            self._listeners.append(tcp)
            port = tcp.getsockname()[1]
            a = self._address
            self._address = ChannelAddress(a.node_id, a.socket_path, a.token, host, port)
        self._start_accepting(tcp, tcp=True)
        return self._address

    def close(self) -> None:
        """Stop accepting, drop every connection (their calls in flight finish first) and
        remove the socket's directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        atexit.unregister(self.close)  # which held this server alive until exit
        for listener in self._listeners:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- internals ----------------------------------------------------------------------

    def _start_accepting(self, listener: socket.socket, *, tcp: bool) -> None:
        kind = "tcp" if tcp else "unix"
        self._thread(self._accept_forever, (listener, tcp), kind)

    def _thread(self, target: Callable[..., None], args: tuple[Any, ...], kind: str) -> None:
        """Run ``target(*args)`` on a daemon thread of its own (named for py-spy and logs)."""
        name = f"kvchannel-{self._name}-{kind}"
        threading.Thread(target=target, args=args, name=name, daemon=True).start()

    def _accept_forever(self, listener: socket.socket, tcp: bool) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            if tcp:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._thread(self._serve, (conn, tcp), "conn")

    def _serve(self, conn: socket.socket, tcp: bool) -> None:
        arena: _Arena | None = None
        try:
            try:
                arena = self._open_arena(_read_hello(conn), tcp)
            except (OSError, ValueError, ChannelProtocolError) as exc:
                log.warning("worker channel refused a connection: %s", exc)
                with contextlib.suppress(OSError):
                    conn.sendall(frame(json.dumps({"ok": False, "error": str(exc)}).encode()))
                return
            conn.sendall(frame(json.dumps({"ok": True, "pinned": arena.pinned}).encode()))
            while True:
                # With shared files mapped, an idle connection looks now and then for files
                # deleted meanwhile and unmaps them: the coordinator's own notice comes with
                # its next request on this connection, which may be long in coming.
                while arena.files and not _readable(conn, SWEEP_INTERVAL_S):
                    arena.unmap_deleted()
                if (request := _read_request(conn, arena)) is None:
                    break
                message, span = self._answer(arena, request)
                if span is None or arena.shared:
                    conn.sendall(frame(message))
                else:
                    lo, hi = span
                    conn.sendall(frame(message, hi - lo, lo))
                    conn.sendall(arena.bytes[lo:hi])
        except (OSError, ChannelProtocolError) as exc:
            if not self._closed:
                log.info("worker channel connection ended: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()
            if arena is not None:
                arena.close()

    def _open_arena(self, hello: dict[str, Any], tcp: bool) -> _Arena:
        token = hello.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token, self._address.token):
            raise PermissionError("wrong token")
        size = hello.get("arena_bytes")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ChannelProtocolError(f"arena_bytes must be a positive integer, got {size!r}")
        path = hello.get("arena_path")
        if path is None:
            if size > MAX_PRIVATE_ARENA_BYTES:
                raise ChannelProtocolError(
                    f"a private arena of {size} bytes (at most {MAX_PRIVATE_ARENA_BYTES})"
                )
            return _Arena.private(size, self._pin)
        if tcp:
            raise ChannelProtocolError("a TCP connection cannot share memory")
        if not isinstance(path, str):
            raise ChannelProtocolError(f"arena_path must be a string, got {path!r}")
        return _Arena.shared_file(_map_file(path, size), self._pin)

    def _answer(self, arena: _Arena, request: bytes) -> tuple[bytes, tuple[int, int] | None]:
        """The reply to one request (an error reply for a malformed one or a failed call)
        and the span of the arena its tensors lie in (None: it names none)."""
        try:
            message = pickle.loads(request)
            if type(message) is tuple and len(message) == 1:  # a repeat
                if arena.template is None:
                    raise RepeatUnavailable("no request to repeat on this connection")
                method, args, kwargs, free_from = arena.template
                args, kwargs = repeated(args, kwargs, message[0])
                result = self._call(method, args, kwargs)
            else:
                arena.template = None  # this request's inputs replace the last one's
                method, free_from, files, forget, args, arg_refs, kwargs, kwarg_refs = message
                if method not in CHANNEL_METHODS:
                    raise ChannelProtocolError(f"{method!r} is not served over the channel")
                if type(args) is not tuple or type(kwargs) is not dict:
                    raise ChannelProtocolError("a request's arguments must be a tuple and a dict")
                arena.forget(forget)
                arena.map_files(files, self._pin)
                tensor_of = arena.tensor_of
                args = join(args, arg_refs, tensor_of)
                kwargs = join(kwargs, kwarg_refs, tensor_of)
                result = self._call(method, args, kwargs)
                # Answered: the caller may repeat it (workers.channel_wire, "repeat").
                arena.template = (method, args, kwargs, free_from)
        except Exception as exc:
            return pickle.dumps((False, _sendable(exc))), None
        placed: list[ArenaTensor] = []
        layout = ArenaLayout(arena.views, free_from)

        def place(t: torch.Tensor) -> ArenaTensor | FileTensor:
            in_file = arena.find_in_files(t)  # an output produced in a shared file
            if in_file is not None:
                return in_file
            ref = layout.place(t)
            placed.append(ref)
            return ref

        try:
            value, refs = split(result, place)
        except ArenaFull:
            # Rare (results are no larger than inputs): the tensors go in the message.
            return pickle.dumps((True, result, ()), protocol=pickle.HIGHEST_PROTOCOL), None
        span = None
        if placed:
            span = (min(r.offset for r in placed), max(r.offset + r.nbytes() for r in placed))
        return pickle.dumps((True, value, refs), protocol=pickle.HIGHEST_PROTOCOL), span


class _Arena:
    """A connection's arena: a mapping of the caller's shared file, or private memory whose
    bytes travel in the messages; page-locked for CUDA when asked (and possible)."""

    def __init__(self, tensor: torch.Tensor, mm: mmap.mmap | None, pinned: bool) -> None:
        self.mm = mm
        self.shared = mm is not None
        self.tensor = tensor
        self.pinned = pinned
        self.views = ArenaViews(tensor)
        self.bytes = memoryview(tensor.numpy())  # for the socket's reads and writes
        # The coordinator's shared files this connection's requests named, by number; those
        # unmapped here because they were deleted (number -> path) before the coordinator
        # said so (a request still naming one gets SharedFileUnavailable: nothing runs).
        self.files: dict[int, _SharedFile] = {}
        self.deleted: dict[int, str] = {}
        # The last full request answered without error, as decoded (method, args, kwargs,
        # free_from), for repeats; its tensors are views of the arena and of the files, so
        # it goes before any file is unmapped.
        self.template: tuple[str, tuple[Any, ...], dict[str, Any], int] | None = None

    @classmethod
    def shared_file(cls, mm: mmap.mmap, pin_for_cuda: bool) -> _Arena:
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
        return cls(tensor, mm, pin(tensor) if pin_for_cuda else False)

    @classmethod
    def private(cls, nbytes: int, pin_for_cuda: bool) -> _Arena:
        pinned = pin_for_cuda and torch.cuda.is_available()
        return cls(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned), None, pinned)

    def tensor_of(self, ref: ArenaTensor | FileTensor) -> torch.Tensor:
        """The tensor a request's reference names (a view of the arena or of a file).

        Raises:
            ChannelProtocolError: it lies outside, or names a file not announced.
        """
        if type(ref) is ArenaTensor:
            return self.views(ref)
        file = self.files.get(ref.file)  # type: ignore[union-attr]
        if file is None:
            path = self.deleted.get(ref.file)  # type: ignore[union-attr]
            if path is not None:
                raise SharedFileUnavailable(path, "deleted, and unmapped by the worker")
            raise ChannelProtocolError(f"shared file {ref.file} was not announced")  # type: ignore[union-attr]
        return file.views(ref)

    def find_in_files(self, t: torch.Tensor) -> FileTensor | None:
        """The reference of ``t`` when it is a contiguous view of a file mapped here (an
        output produced in place), else None."""
        for number, file in self.files.items():
            offset = file.offset_of(t)
            if offset is not None:
                return FileTensor(number, offset, dtype_name(t.dtype), tuple(t.shape))
        return None

    def map_files(self, files: object, pin_for_cuda: bool) -> None:
        """Map the files a request announces, ``(number, path, size)`` each: all of them,
        or (an error) none.

        Raises:
            SharedFileUnavailable: one could not be mapped (it is gone, or not a regular
                file of this user of that size).
            ChannelProtocolError: a malformed announcement (a number in use, too many).
        """
        if not files:
            return
        if not self.shared:
            # Files are for callers on this node; a private arena's caller (TCP: another
            # node) has no business naming this node's files.
            raise ChannelProtocolError("shared files named on a connection without shared memory")
        if not isinstance(files, tuple | list) or len(self.files) + len(files) > MAX_FILES:
            raise ChannelProtocolError(f"a malformed or oversized announcement of files: {files!r}")
        mapped: list[int] = []
        try:
            for number, path, size in files:
                if type(number) is not int or number in self.files:
                    raise ChannelProtocolError(f"shared file number {number!r} is in use")
                if not isinstance(path, str) or type(size) is not int or size <= 0:
                    raise ChannelProtocolError(f"a malformed shared file: {path!r}, {size!r}")
                try:
                    self.files[number] = _SharedFile(path, size, pin_for_cuda)
                except (OSError, ValueError, ChannelProtocolError) as exc:
                    raise SharedFileUnavailable(path, str(exc)) from None
                mapped.append(number)
        except BaseException:
            self.forget(mapped)
            raise

    def forget(self, numbers: object) -> None:
        """Unmap the files numbered (the coordinator deleted them; unknown numbers are
        fine)."""
        for number in numbers or ():  # type: ignore[attr-defined]
            self.deleted.pop(number, None)
            file = self.files.pop(number, None)
            if file is not None:
                self.template = None
                file.close()

    def unmap_deleted(self) -> None:
        """Unmap the files deleted since they were mapped (their memory goes back now)."""
        for number, file in list(self.files.items()):
            if file.deleted():
                self.template = None
                del self.files[number]
                self.deleted[number] = file.path
                file.close()

    def close(self) -> None:
        self.template = None
        self.forget(list(self.files))
        if self.shared and self.pinned:
            unpin(self.tensor)
        self.pinned = False
        self.bytes.release()
        del self.tensor, self.views
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                # A view of it is still referenced somewhere: the mapping goes when that does.
                log.warning("a worker channel's arena is still in use; left mapped")


class _SharedFile:
    """A coordinator's shared file mapped in the worker (page-locked for CUDA when asked):
    the tensors its requests name in it are views of it, read and written in place."""

    def __init__(self, path: str, size: int, pin_for_cuda: bool) -> None:
        self.path = path
        self._fd, self.mm = _map_file_keeping_fd(path, size)
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.pinned = pin(self.base) if pin_for_cuda else False
        self.views = ArenaViews(self.base, max_views=64)
        self._start = self.base.data_ptr()

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where ``t`` starts in the file when it is a contiguous view of it, else None."""
        if not t.is_cpu or not t.is_contiguous():
            return None
        offset = t.data_ptr() - self._start
        if offset < 0 or offset + t.nbytes > self.views.size:
            return None
        return offset

    def deleted(self) -> bool:
        """Whether the file was unlinked (no name left: only mappings keep it alive)."""
        try:
            return os.fstat(self._fd).st_nlink == 0
        except OSError:
            return True

    def close(self) -> None:
        os.close(self._fd)
        if self.pinned:
            unpin(self.base)
            self.pinned = False
        del self.base, self.views
        try:
            self.mm.close()
        except BufferError:
            log.warning("a shared file is still in use by the worker; left mapped")


def _map_file(path: str, size: int) -> mmap.mmap:
    """``path`` mapped read-write and shared, once checked: a regular file (links are not
    followed) of this user, of exactly ``size`` bytes.

    Raises:
        OSError: it cannot be opened or mapped (PermissionError: not a file of this user).
        ChannelProtocolError: its size is not ``size``.
    """
    fd, mm = _map_file_keeping_fd(path, size)
    os.close(fd)  # the mapping keeps the file
    return mm


def _map_file_keeping_fd(path: str, size: int) -> tuple[int, mmap.mmap]:
    """:func:`_map_file`, and a descriptor of the file left open (the caller closes it)."""
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(f"{path} is not a regular file of this user")
        if info.st_size != size:
            raise ChannelProtocolError(f"{path} has {info.st_size} bytes, not {size}")
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def _readable(conn: socket.socket, timeout_s: float) -> bool:
    """Whether ``conn`` has something to read (or was closed) within ``timeout_s``."""
    poller = select.poll()  # not select(): a worker's descriptors may pass FD_SETSIZE
    poller.register(conn, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _remove_stale_sockets() -> None:
    """Remove the socket directories of this user's channel servers that are gone: a worker
    killed outright (Ray kills actors with SIGKILL) never removes its own. A directory
    whose socket refuses connections (or that has none) has no server; one that answers,
    or was changed in the last minute (a server starting), is left alone."""
    root = tempfile.gettempdir()
    now = time.time()
    try:
        names = [n for n in os.listdir(root) if n.startswith(_DIR_PREFIX)]
    except OSError:
        return
    for name in names:
        directory = os.path.join(root, name)
        try:
            info = os.stat(directory)
            if info.st_uid != os.getuid() or now - info.st_mtime < _STALE_AFTER_S:
                continue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(os.path.join(directory, "socket"))
                continue  # a live server
            except (ConnectionRefusedError, FileNotFoundError):
                pass
            finally:
                probe.close()
        except OSError:
            continue
        shutil.rmtree(directory, ignore_errors=True)


def _read_hello(conn: socket.socket) -> dict[str, Any]:
    head = _read_exactly(conn, HEADER.size)
    if head is None:
        raise ChannelProtocolError("the connection closed before its hello")
    n, payload, _ = HEADER.unpack(head)
    if n > MAX_HELLO_BYTES or payload:
        raise ChannelProtocolError(f"a hello of {n} bytes (+{payload}): not a hello")
    body = _read_exactly(conn, n)
    hello = json.loads(body or b"")
    if not isinstance(hello, dict):
        raise ChannelProtocolError("the hello is not a JSON object")
    return hello


def _read_request(conn: socket.socket, arena: _Arena) -> bytes | None:
    """One request's message, its payload (if any) read into the arena at its offset; None
    when the caller closed the connection between requests."""
    head = _read_exactly(conn, HEADER.size)
    if head is None:
        return None
    n, payload, offset = HEADER.unpack(head)
    if n > _MAX_MESSAGE_BYTES:
        raise ChannelProtocolError(f"a request of {n} bytes (at most {_MAX_MESSAGE_BYTES})")
    message = _read_exactly(conn, n)
    if message is None:
        raise ChannelProtocolError("the connection closed inside a message")
    if payload:
        if arena.shared or offset + payload > len(arena.bytes):
            raise ChannelProtocolError(
                f"a payload of {payload} bytes at offset {offset} does not fit this arena"
            )
        _read_into(conn, arena.bytes[offset : offset + payload])
    return message


def _read_into(conn: socket.socket, target: memoryview) -> None:
    got = 0
    while got < len(target):
        n = conn.recv_into(target[got:])
        if not n:
            raise ChannelProtocolError("the connection closed inside a payload")
        got += n


def _read_exactly(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes; None when the connection closed before the first of them."""
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
