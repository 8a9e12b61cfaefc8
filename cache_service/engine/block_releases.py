"""Released blocks and host tier copies: telling the workers whose pools poison them (debug
pools) which blocks went free, and running the copies between pools and host tiers that
the control plane decided, ordered before any later use of those blocks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from cache_service.control.host_tier import TierMove
from cache_service.engine.running_checks import RunningChecks
from cache_service.engine.worker_interface import WorkerClient
from workers.errors import StaleEpochError, WorkerError, WorkerUnavailable

if TYPE_CHECKING:
    from cache_service.engine.coordinator import Coordinator

__all__ = ["BlockReleases"]

log = logging.getLogger("kvcache.coordinator")


class BlockReleases:
    """The release_blocks calls of one coordinator.

    Args:
        owner: the coordinator (its `block_manager` is read at each use: recovery
            replaces it).
        clients: worker id -> client (the coordinator's dict).
        epochs: worker id -> epoch of every registered worker (the coordinator's dict).
        debug_workers: the workers whose pools poison released blocks: only they are told
            (the coordinator's set).
        checks: the running correctness checks (a released block voids those reading it).
        background: the coordinator's background tasks (close() cancels them).
        worker_failed: drops a worker from the control plane
            (`engine.membership.Membership.worker_failed`): what a failed host tier copy
            does, since blocks a sequence adopted may then not hold their data.
    """

    def __init__(
        self,
        owner: Coordinator,
        clients: Mapping[str, WorkerClient],
        epochs: Mapping[str, str],
        debug_workers: set[str],
        checks: RunningChecks,
        background: set[asyncio.Task[None]],
        worker_failed: Callable[[WorkerError, dict[str, str], list[str]], Awaitable[Any]],
    ) -> None:
        self._owner = owner
        self._worker_failed = worker_failed
        self._clients = clients
        self._epochs = epochs
        self._debug_workers = debug_workers
        self._checks = checks
        self._background = background
        # Per worker, the latest release_blocks call (see flush).
        self._releases: dict[str, asyncio.Task[None]] = {}

    def flush(self) -> None:
        """Tell the workers which blocks went free (debug pools poison them with NaN), and
        run the copies between their pools and host tiers that the control plane decided
        (cache_service.control.host_tier).

        Call right after every control-plane step that may free, evict or restore blocks,
        before any await. Fire and forget, yet ordered before any reuse: the worker calls
        start now, and every later worker call that can write, copy into or read a block
        of that worker first waits for the ones started before it (released_before_use).
        Per worker they run offloads, then release_blocks, then restores: an evicted block
        is copied out before it is poisoned, and a block is poisoned before a restore
        fills it. Reuse needs a prepare_write that runs after this step, so its copy or
        write is sent after the release has been carried out, and the poison can never
        land on the new owner's data. (Waiting for completion rather than relying on
        submission order keeps this true for any WorkerClient, in-process threads
        included.)
        """
        manager = self._owner.block_manager
        released = manager.take_released()
        moves = manager.take_tier_moves()
        if not released and not moves:
            return
        if released:
            self._checks.blocks_released(released)
        loop = asyncio.get_running_loop()
        for worker_id in {**released, **moves}:
            epoch = self._epochs.get(worker_id)
            if epoch is None:
                continue  # lost: its pool and host tier are gone
            blocks = released.get(worker_id) if worker_id in self._debug_workers else None
            tier = moves.get(worker_id)
            if not blocks and not tier:
                continue  # a pool that would only check ids
            task = loop.create_task(
                self._release_on(worker_id, epoch, blocks, tier, self._releases.get(worker_id))
            )
            self._releases[worker_id] = task
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _release_on(
        self,
        worker_id: str,
        epoch: str,
        blocks: list[int] | None,
        tier: list[TierMove] | None,
        previous: asyncio.Task[None] | None,
    ) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait({previous})  # one after another: the latest implies all
        client = self._clients[worker_id]
        offloads = [m for m in tier or () if m.direction == "offload"]
        restores = [m for m in tier or () if m.direction == "restore"]
        try:
            if offloads:
                await self._move(
                    "offload",
                    client.offload_blocks(
                        epoch, [m.block for m in offloads], [m.host for m in offloads]
                    ),
                )
            if blocks:
                await client.release_blocks(epoch, blocks)
            if restores:
                await self._move(
                    "restore",
                    client.restore_blocks(
                        epoch, [m.host for m in restores], [m.block for m in restores]
                    ),
                )
        except Exception as exc:  # any failure: a copy may have half landed
            log.warning(
                "release_blocks or host tier copy failed",
                extra={
                    "worker": worker_id,
                    "blocks": len(blocks or ()),
                    "tier_moves": len(tier or ()),
                    "reason": str(exc),
                },
            )
            if tier:
                # A block restored or offloaded may not hold what its key says: the
                # worker's blocks are no longer trusted. Dropping it here, before this task
                # ends, means no call waiting on it can read them (its sequences answer
                # DATA_LOSS); a worker that still answers comes back empty.
                lost = (
                    exc
                    if isinstance(exc, StaleEpochError | WorkerUnavailable)
                    else WorkerUnavailable(worker_id, f"a host tier copy failed: {exc!r}")
                )
                await self._worker_failed(lost, {worker_id: epoch}, [])
            # Otherwise only the poisoning of free blocks failed: a dead or restarted
            # worker has none to poison, and the next data call on it notices the loss.

    async def _move(self, direction: str, call: Awaitable[int]) -> None:
        """Await one batched host tier copy, timed in the metrics."""
        t0 = time.perf_counter()
        nbytes = await call
        metrics = self._owner.metrics
        if metrics is not None:
            metrics.observe_tier_transfer(direction, int(nbytes), time.perf_counter() - t0)

    async def released_before_use(self, worker_ids: Iterable[str]) -> None:
        """Wait for the release_blocks calls already started on these workers.

        Releases still pending in the control plane are sent first: a path that forgot to
        flush after freeing or evicting still cannot write a block before its poison.
        """
        self.flush()
        pending = {
            task
            for w in worker_ids
            if (task := self._releases.get(w)) is not None and not task.done()
        }
        if pending:
            await asyncio.wait(pending)
