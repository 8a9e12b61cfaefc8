"""The coordinator's workers: registration, loss and return.

A worker that fails a call with a stale epoch (it restarted: empty pool) or cannot be
reached is removed from the control plane (`BlockManager.lose_worker`): the sequences with
blocks on it fail with DATA_LOSS from then on, the others keep being served. A background
task adds it back, empty, as soon as it answers again (claimed for the coordinator's
generation where there is one, so an older coordinator cannot use it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from cache_service.engine.errors import WorkerLost
from cache_service.engine.values import WorkerState
from cache_service.engine.worker_interface import WorkerClient
from workers.errors import (
    StaleCoordinatorError,
    StaleEpochError,
    WorkerError,
    WorkerUnavailable,
)

if TYPE_CHECKING:
    from cache_service.engine.coordinator import Coordinator

__all__ = ["Membership"]

log = logging.getLogger("kvcache.coordinator")


class Membership:
    """Registers, drops and re-registers the workers of one coordinator.

    Args:
        owner: the coordinator (its `block_manager`, `metrics` and `generation` are read at
            each use: recovery replaces the block manager and sets the generation).
        clients: worker id -> client (the coordinator's dict).
        states: worker id -> `WorkerState`, every worker known (the coordinator's dict).
        epochs: worker id -> epoch of every registered worker (the coordinator's dict; a
            lost worker is absent).
        debug_workers: the workers whose pools poison released blocks (the coordinator's
            set).
        background: the coordinator's background tasks (close() cancels them).
        flush_released: tells the workers which blocks went free (after a loss frees the
            lost sequences' blocks on the other workers).
        durable: the block manager logs to a store (it records each worker's epoch).
    """

    def __init__(
        self,
        owner: Coordinator,
        clients: Mapping[str, WorkerClient],
        states: dict[str, WorkerState],
        epochs: dict[str, str],
        debug_workers: set[str],
        background: set[asyncio.Task[None]],
        flush_released: Callable[[], None],
        durable: bool,
    ) -> None:
        self._owner = owner
        self._clients = clients
        self._states = states
        self._epochs = epochs
        self._debug_workers = debug_workers
        self._background = background
        self._flush_released = flush_released
        self._durable = durable
        # Set by Coordinator.close(): no worker is revived from then on.
        self.closed = False

    def register(self, worker_id: str, desc: Any, known: bool = False) -> None:
        """Make the worker described by `desc` (a `WorkerDescription`) serve: add its pool to
        the control plane (unless `known`: recovered with its blocks), record its epoch and
        state."""
        if known:  # recovered from the store with its blocks: already registered
            pass
        elif self._durable:  # the durable manager logs the epoch with it
            self._owner.block_manager.add_worker(  # type: ignore[call-arg]
                worker_id, desc.num_blocks, epoch=desc.epoch, host_blocks=_host_blocks(desc)
            )
        else:
            self._owner.block_manager.add_worker(worker_id, desc.num_blocks, _host_blocks(desc))
        self._epochs[worker_id] = desc.epoch
        if getattr(desc, "debug", False):
            self._debug_workers.add(worker_id)
        else:
            self._debug_workers.discard(worker_id)
        self._states[worker_id] = WorkerState(
            worker_id, desc.device, desc.num_blocks, desc.epoch, True
        )
        if self._owner.metrics is not None:
            self._owner.metrics.set_worker_state(worker_id, True, desc.epoch)
        log.info(
            "worker registered",
            extra={"worker": worker_id, "epoch": desc.epoch, "blocks": desc.num_blocks},
        )

    # -- internals: failures ---------------------------------------------------------------
    async def worker_failed(
        self,
        exc: StaleEpochError | WorkerUnavailable,
        epochs: dict[str, str],
        seq_ids: list[str],
    ) -> WorkerLost:
        """Drop the failed worker from the control plane (once per epoch) and start
        watching for its return. Returns the error to raise to the callers."""
        worker_id = exc.worker_id
        epoch = epochs.get(worker_id)
        if epoch is not None and self._epochs.get(worker_id) == epoch:
            lost = self._owner.block_manager.lose_worker(worker_id)
            del self._epochs[worker_id]
            self._flush_released()  # the failed sequences' blocks on the other workers
            state = self._states[worker_id]
            self._states[worker_id] = WorkerState(
                worker_id, state.device, state.num_blocks, state.epoch, False
            )
            log.warning(
                "worker lost",
                extra={
                    "worker": worker_id,
                    "epoch": epoch,
                    "reason": str(exc),
                    "lost_sequences": len(lost),
                },
            )
            if self._owner.metrics is not None:
                self._owner.metrics.add_lost_sequences(len(lost))
                self._owner.metrics.set_worker_state(worker_id, False, epoch)
            if not self.closed:
                task = asyncio.get_running_loop().create_task(self._revive(worker_id))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        reason = (
            "it restarted with an empty pool" if isinstance(exc, StaleEpochError) else exc.reason
        )
        return WorkerLost(worker_id, list(dict.fromkeys(seq_ids)), reason)

    async def claim(self, client: WorkerClient) -> Any:
        """With a store: claim the worker for this coordinator's generation (its calls
        carry it from then on; lower generations are refused: `PoolWorker.claim`).
        Without one (generation None: unfenced), or for a client without `claim`: describe.
        Returns the worker's description."""
        claim = getattr(client, "claim", None)
        if self._owner.generation is None or claim is None:
            return await client.describe()
        return await claim(self._owner.generation)

    async def _revive(self, worker_id: str) -> None:
        """Re-register a lost worker, empty, once it answers again (backoff up to 5 s)."""
        delay = 0.05
        while not self.closed:
            try:
                desc = await self.claim(self._clients[worker_id])
            except StaleCoordinatorError as exc:
                log.error(
                    "worker not re-registered: this coordinator was superseded",
                    extra={"worker": worker_id, "reason": str(exc)},
                )
                return
            except WorkerError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if worker_id not in self._owner.block_manager.workers():
                self.register(worker_id, desc)
            return

    async def check(self) -> None:
        """Probe every registered worker's epoch once; a changed epoch (a restart nobody
        noticed yet) or no answer removes it like a failed call would."""
        for worker_id, epoch in list(self._epochs.items()):
            try:
                desc = await self._clients[worker_id].describe()
            except WorkerUnavailable as exc:
                await self.worker_failed(exc, {worker_id: epoch}, [])
                continue
            if desc.epoch != epoch:
                await self.worker_failed(
                    StaleEpochError(worker_id, epoch, desc.epoch), {worker_id: epoch}, []
                )


def _host_blocks(desc: Any) -> int:
    """The host tier size a `WorkerDescription` reports (0 for a worker without one)."""
    return int(getattr(desc, "host_blocks", 0) or 0)
