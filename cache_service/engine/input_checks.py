"""Argument checks of the coordinator's calls, made before any state changes: tensors of
the layout's shapes and float dtypes, finite values, token ids that agree with positions
other layers reserved. Each failure is an `InvalidRequest` naming the item and tensor."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from cache_service.control.types import WriteCursor
from cache_service.engine.call_tensors import Spans, item_spans
from cache_service.engine.values import AppendAttendItem, JoinedFields
from cache_service.errors import InvalidRequest
from cache_service.wire.tensor_codec import joined_view
from workers.layout import KVLayout

# The dtypes a key, value or query may come in.
FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32))


def block_shape(layout: KVLayout) -> tuple[int, ...]:
    """The shape of one exported block: ``(L, 2, Hkv, block_size, D)``."""
    lay = layout
    return (lay.num_layers, 2, lay.num_kv_heads, lay.block_size, lay.head_dim)


def check_layer(layout: KVLayout, layer: object) -> None:
    """`layer` is an int in ``[0, L)``."""
    if type(layer) is not int or not 0 <= layer < layout.num_layers:
        raise InvalidRequest(f"layer must be in [0, {layout.num_layers}), got {layer!r}")


def check_queries(layout: KVLayout, queries: Sequence[torch.Tensor]) -> int:
    """Validate query tensors ``[m >= 1, Hq, D]`` with one Hq, a multiple of Hkv."""
    hkv, d = layout.num_kv_heads, layout.head_dim
    if queries:
        # The usual call passes at C speed; anything else gets the detailed checks.
        q0 = queries[0]
        if type(q0) is torch.Tensor and q0.ndim == 3:
            hq = q0.shape[1]
            if hq >= 1 and hq % hkv == 0:
                for q in queries:
                    if (
                        type(q) is not torch.Tensor
                        or q.dtype not in FLOAT_DTYPES
                        or q.ndim != 3
                        or q.shape[0] < 1
                        or q.shape[1] != hq
                        or q.shape[2] != d
                    ):
                        break
                else:
                    return hq
    hq = None
    for i, q in enumerate(queries):
        check_tensor(f"items[{i}].query", q, (None, None, d), finite=False)
        if q.shape[0] < 1:
            raise InvalidRequest(f"items[{i}].query has no rows")
        h = q.shape[1]
        if h < 1 or h % hkv:
            raise InvalidRequest(
                f"items[{i}].query has {h} heads, which is not a positive multiple of the "
                f"{hkv} KV heads"
            )
        if hq is not None and h != hq:
            raise InvalidRequest(
                f"items[{i}].query has {h} heads, items[0] has {hq}: one call, one head count"
            )
        hq = h
    return hq or 0


def check_new_kv(layout: KVLayout, items: Sequence[AppendAttendItem]) -> None:
    """Each item's token ids (n >= 1) and key / value ``[n, Hkv, D]`` of a float dtype."""
    hkv, d = layout.num_kv_heads, layout.head_dim
    for i, it in enumerate(items):
        n = len(it.token_ids)
        k, v = it.key, it.value
        if (
            n > 0
            and type(k) is torch.Tensor
            and type(v) is torch.Tensor
            and k.dtype in FLOAT_DTYPES
            and v.dtype in FLOAT_DTYPES
            and k.shape == (n, hkv, d)
            and v.shape == (n, hkv, d)
        ):
            continue
        if n == 0:
            raise InvalidRequest(f"items[{i}].token_ids is empty")
        check_new_rows(f"items[{i}].", n, k, v, (n, hkv, d))
        check_tensor(f"items[{i}].key", k, (n, hkv, d), finite=False)
        check_tensor(f"items[{i}].value", v, (n, hkv, d), finite=False)


def check_not_empty(items: Sequence[object], call: str) -> None:
    """Refuse a call with no items, as the batch calls refuse no sequences: an empty call
    is a caller's mistake, not a request for nothing."""
    if not items:
        raise InvalidRequest(f"items is empty: an {call} call needs at least one item")


def check_new_rows(prefix: str, n: int, key: object, value: object, want: tuple[int, ...]) -> None:
    """Name a disagreement between the n token ids and the key / value rows as such (one
    row per new token) rather than as a shape error. `want` is the full expected shape; the
    token dimension is the one of size n (the second for all layers at once)."""
    row_dim = len(want) - 3
    for name, t in (("key", key), ("value", value)):
        if (
            isinstance(t, torch.Tensor)
            and t.ndim == len(want)
            and t.shape[row_dim] != n
            and tuple(t.shape[row_dim + 1 :]) == tuple(want[row_dim + 1 :])
        ):
            rows = t.shape[row_dim]
            raise InvalidRequest(
                f"{prefix}token_ids has {n} entries but {prefix}{name} has {rows} "
                f"row{'' if rows == 1 else 's'} (shape {list(t.shape)}): one {name} row per "
                "new token"
            )


def check_tensor(
    name: str, t: torch.Tensor, shape: tuple[int | None, ...], *, finite: bool = True
) -> None:
    """A float tensor of the given shape (None: any size), finite unless told otherwise."""
    if not isinstance(t, torch.Tensor):
        raise InvalidRequest(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise InvalidRequest(f"{name} has dtype {t.dtype}; use float16, bfloat16 or float32")
    if t.ndim != len(shape) or any(
        w is not None and g != w for g, w in zip(t.shape, shape, strict=False)
    ):
        want = ", ".join("*" if w is None else str(w) for w in shape)
        raise InvalidRequest(f"{name} has shape {list(t.shape)}, expected [{want}]")
    if finite:
        check_finite([t], lambda: [(name, t)])


_FP32_RANGE = (torch.bfloat16, torch.float32)


def check_finite(
    tensors: Sequence[torch.Tensor], named: Callable[[], Iterable[tuple[str, torch.Tensor]]]
) -> None:
    """No NaN / inf anywhere: a NaN key in a shared prefix block would poison every
    sequence that adopts it.

    Fast pass: the sum of each run of `tensors` (runs: tensors back to back in one
    storage, see `joined_view`). Any NaN or infinity makes its sum NaN or infinite, so a
    finite sum clears the run. A sum that is not finite (a culprit, or finite values
    whose sum overflows) sends every tensor of `named()` through the exact check, which
    names the first culprit.
    """
    if not tensors or sums_finite(tensors):
        return
    for name, t in named():
        if not bool(torch.isfinite(t).all()):
            raise InvalidRequest(f"{name} contains NaN or infinite values")


def sums_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """The fast pass of `check_finite`: every run's sum is finite (so no element is NaN or
    infinite; False may also mean finite values whose sum overflows)."""
    # math.isfinite of the Python float: a fraction of what a torch.isfinite call costs.
    return all(math.isfinite(s.item()) for s in _run_sums(tensors))


def _run_sums(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Sums covering every element of `tensors` (float32 or of float32's range): one per
    run of tensors lying back to back in one storage (so a request decoded by the servicer
    costs three sums)."""
    runs: list[torch.Tensor] = []
    start = 0
    end_ptr = -1
    for i, t in enumerate(tensors):
        # Address arithmetic finds the candidates; joined_view makes sure.
        ptr = t.data_ptr()
        if i and ptr != end_ptr:
            runs.extend(_as_runs(tensors[start:i]))
            start = i
        end_ptr = ptr + t.numel() * t.element_size()
    runs.extend(_as_runs(tensors[start:]))
    if len(runs) > 8:  # many separate tensors (in-process callers): one sum over a copy
        return [torch.cat([r.float() for r in runs]).sum()]
    # bfloat16 and float32 share float32's range, so their own-dtype sum (2.5x faster on
    # CPU for bfloat16) overflows no sooner; float16's would at 65504.
    return [r.sum() if r.dtype in _FP32_RANGE else r.sum(dtype=torch.float32) for r in runs]


def _as_runs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if len(tensors) > 1:
        span = joined_view(tensors)
        if span is not None:
            return [span]
    return [t.reshape(-1) for t in tensors]


def check_reserved(i: int, cursor: WriteCursor, token_ids: Sequence[int], layer: int) -> None:
    """Token ids of positions another layer already reserved must match (checked before
    any reservation, to name the item; the block manager checks again)."""
    reserved = cursor.reserved
    for j in range(min(len(reserved), len(token_ids))):
        if reserved[j] != token_ids[j]:
            raise InvalidRequest(
                f"items[{i}]: position {cursor.start + j} holds token {reserved[j]}, got "
                f"{token_ids[j]} on layer {layer} (every layer must send the same token ids)"
            )


def check_append_attend(
    layout: KVLayout,
    layer: object,
    items: Sequence[AppendAttendItem],
    joined: JoinedFields | None,
) -> tuple[list[torch.Tensor], int, list[str], list[torch.Tensor], list[torch.Tensor], Spans]:
    """Every check of an append-and-attend call before it locks anything: the layer, the
    items (at least one, distinct sequences), their queries, new K/V and finite values.

    Returns (queries, query heads Hq, sequence ids, keys, values, the items' spans in
    `joined` that agree with them: `item_spans`).
    """
    check_layer(layout, layer)
    check_not_empty(items, "append_attend")
    queries = [it.query for it in items]
    hq = check_queries(layout, queries)
    seq_ids = [it.seq_id for it in items]
    if len(set(seq_ids)) != len(seq_ids):
        dup = next(s for s in seq_ids if seq_ids.count(s) > 1)
        raise InvalidRequest(f"sequence {dup!r} appears twice in one append_attend")
    keys = [it.key for it in items]
    values = [it.value for it in items]
    check_new_kv(layout, items)
    spans = item_spans(joined, keys, values, queries)

    def named() -> Iterable[tuple[str, torch.Tensor]]:
        for i, it in enumerate(items):
            for name in ("key", "value", "query"):
                yield f"items[{i}].{name}", getattr(it, name)

    # Keys, values and queries each as one run (what the servicer decodes into one
    # buffer per field is checked in three passes); item order names a culprit.
    runs: list[torch.Tensor] = []
    for span, tensors in zip(spans, (keys, values, queries), strict=True):
        runs += tensors if span is None else (span,)
    check_finite(runs, named)
    return queries, hq, seq_ids, keys, values, spans
