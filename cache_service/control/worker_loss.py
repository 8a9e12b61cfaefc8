"""Forgetting a worker whose pool is gone (`BlockManager.lose_worker`).

Every sequence with a block on it becomes a tombstone (`LostSequence`) after releasing its
other blocks; the worker's blocks leave the pins and the prefix index; sequences merely
homed there are re-placed at their next growth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache_service.control.quotas import unref
from cache_service.control.state import LostSequence
from cache_service.control.types import SeqRef
from cache_service.errors import InvalidRequest

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager

__all__ = ["lose_worker"]


def lose_worker(m: BlockManager, worker_id: str) -> list[SeqRef]:
    """`BlockManager.lose_worker`: the affected sequences, in creation order."""
    if not isinstance(worker_id, str) or worker_id not in m._pools:
        raise InvalidRequest(f"unknown worker {worker_id!r}")
    affected = [
        seq for seq in m._seqs.values() if any(block.worker_id == worker_id for block in seq.table)
    ]
    for seq in affected:
        tenant_blocks = m._tenant_blocks[seq.tenant]
        for block in reversed(seq.table):
            if block.worker_id != worker_id:
                m._release(block)
            unref(tenant_blocks, block)
        m._forget(seq)
        m._lost[seq.seq_id] = LostSequence(seq.tenant, worker_id)
    _drop_pinned(m, worker_id)
    # One cleared event for the worker covers both tiers: its host memory went with it
    # (never served stale).
    m._index.remove_worker(worker_id)
    m._host.drop_worker(worker_id)
    for seq in m._seqs.values():
        if seq.home == worker_id:
            seq.home = None
    del m._pools[worker_id]
    # Its pool is gone: nothing there to poison any more.
    m._released.pop(worker_id, None)
    return [SeqRef(seq.tenant, seq.seq_id) for seq in affected]


def _drop_pinned(m: BlockManager, worker_id: str) -> None:
    """Take the worker's blocks out of every pin (a pin left with none goes)."""
    for key, pin in list(m._pins.items()):
        kept = [b for b in pin.blocks if b.worker_id != worker_id]
        if len(kept) != len(pin.blocks):
            if kept:
                pin.blocks = kept
            else:
                del m._pins[key]
    for block in [b for b in m._pinned if b.worker_id == worker_id]:
        del m._pinned[block]
