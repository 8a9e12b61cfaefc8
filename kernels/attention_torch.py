"""The torch backend of paged attention: a call's sequences padded and computed together.

What ``kernels.paged_attention(backend="torch")`` runs on CUDA tensors (the recomputation
of the service's online correctness check on GPU pools) and on CPU tensors when the padded
work is small (:func:`padded_elements` within :data:`MAX_CPU_ELEMENTS`: a decode step, a
short prefill), where a small call's time is the per-operation overhead. Its semantics are
those of ``reference.paged_attention_ref`` (the oracle it is tested against, and the
conventions in that module's docstring), which loops over sequences, a dozen operations
each; this pads sequences to the longest (rows and keys) and computes them together:

* the keys and values are gathered slot by slot with one ``index_select`` each over a view
  of the cache as rows of ``head_dim`` elements (a copy per row, several times faster than
  advanced indexing), straight into ``[S, Hkv, keys, D]``; a padded position past a
  sequence's length reads that sequence's last key instead, so no slot past a length
  (freed blocks are poisoned with NaN) and no table entry past a sequence's blocks is read,
  and the mask hides the duplicates;
* on CPU the attention itself is one fused operation, the flash kernel that
  ``scaled_dot_product_attention`` uses there, which also returns the log-sum-exp;
  elsewhere (CUDA, a softcap) it is matrix products and a log-sum-exp.

A decode step is about twenty operations, most of them on index tensors of a few hundred
elements (each costs microseconds on a small CPU, whatever its size). Chunks keep their
padded intermediates within a budget of elements, sequences of similar lengths together.
Larger CPU calls keep the reference's loop (each sequence's keys stay in cache).
"""

from __future__ import annotations

import math

import torch

from kernels.reference import compute_dtype

__all__ = ["MAX_CPU_ELEMENTS", "padded_elements", "paged_attention_torch"]

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
    """Attention over a paged KV cache, batched over sequences (validated arguments).

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
    num_rows, num_q_heads, head_dim = query.shape
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    n_rows = [starts[s + 1] - starts[s] for s in range(len(lens))]
    chunks = _chunks(n_rows, lens, num_q_heads, key_cache.shape[1], head_dim, max_chunk_elements)
    scale = head_dim**-0.5 if scale is None else scale
    cdt = compute_dtype(query.dtype)
    args = (query, key_cache, value_cache, block_tables, seq_lens, cdt)
    options = (scale, causal, sliding_window, softcap)
    if len(chunks) == 1 and len(chunks[0]) == len(lens) and n_rows == [1] * len(lens):
        # A decode step in one chunk (row s is sequence s's): no padding, no scatter.
        o, row_lse = _attend_decode(*args, max(lens), *options)
        return o.to(query.dtype), row_lse.to(torch.float32)
    # One row past the end: where the chunks' padding rows land (dropped with it).
    out = torch.zeros(num_rows + 1, num_q_heads, head_dim, dtype=cdt, device=query.device)
    lse = torch.full((num_rows + 1, num_q_heads), -math.inf, dtype=cdt, device=query.device)
    for chunk in chunks:
        seqs = ([starts[s] for s in chunk], [n_rows[s] for s in chunk], [lens[s] for s in chunk])
        o, row_lse, targets = _attend_chunk(*args, chunk, *seqs, *options)
        # Chunks' rows are disjoint: the only duplicates in `targets` are the extra row.
        out.index_copy_(0, targets, o)
        lse.index_copy_(0, targets, row_lse)
    return out[:num_rows].to(query.dtype), lse[:num_rows].to(torch.float32)


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


def _attend_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cdt: torch.dtype,
    num_keys: int,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step, sequence s's one row being row s and every sequence having keys
    (`num_keys` the most): ``(o [S, Hq, D], lse [S, Hq])`` in the compute dtype."""
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    len_col = seq_lens.view(-1, 1)
    k_pos = torch.arange(num_keys, device=query.device)
    k, v = _gather_keys(key_cache, value_cache, block_tables, len_col, k_pos, cdt)
    # A row sits at its sequence's last position: causality hides nothing there.
    visible = k_pos < len_col  # [S, keys]
    if sliding_window is not None and sliding_window > 0:
        visible &= k_pos > len_col - 1 - sliding_window
    # [S, Hkv, G, D]: the G query heads of a KV head are its rows.
    q = query.to(cdt).reshape(num_seqs, num_kv_heads, -1, head_dim)
    o, lse = _attention(q, k, v, visible.view(num_seqs, 1, 1, -1), scale, softcap, True)
    return o.reshape(num_seqs, num_q_heads, head_dim), lse.reshape(num_seqs, num_q_heads)


def _attend_chunk(
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
    scale: float,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences `seqs` (their first rows `firsts`, their rows `n_rows` and keys `lens`,
    each at least 1) padded to the most rows R and keys: ``(o [S * R, Hq, D], lse
    [S * R, Hq], targets [S * R])`` in the compute dtype, `targets` each padded row's
    index into `query`, T for padding rows."""
    device = query.device
    num_q_rows, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    num_seqs, max_rows, num_keys = len(seqs), max(n_rows), max(lens)
    index = torch.tensor(seqs, device=device)
    len_col = seq_lens.index_select(0, index).view(-1, 1)
    k_pos = torch.arange(num_keys, device=device)
    tables = block_tables.index_select(0, index)
    k, v = _gather_keys(key_cache, value_cache, tables, len_col, k_pos, cdt)
    i = torch.arange(max_rows, device=device)
    n_col = torch.tensor(n_rows, device=device).view(-1, 1)
    rows = torch.tensor(firsts, device=device).view(-1, 1) + i  # [S, R]
    # Padding rows read a real row (their results are dropped) and land on row T.
    targets = torch.where(i < n_col, rows, num_q_rows).view(-1)
    q = query.index_select(0, rows.clamp(max=num_q_rows - 1).view(-1)).to(cdt)
    # [S, Hkv, R * G, D]: a sequence's rows outer, the query heads of a KV head inner.
    q = q.view(num_seqs, max_rows, num_kv_heads, -1, head_dim).transpose(1, 2)
    q = q.reshape(num_seqs, num_kv_heads, -1, head_dim)
    visible = _visible(len_col, n_col, i, k_pos, causal, sliding_window)  # [S, R or 1, keys]
    group = num_q_heads // num_kv_heads
    if visible.shape[1] > 1:  # a mask row per query row
        visible = visible[:, :, None].expand(-1, -1, group, -1).reshape(num_seqs, -1, num_keys)
    # A row at a position >= 0 sees its own key; one before (more rows than keys) may not.
    every_row_sees = all(n <= keys for n, keys in zip(n_rows, lens, strict=True))
    o, lse = _attention(q, k, v, visible[:, None], scale, softcap, every_row_sees)
    o = o.view(num_seqs, num_kv_heads, max_rows, group, head_dim).transpose(1, 2)
    lse = lse.view(num_seqs, num_kv_heads, max_rows, group).transpose(1, 2)
    return o.reshape(-1, num_q_heads, head_dim), lse.reshape(-1, num_q_heads), targets


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


def _gather_keys(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    len_col: torch.Tensor,
    k_pos: torch.Tensor,
    cdt: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)``, each ``[S, Hkv, keys, D]`` in `cdt`: the keys and values at positions
    `k_pos` (long ``[keys]``) of the sequences whose block tables are `tables` (int
    ``[S, max_blocks]``) and lengths `len_col` (int ``[S, 1]``, each at least 1)."""
    # A position past a sequence's length reads its last key (which the mask hides there):
    # so only its own blocks' table entries and written slots are read, as the others may
    # hold garbage or NaN (freed blocks are poisoned), and a zero probability times NaN
    # is NaN.
    pos = torch.minimum(k_pos, len_col - 1)  # [S, keys]
    block_size = key_cache.shape[2]
    blocks = tables.gather(1, pos // block_size)
    offsets = pos % block_size
    index = _row_index(key_cache, blocks, offsets)
    k = _gather_slots(key_cache, blocks, offsets, index)
    if value_cache.stride() != key_cache.stride():
        index = _row_index(value_cache, blocks, offsets)
    v = _gather_slots(value_cache, blocks, offsets, index)
    return k.to(cdt), v.to(cdt)


def _row_index(
    cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor | None:
    """long ``[S * Hkv * keys]``: slots ``(blocks, h, offsets)`` (int ``[S, keys]``) for
    every KV head h, as rows of :func:`_rows`; None where the cache's slots are not such
    rows (a slot's elements not contiguous, or not a whole number of rows apart)."""
    head_dim = cache.shape[3]
    stride = cache.stride()
    if stride[3] != 1 or stride[2] != head_dim or stride[0] % head_dim or stride[1] % head_dim:
        return None
    slots = torch.add(offsets, blocks, alpha=stride[0] // head_dim)  # int64 [S, keys]
    heads = torch.arange(cache.shape[1], device=cache.device).mul_(stride[1] // head_dim)
    return (slots.unsqueeze(1) + heads.unsqueeze(1)).view(-1)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """``[rows, D]``: the cache's memory from its first slot to its last (a pool's other
    layers in between) as rows of head_dim elements (valid where :func:`_row_index` is)."""
    num_blocks, num_heads, block_size, head_dim = cache.shape
    last = (num_blocks - 1) * cache.stride(0) + (num_heads - 1) * cache.stride(1)
    return cache.as_strided((last // head_dim + block_size, head_dim), (head_dim, 1))


def _gather_slots(
    cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor | None
) -> torch.Tensor:
    """``cache[blocks, h, offsets]`` for every KV head h: ``[S, Hkv, keys, D]`` in the
    cache's dtype, through `index` (see :func:`_row_index`) where there is one: a copy per
    row, several times faster than advanced indexing."""
    if index is None:
        return cache.transpose(0, 1)[:, blocks, offsets].transpose(0, 1)
    num_seqs, num_keys = blocks.shape
    gathered = _rows(cache).index_select(0, index)
    return gathered.view(num_seqs, cache.shape[1], num_keys, cache.shape[3])


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
    visible: torch.Tensor,
    scale: float,
    softcap: float | None,
    every_row_sees_a_key: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention, ``(o [B, H, L, D], lse [B, H, L])`` in q's dtype, of q
    ``[B, H, L, D]`` over k and v ``[B, H, keys, D]`` where `visible` (bool, broadcastable
    to ``[B, H, L, keys]``); a row that sees no key gets 0 and -inf (free to skip that
    step where `every_row_sees_a_key`)."""
    capped = softcap is not None and softcap > 0
    if _FLASH_CPU is not None and q.device.type == "cpu" and not capped:
        # One fused operation where a small call's time is the number of operations.
        bias = torch.where(visible, 0.0, -math.inf).to(q.dtype)
        o, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        if not every_row_sees_a_key:  # the kernel's answer there is not the convention
            seen = visible.any(-1)
            o, lse = o.masked_fill(~seen[..., None], 0.0), lse.masked_fill(~seen, -math.inf)
        return o, lse
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if capped:
        scores = softcap * torch.tanh(scores / softcap)
    scores.masked_fill_(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    if not every_row_sees_a_key:
        probs.nan_to_num_(0.0)  # exp(-inf - -inf)
    return torch.matmul(probs, v), lse
