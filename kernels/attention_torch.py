"""The torch backend of paged attention: a call's sequences padded and computed together.

What ``kernels.paged_attention(backend="torch")`` runs on CUDA tensors (the recomputation
of the service's online correctness check on GPU pools) and on CPU tensors when the padded
work is small (:func:`padded_elements` within :data:`MAX_CPU_ELEMENTS`: a decode step, a
short prefill), where a small call's time is the per-operation overhead. Its semantics are
those of ``reference.paged_attention_ref`` (the oracle it is tested against, and the
conventions in that module's docstring), which loops over sequences, a dozen operations
each; this pads sequences to the longest (rows and keys) and computes them with batched
matrix products, KV heads outermost so that the block gather is the keys' only copy: about
twenty operations per chunk. Chunks keep their padded intermediates within a budget of
elements, sequences of similar lengths together. Larger CPU calls keep the reference's
loop (each sequence's keys stay in cache).
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
            used); seq_lens: int ``[S]``; query_start_loc: int ``[S + 1]``: as in
            ``reference.paged_attention_ref``.
        scale, causal, sliding_window, softcap: as there.
        max_chunk_elements: the budget of a chunk's padded float intermediates (elements).

    Returns:
        ``(out, lse)``: out ``[T, Hq, D]`` in the query's dtype, lse float32 ``[T, Hq]``;
        a row that sees no key gets 0 and -inf.
    """
    num_rows, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    cdt = compute_dtype(query.dtype)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    n_rows = [starts[s + 1] - starts[s] for s in range(len(lens))]
    # Sequences with rows and keys; the others' rows keep 0 and -inf.
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
    args = (query, key_cache, value_cache, block_tables, starts, lens, cdt)
    options = (scale, causal, sliding_window, softcap)
    if len(chunks) == 1 and starts == list(range(len(lens) + 1)) and len(work) == len(lens):
        # A decode step in one chunk (row s is sequence s's): no padding, no scatter.
        o, row_lse, _ = _attend_chunk(*args, list(range(len(lens))), *options, decode=True)
        return o.reshape(num_rows, num_q_heads, head_dim).to(query.dtype), row_lse.reshape(
            num_rows, num_q_heads
        ).to(torch.float32)
    out = torch.zeros(num_rows, num_q_heads, head_dim, dtype=cdt, device=query.device)
    lse = torch.full((num_rows, num_q_heads), -math.inf, dtype=cdt, device=query.device)
    for chunk in chunks:
        o, row_lse, rows = _attend_chunk(*args, chunk, *options, decode=False)
        n_t = torch.tensor([n_rows[s] for s in chunk], device=query.device)
        valid = torch.arange(o.shape[1], device=query.device)[None, :] < n_t[:, None]
        targets = rows[valid]
        out[targets] = o[valid]
        lse[targets] = row_lse[valid]
    return out.to(query.dtype), lse.to(torch.float32)


def _attend_chunk(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: list[int],
    lens: list[int],
    cdt: torch.dtype,
    seqs: list[int],
    scale: float | None,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    *,
    decode: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sequences `seqs` padded to the longest: ``(o [S, R, Hq, D], lse [S, R, Hq], rows
    [S, R])`` in the compute dtype, `rows` each padded row's index into `query` (None for
    `decode`: one row per sequence, sequence s's row s)."""
    device = query.device
    num_q_heads, head_dim = query.shape[1:]
    num_blocks, num_kv_heads, block_size = key_cache.shape[:3]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    num_seqs = len(seqs)
    n_rows = [starts[s + 1] - starts[s] for s in seqs]
    max_rows = max(n_rows)
    width = -(-max(lens[s] for s in seqs) // block_size)
    keys = width * block_size
    index = slice(None) if decode else torch.tensor(seqs, device=device)
    # Entries past a sequence's own blocks may hold anything: clamped to a real block, whose
    # keys the mask hides.
    tables = block_tables[index, :width].long().clamp(0, num_blocks - 1)

    def gathered(cache: torch.Tensor) -> torch.Tensor:
        # Heads first, so the gather is the only copy: [Hkv, S, width, bs, D] is already
        # [Hkv, S, keys, D] in memory.
        blocks = cache.transpose(0, 1)[:, tables]
        return blocks.reshape(num_kv_heads, num_seqs, keys, head_dim).to(cdt)

    k, v = gathered(key_cache), gathered(value_cache)
    len_t = torch.tensor([lens[s] for s in seqs], device=device)
    n_t = torch.tensor(n_rows, device=device)
    k_pos = torch.arange(keys, device=device)
    # Slots past a sequence's length may hold anything, NaN included (freed blocks are
    # poisoned): a zero probability times NaN is NaN, so their values are zeroed.
    v.masked_fill_(~(k_pos[None, :] < len_t[:, None])[None, :, :, None], 0.0)
    if decode:
        rows = None
        q = query.to(cdt).reshape(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
    else:
        first = torch.tensor([starts[s] for s in seqs], device=device)
        i = torch.arange(max_rows, device=device)
        # Padding rows read a real row; their results are dropped.
        rows = (first[:, None] + i[None, :]).clamp(max=query.shape[0] - 1)  # [S, R]
        q = query[rows].to(cdt).reshape(num_seqs, max_rows, num_kv_heads, group, head_dim)
        q = q.permute(2, 0, 3, 1, 4)  # [Hkv, S, G, R, D]
    q = q.reshape(num_kv_heads, num_seqs, group * max_rows, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2))  # [Hkv, S, G * R, keys]
    scores = scores.view(num_kv_heads, num_seqs, group, max_rows, keys).mul_(scale)
    if softcap is not None and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # A decode row sits at its sequence's last position: causality hides nothing more there.
    visible = _visible(len_t, n_t, k_pos, max_rows, causal and not decode, sliding_window)
    scores.masked_fill_(~visible[None, :, None], -math.inf)
    row_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, S, G, R]
    probs = torch.exp(scores - row_lse[..., None]).nan_to_num_(0.0)
    o = torch.matmul(probs.view(num_kv_heads, num_seqs, group * max_rows, keys), v)
    o = o.view(num_kv_heads, num_seqs, group, max_rows, head_dim).permute(1, 3, 0, 2, 4)
    o = o.reshape(num_seqs, max_rows, num_q_heads, head_dim)
    row_lse = row_lse.permute(1, 3, 0, 2).reshape(num_seqs, max_rows, num_q_heads)
    return o, row_lse, rows


def _visible(
    len_t: torch.Tensor,
    n_t: torch.Tensor,
    k_pos: torch.Tensor,
    max_rows: int,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """bool ``[S, R or 1, keys]``: which padded keys each padded row of each sequence sees
    (its own keys; with `causal`, none after its position; with a window, only the last
    `sliding_window`). Rows sit at the ends of their sequences."""
    visible = k_pos[None, None, :] < len_t[:, None, None]  # [S, 1, keys]
    windowed = sliding_window is not None and sliding_window > 0
    if causal or windowed:
        r = torch.arange(max_rows, device=len_t.device)
        q_pos = ((len_t - n_t)[:, None] + r[None, :])[:, :, None]  # [S, R, 1]
        if causal:
            visible = visible & (k_pos <= q_pos)
        if windowed:
            visible = visible & ((q_pos - k_pos) < sliding_window)
    return visible
