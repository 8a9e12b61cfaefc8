"""Value types the block manager hands to the layers above it (see docs/contracts.md).

Plain immutable values: they can be logged, compared and turned into JSON as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "BlockCopy",
    "CancelledWrite",
    "CreatedSequence",
    "PhysicalBlock",
    "Segment",
    "SeqRef",
    "SequenceInfo",
    "SequenceSummary",
    "SequenceView",
    "TenantQuota",
    "WriteCursor",
    "WritePlan",
]


class PhysicalBlock(NamedTuple):
    """One block of one worker's pool: `index` in [0, num_blocks) of worker `worker_id`.

    A NamedTuple rather than a dataclass: it is a dict key on every hot path, and tuple
    hashing runs in C.
    """

    worker_id: str
    index: int


class SeqRef(NamedTuple):
    """A sequence named by its tenant and id (what `lose_worker` returns)."""

    tenant: str
    seq_id: str


@dataclass(frozen=True, slots=True)
class CreatedSequence:
    """Result of `create_sequence` / `fork`.

    Attributes:
        seq_id: the new sequence's opaque id (scoped to its tenant).
        num_cached_tokens: tokens whose KV is already in the cache, every layer written;
            the client computes the prompt from this position on.
    """

    seq_id: str
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy block `src` to block `dst` on one worker (all layers, K and V)."""

    worker_id: str
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Where the worker writes the K/V of the tokens passed to `prepare_write`.

    Attributes:
        start: position of the first token (the layer's written length before the write).
        slots: per token, (worker_id, flat slot = block_index * block_size + offset).
        copies: copy-on-write copies the workers must run before writing.
    """

    start: int
    slots: list[tuple[str, int]]
    copies: list[BlockCopy]


@dataclass(frozen=True, slots=True)
class CancelledWrite:
    """What `cancel_write` released: reserved positions that no layer had written.

    Attributes:
        start: first released position (the longest written length over the layers).
        num_tokens: released positions [start, start + num_tokens).
        blocks: the block-table entries dropped with them, in logical order (each lost one
            reference; those no other sequence used became free).
    """

    start: int
    num_tokens: int
    blocks: tuple[PhysicalBlock, ...]


@dataclass(frozen=True, slots=True)
class WriteCursor:
    """Where the next write of one layer of a sequence starts (cheap to get: O(reserved
    positions past it), not O(sequence length)).

    Attributes:
        start: the layer's written length: the next write's first position.
        reserved: token ids of the positions from `start` on that are already reserved (by
            another layer's write); a write over them must repeat these ids.
    """

    start: int
    reserved: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """One tenant's own limits; None falls back to the manager-wide default of
    `BlockManagerConfig` (itself None: no limit).

    Attributes:
        max_blocks: distinct blocks the tenant's sequences may reference at once.
        max_sequences: live sequences at once.
    """

    max_blocks: int | None = None
    max_sequences: int | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of consecutive logical blocks of a sequence that live on one worker.

    Attributes:
        worker_id: the worker holding these blocks.
        start_token: logical position of the segment's first token.
        block_indices: the blocks' indices in that worker's pool, in logical order.
    """

    worker_id: str
    start_token: int
    block_indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SequenceView:
    """What attention over one layer of a sequence reads.

    Attributes:
        seq_len: tokens written for the layer (the kernel's seq_len).
        segments: contiguous runs of the block table covering [0, seq_len), in order. More
            than one when the sequence spans workers: each worker attends over its segments
            and the partial outputs are merged with their log-sum-exps.
    """

    seq_len: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    """A read-only description of one sequence.

    Attributes:
        seq_id: its id.
        token_ids: every reserved position's token id.
        written: per layer, tokens whose K/V has been committed.
        num_blocks: length of its block table.
        workers: worker ids its blocks live on, in logical order of first use.
    """

    seq_id: str
    token_ids: tuple[int, ...]
    written: tuple[int, ...]
    num_blocks: int
    workers: tuple[str, ...]


class SequenceSummary(NamedTuple):
    """One sequence of a tenant, as ListSequences reports it.

    seq_id: its id; num_tokens: reserved positions; written: per layer, the written
    length; lost: its blocks were on a lost worker (then num_tokens is 0, written empty).
    """

    seq_id: str
    num_tokens: int
    written: tuple[int, ...]
    lost: bool
