"""Repeating a planned batch of one-layer writes on the other layers of a decode step.

`snapshot_writes` remembers a batch `prepare_writes` planned; `repeatable` tells, read only,
whether the same tokens written on another layer would get the very same plan; then
`commit_repeated` commits them without looking any sequence up again.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cache_service.control.sequence import Sequence
from cache_service.control.types import WritePlan
from cache_service.errors import InvalidRequest

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager

__all__ = [
    "WriteSnapshot",
    "commit_repeated",
    "commit_repeated_layers",
    "commit_steps",
    "repeatable",
    "snapshot_writes",
]


@dataclass(frozen=True, slots=True)
class WriteSnapshot:
    """A batch of one-layer writes as planned, for `BlockManager.repeatable` (see
    `BlockManager.snapshot_writes`).

    Attributes:
        tenant: the writes' tenant.
        seq_ids: the sequences, in batch order.
        starts: per sequence, the first position written.
        num_tokens: tokens each sequence wrote; -1 when they differ (`ragged`: such a
            snapshot is never `repeatable`, only leased whole).
        counts: per sequence, the tokens it wrote.
        seqs / rows: the live sequence objects and their block rows at the time (identity
            is what `repeatable` checks; read them only through the manager).
    """

    tenant: str
    seq_ids: tuple[str, ...]
    starts: tuple[int, ...]
    num_tokens: int
    seqs: tuple[Sequence, ...]
    rows: tuple[Any, ...]
    counts: tuple[int, ...]


def snapshot_writes(
    m: BlockManager,
    tenant: str,
    seq_ids: SequenceABC[str],
    plans: SequenceABC[WritePlan],
    ragged: bool = False,
) -> WriteSnapshot | None:
    """`BlockManager.snapshot_writes`: the snapshot, or None when the batch does not
    qualify."""
    if len(seq_ids) != len(plans):
        raise InvalidRequest(f"{len(seq_ids)} seq_ids for {len(plans)} write plans")
    if not plans:
        return None
    n = len(plans[0].slots)
    seqs: list[Sequence] = []
    rows: list[Any] = []
    for seq_id, plan in zip(seq_ids, plans, strict=True):
        seq = m._resolve(tenant, seq_id)
        row = seq.row
        uneven = len(plan.slots) != n and not ragged
        if plan.copies or uneven or row is None or not row.matches(seq.table):
            return None
        seqs.append(seq)
        rows.append(row)
    starts = tuple(plan.start for plan in plans)
    counts = tuple(len(plan.slots) for plan in plans)
    if any(c != n for c in counts):
        n = -1
    return WriteSnapshot(tenant, tuple(seq_ids), starts, n, tuple(seqs), tuple(rows), counts)


def repeatable(
    m: BlockManager, snapshot: WriteSnapshot, layer: int, token_ids: SequenceABC[object]
) -> bool:
    """`BlockManager.repeatable`: whether writing `token_ids` on `layer` now would be
    planned exactly as the snapshot's writes were."""
    n = snapshot.num_tokens
    if (
        n < 0
        or type(layer) is not int
        or not 0 <= layer < m._num_layers
        or len(token_ids) != n * len(snapshot.seq_ids)
    ):
        return False
    live = m._seqs
    for i, (seq_id, seq, row, start) in enumerate(
        zip(snapshot.seq_ids, snapshot.seqs, snapshot.rows, snapshot.starts, strict=True)
    ):
        if (
            live.get(seq_id) is not seq
            or seq.written[layer] != start
            or seq.row is not row
            or not row.matches(seq.table)
            or len(seq.tokens) < start + n
        ):
            return False
        if n == 1:
            token = token_ids[i]
            if type(token) is not int or seq.tokens[start] != token:
                return False
        else:
            mine = token_ids[i * n : (i + 1) * n]
            if any(type(t) is not int for t in mine) or seq.tokens[start : start + n] != list(mine):
                return False
    return True


def commit_repeated(m: BlockManager, snapshot: WriteSnapshot, layer: int) -> None:
    """`BlockManager.commit_repeated`: commit snapshot.counts tokens per sequence on `layer`,
    all or nothing."""
    commit_repeated_layers(m, snapshot, (layer,))


def commit_repeated_layers(
    m: BlockManager, snapshot: WriteSnapshot, layers: SequenceABC[int]
) -> None:
    """`BlockManager.commit_repeated_layers`: `commit_repeated` of each layer in order, all
    or nothing: every layer is checked before any is committed (a commit changes only its
    own layer, so the checks of the others still hold when their turn comes)."""
    if len(set(layers)) != len(layers):
        raise InvalidRequest(f"each layer is committed once, got {list(layers)}")
    num_layers = m._num_layers
    # A leased decode step commits every layer of sequences that stand at one length on
    # all of them: one list count per sequence checks that, not a loop over its layers.
    every = len(layers) == num_layers
    for i, (seq, start) in enumerate(zip(snapshot.seqs, snapshot.starts, strict=True)):
        if every and seq.written.count(start) == num_layers:
            continue
        for layer in layers:
            if seq.written[layer] != start:
                raise InvalidRequest(
                    f"layer {layer} of {snapshot.seq_ids[i]!r} stands at {seq.written[layer]}, "
                    f"not at the snapshot's {start}: check repeatable() under the same locks"
                )
    ends = [start + count for start, count in zip(snapshot.starts, snapshot.counts, strict=True)]
    for seq, end in zip(snapshot.seqs, ends, strict=True):
        # Every layer's new length first, then the blocks they complete published once
        # (as each layer's commit in turn would leave them).
        written = seq.written
        if every:
            written[:] = (end,) * num_layers
        else:
            for layer in layers:
                written[layer] = end
        m._publish_written(seq, end)


def commit_steps(
    m: BlockManager, snapshot: WriteSnapshot, steps: int, layers: SequenceABC[int]
) -> None:
    """`BlockManager.commit_steps`: every layer to start + `steps`, then `layers` one
    further, all or nothing."""
    num_layers = m._num_layers
    if type(steps) is not int or steps < 0:
        raise InvalidRequest(f"steps must be a non-negative int, got {steps!r}")
    if len(set(layers)) != len(layers) or any(
        type(x) is not int or not 0 <= x < num_layers for x in layers
    ):
        raise InvalidRequest(
            f"layers must be distinct ints in [0, {num_layers}), got {list(layers)}"
        )
    longest = steps + (1 if layers else 0)
    for i, (seq, start) in enumerate(zip(snapshot.seqs, snapshot.starts, strict=True)):
        if seq.written.count(start) != num_layers:
            raise InvalidRequest(
                f"{snapshot.seq_ids[i]!r} no longer stands at the snapshot's {start} on "
                f"every layer ({seq.written}): check repeatable() under the same locks"
            )
        if start + longest > len(seq.tokens):
            raise InvalidRequest(
                f"{snapshot.seq_ids[i]!r}: {longest} positions from {start} pass the "
                f"{len(seq.tokens)} reserved"
            )
    for seq, start in zip(snapshot.seqs, snapshot.starts, strict=True):
        written = seq.written
        written[:] = (start + steps,) * num_layers
        for layer in layers:
            written[layer] = start + steps + 1
        m._publish_written(seq, start + longest)


def repeatable_layers(m: BlockManager, snapshot: WriteSnapshot) -> list[int]:
    """`BlockManager.repeatable_layers`: the layers `repeatable` would accept the
    snapshot's own tokens on."""
    live = m._seqs
    for seq_id, seq, row, start, count in zip(
        snapshot.seq_ids,
        snapshot.seqs,
        snapshot.rows,
        snapshot.starts,
        snapshot.counts,
        strict=True,
    ):
        if (
            live.get(seq_id) is not seq
            or seq.row is not row
            or not row.matches(seq.table)
            or len(seq.tokens) < start + count
        ):
            return []
    num_layers = m._num_layers
    pairs = list(zip(snapshot.seqs, snapshot.starts, strict=True))
    if all(seq.written.count(start) == num_layers for seq, start in pairs):
        return list(range(num_layers))  # a decode step: every layer at one length
    return [
        layer
        for layer in range(num_layers)
        if all(seq.written[layer] == start for seq, start in pairs)
    ]
