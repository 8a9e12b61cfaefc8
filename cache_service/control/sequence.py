"""A sequence's bookkeeping: its tokens, block table and written length per layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter

from cache_service.control.block_rows import BlockRow
from cache_service.control.types import PhysicalBlock, Segment

__all__ = ["PENDING_TOKEN", "Sequence", "segments_of"]

# A reserved position whose token is not known yet (a multi-step lease reserves the
# positions of its later steps before their tokens exist; `fill_pending` sets them before
# they are committed). Token ids are unsigned, so no real token is negative.
PENDING_TOKEN = -1

_WORKER = itemgetter(0)  # PhysicalBlock.worker_id
_INDEX = itemgetter(1)  # PhysicalBlock.index


@dataclass(slots=True)
class Sequence:
    """One sequence of one tenant.

    Attributes:
        seq_id: opaque id, unique across tenants.
        tenant: owner; every call on the sequence must name it.
        tokens: token ids of every reserved position (slots exist for them).
        table: logical block i -> physical block; len(table) == ceil(len(tokens) / block_size).
        written: per layer, positions [0, written[l]) hold K/V for layer l; each is at most
            len(tokens).
        keys: prefix-index keys of blocks 0 .. len(keys)-1, which are full and written on
            every layer (the chain the next block's key extends).
        home: worker that new blocks come from first (None: choose at the next growth).
        namespace: prefix-cache namespace its blocks are keyed in ("" = the default); forks
            inherit it.
        row: the table's block ids as int32 (`block_row`), a cache derived from `table`;
            not state (never compared, copied or recorded).

    Change `table` only by appending, `replace_last_block` or `truncate_table`: the last
    two drop `row`, which is what keeps it exact (cache_service.control.block_rows).
    """

    seq_id: str
    tenant: str
    tokens: list[int]
    table: list[PhysicalBlock]
    written: list[int]
    keys: list[bytes]
    home: str | None
    namespace: str = ""
    row: BlockRow | None = field(default=None, compare=False, repr=False)

    def block_row(self) -> BlockRow:
        """The table's block ids as int32, brought up to date (built on first use, then
        extended as the table grows)."""
        row = self.row
        table = self.table
        if row is None or not row.matches(table):
            row = self.row = BlockRow(table)
        elif row.n < len(table):
            row.extend(table)
        return row

    def replace_last_block(self, block: PhysicalBlock) -> None:
        """Point the table's last entry at `block` (copy-on-write, undo of one)."""
        self.table[-1] = block
        self.row = None

    def truncate_table(self, num_blocks: int) -> None:
        """Keep the first `num_blocks` entries of the table."""
        del self.table[num_blocks:]
        self.row = None

    def copy_as(self, seq_id: str) -> Sequence:
        """A fork: same tokens, table, lengths and keys under a new id (lists copied; no
        block row: the fork's table grows on its own)."""
        return Sequence(
            seq_id=seq_id,
            tenant=self.tenant,
            tokens=list(self.tokens),
            table=list(self.table),
            written=list(self.written),
            keys=list(self.keys),
            home=self.home,
            namespace=self.namespace,
        )


def segments_of(
    table: list[PhysicalBlock], num_blocks: int, block_size: int
) -> tuple[Segment, ...]:
    """Split the first `num_blocks` entries of a block table into per-worker runs.

    Returns:
        Segments in logical order; start_token of segment k is its first logical block
        times block_size.
    """
    blocks = table[:num_blocks]
    if blocks and len(blocks) == num_blocks:
        # C-level passes (PhysicalBlock is a tuple) instead of a Python step per block,
        # for the usual case of a sequence on one worker.
        workers = set(map(_WORKER, blocks))
        if len(workers) == 1:
            indices = tuple(map(_INDEX, blocks))
            return (Segment(worker_id=workers.pop(), start_token=0, block_indices=indices),)
    segments: list[Segment] = []
    run_start = 0
    for i in range(1, num_blocks + 1):
        if i == num_blocks or table[i].worker_id != table[run_start].worker_id:
            segments.append(
                Segment(
                    worker_id=table[run_start].worker_id,
                    start_token=run_start * block_size,
                    block_indices=tuple(b.index for b in table[run_start:i]),
                )
            )
            run_start = i
    return tuple(segments)
