"""The undo journal of a `prepare_writes` batch: what each prepare_write changed, so a failing
item can put every earlier one back exactly (free-list and eviction order included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache_service.control.accounting import CacheCounters
from cache_service.control.quotas import ref, unref
from cache_service.control.sequence import Sequence
from cache_service.control.types import PhysicalBlock

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager

__all__ = ["Journal", "Undo", "roll_back"]


@dataclass(slots=True)
class Undo:
    """How to put one sequence back as it was before one prepare_write of a batch."""

    seq: Sequence
    tokens: int
    table: int
    last: PhysicalBlock | None
    home: str | None
    # Blocks taken, in order, and whether each was an evicted cached-free block.
    taken: list[tuple[PhysicalBlock, bool]]
    cow_src: PhysicalBlock | None = None


class Journal:
    """What the prepare_write calls of one `prepare_writes` batch changed.

    Index entries of cached-free blocks a batch evicts are removed only once the whole
    batch succeeded: nothing in prepare_write reads the index, and a failed batch then has
    nothing to re-publish (re-publishing would change the index's order).
    """

    def __init__(self, counters: CacheCounters, released: dict[str, list[int]]) -> None:
        """Start a batch: remember the counters and the pending released blocks' lengths."""
        self.evictions = counters.evictions
        self.cow_copies = counters.cow_copies
        self.released = {w: len(ids) for w, ids in released.items()}
        self.steps: list[Undo] = []
        self.evicted: list[PhysicalBlock] = []


def roll_back(m: BlockManager, journal: Journal) -> None:
    """Undo every step of a failed batch, last first (see Journal)."""
    for step in reversed(journal.steps):
        seq = step.seq
        tenant_blocks = m._tenant_blocks[seq.tenant]
        for block, evicted in reversed(step.taken):
            m._pools[block.worker_id].untake(block.index, evicted)
            unref(tenant_blocks, block)
        if step.cow_src is not None:
            m._pools[step.cow_src.worker_id].incref(step.cow_src.index)
            ref(tenant_blocks, step.cow_src)
        del seq.tokens[step.tokens :]
        seq.truncate_table(step.table)
        if step.last is not None:
            seq.replace_last_block(step.last)
        seq.home = step.home
    m._counters.evictions = journal.evictions
    m._counters.cow_copies = journal.cow_copies
    for worker_id in list(m._released):
        kept = journal.released.get(worker_id, 0)
        if kept:
            del m._released[worker_id][kept:]
        else:
            del m._released[worker_id]
