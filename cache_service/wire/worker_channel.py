"""The coordinator's end of the worker channel (:mod:`workers.channel_wire`): a Ray
worker's per-layer data calls sent straight to the worker instead of through Ray. A worker
on the coordinator's node is reached over a Unix socket, the tensors in an arena of shared
memory; a worker on another node over TCP, the tensors' bytes in the messages.

:class:`WorkerChannel` is one connection with its arena: calls on it run one at a time.
:class:`ChannelPool` keeps up to ``connections`` of them per worker, so the coordinator
prepares one call while the worker runs another; ``RayWorkerClient`` asks it first for
the methods the channel serves and makes a Ray call when it declines (no channel: the
worker is on another node and TCP is off, the arena cannot be created, opening failed
recently; or the call's tensors do not fit the arena).

A call that differs from the connection's last full call only in plain arguments (a
decode step's other layers: the layer) goes as a repeat of it, a few bytes
the worker answers without decoding anything (see ``workers.channel_wire``): its tensors
of the same shapes and dtypes, each where the last call's lay: at the same address of the
same shared file, or in the arena, which a repeat refills in place (a shared arena; the
attention's index tensors are not even copied when the call's unchanged ``metadata_key``
names them, since a key names one content).

A connection that breaks mid-call leaves unknown whether the worker ran the call. The data
calls served have the same effect run twice as once, so the pool declines the call and the
Ray call that follows decides: the worker answers it (the channel alone broke), or Ray
reports the worker dead or restarted, which the coordinator handles as for any call.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import pickle
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from cache_service.wire.shared_regions import default_directory
from workers.channel_server import CHANNEL_METHODS, MAX_FILES, ChannelAddress
from workers.channel_wire import (
    HEADER,
    KEYED_ARGUMENTS,
    ArenaFull,
    ArenaLayout,
    ArenaTensor,
    ArenaViews,
    FileTensor,
    RepeatUnavailable,
    SharedFileUnavailable,
    frame,
    join,
    split,
)
from workers.description import FencedEpoch
from workers.errors import WorkerError, WorkerUnavailable
from workers.owned_files import owned_prefix, reclaim_orphans
from workers.shared_files import SHARED_FILES, create_mapped, unlink_quietly
from workers.transport import dtype_name

__all__ = [
    "CHANNEL_METHODS",
    "ChannelBroken",
    "ChannelOptions",
    "ChannelPool",
    "WorkerChannel",
    "remove_orphan_arenas",
]

log = logging.getLogger("kvcache.worker_channel")

# Replies carry small values unless a result did not fit the arena (then it is inline).
_MAX_REPLY_BYTES = 1 << 30
# A shared arena's file exists only while its connection is made (then both ends keep just
# their mappings); one whose coordinator was killed meanwhile is left behind, named
# "kvcache-arena-<owner>-<random>" (workers.owned_files) for `remove_orphan_arenas`.
ARENA_PREFIX = "kvcache-arena-"


class ChannelBroken(ConnectionError):
    """The connection closed or failed: whether the worker ran the call in flight is unknown."""


class _Place(NamedTuple):
    """Where a tensor of the last full call went: a shared file at address `ptr`; or (ptr
    None) the arena, at `slot` when a repeat copies the new content there first, else (no
    slot) where the call's metadata_key names the content or, for the output, the content
    does not matter."""

    ptr: int | None
    shape: torch.Size
    dtype: torch.dtype
    slot: ArenaTensor | None = None


class _Parts(NamedTuple):
    """Where the parts of a tensor given in parts lay (each in a shared file): a repeat's
    parts must lie at the same addresses, with the same shapes and dtypes."""

    places: tuple[_Place, ...]


@dataclass(frozen=True)
class _Sent:
    """The connection's last full call, answered without error: what a repeat must match.

    Attributes:
        method: its method.
        args, kwargs: its arguments, each tensor replaced by its `_Place`.
        out: the place of its output (None: it had none).
        out_ref: the output's reference when it lay in a shared file.
        files_version: SHARED_FILES.version when it was built (a repeat needs the same:
            the files mapped where they were).
    """

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: _Place | _Parts | None
    out_ref: FileTensor | tuple[FileTensor, ...] | None
    files_version: int


# Values a repeat may replace (channel_wire._SCALARS; lists of them too).
_REPLACEABLE = frozenset({int, float, bool, str, bytes, type(None)})


@dataclass(frozen=True)
class ChannelOptions:
    """How a coordinator reaches its Ray workers over worker channels.

    Attributes:
        arena_bytes: arena per connection, bytes (shared memory on the same node, private
            memory on both ends over TCP); a call whose tensors (inputs and outputs) do not
            fit goes through Ray. 32 MiB holds a decode step of hundreds of sequences of an
            8B model.
        connections: connections per worker (calls in flight on one worker at once).
        directory: where arenas are created (None: /dev/shm where it exists).
        retry_after_s: after a channel could not be opened, calls go through Ray for this
            long before the next attempt.
        remote: reach workers on other nodes over TCP (the worker listens on its node's
            address once asked); False: their calls go through Ray.
        force_tcp: TCP even to a worker on this node (diagnostics: the remote path's cost
            measured on one host).
    """

    arena_bytes: int = 32 << 20
    connections: int = 2
    directory: str | None = None
    retry_after_s: float = 5.0
    remote: bool = True
    force_tcp: bool = False

    def __post_init__(self) -> None:
        if self.arena_bytes < 1 << 16:
            raise ValueError(f"arena_bytes must be at least 65536, got {self.arena_bytes}")
        if self.connections < 1:
            raise ValueError(f"connections must be >= 1, got {self.connections}")


class _Connection(asyncio.Protocol):
    """The socket: whole frames in, the one reply awaited at a time out. A reply's payload
    (private arenas) is copied into the arena at its offset before the reply is handed on.

    Args:
        arena: the bytes of a private arena (None: a shared one; replies carry no payload).
    """

    def __init__(self, arena: memoryview | None) -> None:
        self.transport: asyncio.Transport | None = None
        self._arena = arena
        self._buf = bytearray()
        self._waiter: asyncio.Future[bytes] | None = None
        self._lost: ChannelBroken | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self._buf and len(data) >= HEADER.size:
            # The common case, one whole frame without payload per read: no buffering.
            n, payload, _ = HEADER.unpack_from(data)
            if not payload and len(data) == HEADER.size + n:
                self._deliver(data[HEADER.size :])
                return
        self._buf += data
        while len(self._buf) >= HEADER.size:
            n, payload, offset = HEADER.unpack_from(self._buf)
            end = HEADER.size + n + payload
            if n > _MAX_REPLY_BYTES:
                self._fail(ChannelBroken(f"the worker sent a reply of {n} bytes"))
                return
            if len(self._buf) < end:
                return
            if payload:
                arena = self._arena
                if arena is None or offset + payload > len(arena):
                    self._fail(ChannelBroken("the worker sent a payload outside the arena"))
                    return
                with memoryview(self._buf) as received:  # no copy before the arena's
                    arena[offset : offset + payload] = received[HEADER.size + n : end]
            message = bytes(self._buf[HEADER.size : HEADER.size + n])
            del self._buf[:end]
            self._deliver(message)

    def _deliver(self, message: bytes) -> None:
        waiter = self._waiter
        self._waiter = None
        if waiter is None or waiter.done():
            self._fail(ChannelBroken("the worker sent a reply nobody asked for"))
            return
        waiter.set_result(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ChannelBroken(f"the connection closed ({exc or 'by the worker'})"))

    def _fail(self, error: ChannelBroken) -> None:
        if self._lost is None:
            self._lost = error
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(self._lost)
        self._waiter = None
        if self.transport is not None:
            self.transport.close()

    def exchange(
        self, message: bytes, payload: memoryview | None = None, offset: int = 0
    ) -> asyncio.Future[bytes]:
        """Send one message (and the payload: arena bytes that go to ``offset`` of the
        worker's arena); the future is its reply."""
        if self._lost is not None:
            raise self._lost
        assert self.transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        if payload is None or not len(payload):
            self.transport.write(frame(message))
        else:
            self.transport.write(frame(message, len(payload), offset))
            # Not changed before the reply arrives, i.e. after the worker read all of it.
            self.transport.write(payload)
        return self._waiter


class WorkerChannel:
    """One connection to a worker's channel, with its own arena (calls one at a time).

    Use :meth:`connect`.
    """

    def __init__(
        self, conn: _Connection, arena: torch.Tensor, shared: bool, pinned: bool, tcp: bool
    ) -> None:
        self._conn = conn
        self._views = ArenaViews(arena)
        self._bytes = None if shared else memoryview(arena.numpy())
        self.shared = shared  # the arena is shared memory (else its bytes travel)
        # Shared files (workers.shared_files.SHARED_FILES) the worker mapped for this
        # connection, by (path, size); those it could not map; SHARED_FILES.version when
        # the files were last checked for deleted ones.
        self._files: dict[tuple[str, int], int] = {}
        self._next_file = 0
        self._unmappable: set[tuple[str, int]] = set()
        self._files_version = -1
        self.pinned = pinned  # whether the worker page-locked its arena for CUDA
        # The data path it gives its calls (WorkerInfo.data_path).
        self.path = "channel_tcp" if tcp else "channel_unix"
        self._sent: _Sent | None = None  # what the worker may repeat
        self.repeats = 0  # calls sent as repeats

    @classmethod
    async def connect(
        cls,
        address: ChannelAddress,
        arena_bytes: int,
        directory: str | None = None,
        *,
        tcp: bool = False,
        shared_memory: bool | None = None,
    ) -> WorkerChannel:
        """Connect to the worker at ``address`` with an arena of ``arena_bytes``: over its
        Unix socket, the arena a file in ``directory`` (None: /dev/shm where it exists)
        that both map; or (``tcp``, or ``shared_memory=False``) with private arenas on both
        sides, the tensors' bytes in the messages.

        Raises:
            OSError: the arena could not be created or the worker reached.
            ChannelBroken: the worker refused the connection (the message says why).
        """
        shared = not tcp if shared_memory is None else shared_memory
        if tcp and shared:
            raise ValueError("a TCP connection cannot share memory")
        if tcp and (address.tcp_host is None or address.tcp_port is None):
            raise ConnectionRefusedError("the worker has no TCP listener")
        loop = asyncio.get_running_loop()
        path = None
        if shared:
            path, mm = create_mapped(
                directory or default_directory(), owned_prefix(ARENA_PREFIX), arena_bytes
            )
            arena = torch.frombuffer(mm, dtype=torch.uint8)
        else:
            arena = torch.empty(arena_bytes, dtype=torch.uint8)
        try:
            conn = _Connection(None if shared else memoryview(arena.numpy()))
            if tcp:
                transport, _ = await loop.create_connection(
                    lambda: conn, address.tcp_host, address.tcp_port
                )
                sock = transport.get_extra_info("socket")
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                await loop.create_unix_connection(lambda: conn, address.socket_path)
            hello = {"token": address.token, "arena_path": path, "arena_bytes": arena_bytes}
            try:
                answer = json.loads(await conn.exchange(json.dumps(hello).encode()))
            except BaseException:
                conn._fail(ChannelBroken("abandoned while connecting"))
                raise
            if not answer.get("ok"):
                conn._fail(ChannelBroken("refused by the worker"))
                raise ChannelBroken(f"the worker refused the channel: {answer.get('error')}")
        finally:
            if path is not None:
                unlink_quietly(path)  # both ends hold their mapping; nothing left in /dev/shm
        return cls(conn, arena, shared, bool(answer.get("pinned")), tcp)

    def close(self) -> None:
        """Close the connection (the arena goes with the last reference to it)."""
        self._conn._fail(ChannelBroken("closed by the coordinator"))

    def last_call_was(self, method: str, metadata_key: object) -> bool:
        """Whether the call this connection may repeat is of `method` with `metadata_key`
        (a hint for choosing among idle connections: the call itself decides)."""
        sent = self._sent
        return (
            sent is not None
            and sent.method == method
            and sent.kwargs.get("metadata_key") == metadata_key
        )

    async def call(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: torch.Tensor | list[torch.Tensor] | None = None,
    ) -> tuple[bool, Any]:
        """Run ``PoolWorker.<method>(*args, **kwargs)`` on the worker. A call that matches
        the connection's last full call but for plain arguments goes as a repeat of it
        (see the module docstring).

        Args:
            out: host memory for the call's (first) output: the worker writes it into the
                arena and it is copied here; the result then holds ``out`` itself. A list:
                the output in parts (``write_and_attend_pages``' ``out``), sent only where
                every part lies in a shared file (the worker writes each there, and the
                result holds the list); else not sent (the output comes back joined).

        Returns:
            ``(True, result)`` with every tensor the caller's own (copied out of the arena),
            or ``(False, exception)``: the worker's error, the channel still usable.

        Raises:
            ArenaFull: the call's tensors do not fit the arena (nothing was sent).
            ChannelBroken: the connection failed (whether the call ran is unknown).
        """
        while True:
            sent = self._sent
            repeat = None if sent is None else _repeat_changes(sent, method, args, kwargs, out)
            if repeat is not None:
                assert sent is not None
                changes, refills = repeat
                for slot, t in refills:
                    self._views(slot).copy_(t)
                reply = await self._conn.exchange(
                    pickle.dumps((changes,), protocol=pickle.HIGHEST_PROTOCOL)
                )
                ok, value = self._read_reply(reply, out, sent.out_ref)
                if ok:
                    self.repeats += 1
                    return True, value
                if type(value) is RepeatUnavailable:
                    self._sent = None  # nothing ran: sent in full
                    continue
                return False, value
            # A full request overwrites the arena's inputs (even one that ends in ArenaFull
            # before it is sent): the last call can no longer be repeated.
            self._sent = None
            request, out_ref, payload, announced, sent = self._request(method, args, kwargs, out)
            reply = await self._conn.exchange(request, *payload)
            ok, value = self._read_reply(reply, out, out_ref)
            if ok:
                self._sent = sent
                return True, value
            failed = [key for key in self._files if key[0] == getattr(value, "path", None)]
            if type(value) is SharedFileUnavailable and (failed or announced):
                # Nothing ran: the worker could not map a file this request announced, or
                # had unmapped one it named, deleted meanwhile; it did not keep the
                # request's new files. The call goes again with that file's tensors copied
                # (each round rules out one file at least).
                for key in {*announced, *failed}:
                    del self._files[key]
                self._unmappable.update(failed or announced)
                log.warning(
                    "a worker could not map a client's shared region; its tensors are copied "
                    "on this connection from now on",
                    extra={"reason": str(value)},
                )
                continue
            return False, value

    def _request(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: torch.Tensor | list[torch.Tensor] | None,
    ) -> tuple[
        bytes,
        FileTensor | None,
        tuple[memoryview, int] | tuple[()],
        list[tuple[str, int]],
        _Sent | None,
    ]:
        """The request's message, the reference `out` travels as when it lies in a shared
        file (else None), the payload (private arenas: the inputs' bytes and their offset
        in the arena; else empty), the files it announces and what a repeat of it must
        match (None: it cannot be repeated); the connection's files are updated only once
        the request is built.

        Raises:
            ArenaFull: the tensors do not fit the arena (nothing changed but the arena).
        """
        layout = ArenaLayout(self._views)
        new: dict[tuple[str, int], int] = {}
        share = self.shared
        in_arena: dict[int, ArenaTensor] = {}  # tensors copied into the arena, by id

        def place(t: torch.Tensor) -> ArenaTensor | FileTensor:
            ref = share and self._in_file(t, new)
            if ref:
                return ref
            ref = in_arena[id(t)] = layout.put(t)
            return ref

        version, gone = self._gone_files() if share else (self._files_version, [])
        args_in, kwargs_in = args, kwargs
        out_ref: FileTensor | tuple[FileTensor, ...] | None = None
        if type(out) is list:
            # An output in parts goes only where every part lies in a shared file (the
            # callers' slots): the worker writes each there. Else it is not named, and the
            # output comes back joined, in the arena.
            refs = [self._in_file(o, new) for o in out] if share else []
            if refs and all(refs):
                out_ref = tuple(refs)  # type: ignore[arg-type]
                kwargs = {**kwargs, "out": list(out_ref)}
        elif out is not None:
            # Named before the inputs are placed: where it is not in a shared file, its room
            # is the arena's first (the inputs follow; only their bytes travel over TCP).
            out_ref = self._in_file(out, new) if share else None
            kwargs = {**kwargs, "out": out_ref or layout.reserve(tuple(out.shape), out.dtype)[0]}
        inputs_start = layout.end
        args, arg_refs = split(args, place)
        kwargs, kwarg_refs = split(kwargs, place)
        inputs_end = layout.end
        announce = tuple((number, *key) for key, number in new.items())
        forget = tuple(self._files.pop(key) for key in gone)
        request = pickle.dumps(
            (method, layout.end, announce, forget, args, arg_refs, kwargs, kwarg_refs),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        # Built: only now does the connection's record change (ArenaFull changes nothing).
        self._files.update(new)
        self._next_file += len(new)
        self._files_version = version
        payload = (
            () if self._bytes is None else (self._bytes[inputs_start:inputs_end], inputs_start)
        )
        sent = _sent_as(method, args_in, kwargs_in, out, out_ref, in_arena, version, share)
        return request, out_ref, payload, list(new), sent

    def _in_file(self, t: torch.Tensor, new: dict[tuple[str, int], int]) -> FileTensor | None:
        """``t``'s reference when it lies in a shared file the worker may map, else None;
        a file new to this connection is numbered in ``new`` (announced by the request)."""
        nbytes = t.nbytes
        if not nbytes or not t.is_cpu or not t.is_contiguous():
            return None
        ptr = t.data_ptr()
        found = SHARED_FILES.find(ptr, nbytes)
        if found is None:
            return None
        start, key = found
        assert key is not None  # every shared file is recorded with its (path, size)
        number = self._files.get(key)
        if number is None:
            number = new.get(key)
        if number is None:
            if key in self._unmappable or len(self._files) + len(new) >= MAX_FILES:
                return None
            number = new[key] = self._next_file + len(new)
        return FileTensor(number, ptr - start, dtype_name(t.dtype), tuple(t.shape))

    def _gone_files(self) -> tuple[int, list[tuple[str, int]]]:
        """SHARED_FILES.version now, and this connection's files deleted since the last
        request looked (that request tells the worker to unmap them)."""
        version = SHARED_FILES.version
        if version == self._files_version:
            return version, []
        live = SHARED_FILES.holds_value
        self._unmappable = {key for key in self._unmappable if live(key)}
        return version, [key for key in self._files if not live(key)]

    def _read_reply(
        self,
        reply: bytes,
        out: torch.Tensor | list[torch.Tensor] | None,
        out_ref: FileTensor | tuple[FileTensor, ...] | None,
    ) -> tuple[bool, Any]:
        """The reply: ``(True, value)`` with the value's arena tensors copied out, the first
        into `out`, or `out` itself where the reply names `out_ref` (the worker wrote it in
        place; an output in parts: each part where the reply names its reference); or
        ``(False, exception)``.

        Raises:
            ChannelBroken: the reply names a shared file the request did not give.
        """
        views = self._views
        own = (
            _parts_owner(out, out_ref, views) if type(out) is list else _owner(out, out_ref, views)
        )
        ok, *value = pickle.loads(reply)
        if not ok:
            return False, value[0]
        return True, join(*value, own)


def _owner(
    out: torch.Tensor | None, out_ref: object, views: ArenaViews
) -> Callable[[ArenaTensor | FileTensor], torch.Tensor]:
    """The tensor a reply's reference stands for: `out` where it names `out_ref` (written
    in place), else the arena's tensor copied out, the first into `out`."""
    first = [out]

    def own(ref: ArenaTensor | FileTensor) -> torch.Tensor:
        if type(ref) is FileTensor:
            if ref != out_ref:
                raise ChannelBroken(f"the worker named a shared file it was not given: {ref}")
            first[0] = None
            return out  # type: ignore[return-value]
        t = views(ref)
        target = first[0]
        first[0] = None
        if target is not None and target.shape == t.shape and target.dtype == t.dtype:
            return target.copy_(t)
        return t.clone()

    return own


def _parts_owner(
    out: list[torch.Tensor], out_ref: object, views: ArenaViews
) -> Callable[[ArenaTensor | FileTensor], torch.Tensor]:
    """`_owner` of an output given in parts: a reference to a part's slot (`out_ref`, when
    the request named them) is that part; arena tensors are copied out."""
    given = dict(zip(out_ref, out, strict=True)) if type(out_ref) is tuple else {}

    def own(ref: ArenaTensor | FileTensor) -> torch.Tensor:
        if type(ref) is FileTensor:
            part = given.get(ref)
            if part is None:
                raise ChannelBroken(f"the worker named a shared file it was not given: {ref}")
            return part
        return views(ref).clone()

    return own


def _sent_as(
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: torch.Tensor | list[torch.Tensor] | None,
    out_ref: FileTensor | tuple[FileTensor, ...] | None,
    in_arena: dict[int, ArenaTensor],
    files_version: int,
    refillable: bool,
) -> _Sent | None:
    """What a repeat of a full call must match, or None when it cannot be repeated: a
    value that is neither a tensor nor plain (a list of plain values at most), a tensor
    in parts with a part copied into the arena, an output in parts the worker did not
    write in place, or (not `refillable`: a private arena, whose bytes would have to
    travel) a tensor copied into the arena that its metadata_key does not name.

    Args:
        in_arena: the call's tensors copied into the arena, by id, with their slots (the
            others lie in shared files).
    """
    keyed = KEYED_ARGUMENTS.get(method, frozenset())
    if kwargs.get("metadata_key") is None:
        keyed = frozenset()

    def sent(value: Any, keyed_here: bool) -> Any:
        if type(value) is torch.Tensor:
            slot = in_arena.get(id(value))
            if slot is None:
                return _Place(value.data_ptr(), value.shape, value.dtype)
            if keyed_here:
                return _Place(None, value.shape, value.dtype)
            return _Place(None, value.shape, value.dtype, slot) if refillable else None
        kind = type(value)
        if kind in _REPLACEABLE or kind is FencedEpoch:
            return value
        if kind is list and value and all(type(v) is torch.Tensor for v in value):
            # A tensor in parts: repeatable where every part lies in a shared file.
            if any(id(v) in in_arena for v in value):
                return None
            return _Parts(tuple(_Place(v.data_ptr(), v.shape, v.dtype) for v in value))
        if (kind is list or kind is tuple) and all(type(v) in _REPLACEABLE for v in value):
            return value
        return None

    plain_args = tuple(sent(a, i in keyed) for i, a in enumerate(args))
    plain_kwargs = {k: sent(v, False) for k, v in kwargs.items()}
    for given, plain in ((args, plain_args), (kwargs.values(), plain_kwargs.values())):
        if any(p is None and g is not None for g, p in zip(given, plain, strict=True)):
            return None
    place: _Place | _Parts | None = None
    if type(out) is list:
        if type(out_ref) is not tuple:
            return None  # the output in parts came back joined: nothing to repeat into
        place = _Parts(tuple(_Place(o.data_ptr(), o.shape, o.dtype) for o in out))
    elif out is not None:
        assert isinstance(out, torch.Tensor)
        place = _Place(out.data_ptr() if out_ref is not None else None, out.shape, out.dtype)
    return _Sent(method, plain_args, plain_kwargs, place, out_ref, files_version)


def _repeat_changes(
    sent: _Sent,
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: torch.Tensor | list[torch.Tensor] | None,
) -> tuple[tuple[tuple[int | str, Any], ...], list[tuple[ArenaTensor, torch.Tensor]]] | None:
    """What makes this call a repeat of `sent`: the arguments to replace (``(position or
    keyword, value)`` each) and the tensors to copy into their arena slots first; None
    when it is not one (then it goes in full).

    A repeat has the same method, keywords and shared files (SHARED_FILES unchanged), each
    tensor of the shape and dtype `sent`'s had and where it lay (the same address of a
    shared file, or the arena), and equal plain values but for scalars and lists of them
    replaced by others of their type.
    """
    if (
        sent.method != method
        or len(args) != len(sent.args)
        or len(kwargs) != len(sent.kwargs)
        or SHARED_FILES.version != sent.files_version
        or not _fits(out, sent.out)
    ):
        return None
    changes: list[tuple[int | str, Any]] = []
    refills: list[tuple[ArenaTensor, torch.Tensor]] = []
    try:
        for i, (new, old) in enumerate(zip(args, sent.args, strict=True)):
            if not _matches(new, old, i, changes, refills):
                return None
        for name, old in sent.kwargs.items():
            new = kwargs.get(name, _Place)  # _Place: a value no call passes
            # The key vouches for the arena's index tensors, which are not refilled.
            if not _matches(new, old, name, changes, refills, fixed=name == "metadata_key"):
                return None
    except Exception:  # a comparison that is not a plain yes or no (a tensor in a list)
        return None
    return tuple(changes), refills


def _matches(
    new: object,
    old: object,
    where: int | str,
    changes: list[tuple[int | str, Any]],
    refills: list[tuple[ArenaTensor, torch.Tensor]],
    fixed: bool = False,
) -> bool:
    """Whether `new` may stand where the last call had `old` (a `_Place`, or a plain value)
    in a repeat; records the refill or the change (at `where`) it takes. `fixed`: a plain
    value that must stay equal."""
    if type(old) is _Place:
        if not _fits(new, old):
            return False
        if old.slot is not None:
            refills.append((old.slot, new))  # type: ignore[arg-type]
        return True
    if type(old) is _Parts:
        return _fits(new, old)  # parts lie in shared files: nothing to refill
    if new is old or (type(new) is type(old) and new == old):
        return True
    if fixed or not _replaceable(new, old):
        return False
    changes.append((where, new))
    return True


def _replaceable(new: object, old: object) -> bool:
    """Whether a repeat may send `new` in place of `old`: a plain scalar, or a list of
    them, of `old`'s type (channel_wire.repeated's rule)."""
    kind = type(new)
    if kind is not type(old):
        return False
    return kind in _REPLACEABLE or (
        kind is list and all(type(v) in _REPLACEABLE for v in new)  # type: ignore[attr-defined]
    )


def _fits(t: object, place: _Place | _Parts | None) -> bool:
    """Whether `t` is a tensor where `place` says the last call's was (None: no tensor;
    `_Parts`: a list of tensors, each where its part was)."""
    if place is None:
        return t is None
    if type(place) is _Parts:
        return (
            type(t) is list
            and len(t) == len(place.places)
            and all(_fits(x, p) for x, p in zip(t, place.places, strict=True))
        )
    return (
        type(t) is torch.Tensor
        and t.shape == place.shape
        and t.dtype == place.dtype
        and (
            (place.slot is not None and t.is_cpu)
            or (place.ptr is None and place.slot is None)
            or (t.data_ptr() == place.ptr and t.is_contiguous())
        )
    )


class ChannelPool:
    """Up to ``options.connections`` channels to one worker, opened when calls need them.

    Args:
        worker_id: for errors and logs.
        options: arena size, connections, retry interval.
        address: fetches the worker's :class:`ChannelAddress` (a Ray call), with a TCP
            listener when called with True.
        local_node: this process's Ray node id (None: not in a Ray node; only TCP).
        timeout_s: a call taking longer raises WorkerUnavailable (None: wait forever).
    """

    def __init__(
        self,
        worker_id: str,
        options: ChannelOptions,
        address: Callable[[bool], Awaitable[ChannelAddress]],
        local_node: str | None,
        timeout_s: float | None = None,
    ) -> None:
        self._worker_id = worker_id
        self._options = options
        self._address = address
        self._local_node = local_node
        self._timeout = timeout_s
        self._idle: list[WorkerChannel] = []
        self._count = 0  # channels open or being opened
        self._waiters: collections.deque[asyncio.Future[WorkerChannel | None]] = collections.deque()
        self._retry_at = 0.0
        self._closed = False
        self.calls = 0  # calls the channel answered (the rest went through Ray)
        self.repeats = 0  # of those, calls sent as repeats of the connection's last one

    @property
    def open_channels(self) -> int:
        return self._count

    async def call(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: torch.Tensor | list[torch.Tensor] | None = None,
    ) -> tuple[str | None, Any]:
        """``(path, result)`` when a channel ran the call (``path``: its
        :attr:`WorkerChannel.path`); ``(None, None)`` when the caller must make a Ray call
        instead (no channel, arena too small, connection broke).

        Raises:
            WorkerError: the worker's error (one that is not a WorkerError is wrapped).
            WorkerUnavailable: no answer within the timeout.
        """
        chan = await self._take(method, kwargs.get("metadata_key"))
        if chan is None:
            return None, None
        repeats_before = chan.repeats
        try:
            async with asyncio.timeout(self._timeout):
                ok, value = await chan.call(method, args, kwargs, out)
        except ArenaFull:
            self._give(chan)
            return None, None
        except ChannelBroken as exc:
            self._drop(chan)
            log.warning(
                "worker channel broke; the call goes through Ray",
                extra={"worker": self._worker_id, "reason": str(exc)},
            )
            return None, None
        except TimeoutError:
            self._drop(chan)
            raise WorkerUnavailable(
                self._worker_id, f"no answer within {self._timeout} s"
            ) from None
        except BaseException:
            # Cancelled mid-call: the reply (and the worker's writes into the arena) may
            # still come, so the connection is not reused.
            self._drop(chan)
            raise
        self._give(chan)
        if ok:
            self.calls += 1
            self.repeats += chan.repeats - repeats_before
            return chan.path, value
        if isinstance(value, WorkerError):
            raise value
        raise WorkerError(f"worker {self._worker_id!r} failed: {value!r}")

    def close(self) -> None:
        """Close every channel (those in use when their call ends)."""
        self._closed = True
        for chan in self._idle:
            chan.close()
        self._idle.clear()
        self._wake_all()

    async def _take(self, method: str, metadata_key: object) -> WorkerChannel | None:
        """An idle channel (the one whose last call this one may repeat, if any), a new
        one, or one handed over by a call that ends; None: go through Ray."""
        if self._closed:
            return None
        idle = self._idle
        if idle:
            for i in range(len(idle) - 1, -1, -1):
                if idle[i].last_call_was(method, metadata_key):
                    return idle.pop(i)
            return idle.pop()
        if self._count < self._options.connections and time.monotonic() >= self._retry_at:
            self._count += 1
            try:
                return await self._open()
            except asyncio.CancelledError:
                self._count -= 1
                raise
            except Exception as exc:
                self._count -= 1
                self._retry_at = time.monotonic() + self._options.retry_after_s
                log.warning(
                    "worker channel unavailable; calls go through Ray",
                    extra={"worker": self._worker_id, "reason": f"{type(exc).__name__}: {exc}"},
                )
                self._wake_all()  # they go through Ray too
                return None
        if self._count == 0:
            return None
        waiter: asyncio.Future[WorkerChannel | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self._give(waiter.result())  # handed over as the caller gave up
            raise

    async def _open(self) -> WorkerChannel:
        options = self._options
        address = await self._address(options.force_tcp)
        here = address.node_id is not None and address.node_id == self._local_node
        tcp = options.force_tcp or not here
        if tcp and not options.force_tcp:
            if not options.remote:
                raise ConnectionRefusedError(
                    f"the worker runs on node {address.node_id}, this process on "
                    f"{self._local_node}, and remote channels are off"
                )
            address = await self._address(True)
        chan = await WorkerChannel.connect(address, options.arena_bytes, options.directory, tcp=tcp)
        if self._closed:
            chan.close()
            raise ConnectionAbortedError("the client closed meanwhile")
        log.info(
            "worker channel open",
            extra={
                "worker": self._worker_id,
                "transport": f"tcp {address.tcp_host}:{address.tcp_port}" if tcp else "unix",
                "arena_bytes": options.arena_bytes,
                "pinned": chan.pinned,
            },
        )
        return chan

    def _give(self, chan: WorkerChannel) -> None:
        if self._closed:
            chan.close()
            self._count -= 1
            return
        if not self._wake(chan):
            self._idle.append(chan)

    def _drop(self, chan: WorkerChannel) -> None:
        chan.close()
        self._count -= 1
        if self._count == 0:
            self._wake_all()  # nothing left to wait for: they go through Ray

    def _wake_all(self) -> None:
        """Send every waiting caller to Ray."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _wake(self, chan: WorkerChannel) -> bool:
        """Hand ``chan`` to the first caller still waiting; False when none is."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(chan)
                return True
        return False


def remove_orphan_arenas(directory: str | None = None) -> list[str]:
    """Delete the arena files in ``directory`` (None: /dev/shm where it exists) left by
    coordinator processes that are gone; a live one's stay. Returns the paths removed."""
    return reclaim_orphans(directory or default_directory(), ARENA_PREFIX)
