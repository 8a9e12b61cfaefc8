"""One connection of the worker channel (`WorkerChannel`): its socket, its arena, its
calls one at a time, each sent in full or as a repeat of the last (`channel_repeat`).

A worker on the coordinator's node is reached over a Unix socket, the tensors in an arena
of shared memory both ends map (or in shared files of the client the worker maps too); a
worker on another node over TCP, the tensors' bytes in the messages (private arenas).
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import socket
from collections.abc import Callable
from typing import Any

import torch

from cache_service.wire.channel_repeat import SentCall, repeat_changes, sent_as
from cache_service.wire.shared_regions import default_directory
from workers.channel_server import MAX_FILES, ChannelAddress
from workers.channel_wire import (
    HEADER,
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
from workers.owned_files import owned_prefix
from workers.shared_files import SHARED_FILES, create_mapped, unlink_quietly
from workers.transport import dtype_name

__all__ = ["ARENA_PREFIX", "ChannelBroken", "WorkerChannel"]

log = logging.getLogger("kvcache.worker_channel")

# Replies carry small values unless a result did not fit the arena (then it is inline).
_MAX_REPLY_BYTES = 1 << 30
# A shared arena's file exists only while its connection is made (then both ends keep just
# their mappings); one whose coordinator was killed meanwhile is left behind, named
# "kvcache-arena-<owner>-<random>" (workers.owned_files) for `remove_orphan_arenas`.
ARENA_PREFIX = "kvcache-arena-"


class ChannelBroken(ConnectionError):
    """The connection closed or failed: whether the worker ran the call in flight is unknown."""


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
        self._sent: SentCall | None = None  # what the worker may repeat
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

    def last_call_was(self, method: str, step_key: object) -> bool:
        """Whether the call this connection may repeat is of `method` with `step_key`
        (a hint for choosing among idle connections: the call itself decides)."""
        sent = self._sent
        return (
            sent is not None and sent.method == method and sent.kwargs.get("step_key") == step_key
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
                the output in parts (a round of several callers), sent only where
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
            repeat = None if sent is None else repeat_changes(sent, method, args, kwargs, out)
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
        SentCall | None,
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
        sent = sent_as(method, args_in, kwargs_in, out, out_ref, in_arena, version, share)
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
