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
decode step's other layers) goes as a repeat of it (:mod:`channel_repeat`); the connection
itself, its arena and its socket are :mod:`channel_connection`.

A connection that breaks mid-call leaves unknown whether the worker ran the call. The data
calls served have the same effect run twice as once, so the pool declines the call and the
Ray call that follows decides: the worker answers it (the channel alone broke), or Ray
reports the worker dead or restarted, which the coordinator handles as for any call.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from cache_service.wire.channel_connection import ARENA_PREFIX, ChannelBroken, WorkerChannel
from cache_service.wire.shared_regions import default_directory
from workers.channel_server import CHANNEL_METHODS, ChannelAddress
from workers.channel_wire import ArenaFull
from workers.errors import WorkerError, WorkerUnavailable
from workers.owned_files import reclaim_orphans

__all__ = [
    "ARENA_PREFIX",
    "CHANNEL_METHODS",
    "ChannelBroken",
    "ChannelOptions",
    "ChannelPool",
    "WorkerChannel",
    "remove_orphan_arenas",
]

log = logging.getLogger("kvcache.worker_channel")


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
        chan = await self._take(method, kwargs.get("step_key"))
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

    async def _take(self, method: str, step_key: object) -> WorkerChannel | None:
        """An idle channel (the one whose last call this one may repeat, if any), a new
        one, or one handed over by a call that ends; None: go through Ray."""
        if self._closed:
            return None
        idle = self._idle
        if idle:
            for i in range(len(idle) - 1, -1, -1):
                if idle[i].last_call_was(method, step_key):
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
