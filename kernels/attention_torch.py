"""The torch backend of paged attention: a call's sequences padded and computed together.

What ``kernels.paged_attention(backend="torch")`` runs on CUDA tensors (the recomputation
of the service's online correctness check on GPU pools) and on CPU tensors when the padded
work is small (:func:`padded_elements` within :data:`MAX_CPU_ELEMENTS`: a decode step, a
short prefill), where a small call's time is the per-operation overhead. Its semantics are
those of ``reference.paged_attention_ref`` (the oracle it is tested against, and the
conventions in that module's docstring), which loops over sequences, a dozen operations
each; this pads sequences to the longest (rows and keys) and computes them together:

* the keys and values are gathered slot by slot with one ``index_select`` each over a view
  of the cache as rows of ``head_dim`` elements (:mod:`kernels.cache_rows`), straight into
  ``[S, Hkv, keys, D]``; a padded position past a sequence's length reads that sequence's
  last key instead, so no slot past a length (freed blocks are poisoned with NaN) and no
  table entry past a sequence's blocks is read, and the mask hides the duplicates;
* on CPU the attention itself is one fused operation, the flash kernel that
  ``scaled_dot_product_attention`` uses there, which also returns the log-sum-exp;
  elsewhere (CUDA, a softcap) it is matrix products and a log-sum-exp.

A call is planned, then run. The plan (:func:`plan_paged_attention`) holds what the
metadata alone decides: the chunks, each one's row index into the cache, its mask and its
query rows; it serves any cache of the same shape and strides, so a decode step's layers
share one (a pool's layers are such caches). Running it (:func:`attend_planned`) is then
a handful of operations: two gathers, the attention, and for a prefill the rows' moves.
Chunks keep their padded intermediates within a budget of elements, sequences of similar
lengths together. Larger CPU calls keep the reference's loop (each sequence's keys stay in
cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.cache_rows import as_rows, row_index
from kernels.reference import compute_dtype
from kernels.validation import KernelArgumentError

__all__ = [
    "MAX_CPU_ELEMENTS",
    "AttentionPlan",
    "attend_planned",
    "padded_elements",
    "paged_attention_torch",
    "plan_paged_attention",
]

# Elements of a chunk's padded float intermediates (scores, keys, values, queries): 2**26
# float32 elements are 256 MiB. A sequence alone may exceed it (then it is its own chunk).
MAX_CHUNK_ELEMENTS = 1 << 26
# Padded score elements up to which a CPU call takes this path: 2**20 float32 scores are
# 4 MiB, a decode step of 64 sequences x 32 heads x 512 keys.
MAX_CPU_ELEMENTS = 1 << 20


def padded_elements(
    num_q_heads: int, block_size: int, query_start_loc: list[int], seq_lens: list[int]
) -> int:
    """Score elements of the call computed in one chunk: sequences x query heads x the
    most rows x the most keys (rounded up to whole blocks)."""
    num_seqs = len(seq_lens)
    if num_seqs == 0:
        return 0
    rows = max(query_start_loc[s + 1] - query_start_loc[s] for s in range(num_seqs))
    keys = -(-max(seq_lens) // block_size) * block_size
    return num_seqs * num_q_heads * rows * keys


@dataclass(frozen=True, eq=False)
class _Chunk:
    """One chunk of a plan: `num_seqs` sequences padded to `max_rows` rows and `num_keys`
    keys.

    Attributes:
        k_index, v_index: long ``[S * Hkv * keys]``, the padded keys' rows in the key and
            value caches (:func:`kernels.cache_rows.row_index`; the same tensor when both
            caches have the same strides); None where the slots are not rows, and then
            `blocks` and `offsets` (long ``[S, keys]``) address them.
        visible: bool ``[S, 1, R * G or 1, keys]``: which keys each row sees.
        bias: `visible` as an additive mask (0 or -inf) in the compute dtype, on CPU.
        q_index, targets: long ``[S * R]``, each padded row's query row and where its
            result lands (row T, dropped, for padding rows); None for a decode chunk
            (sequence s's one row is row s, no padding).
        every_row_sees: whether every row sees a key (a row before its sequence's first
            key sees none: 0 and -inf).
    """

    num_seqs: int
    max_rows: int
    num_keys: int
    k_index: torch.Tensor | None
    v_index: torch.Tensor | None
    blocks: torch.Tensor
    offsets: torch.Tensor
    visible: torch.Tensor
    bias: torch.Tensor | None
    q_index: torch.Tensor | None
    targets: torch.Tensor | None
    every_row_sees: bool


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """A call's metadata turned into index tensors once, for calls of one query shape and
    caches of one geometry (:func:`plan_paged_attention`); run by :func:`attend_planned`.

    Attributes:
        query: the queries' ``(T, Hq, D)``, dtype and device.
        cache: the key and value caches' shape, strides, dtype and device.
        dtype: the compute dtype.
        chunks: the chunks, disjoint in rows; empty where no row sees a key.
        decode: one chunk holding every sequence, sequence s's one row being row s.
    """

    query: tuple[torch.Size, torch.dtype, torch.device]
    cache: tuple[object, ...]
    dtype: torch.dtype
    chunks: tuple[_Chunk, ...]
    decode: bool


def _cache_geometry(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[object, ...]:
    return (
        key_cache.shape,
        key_cache.stride(),
        value_cache.stride(),
        key_cache.dtype,
        key_cache.device,
    )


def plan_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    max_chunk_elements: int = MAX_CHUNK_ELEMENTS,
) -> AttentionPlan:
    """Plan attention over a paged KV cache (validated arguments, as
    :func:`paged_attention_torch` takes them). Reads the metadata on the host once.

    Args:
        query: ``[T, Hq, D]``: any query of the calls the plan serves (its shape, dtype and
            device; its values are not read).
        key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]``: any caches of the
            geometry the plan serves (one layer of a pool serves for all; their contents
            are not read).
        block_tables, seq_lens, query_start_loc, causal, sliding_window,
            max_chunk_elements: as :func:`paged_attention_torch` takes them.
    """
    _, num_q_heads, head_dim = query.shape
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    n_rows = [starts[s + 1] - starts[s] for s in range(len(lens))]
    chunks = _chunks(n_rows, lens, num_q_heads, key_cache.shape[1], head_dim, max_chunk_elements)
    decode = len(chunks) == 1 and len(chunks[0]) == len(lens) and n_rows == [1] * len(lens)
    cdt = compute_dtype(query.dtype)
    planned = []
    for chunk in chunks:
        seqs = ([starts[s] for s in chunk], [n_rows[s] for s in chunk], [lens[s] for s in chunk])
        masking = (causal, sliding_window, decode)
        tensors = (query, key_cache, value_cache, block_tables, seq_lens)
        planned.append(_plan_chunk(*tensors, cdt, chunk, *seqs, *masking))
    return AttentionPlan(
        (query.shape, query.dtype, query.device),
        _cache_geometry(key_cache, value_cache),
        cdt,
        tuple(planned),
        decode,
    )


def attend_planned(
    plan: AttentionPlan,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a plan (:func:`plan_paged_attention`) on `query` over the caches.

    Args:
        query: ``[T, Hq, D]`` of the plan's shape, dtype and device.
        key_cache, value_cache: caches of the plan's geometry (shape, strides, dtype).
        scale, softcap: as :func:`paged_attention_torch` takes them.

    Returns:
        ``(out [T, Hq, D]`` in the query's dtype, ``lse [T, Hq]`` float32``)``.

    Raises:
        KernelArgumentError: the query or the caches are not of the plan's geometry.
    """
    if (query.shape, query.dtype, query.device) != plan.query:
        raise KernelArgumentError(
            f"the plan serves queries {tuple(plan.query[0])} {plan.query[1]} on "
            f"{plan.query[2]}, got {tuple(query.shape)} {query.dtype} on {query.device}"
        )
    if _cache_geometry(key_cache, value_cache) != plan.cache:
        raise KernelArgumentError("the caches are not of the geometry the plan was made for")
    num_rows, num_q_heads, head_dim = query.shape
    scale = head_dim**-0.5 if scale is None else scale
    cdt = plan.dtype
    if plan.decode:
        (chunk,) = plan.chunks
        o, row_lse = _attend_chunk(chunk, query, key_cache, value_cache, cdt, scale, softcap)
        return o.to(query.dtype), row_lse.to(torch.float32)
    # One row past the end: where the chunks' padding rows land (dropped with it).
    out = torch.zeros(num_rows + 1, num_q_heads, head_dim, dtype=cdt, device=query.device)
    lse = torch.full((num_rows + 1, num_q_heads), -math.inf, dtype=cdt, device=query.device)
    for chunk in plan.chunks:
        o, row_lse = _attend_chunk(chunk, query, key_cache, value_cache, cdt, scale, softcap)
        # Chunks' rows are disjoint: the only duplicates in `targets` are the extra row.
        out.index_copy_(0, chunk.targets, o)
        lse.index_copy_(0, chunk.targets, row_lse)
    return out[:num_rows].to(query.dtype), lse[:num_rows].to(torch.float32)


def paged_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_chunk_elements: int = MAX_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a paged KV cache, batched over sequences (validated arguments): the
    call planned and run at once.

    Args:
        query: ``[T, Hq, D]``; key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]``
            (dim 0 may be strided: one layer of a pool holding every layer).
        block_tables: int ``[S, max_blocks]`` (entries past a sequence's blocks are never
            read); seq_lens: int ``[S]``; query_start_loc: int ``[S + 1]``: as in
            ``reference.paged_attention_ref``.
        scale, causal, sliding_window, softcap: as there.
        max_chunk_elements: the budget of a chunk's padded float intermediates (elements).

    Returns:
        ``(out, lse)``: out ``[T, Hq, D]`` in the query's dtype, lse float32 ``[T, Hq]``;
        a row that sees no key gets 0 and -inf.
    """
    plan = plan_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        causal=causal, sliding_window=sliding_window, max_chunk_elements=max_chunk_elements,
    )  # fmt: skip
    return attend_planned(plan, query, key_cache, value_cache, scale=scale, softcap=softcap)


def _chunks(
    n_rows: list[int],
    lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_chunk_elements: int,
) -> list[list[int]]:
    """The sequences with rows and keys (the others' rows keep 0 and -inf), sorted by
    length and cut into chunks whose padded intermediates fit `max_chunk_elements`."""
    work = sorted(
        (s for s in range(len(lens)) if n_rows[s] > 0 and lens[s] > 0),
        key=lambda s: (lens[s], n_rows[s]),
    )
    per_key = 2 * num_kv_heads * head_dim  # a padded key position's K and V
    chunks: list[list[int]] = []
    rows_max = keys_max = 0
    for s in work:
        r, k = max(rows_max, n_rows[s]), max(keys_max, lens[s])
        elements = (len(chunks[-1]) + 1 if chunks else 1) * (
            num_q_heads * r * (k + head_dim) + per_key * k
        )
        if not chunks or elements > max_chunk_elements:
            chunks.append([])
            r, k = n_rows[s], lens[s]
        chunks[-1].append(s)
        rows_max, keys_max = r, k
    return chunks


def _plan_chunk(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cdt: torch.dtype,
    seqs: list[int],
    firsts: list[int],
    n_rows: list[int],
    lens: list[int],
    causal: bool,
    sliding_window: int | None,
    decode: bool,
) -> _Chunk:
    """The index work of sequences `seqs` (their first rows `firsts`, their rows `n_rows`
    and keys `lens`, each at least 1) padded to the most rows R and keys."""
    device = query.device
    num_q_rows, num_q_heads, _ = query.shape
    num_seqs, max_rows, num_keys = len(seqs), max(n_rows), max(lens)
    group = num_q_heads // key_cache.shape[1]
    k_pos = torch.arange(num_keys, device=device)
    if decode:
        tables, len_col = block_tables, seq_lens.view(-1, 1)
    else:
        index = torch.tensor(seqs, device=device)
        tables, len_col = block_tables.index_select(0, index), seq_lens.index_select(0, index)
        len_col = len_col.view(-1, 1)
    # A position past a sequence's length reads its last key (which the mask hides there):
    # so only its own blocks' table entries and written slots are read, as the others may
    # hold garbage or NaN (freed blocks are poisoned), and a zero probability times NaN
    # is NaN.
    pos = torch.minimum(k_pos, len_col - 1)  # [S, keys]
    block_size = key_cache.shape[2]
    blocks = tables.gather(1, pos // block_size).long()
    offsets = pos % block_size
    k_index = row_index(key_cache, blocks, offsets)
    v_index = k_index
    if value_cache.stride() != key_cache.stride():
        v_index = row_index(value_cache, blocks, offsets)
    q_index = targets = None
    if decode:
        # A row sits at its sequence's last position: causality hides nothing there.
        visible = k_pos < len_col  # [S, keys]
        if sliding_window is not None and sliding_window > 0:
            visible &= k_pos > len_col - 1 - sliding_window
        visible = visible.view(num_seqs, 1, 1, -1)
        every_row_sees = True
    else:
        i = torch.arange(max_rows, device=device)
        n_col = torch.tensor(n_rows, device=device).view(-1, 1)
        rows = torch.tensor(firsts, device=device).view(-1, 1) + i  # [S, R]
        # Padding rows read a real row (their results are dropped) and land on row T.
        targets = torch.where(i < n_col, rows, num_q_rows).view(-1)
        q_index = rows.clamp(max=num_q_rows - 1).view(-1)
        visible = _visible(len_col, n_col, i, k_pos, causal, sliding_window)  # [S, R or 1, keys]
        if visible.shape[1] > 1:  # a mask row per query row
            visible = visible[:, :, None].expand(-1, -1, group, -1)
            visible = visible.reshape(num_seqs, -1, num_keys)
        visible = visible[:, None]
        # A row at a position >= 0 sees its own key; one before (more rows than keys) may not.
        every_row_sees = all(n <= keys for n, keys in zip(n_rows, lens, strict=True))
    bias = None
    if device.type == "cpu":
        bias = torch.where(visible, 0.0, -math.inf).to(cdt)
    return _Chunk(
        num_seqs, max_rows, num_keys, k_index, v_index, blocks, offsets, visible, bias,
        q_index, targets, every_row_sees,
    )  # fmt: skip


def _attend_chunk(
    chunk: _Chunk,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cdt: torch.dtype,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's attention: ``(o [S * R, Hq, D], lse [S * R, Hq])`` in the compute
    dtype, padded row by padded row (see `chunk.targets`)."""
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    num_seqs, max_rows = chunk.num_seqs, chunk.max_rows
    k = _gather(key_cache, chunk, chunk.k_index).to(cdt)
    v = _gather(value_cache, chunk, chunk.v_index).to(cdt)
    if chunk.q_index is None:
        # [S, Hkv, G, D]: the G query heads of a KV head are its rows.
        q = query.to(cdt).view(num_seqs, num_kv_heads, -1, head_dim)
    else:
        q = query.index_select(0, chunk.q_index).to(cdt)
        # [S, Hkv, R * G, D]: a sequence's rows outer, the query heads of a KV head inner.
        q = q.view(num_seqs, max_rows, num_kv_heads, -1, head_dim).transpose(1, 2)
        q = q.reshape(num_seqs, num_kv_heads, -1, head_dim)
    o, lse = _attention(q, k, v, chunk, scale, softcap)
    if chunk.q_index is None:
        return o.reshape(num_seqs, num_q_heads, head_dim), lse.reshape(num_seqs, num_q_heads)
    group = num_q_heads // num_kv_heads
    o = o.view(num_seqs, num_kv_heads, max_rows, group, head_dim).transpose(1, 2)
    lse = lse.view(num_seqs, num_kv_heads, max_rows, group).transpose(1, 2)
    return o.reshape(-1, num_q_heads, head_dim), lse.reshape(-1, num_q_heads)


def _visible(
    len_col: torch.Tensor,
    n_col: torch.Tensor,
    i: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """bool ``[S, R or 1, keys]``: which padded keys `k_pos` each padded row `i` of each
    sequence (`len_col` keys and `n_col` rows, int ``[S, 1]``) sees: its own keys; with
    `causal`, none after its position; with a window, only the last `sliding_window`. Rows
    sit at the ends of their sequences."""
    visible = (k_pos < len_col)[:, None]  # [S, 1, keys]
    windowed = sliding_window is not None and sliding_window > 0
    if causal or windowed:
        q_pos = (len_col - n_col + i)[:, :, None]  # [S, R, 1]
        if causal:
            visible = visible & (k_pos <= q_pos)
        if windowed:
            visible = visible & ((q_pos - k_pos) < sliding_window)
    return visible


def _gather(cache: torch.Tensor, chunk: _Chunk, index: torch.Tensor | None) -> torch.Tensor:
    """The chunk's padded keys of `cache`: ``[S, Hkv, keys, D]`` in the cache's dtype,
    through the row index where there is one (a copy per row)."""
    if index is None:
        return cache.transpose(0, 1)[:, chunk.blocks, chunk.offsets].transpose(0, 1)
    gathered = as_rows(cache).index_select(0, index)
    return gathered.view(chunk.num_seqs, cache.shape[1], chunk.num_keys, cache.shape[3])


def _cpu_flash_attention():
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (the kernel behind
    ``scaled_dot_product_attention`` on CPU, which alone also returns the log-sum-exp), or
    None where this torch build lacks it."""
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):  # pragma: no cover - present since torch 2.3
        return None


# Module-level so that tests can send CPU calls down the matrix-product path (None).
_FLASH_CPU = _cpu_flash_attention()


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: _Chunk,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention, ``(o [B, H, L, D], lse [B, H, L])`` in q's dtype, of q
    ``[B, H, L, D]`` over k and v ``[B, H, keys, D]`` where `chunk.visible` (broadcast to
    ``[B, H, L, keys]``); a row that sees no key gets 0 and -inf."""
    visible = chunk.visible
    capped = softcap is not None and softcap > 0
    if _FLASH_CPU is not None and chunk.bias is not None and not capped:
        # One fused operation where a small call's time is the number of operations.
        o, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=chunk.bias, scale=scale)
        if not chunk.every_row_sees:  # the kernel's answer there is not the convention
            seen = visible.any(-1)
            o, lse = o.masked_fill(~seen[..., None], 0.0), lse.masked_fill(~seen, -math.inf)
        return o, lse
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if capped:
        scores = softcap * torch.tanh(scores / softcap)
    scores.masked_fill_(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    if not chunk.every_row_sees:
        probs.nan_to_num_(0.0)  # exp(-inf - -inf)
    return torch.matmul(probs, v), lse
