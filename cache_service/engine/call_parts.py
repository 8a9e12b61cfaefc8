"""A call's items as parts of worker rounds: the view each item's attention reads (before
or after its planned write) and the grouping of items into parts, one per single worker
(coalescible) and one for the items spread over several workers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cache_service.control.block_manager import BlockManager
from cache_service.control.types import Segment, SequenceView, WritePlan
from cache_service.engine.attention_plan import OneWorkerView, SequenceViewLike
from cache_service.engine.batching import Part
from cache_service.engine.call_tensors import Spans, joined_rows, part_writes


def view_of(
    block_manager: BlockManager, block_size: int, tenant: str, seq_id: str, layer: int
) -> SequenceViewLike:
    """What attending over `layer` reads: a `OneWorkerView` over the cached block ids
    when the sequence lives on one worker (O(1)), else its per-worker segments."""
    seq_len = block_manager.written_length(tenant, seq_id, layer)
    ids = block_manager.block_ids(tenant, seq_id, -(-seq_len // block_size))
    if ids is not None:
        worker_id, view = ids
        return OneWorkerView(seq_len, worker_id, np.frombuffer(view, dtype=np.int32))
    return block_manager.attention_view(tenant, seq_id, layer)


def view_after_write(
    block_manager: BlockManager,
    block_size: int,
    tenant: str,
    seq_id: str,
    layer: int,
    plan: WritePlan,
) -> SequenceViewLike:
    """The view of `layer` as it will be once the planned tokens are written: keys
    ``[0, start + n)``, i.e. the table's first ``ceil((start + n) / block_size)`` blocks.

    A sequence on one worker (the usual case) gets a `OneWorkerView` over the block
    manager's cached int32 ids (no per-block work); others their per-worker segments.
    """
    bs = block_size
    seq_len = plan.start + len(plan.slots)
    ids = block_manager.block_ids(tenant, seq_id, -(-seq_len // bs))
    if ids is not None:
        worker_id, view = ids
        # A read-only int32 array over the cached ids: no copy.
        return OneWorkerView(seq_len, worker_id, np.frombuffer(view, dtype=np.int32))
    segments: list[Segment] = []
    if plan.start > 0:
        segments = list(block_manager.attention_view(tenant, seq_id, layer).segments)
    num_blocks = -(-plan.start // bs)  # what the view covers: [0, start)
    # The blocks the new tokens open (a position at a block's first slot), in order,
    # each joining the last segment when it is on the same worker.
    for i, (worker_id, slot) in enumerate(plan.slots):
        if (plan.start + i) // bs != num_blocks:
            continue
        block = slot // bs
        last = segments[-1] if segments else None
        if last is not None and last.worker_id == worker_id:
            segments[-1] = Segment(worker_id, last.start_token, (*last.block_indices, block))
        else:
            segments.append(Segment(worker_id, num_blocks * bs, (block,)))
        num_blocks += 1
    return SequenceView(plan.start + len(plan.slots), tuple(segments))


def split_parts(
    dtype: torch.dtype,
    views: list[SequenceViewLike],
    queries: Sequence[torch.Tensor],
    seq_ids: list[str],
    return_lse: bool,
    new: tuple[list[WritePlan], list[torch.Tensor], list[torch.Tensor]] | None = None,
    spans: Spans = (None, None, None),
) -> list[tuple[list[int], Part]]:
    """Group a call's items into parts: one per single worker (coalescible), one for
    the items spread over several workers. Returns (item indices, part) pairs.

    new: per item, the write plan and the new tokens' key / value (append-and-attend).
    spans: the keys, values and queries of all items as one flat tensor each, where
    known (`item_spans`); used when one part holds every item.
    Each part gets its items' queries, keys and values as one tensor (per worker) in
    the pool dtype: a view when the items' tensors lie back to back (as the servicer
    decodes them), else one copy.
    """
    groups: dict[str | None, list[int]] = {}
    for i, view in enumerate(views):
        if type(view) is OneWorkerView:
            groups.setdefault(view.worker_id, []).append(i)
            continue
        segs = view.segments
        if len(segs) == 1:
            key: str | None = segs[0].worker_id
        else:
            used = {seg.worker_id for seg in segs if seg.start_token < view.seq_len}
            key = next(iter(used)) if len(used) == 1 else None
        groups.setdefault(key, []).append(i)
    out = []
    for idx in groups.values():
        # One part of every item (the usual call): the items' spans are the part's.
        k_span, v_span, q_span = spans if len(idx) == len(views) else (None, None, None)
        writes: dict[str, tuple[list[int], torch.Tensor, torch.Tensor]] = {}
        if new is not None:
            writes = part_writes(idx, *new, dtype, k_span, v_span)
        part = Part(
            views=[views[i] for i in idx],
            num_queries=[queries[i].shape[0] for i in idx],
            seq_ids=[seq_ids[i] for i in idx],
            query=joined_rows([queries[i] for i in idx], dtype, q_span),
            writes=writes,
            return_lse=return_lse,
        )
        out.append((idx, part))
    return out
