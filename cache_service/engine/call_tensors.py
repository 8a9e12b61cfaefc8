"""A call's tensors on their way to a worker round and back: the items' rows joined per
part (a view where they lie back to back, else one copy, in the pool's dtype), the new
tokens' rows grouped per worker, and a round's output split back into per-item or stacked
answers in the caller's dtype."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache_service.control.types import WritePlan
from cache_service.engine.batching import Part
from cache_service.engine.values import JoinedFields, StackedAppendAttend
from cache_service.engine.worker_interface import AttentionResult
from cache_service.wire.tensor_codec import joined_view

Spans = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the call when `t` has that dtype already (the usual case:
    about 1.6 us a call on the CPU VM, several per part on the hot path)."""
    return t if t.dtype is dtype else t.to(dtype)


def joined_rows(
    tensors: list[torch.Tensor], dtype: torch.dtype, span: torch.Tensor | None = None
) -> torch.Tensor:
    """The tensors (same trailing dims) concatenated along dim 0, in `dtype`: a view of
    their memory when they lie back to back in one storage, else one copy.

    span: their `joined_view`, when the caller knows it already."""
    if len(tensors) == 1:
        return in_dtype(tensors[0], dtype)
    if span is None:
        span = joined_view(tensors)
    if span is not None:
        return in_dtype(span.view(-1, *tensors[0].shape[1:]), dtype)
    return torch.cat([t.to(dtype) for t in tensors])


def item_spans(
    joined: JoinedFields | None,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    queries: list[torch.Tensor],
) -> Spans:
    """The flat key, value and query spans of `joined` that agree with the items (same
    dtype, first and last element, element count); None for the others, which then go
    the general way. A cheap consistency check, not a proof: `joined` comes from the
    servicer, which decoded the items into those very spans."""
    if joined is None:
        return (None, None, None)
    out: list[torch.Tensor | None] = []
    for span, tensors in zip(joined, (keys, values, queries), strict=True):
        ok = (
            span is not None
            and span.ndim == 1
            and span.dtype == tensors[0].dtype
            and span.is_contiguous()
            and span.data_ptr() == tensors[0].data_ptr()
            and span.numel() == sum(map(torch.Tensor.numel, tensors))
            and tensors[-1].data_ptr() + tensors[-1].numel() * span.element_size()
            == span.data_ptr() + span.numel() * span.element_size()
        )
        out.append(span if ok else None)
    return out[0], out[1], out[2]


def group_slots(slots: list[tuple[str, int]]) -> dict[str, tuple[list[int], list[int]]]:
    """worker -> (token rows, flat slots) of a write plan."""
    out: dict[str, tuple[list[int], list[int]]] = {}
    for row, (worker_id, slot) in enumerate(slots):
        rows, flat = out.setdefault(worker_id, ([], []))
        rows.append(row)
        flat.append(slot)
    return out


def part_writes(
    idx: list[int],
    plans: list[WritePlan],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    dtype: torch.dtype,
    k_span: torch.Tensor | None = None,
    v_span: torch.Tensor | None = None,
) -> dict[str, tuple[list[int], torch.Tensor, torch.Tensor]]:
    """worker -> (slots, key rows, value rows) of the new tokens of items `idx`, in item
    order, in `dtype`. k_span / v_span: the `joined_view` of those items' keys / values,
    when known."""
    per: dict[str, tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = {}
    whole = True  # every item's tokens go to one worker, so its rows stay in order
    for i in idx:
        slots = plans[i].slots
        worker_id = slots[0][0]
        if len(slots) == 1 or all(w == worker_id for w, _ in slots):
            slot_list, ks, vs = per.setdefault(worker_id, ([], [], []))
            slot_list.extend([slot for _, slot in slots])
            ks.append(keys[i])
            vs.append(values[i])
            continue
        whole = False
        for w, (rows, flat) in group_slots(slots).items():
            rows_t = torch.tensor(rows, dtype=torch.long)
            slot_list, ks, vs = per.setdefault(w, ([], [], []))
            slot_list.extend(flat)
            ks.append(keys[i].index_select(0, rows_t))
            vs.append(values[i].index_select(0, rows_t))
    if not (whole and len(per) == 1):
        k_span = v_span = None
    return {
        w: (sl, joined_rows(ks, dtype, k_span), joined_rows(vs, dtype, v_span))
        for w, (sl, ks, vs) in per.items()
    }


def part_rows(
    parts: list[Part], result: AttentionResult
) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor | None]]:
    """Each part's rows of a round's result (out ``[rows, Hq, D]``, lse ``[rows, Hq]`` or
    None), in part order: the result itself for a lone part, the output's parts where the
    worker delivered them in parts, else one ``split`` (a single call however many parts,
    where slicing costs one per part). `run_attention` has checked that the result holds
    the plan's rows, which are the parts' in order."""
    out, lse = result.out, result.lse
    if len(parts) == 1 and not isinstance(out, list):
        return (out,), (lse,)
    sizes = [sum(p.num_queries) for p in parts]
    outs = out if isinstance(out, list) else out.split(sizes)  # in parts: one per part
    return outs, ([None] * len(parts) if lse is None else lse.split(sizes))


def reassemble(
    num_items: int,
    parts: list[tuple[list[int], Part]],
    outputs: list[AttentionResult],
    dtypes: list[torch.dtype],
) -> list[AttentionResult]:
    """Per item, in call order, the rows of its part's output (converted to its dtype:
    once per part when its items share one)."""
    results: list[AttentionResult | None] = [None] * num_items
    for (idx, part), res in zip(parts, outputs, strict=True):
        kinds = {dtypes[i] for i in idx}
        one_kind = len(kinds) == 1
        out = res.out.to(next(iter(kinds))) if one_kind else res.out
        outs = out.split_with_sizes(part.num_queries)
        lses = (
            res.lse.split_with_sizes(part.num_queries) if res.lse is not None else [None] * len(idx)
        )
        for i, o, lse in zip(idx, outs, lses, strict=True):
            results[i] = AttentionResult(o if one_kind else o.to(dtypes[i]), lse)
    return results  # type: ignore[return-value]


def stacked_result(
    num_items: int,
    parts: list[tuple[list[int], Part]],
    outputs: list[AttentionResult],
    dtype: torch.dtype,
    return_lse: bool,
) -> AttentionResult:
    """Every item's rows, in call order, as one result in `dtype`: the part's output itself
    when one part holds every item in order (the usual call), else one concatenation."""
    if len(parts) == 1 and parts[0][0] == list(range(num_items)):
        res = outputs[0]
        return AttentionResult(in_dtype(res.out, dtype), res.lse if return_lse else None)
    per_item = reassemble(num_items, parts, outputs, [dtype] * num_items)
    out = torch.cat([r.out for r in per_item])
    lse = torch.cat([r.lse for r in per_item]) if return_lse else None  # type: ignore[misc]
    return AttentionResult(out, lse)


def repeat_answer(
    batch: StackedAppendAttend, output: AttentionResult, return_lse: bool
) -> AttentionResult:
    """A repeated layer's answer: its round's output in the query's dtype (made before
    the commit, so a failure here keeps nothing)."""
    out = in_dtype(output.out, batch.query.dtype)
    return AttentionResult(out, output.lse if return_lse else None)


def blocks_to_tokens(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[nb, L, 2, Hkv, bs, D]`` -> key, value ``[L, n, Hkv, D]`` (first n positions)."""
    nb, num_layers, _, hkv, bs, d = blocks.shape
    # [nb, L, 2, Hkv, bs, D] -> [2, L, nb, bs, Hkv, D] -> [2, L, nb*bs, Hkv, D]
    t = blocks.permute(2, 1, 0, 4, 3, 5).reshape(2, num_layers, nb * bs, hkv, d)
    return t[0, :, :n], t[1, :, :n]
