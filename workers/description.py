"""What a worker reports about itself. Pure dataclasses (they cross Ray and the
coordinator's worker interface)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from workers.layout import KVLayout

__all__ = ["FencedEpoch", "WorkerDescription", "WorkerHealth"]


class FencedEpoch(NamedTuple):
    """The epoch argument of a data call, with the caller's coordinator generation.

    Every ``PoolWorker`` data method takes the epoch it expects first; a caller with a
    coordinator generation (a coordinator with a metadata store) passes this instead of
    the bare epoch string, so the generation reaches the worker's single choke point
    without another parameter on every method. A bare string still works: unfenced.
    """

    epoch: str
    generation: int


@dataclass(frozen=True)
class WorkerDescription:
    """Identity and capacity of one worker.

    Attributes:
        worker_id: stable id (the actor's name); survives restarts.
        epoch: random hex id drawn at every start; a new epoch means an empty pool.
        num_blocks: blocks in the pool.
        device: torch device string of the pool, e.g. ``"cuda:0"`` or ``"cpu"``.
        layout: the pool's KV layout.
        pool_bytes: bytes the pool tensor holds.
        debug: freed blocks are poisoned with NaN.
        host_blocks: blocks of its host tier (workers.host_tier); 0: none.
    """

    worker_id: str
    epoch: str
    num_blocks: int
    device: str
    layout: KVLayout
    pool_bytes: int
    debug: bool = False
    host_blocks: int = 0


@dataclass(frozen=True)
class WorkerHealth:
    """A liveness probe's answer.

    Attributes:
        worker_id, epoch: as in :class:`WorkerDescription`.
        ok: the device answered a small computation.
        detail: why not, when ``ok`` is False ("" otherwise).
        uptime_s: seconds since this epoch started.
        calls: data calls served in this epoch (refused ones included).
        failed_calls: data calls that raised.
        device_free_bytes: free device memory (CUDA), None on CPU.
    """

    worker_id: str
    epoch: str
    ok: bool
    detail: str
    uptime_s: float
    calls: int
    failed_calls: int
    device_free_bytes: int | None = None
