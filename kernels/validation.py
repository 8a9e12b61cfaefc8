"""Argument checks shared by the Triton and the torch paths of every public kernel.

Each ``check_*`` function raises :class:`KernelArgumentError` (a ``ValueError``) whose message
names the offending argument, before anything is written. Shape, dtype and device checks read
only tensor metadata. The *value* checks (block ids inside the pool, lengths inside the block
table, ...) must read the index tensors; on CUDA they cost one device-to-host copy, which is
why they are off by default for paged attention and callers that built the indices
themselves may turn them off elsewhere (``check_values=False``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "ATTENTION_DTYPES",
    "INDEX_DTYPES",
    "AttentionProblem",
    "KernelArgumentError",
    "check_block_copy_args",
    "check_gather_args",
    "check_merge_args",
    "check_paged_attention_args",
    "check_record_fingerprints_args",
    "check_scatter_args",
    "check_write_kv_args",
]

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


class KernelArgumentError(ValueError):
    """A kernel argument is malformed; the message names it. Nothing was written."""


@dataclass(frozen=True)
class AttentionProblem:
    """Sizes of one ``paged_attention`` call, read off validated arguments.

    Attributes:
        num_q_tokens: rows of ``query`` (T).
        num_q_heads, num_kv_heads: Hq and Hkv; ``group = Hq // Hkv`` query heads share a KV head.
        head_dim: D, elements per head.
        num_blocks, block_size: pool size in blocks and tokens per block.
        num_seqs: S, sequences in the batch.
        max_blocks: columns of ``block_tables``; ``max_blocks * block_size`` bounds every
            ``seq_lens`` entry.
    """

    num_q_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    num_seqs: int
    max_blocks: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_kv_len(self) -> int:
        """Upper bound on any sequence's KV length, in tokens (known without a device read)."""
        return self.max_blocks * self.block_size


def _fail(message: str) -> None:
    raise KernelArgumentError(message)


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value  # type: ignore[return-value]


def _require_dim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _require_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        _fail(f"{name} must have dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")


def _require_same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor):
    for name, t in others.items():
        if t.device != reference.device:
            _fail(f"{name} is on {t.device} but {reference_name} is on {reference.device}")


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """The caches' shared layout: ``[num_blocks, Hkv, block_size, D]``, inner dims contiguous."""
    _require_tensor("key_cache", key_cache)
    _require_tensor("value_cache", value_cache)
    _require_dim("key_cache", key_cache, 4, "[num_blocks, num_kv_heads, block_size, head_dim]")
    _require_dim("value_cache", value_cache, 4, "[num_blocks, num_kv_heads, block_size, head_dim]")
    if value_cache.shape != key_cache.shape:
        _fail(
            f"value_cache shape {tuple(value_cache.shape)} differs from key_cache shape "
            f"{tuple(key_cache.shape)}"
        )
    if value_cache.dtype != key_cache.dtype:
        _fail(
            f"value_cache dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}"
        )
    _require_same_device("key_cache", key_cache, value_cache=value_cache)
    _require_dtype("key_cache", key_cache, ATTENTION_DTYPES)
    _, hkv, bs, d = key_cache.shape
    if hkv == 0 or bs == 0 or d == 0:
        _fail(f"key_cache has an empty inner dimension: shape {tuple(key_cache.shape)}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        # Each (block, head) must be one contiguous block_size x head_dim run; dim 0 is free so
        # one pool tensor can hold every layer.
        if cache.stride(3) != 1 or cache.stride(2) != d or cache.stride(1) != bs * d:
            _fail(
                f"{name} must be contiguous in its last three dims (strides "
                f"[*, {bs * d}, {d}, 1]), got strides {tuple(cache.stride())}"
            )


def check_paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor | None,
    check_values: bool = True,
) -> AttentionProblem:
    """Validate the arguments of :func:`kernels.paged_attention`; return the problem's sizes.

    The metadata checks (everything but ``check_values``) are a function of the arguments'
    types, shapes, strides, dtypes and devices and of the scalar options; their outcome is
    remembered per such signature, so a decode loop repeating one call shape pays them
    once. The value checks run on every call that asks for them.

    Raises:
        KernelArgumentError: naming the first malformed argument.
    """
    try:
        key = (
            _tensor_signature(query),
            _tensor_signature(key_cache),
            _tensor_signature(value_cache),
            _tensor_signature(block_tables),
            _tensor_signature(seq_lens),
            _tensor_signature(query_start_loc),
            None if out is None else _tensor_signature(out),
            # Types too: True == 1 as a key, but a bool is rejected where an int passes.
            type(scale),
            scale,
            type(sliding_window),
            sliding_window,
            type(softcap),
            softcap,
        )
        problem = _PASSED_SIGNATURES.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: check in full
        key = problem = None
    if problem is None:
        problem = _check_attention_metadata(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            out=out,
        )
        if key is not None:
            if len(_PASSED_SIGNATURES) >= _MAX_SIGNATURES:
                _PASSED_SIGNATURES.clear()
            _PASSED_SIGNATURES[key] = problem
    if check_values:
        _check_attention_values(problem, block_tables, seq_lens, query_start_loc)
    return problem


def _tensor_signature(t: torch.Tensor) -> tuple:
    """What the metadata checks read of a tensor argument."""
    return (type(t), t.shape, t.stride(), t.dtype, t.device)


# Signatures (see check_paged_attention_args) whose metadata checks passed, with their
# problem sizes. Bounded: unusual callers (a new table width every call) only refill it.
_PASSED_SIGNATURES: dict[tuple, AttentionProblem] = {}
_MAX_SIGNATURES = 256


def _check_attention_metadata(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor | None,
) -> AttentionProblem:
    """The metadata checks of :func:`check_paged_attention_args` (no device reads)."""
    _require_tensor("query", query)
    _require_dim("query", query, 3, "[num_q_tokens, num_q_heads, head_dim]")
    _check_cache_pair(key_cache, value_cache)
    _require_dtype("query", query, ATTENTION_DTYPES)
    if query.dtype != key_cache.dtype:
        _fail(f"query dtype {query.dtype} differs from key_cache dtype {key_cache.dtype}")
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    num_q_tokens, num_q_heads, q_head_dim = query.shape
    if q_head_dim != head_dim:
        _fail(f"query head_dim {q_head_dim} differs from key_cache head_dim {head_dim}")
    if num_q_heads == 0 or num_q_heads % num_kv_heads != 0:
        _fail(
            f"query has {num_q_heads} heads, not a positive multiple of key_cache's "
            f"{num_kv_heads} KV heads"
        )
    if query.stride(2) != 1 and num_q_tokens > 0:
        _fail(f"query must be contiguous in head_dim, got strides {tuple(query.stride())}")

    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        _require_tensor(name, t)
        _require_dtype(name, t, INDEX_DTYPES)
    _require_dim("block_tables", block_tables, 2, "[num_seqs, max_blocks]")
    _require_dim("seq_lens", seq_lens, 1, "[num_seqs]")
    _require_dim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    num_seqs, max_blocks = block_tables.shape
    if seq_lens.shape[0] != num_seqs:
        _fail(f"seq_lens has {seq_lens.shape[0]} entries but block_tables has {num_seqs} rows")
    if query_start_loc.shape[0] != num_seqs + 1:
        _fail(
            f"query_start_loc has {query_start_loc.shape[0]} entries, expected num_seqs + 1 = "
            f"{num_seqs + 1}"
        )
    _require_same_device(
        "query",
        query,
        key_cache=key_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )

    _check_options(scale, sliding_window, softcap)
    if out is not None:
        _check_out(out, query)
    return AttentionProblem(
        num_q_tokens=num_q_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        num_seqs=num_seqs,
        max_blocks=max_blocks,
    )


def _check_options(scale: float | None, sliding_window: int | None, softcap: float | None) -> None:
    """The attention options' types and ranges (each may be None)."""
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale)
    ):
        _fail(f"scale must be a finite float or None, got {scale!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        _fail(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, int | float)
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        _fail(f"softcap must be a positive finite float or None, got {softcap!r}")


def _check_out(out: torch.Tensor, query: torch.Tensor) -> None:
    """A caller's output tensor: the query's shape, dtype and device, unit stride in
    head_dim."""
    _require_tensor("out", out)
    if out.shape != query.shape:
        _fail(f"out shape {tuple(out.shape)} differs from query shape {tuple(query.shape)}")
    if out.dtype != query.dtype:
        _fail(f"out dtype {out.dtype} differs from query dtype {query.dtype}")
    _require_same_device("query", query, out=out)
    if out.numel() > 0 and out.stride(2) != 1:
        _fail(f"out must be contiguous in head_dim, got strides {tuple(out.stride())}")


def _check_attention_values(
    p: AttentionProblem,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Value checks of the index tensors, on a host copy (one device-to-host transfer)."""
    # One concatenated copy: a single synchronisation instead of one per reduction, and the
    # small checks below then run on the CPU without further kernel launches.
    flat = torch.cat([query_start_loc.long(), seq_lens.long(), block_tables.long().flatten()])
    host = flat.cpu()
    qsl = host[: p.num_seqs + 1]
    lens = host[p.num_seqs + 1 : 2 * p.num_seqs + 1]
    tables = host[2 * p.num_seqs + 1 :].view(p.num_seqs, p.max_blocks)
    if int(qsl[0]) != 0:
        _fail(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    if int(qsl[-1]) != p.num_q_tokens:
        _fail(
            f"query_start_loc[-1] = {int(qsl[-1])} but query has {p.num_q_tokens} rows "
            "(num_q_tokens)"
        )
    if p.num_seqs == 0:
        return
    n_q = qsl[1:] - qsl[:-1]
    used_blocks = (lens.clamp_min(0) + p.block_size - 1) // p.block_size
    used = torch.arange(p.max_blocks)[None, :] < used_blocks[:, None]
    bad_ids = used & ((tables < 0) | (tables >= p.num_blocks))
    problems = (
        (lens < 0, "seq_lens[{s}] is negative"),
        (
            lens > p.max_kv_len,
            "seq_lens[{s}] exceeds the block table's capacity of "
            f"{p.max_blocks} blocks x {p.block_size} tokens",
        ),
        (n_q < 0, "query_start_loc decreases at sequence {s}"),
        (
            n_q > lens,
            "sequence {s} has more query tokens (query_start_loc) than KV tokens (seq_lens)",
        ),
        (
            bad_ids.any(dim=1),
            "block_tables row {s} holds a block id outside the pool "
            f"[0, {p.num_blocks}) among its first ceil(seq_len / block_size) entries",
        ),
    )
    for flags, template in problems:
        if bool(flags.any()):
            _fail(template.format(s=int(flags.nonzero()[0, 0])))


def check_merge_args(outputs: torch.Tensor, lses: torch.Tensor) -> None:
    """Validate ``merge_attention_states(outputs [P, T, H, D], lses [P, T, H])``."""
    _require_tensor("outputs", outputs)
    _require_tensor("lses", lses)
    _require_dim("outputs", outputs, 4, "[num_parts, num_tokens, num_heads, head_dim]")
    _require_dim("lses", lses, 3, "[num_parts, num_tokens, num_heads]")
    _require_dtype("outputs", outputs, ATTENTION_DTYPES)
    if lses.dtype != torch.float32:
        _fail(f"lses must be float32, got {lses.dtype}")
    if tuple(lses.shape) != tuple(outputs.shape[:3]):
        _fail(
            f"lses shape {tuple(lses.shape)} must equal outputs' first three dims "
            f"{tuple(outputs.shape[:3])}"
        )
    if outputs.shape[0] == 0:
        _fail("outputs must hold at least one part (num_parts >= 1)")
    _require_same_device("outputs", outputs, lses=lses)


def _check_token_rows(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """A write's value and slot_mapping ``[n]`` (int32/int64) have key's n tokens."""
    if value.shape[0] != key.shape[0]:
        _fail(f"value has {value.shape[0]} tokens but key has {key.shape[0]}")
    _require_tensor("slot_mapping", slot_mapping)
    _require_dim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _require_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")


def check_write_kv_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
) -> None:
    """Validate ``write_kv``: key/value ``[n, Hkv, D]`` into the caches at ``slot_mapping``."""
    _check_cache_pair(key_cache, value_cache)
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    for name, t in (("key", key), ("value", value)):
        _require_tensor(name, t)
        _require_dim(name, t, 3, "[num_tokens, num_kv_heads, head_dim]")
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            _fail(
                f"{name} shape {tuple(t.shape)} does not match the cache: expected "
                f"[num_tokens, {num_kv_heads}, {head_dim}]"
            )
        if t.dtype != key_cache.dtype:
            _fail(f"{name} dtype {t.dtype} differs from the cache dtype {key_cache.dtype}")
    _check_token_rows(key, value, slot_mapping)
    _require_same_device("key_cache", key_cache, key=key, value=value, slot_mapping=slot_mapping)
    if check_values and slot_mapping.numel() > 0:
        capacity = num_blocks * block_size
        slots = slot_mapping.long()
        kept = slots[slots >= 0]  # one device read (boolean indexing)
        too_big = kept[kept >= capacity]
        if too_big.numel() > 0:
            _fail(
                f"slot_mapping holds slot {int(too_big[0])}, outside the cache's {capacity} "
                f"slots ({num_blocks} blocks x {block_size})"
            )
        if torch.unique(kept).numel() != kept.numel():
            _fail("slot_mapping names one slot more than once (each slot takes one token)")


def _check_block_ids(name: str, ids: torch.Tensor, device: torch.device) -> None:
    _require_tensor(name, ids)
    _require_dim(name, ids, 1, "[n]")
    _require_dtype(name, ids, INDEX_DTYPES)
    if ids.device != device:
        _fail(f"{name} is on {ids.device} but the cache is on {device}")


def _check_block_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Block-level ops accept any tensors whose dim 0 indexes blocks (a layer or a whole pool)."""
    _require_tensor("key_cache", key_cache)
    _require_tensor("value_cache", value_cache)
    if key_cache.dim() < 1 or value_cache.dim() < 1:
        _fail("key_cache and value_cache must have a block dimension (dim 0)")
    if value_cache.shape[0] != key_cache.shape[0]:
        _fail(
            f"value_cache has {value_cache.shape[0]} blocks but key_cache has {key_cache.shape[0]}"
        )
    _require_same_device("key_cache", key_cache, value_cache=value_cache)


def _out_of_range(ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """0-d bool tensor on ids' device: some id falls outside ``[0, num_blocks)``."""
    return ((ids < 0) | (ids >= num_blocks)).any()


def check_block_copy_args(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    check_values: bool = True,
) -> bool:
    """Validate ``copy_blocks``; return True when a destination is also a source (overlap).

    With ``check_values=False`` overlap is assumed possible and True is returned.
    """
    _check_block_pair(key_cache, value_cache)
    n_blocks = key_cache.shape[0]
    _check_block_ids("src", src, key_cache.device)
    _check_block_ids("dst", dst, key_cache.device)
    if src.shape != dst.shape:
        _fail(f"src has {src.shape[0]} entries but dst has {dst.shape[0]}")
    if not check_values:
        return True
    if src.numel() == 0:
        return False
    s, d = src.long(), dst.long()
    flags = torch.stack(
        [_out_of_range(s, n_blocks), _out_of_range(d, n_blocks), torch.isin(d, s).any()]
    ).tolist()
    if flags[0]:
        _fail(f"src holds a block id outside [0, {n_blocks})")
    if flags[1]:
        _fail(f"dst holds a block id outside [0, {n_blocks})")
    if torch.unique(d).numel() != d.numel():
        _fail("dst names one block more than once")
    return bool(flags[2])


def check_gather_args(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    check_values: bool = True,
) -> None:
    """Validate ``gather_blocks(key_cache, value_cache, block_ids)``."""
    _check_block_pair(key_cache, value_cache)
    n_blocks = key_cache.shape[0]
    _check_block_ids("block_ids", block_ids, key_cache.device)
    if check_values and block_ids.numel() > 0 and bool(_out_of_range(block_ids, n_blocks)):
        _fail(f"block_ids holds a block id outside [0, {n_blocks})")


def check_scatter_args(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    *,
    check_values: bool = True,
) -> None:
    """Validate ``scatter_blocks``: ``key_blocks`` is ``[len(block_ids), *key_cache.shape[1:]]``."""
    _check_block_pair(key_cache, value_cache)
    n_blocks = key_cache.shape[0]
    _check_block_ids("block_ids", block_ids, key_cache.device)
    for name, blocks, cache in (
        ("key_blocks", key_blocks, key_cache),
        ("value_blocks", value_blocks, value_cache),
    ):
        _require_tensor(name, blocks)
        expected = (block_ids.shape[0], *cache.shape[1:])
        if tuple(blocks.shape) != expected:
            _fail(f"{name} shape {tuple(blocks.shape)} differs from expected {expected}")
        if blocks.dtype != cache.dtype:
            _fail(f"{name} dtype {blocks.dtype} differs from the cache dtype {cache.dtype}")
        _require_same_device("key_cache", key_cache, **{name: blocks})
    if check_values and block_ids.numel() > 0:
        ids = block_ids.long()
        if bool(_out_of_range(ids, n_blocks)):
            _fail(f"block_ids holds a block id outside [0, {n_blocks})")
        if torch.unique(ids).numel() != ids.numel():
            _fail("block_ids names one block more than once")


def check_record_fingerprints_args(
    key: torch.Tensor,
    value: torch.Tensor,
    weights: torch.Tensor,
    sums: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer: int | None,
    block_size: int,
    *,
    check_values: bool = True,
) -> None:
    """Validate ``record_fingerprints`` (shapes in its docstring)."""
    _require_tensor("weights", weights)
    _require_dim("weights", weights, 2, "[num_kv_heads, head_dim]")
    _require_dtype("weights", weights, (torch.float64,))
    _require_tensor("sums", sums)
    _require_dim("sums", sums, 3, "[rows, num_layers, 2]")
    _require_dtype("sums", sums, (torch.float64,))
    if not weights.is_contiguous() or not sums.is_contiguous():
        _fail("weights and sums must be contiguous")
    if type(block_size) is not int or block_size < 1:
        _fail(f"block_size must be a positive int, got {block_size!r}")
    rows, num_layers, kinds = sums.shape
    if kinds != 2 or rows < block_size or rows % block_size:
        _fail(
            f"sums must be [rows, num_layers, 2] with rows a multiple of block_size "
            f"{block_size} (a spare block included), got shape {tuple(sums.shape)}"
        )
    if layer is not None and (type(layer) is not int or not 0 <= layer < num_layers):
        _fail(f"layer must be None or an int in [0, {num_layers}), got {layer!r}")
    for name, t in (("key", key), ("value", value)):
        _require_tensor(name, t)
        _require_dim(name, t, 3, "[num_tokens, num_kv_heads, head_dim]")
        _require_dtype(name, t, ATTENTION_DTYPES)
        if tuple(t.shape[1:]) != tuple(weights.shape):
            _fail(f"{name} shape {tuple(t.shape)} does not match weights {tuple(weights.shape)}")
    _check_token_rows(key, value, slot_mapping)
    _require_same_device(
        "sums", sums, key=key, value=value, weights=weights, slot_mapping=slot_mapping
    )
    if check_values and slot_mapping.numel() > 0:
        limit = (rows - block_size) * (1 if layer is not None else num_layers)
        top = int(slot_mapping.max())
        if top >= limit:
            _fail(f"slot_mapping holds slot {top}, past the {limit} slots sums covers")
