"""The coordinator's end of the worker channel (:mod:`workers.channel_wire`): a Ray
worker's per-layer data calls over a Unix socket, their tensors in an arena of shared
memory, instead of through Ray.

:class:`WorkerChannel` is one connection with its arena: calls on it run one at a time.
:class:`ChannelPool` keeps up to ``connections`` of them per worker, so the coordinator
prepares one call while the worker runs another; ``RayWorkerClient`` asks it first for
the methods the channel serves and makes a Ray call when it declines (no channel: the
worker is on another node, the arena cannot be created, opening failed recently; or the
call's tensors do not fit the arena).

A connection that breaks mid-call leaves unknown whether the worker ran the call. The data
calls served have the same effect run twice as once, so the pool declines the call and the
Ray call that follows decides: the worker answers it (the channel alone broke), or Ray
reports the worker dead or restarted, which the coordinator handles as for any call.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import pickle
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from cache_service.local_frames import FrameBuffer, FrameError
from cache_service.shared_regions import default_directory
from workers.channel_server import CHANNEL_METHODS, ChannelAddress, Hello
from workers.channel_wire import ArenaFull, ArenaLayout, ArenaViews, decode, encode, frame
from workers.errors import WorkerError, WorkerUnavailable
from workers.shared_files import create_mapped, unlink_quietly

__all__ = [
    "CHANNEL_METHODS",
    "ChannelBroken",
    "ChannelOptions",
    "ChannelPool",
    "WorkerChannel",
]

log = logging.getLogger("kvcache.worker_channel")

# Replies carry small values unless a result did not fit the arena (then it is inline).
_MAX_REPLY_BYTES = 1 << 30


class ChannelBroken(ConnectionError):
    """The connection closed or failed: whether the worker ran the call in flight is unknown."""


@dataclass(frozen=True)
class ChannelOptions:
    """How a coordinator reaches its same-node Ray workers over worker channels.

    Attributes:
        arena_bytes: shared memory per connection, bytes; a call whose tensors (inputs and
            outputs) do not fit goes through Ray. 32 MiB holds a decode step of hundreds
            of sequences of an 8B model.
        connections: connections per worker (calls in flight on one worker at once).
        directory: where arenas are created (None: /dev/shm where it exists).
        retry_after_s: after a channel could not be opened, calls go through Ray for this
            long before the next attempt.
    """

    arena_bytes: int = 32 << 20
    connections: int = 2
    directory: str | None = None
    retry_after_s: float = 30.0

    def __post_init__(self) -> None:
        if self.arena_bytes < 1 << 16:
            raise ValueError(f"arena_bytes must be at least 65536, got {self.arena_bytes}")
        if self.connections < 1:
            raise ValueError(f"connections must be >= 1, got {self.connections}")


class _Connection(asyncio.Protocol):
    """The socket: whole messages in, the one reply awaited at a time out."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._frames = FrameBuffer(_MAX_REPLY_BYTES)
        self._waiter: asyncio.Future[bytes] | None = None
        self._lost: ChannelBroken | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._frames.feed(data)
        except FrameError as exc:
            self._fail(ChannelBroken(f"the worker sent a malformed reply: {exc}"))
            return
        for message in messages:
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

    def exchange(self, payload: bytes) -> asyncio.Future[bytes]:
        """Send one message; the future is its reply."""
        if self._lost is not None:
            raise self._lost
        assert self.transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(frame(payload))
        return self._waiter


class WorkerChannel:
    """One connection to a worker's channel, with its own arena (calls one at a time).

    Use :meth:`connect`.
    """

    def __init__(self, conn: _Connection, arena: torch.Tensor, pinned: bool) -> None:
        self._conn = conn
        self._views = ArenaViews(arena)
        self.pinned = pinned  # whether the worker page-locked the arena for CUDA
        self.closed = False

    @classmethod
    async def connect(
        cls, address: ChannelAddress, arena_bytes: int, directory: str | None = None
    ) -> WorkerChannel:
        """Create an arena of ``arena_bytes`` in ``directory`` (None: /dev/shm where it
        exists), connect to ``address`` and hand the worker the arena.

        Raises:
            OSError: the arena could not be created or the socket reached.
            ChannelBroken: the worker refused the connection (the message says why).
        """
        path, mm = create_mapped(directory or default_directory(), "kvcache-arena-", arena_bytes)
        try:
            loop = asyncio.get_running_loop()
            _, conn = await loop.create_unix_connection(_Connection, address.socket_path)
            hello = Hello(address.token, path, arena_bytes)
            try:
                ok, detail = pickle.loads(await conn.exchange(pickle.dumps(hello)))
            except BaseException:
                conn._fail(ChannelBroken("abandoned while connecting"))
                raise
            if not ok:
                conn._fail(ChannelBroken(f"refused by the worker: {detail}"))
                raise ChannelBroken(f"the worker refused the channel: {detail}")
        finally:
            unlink_quietly(path)  # both ends hold their mapping; nothing left in /dev/shm
        return cls(conn, torch.frombuffer(mm, dtype=torch.uint8), bool(detail))

    def close(self) -> None:
        """Close the connection (the arena goes with the last reference to it)."""
        self.closed = True
        self._conn._fail(ChannelBroken("closed by the coordinator"))

    async def call(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: torch.Tensor | None = None,
    ) -> tuple[bool, Any]:
        """Run ``PoolWorker.<method>(*args, **kwargs)`` on the worker.

        Args:
            out: host memory for the call's (first) output: the worker writes it into the
                arena and it is copied here; the result then holds ``out`` itself.

        Returns:
            ``(True, result)`` with every tensor the caller's own (copied out of the arena),
            or ``(False, exception)``: the worker's error, the channel still usable.

        Raises:
            ArenaFull: the call's tensors do not fit the arena (nothing was sent).
            ChannelBroken: the connection failed (whether the call ran is unknown).
        """
        layout = ArenaLayout(self._views)
        wire_args = encode(args, layout.put)
        wire_kwargs = encode(kwargs, layout.put)
        if out is not None:
            wire_kwargs["out"], _ = layout.reserve(tuple(out.shape), out.dtype)
        request = pickle.dumps(
            (method, wire_args, wire_kwargs, layout.end), protocol=pickle.HIGHEST_PROTOCOL
        )
        ok, value = pickle.loads(await self._conn.exchange(request))
        if not ok:
            return False, value
        return True, self._deliver(value, out)

    def _deliver(self, value: Any, out: torch.Tensor | None) -> Any:
        """The reply's value with its arena tensors copied out (the first into `out`)."""
        views = self._views
        first = [out]

        def own(ref: Any) -> torch.Tensor:
            t = views(ref)
            target = first[0]
            first[0] = None
            if target is not None and target.shape == t.shape and target.dtype == t.dtype:
                return target.copy_(t)
            return t.clone()

        return decode(value, own)


class ChannelPool:
    """Up to ``options.connections`` channels to one worker, opened when calls need them.

    Args:
        worker_id: for errors and logs.
        options: arena size, connections, retry interval.
        address: fetches the worker's :class:`ChannelAddress` (a Ray call).
        local_node: this process's Ray node id (None: channels are never used).
        timeout_s: a call taking longer raises WorkerUnavailable (None: wait forever).
    """

    def __init__(
        self,
        worker_id: str,
        options: ChannelOptions,
        address: Callable[[], Awaitable[ChannelAddress]],
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

    @property
    def open_channels(self) -> int:
        return self._count

    async def call(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: torch.Tensor | None = None,
    ) -> tuple[bool, Any]:
        """``(True, result)`` when a channel ran the call; ``(False, None)`` when the caller
        must make a Ray call instead (no channel, arena too small, connection broke).

        Raises:
            WorkerError: the worker's error (one that is not a WorkerError is wrapped).
            WorkerUnavailable: no answer within the timeout.
        """
        chan = await self._take()
        if chan is None:
            return False, None
        try:
            async with asyncio.timeout(self._timeout):
                ok, value = await chan.call(method, args, kwargs, out)
        except ArenaFull:
            self._give(chan)
            return False, None
        except ChannelBroken as exc:
            self._drop(chan)
            log.warning(
                "worker channel broke; the call goes through Ray",
                extra={"worker": self._worker_id, "reason": str(exc)},
            )
            return False, None
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
            return True, value
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

    async def _take(self) -> WorkerChannel | None:
        if self._closed or self._local_node is None:
            return None
        if self._idle:
            return self._idle.pop()
        if self._count < self._options.connections and time.monotonic() >= self._retry_at:
            self._count += 1
            try:
                return await self._open()
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
        address = await self._address()
        if address.node_id is None or address.node_id != self._local_node:
            raise ConnectionRefusedError(
                f"the worker runs on node {address.node_id}, this process on {self._local_node}"
            )
        chan = await WorkerChannel.connect(
            address, self._options.arena_bytes, self._options.directory
        )
        if self._closed:
            chan.close()
            raise ConnectionAbortedError("the client closed meanwhile")
        log.info(
            "worker channel open",
            extra={
                "worker": self._worker_id,
                "arena_bytes": self._options.arena_bytes,
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
