"""Validation of every pool request against the layout and the pool size.

Each check raises :class:`~workers.errors.InvalidWorkerRequest` naming the argument before
anything is written. Index values are checked on host copies (requests arrive on the host
from Ray anyway), so the kernels can then run with ``check_values=False``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.errors import InvalidWorkerRequest
from workers.layout import KVLayout

__all__ = [
    "AttendOptions",
    "as_index_tensor",
    "check_attend",
    "check_block_data",
    "check_block_ids",
    "check_layer",
    "check_new_kv",
    "check_query",
    "check_write",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(message: str) -> None:
    raise InvalidWorkerRequest(message)


def as_index_tensor(name: str, value: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``value`` as an int32/int64 tensor (a sequence of ints becomes int64 on the host).

    Raises:
        InvalidWorkerRequest: ``value`` holds something other than integers.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INDEX_DTYPES:
            _fail(f"{name} must be an int32 or int64 tensor, got dtype {value.dtype}")
        return value
    if type(value) is list and value and all(type(v) is int for v in value):
        # A flat list of ints (a leased step's slots): numpy builds it in half the time
        # torch does. Ids outside int64 take torch's way, which names the overflow.
        with contextlib.suppress(OverflowError):
            return torch.from_numpy(np.array(value, dtype=np.int64))
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidWorkerRequest(f"{name} must be a sequence of ints: {exc}") from None
    if tensor.numel() == 0:
        # An empty list has no element type (torch calls it float32); it is a valid no-op.
        return torch.zeros(tensor.shape, dtype=torch.int64)
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        _fail(f"{name} must hold ints, got {tensor.dtype}")
    return tensor.to(torch.int64)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.cpu()


def _host_array(t: torch.Tensor) -> np.ndarray:
    """An int64 numpy view (or copy) of an index tensor, for the value checks: numpy's
    per-op cost on a few hundred elements is a fraction of torch's."""
    return _host(t).numpy().astype(np.int64, copy=False)


def check_layer(layer: int | None, num_layers: int, *, allow_all: bool = False) -> None:
    """``layer`` is an int in ``[0, num_layers)`` (or None when ``allow_all``)."""
    if layer is None and allow_all:
        return
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        allowed = f"an int in [0, {num_layers})" + (" or None (all layers)" if allow_all else "")
        _fail(f"layer must be {allowed}, got {layer!r}")


def _check_heads(name: str, t: object, layout: KVLayout, leading: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    expected = f"[{leading}, {layout.num_kv_heads}, {layout.head_dim}]"
    if t.dim() != ndim or tuple(t.shape[-2:]) != (layout.num_kv_heads, layout.head_dim):
        _fail(f"{name} must be {expected} for this layout, got shape {tuple(t.shape)}")
    if t.dtype != layout.torch_dtype():
        _fail(f"{name} dtype {t.dtype} differs from the pool's {layout.dtype}")


def check_write(
    layout: KVLayout,
    num_blocks: int,
    layer: int | None,
    slot_mapping: torch.Tensor | Sequence[int],
    key: torch.Tensor,
    value: torch.Tensor,
) -> torch.Tensor:
    """Validate a write; return ``slot_mapping`` as an index tensor.

    Args:
        layout, num_blocks: the pool.
        layer: layer index, or None for all layers.
        slot_mapping: int ``[n]`` flat slots ``block * block_size + offset``; negative = skip;
            the others distinct and below ``num_blocks * block_size``.
        key, value: ``[n, Hkv, D]`` (``[L, n, Hkv, D]`` when ``layer`` is None) in the
            layout's dtype.
    """
    check_layer(layer, layout.num_layers, allow_all=True)
    slots = as_index_tensor("slot_mapping", slot_mapping)
    if slots.dim() != 1:
        _fail(f"slot_mapping must be 1-D [num_tokens], got shape {tuple(slots.shape)}")
    n = slots.shape[0]
    check_new_kv(layout, layer, n, key, value)
    if n:
        # A list (a leased step's slots) is checked as it is, a tensor on a host copy.
        top, repeats = _slot_summary(slot_mapping if type(slot_mapping) is list else slots)
        capacity = num_blocks * layout.block_size
        if top >= capacity:
            _fail(
                f"slot_mapping holds slot {top}, outside the pool's {capacity} slots "
                f"({num_blocks} blocks x {layout.block_size})"
            )
        if repeats:
            _fail("slot_mapping names one slot more than once")
    return slots


def _slot_summary(slots: list[int] | torch.Tensor) -> tuple[int, bool]:
    """The largest slot written (-1 if none: negative slots are skipped) and whether a slot
    written repeats. A list of ints is summed up in Python (a few C calls, where numpy
    would take a dozen for a handful of slots); a tensor with numpy on a host copy."""
    if type(slots) is list:
        kept = slots if min(slots) >= 0 else [s for s in slots if s >= 0]
        return max(kept, default=-1), len(set(kept)) != len(kept)
    host = _host_array(slots)
    # Negative slots are skipped; a step's slots (the usual case) have none.
    kept_array = host if host.min() >= 0 else host[host >= 0]
    if not kept_array.size:
        return -1, False
    if kept_array.size == 1:
        return int(kept_array[0]), False
    ordered = np.sort(kept_array)
    return int(ordered[-1]), bool((ordered[1:] == ordered[:-1]).any())


def check_new_kv(
    layout: KVLayout, layer: int | None, n: int, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Validate a write's key and value for `n` slots: ``[n, Hkv, D]`` (``[L, n, Hkv, D]``
    when ``layer`` is None) in the layout's dtype."""
    # The per-layer call of every decode step: accepted by one comparison per tensor (the
    # checks below build their messages up front, a few microseconds per call); anything
    # else takes them, so what is refused and how is unchanged.
    if layer is not None:
        shape, dtype = (n, layout.num_kv_heads, layout.head_dim), layout.torch_dtype()
        if _is_tensor_of(key, shape, dtype) and _is_tensor_of(value, shape, dtype):
            return
    if layer is None:
        leading, ndim = f"{layout.num_layers}, {n}", 4
    else:
        leading, ndim = f"{n}", 3
    for name, t in (("key", key), ("value", value)):
        _check_heads(name, t, layout, leading, ndim)
        if tuple(t.shape[:-2]) != ((layout.num_layers, n) if layer is None else (n,)):
            _fail(
                f"{name} must be [{leading}, {layout.num_kv_heads}, {layout.head_dim}] "
                f"(slot_mapping has {n} entries), got shape {tuple(t.shape)}"
            )


def _is_tensor_of(t: object, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether `t` is a tensor of exactly `shape` and `dtype`."""
    return isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype


@dataclass(frozen=True)
class AttendOptions:
    """Scalar options of an attention call (meanings as in ``kernels.paged_attention``).

    Raises:
        InvalidWorkerRequest: an option is malformed (named in the message).
    """

    causal: bool = True
    return_lse: bool = False
    scale: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("causal", "return_lse"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be a bool, got {getattr(self, name)!r}")
        scale, window, cap = self.scale, self.sliding_window, self.softcap
        if scale is not None and (
            isinstance(scale, bool)
            or not isinstance(scale, int | float)
            or not math.isfinite(scale)
        ):
            _fail(f"scale must be a finite number or None, got {scale!r}")
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            _fail(f"sliding_window must be a positive int or None, got {window!r}")
        if cap is not None and (
            isinstance(cap, bool)
            or not isinstance(cap, int | float)
            or not math.isfinite(cap)
            or cap <= 0
        ):
            _fail(f"softcap must be a positive finite number or None, got {cap!r}")


def check_query(layout: KVLayout, query: object) -> None:
    """``query`` is ``[T, Hq, D]`` in the layout's dtype with ``Hq`` a positive multiple of
    the layout's KV heads."""
    if not isinstance(query, torch.Tensor):
        _fail(f"query must be a torch.Tensor, got {type(query).__name__}")
    assert isinstance(query, torch.Tensor)
    if query.dim() != 3 or query.shape[2] != layout.head_dim:
        _fail(
            f"query must be [num_tokens, num_q_heads, {layout.head_dim}] for this layout, got "
            f"shape {tuple(query.shape)}"
        )
    hq = query.shape[1]
    if hq == 0 or hq % layout.num_kv_heads:
        _fail(
            f"query has {hq} heads, not a positive multiple of the layout's "
            f"{layout.num_kv_heads} KV heads"
        )
    if query.dtype != layout.torch_dtype():
        _fail(f"query dtype {query.dtype} differs from the pool's {layout.dtype}")


def check_attend(
    layout: KVLayout,
    num_blocks: int,
    layer: int,
    query: torch.Tensor,
    block_tables: torch.Tensor | Sequence[Sequence[int]],
    seq_lens: torch.Tensor | Sequence[int],
    query_start_loc: torch.Tensor | Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate an attention batch; return ``(block_tables, seq_lens, query_start_loc)`` as
    index tensors.

    Args:
        layout, num_blocks: the pool.
        layer: layer index.
        query: ``[T, Hq, D]`` in the layout's dtype, ``Hq`` a multiple of ``Hkv``.
        block_tables: int ``[S, max_blocks]`` block ids; the first ``ceil(seq_len /
            block_size)`` of row s lie in ``[0, num_blocks)``.
        seq_lens: int ``[S]``, KV tokens of each sequence, ``<= max_blocks * block_size``.
        query_start_loc: int ``[S + 1]``, non-decreasing from 0 to T, with
            ``n_s <= seq_lens[s]``.
    """
    check_layer(layer, layout.num_layers)
    check_query(layout, query)
    tables = as_index_tensor("block_tables", block_tables)
    lens = as_index_tensor("seq_lens", seq_lens)
    starts = as_index_tensor("query_start_loc", query_start_loc)
    if tables.dim() != 2:
        _fail(f"block_tables must be 2-D [num_seqs, max_blocks], got shape {tuple(tables.shape)}")
    num_seqs, max_blocks = tables.shape
    if lens.shape != (num_seqs,):
        _fail(
            f"seq_lens must be [num_seqs] = [{num_seqs}] (block_tables rows), got shape "
            f"{tuple(lens.shape)}"
        )
    if starts.shape != (num_seqs + 1,):
        _fail(
            f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}], got shape "
            f"{tuple(starts.shape)}"
        )

    qsl = _host_array(starts)
    if int(qsl[0]) != 0:
        _fail(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    if int(qsl[-1]) != query.shape[0]:
        _fail(
            f"query_start_loc[-1] = {int(qsl[-1])} but query has {query.shape[0]} rows (num_tokens)"
        )
    counts = qsl[1:] - qsl[:-1]
    host_lens = _host_array(lens)
    bs = layout.block_size
    # 0 <= counts[s] <= seq_lens[s] <= max_blocks * bs for every s is all four checks of
    # `_check_lengths` at once (4 numpy calls, not 8): it looks again only to name a culprit.
    if not (
        counts.min(initial=0) >= 0
        and bool((counts <= host_lens).all())
        and host_lens.max(initial=0) <= max_blocks * bs
    ):
        _check_lengths(counts, host_lens, max_blocks, bs)
    if num_seqs and max_blocks:
        host_tables = _host(tables).numpy()
        # Entries past a row's used blocks may hold anything; when none is outside the
        # pool (the coordinator pads rows with block 0), no used one is: two reductions
        # instead of the mask of `_check_used_blocks`.
        if host_tables.min() < 0 or host_tables.max() >= num_blocks:
            _check_used_blocks(host_tables.astype(np.int64), host_lens, bs, num_blocks)
    return tables, lens, starts


def _check_lengths(counts: np.ndarray, lens: np.ndarray, max_blocks: int, bs: int) -> None:
    """`check_attend`'s checks of query rows and seq_lens, one by one: the first that
    fails names its sequence."""
    checks = (
        (counts < 0, "query_start_loc decreases at sequence {s}"),
        (lens < 0, "seq_lens[{s}] is negative"),
        (
            lens > max_blocks * bs,
            f"seq_lens[{{s}}] exceeds block_tables' {max_blocks} blocks x {bs} tokens",
        ),
        (
            counts > lens,
            "sequence {s} has more query rows (query_start_loc) than KV tokens (seq_lens)",
        ),
    )
    for bad, template in checks:
        if bool(bad.any()):
            _fail(template.format(s=int(np.flatnonzero(bad)[0])))


def _check_used_blocks(tables: np.ndarray, lens: np.ndarray, bs: int, num_blocks: int) -> None:
    """The block ids that `lens` uses (the first ``ceil(seq_len / bs)`` of each row) lie in
    ``[0, num_blocks)``; the first that does not is named."""
    used = np.arange(tables.shape[1])[None, :] < ((lens + bs - 1) // bs)[:, None]
    bad_ids = used & ((tables < 0) | (tables >= num_blocks))
    if bool(bad_ids.any()):
        s, j = (int(x) for x in np.argwhere(bad_ids)[0])
        _fail(
            f"block_tables[{s}, {j}] = {int(tables[s, j])} is not a block of this pool "
            f"[0, {num_blocks})"
        )


def check_block_ids(
    name: str, block_ids: torch.Tensor | Sequence[int], num_blocks: int, *, distinct: bool
) -> torch.Tensor:
    """Validate 1-D block ids in ``[0, num_blocks)`` (pairwise distinct when ``distinct``);
    return them as an index tensor."""
    ids = as_index_tensor(name, block_ids)
    if ids.dim() != 1:
        _fail(f"{name} must be 1-D [n], got shape {tuple(ids.shape)}")
    if ids.numel():
        host = _host(ids).long()
        bad = (host < 0) | (host >= num_blocks)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            _fail(f"{name}[{i}] = {int(host[i])} is not a block of this pool [0, {num_blocks})")
        if distinct and torch.unique(host).numel() != host.numel():
            _fail(f"{name} names one block more than once")
    return ids


def check_block_data(data: torch.Tensor, num_ids: int, layout: KVLayout) -> None:
    """``data`` is ``[num_ids, L, 2, Hkv, block_size, D]`` in the layout's dtype."""
    if not isinstance(data, torch.Tensor):
        _fail(f"data must be a torch.Tensor, got {type(data).__name__}")
    expected = (num_ids, *layout.block_shape)
    if tuple(data.shape) != expected:
        _fail(
            f"data must be [n, L, 2, Hkv, block_size, D] = {list(expected)} for this layout and "
            f"{num_ids} block ids, got {list(data.shape)}"
        )
    if data.dtype != layout.torch_dtype():
        _fail(f"data dtype {data.dtype} differs from the pool's {layout.dtype}")
