"""Paged attention of a whole batch in a fixed, small number of torch operations (CPU).

On CPU tensors a small call's time is the per-operation overhead, not the arithmetic:
``reference.paged_attention_ref`` runs a dozen operations per sequence (1.5 ms for a decode
step of 8 sequences of 80 tokens, 8 query / 4 KV heads of 32, on a 2-core CPU), where this
runs about twenty for the whole batch (0.33 ms there). It pads every sequence of the call
to the longest (rows and keys) and computes them together with batched matrix products,
KV heads outermost so that the block gather is the keys' only copy. The caller bounds the
padded work (:data:`MAX_PACKED_ELEMENTS`, :func:`packed_elements`) and keeps the
reference's loop above it (long prefills, where the padded scores would take much memory).

Semantics are ``reference.paged_attention_ref``'s (the conventions in that module's
docstring), against which the tests check it.
"""

from __future__ import annotations

import math

import torch

from kernels.reference import compute_dtype

__all__ = ["MAX_PACKED_ELEMENTS", "packed_elements", "paged_attention_packed"]

# Padded score elements of one packed call (sequences x query heads x rows x keys): 2**20
# float32 scores are 4 MiB, a decode step of 64 sequences x 32 heads x 512 keys.
MAX_PACKED_ELEMENTS = 1 << 20


def packed_elements(
    num_q_heads: int, block_size: int, query_start_loc: list[int], seq_lens: list[int]
) -> int:
    """Score elements :func:`paged_attention_packed` would compute for these sequences:
    sequences x query heads x the most rows x the most keys (rounded up to whole blocks)."""
    num_seqs = len(seq_lens)
    if num_seqs == 0:
        return 0
    rows = max(query_start_loc[s + 1] - query_start_loc[s] for s in range(num_seqs))
    keys = -(-max(seq_lens) // block_size) * block_size
    return num_seqs * num_q_heads * rows * keys


def paged_attention_packed(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a paged KV cache, every sequence in one padded pass.

    Args:
        query: ``[num_q_tokens, num_q_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_tables: int ``[num_seqs, max_blocks]`` (entries past a sequence's blocks are
            never read for it); seq_lens: int ``[num_seqs]``; query_start_loc: int
            ``[num_seqs + 1]``: validated, as in ``reference.paged_attention_ref``.
        scale, causal, sliding_window, softcap: as there.

    Returns:
        ``(out, lse)``: out ``[num_q_tokens, num_q_heads, head_dim]`` in the query's dtype,
        lse float32 ``[num_q_tokens, num_q_heads]``; a row that sees no key gets 0 and -inf.
    """
    num_rows, num_q_heads, head_dim = query.shape
    num_blocks, num_kv_heads, block_size = key_cache.shape[:3]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    cdt = compute_dtype(query.dtype)
    device = query.device
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_seqs = len(lens)
    n_rows = [starts[s + 1] - starts[s] for s in range(num_seqs)]
    max_rows = max(n_rows, default=0)
    max_keys = max(lens, default=0)
    if max_rows == 0 or max_keys == 0:
        out = torch.zeros(num_rows, num_q_heads, head_dim, dtype=query.dtype, device=device)
        lse = torch.full((num_rows, num_q_heads), -math.inf, dtype=torch.float32, device=device)
        return out, lse
    width = -(-max_keys // block_size)
    keys = width * block_size
    # Entries past a sequence's own blocks may hold anything: clamped to a real block, whose
    # keys the mask hides.
    tables = block_tables[:, :width].long().clamp(0, num_blocks - 1)

    def gathered(cache: torch.Tensor) -> torch.Tensor:
        # Heads first, so the gather is the only copy: [Hkv, S, width, bs, D] is already
        # [Hkv, S, keys, D] in memory.
        blocks = cache.transpose(0, 1)[:, tables]
        return blocks.reshape(num_kv_heads, num_seqs, keys, head_dim).to(cdt)

    k, v = gathered(key_cache), gathered(value_cache)
    len_t = seq_lens.to(device=device, dtype=torch.long)
    k_pos = torch.arange(keys, device=device)
    # Slots past a sequence's length may hold anything, NaN included (freed blocks are
    # poisoned): a zero probability times NaN is NaN, so their values are zeroed.
    v.masked_fill_(~(k_pos[None, :] < len_t[:, None])[None, :, :, None], 0.0)
    # One row per sequence, each with its row (a decode step): the query needs no padding.
    decode = max_rows == 1 and num_rows == num_seqs and all(n == 1 for n in n_rows)
    q, rows = _packed_queries(query.to(cdt), starts, max_rows, num_kv_heads, decode)
    scores = torch.matmul(q, k.transpose(-1, -2))  # [Hkv, S, G * R, keys]
    scores = scores.view(num_kv_heads, num_seqs, group, max_rows, keys)
    scores.mul_(scale)
    if softcap is not None and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    n_t = torch.tensor(n_rows, device=device)
    # A decode row sits at its sequence's last position: causality hides nothing more there.
    visible = _visible(len_t, n_t, keys, max_rows, causal and not decode, sliding_window)
    scores.masked_fill_(~visible[None, :, None], -math.inf)
    row_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, S, G, R]
    probs = torch.exp(scores - row_lse[..., None]).nan_to_num_(0.0)
    o = torch.matmul(probs.view(num_kv_heads, num_seqs, group * max_rows, keys), v)
    o = o.view(num_kv_heads, num_seqs, group, max_rows, head_dim).permute(1, 3, 0, 2, 4)
    o = o.reshape(num_seqs, max_rows, num_q_heads, head_dim)
    row_lse = row_lse.permute(1, 3, 0, 2).reshape(num_seqs, max_rows, num_q_heads)
    if rows is None:
        out = o.reshape(num_rows, num_q_heads, head_dim)
        return out.to(query.dtype), row_lse.reshape(num_rows, num_q_heads).to(torch.float32)
    return _unpad_rows(o, row_lse, rows, n_t, num_rows, query.dtype)


def _packed_queries(
    query: torch.Tensor, starts: list[int], max_rows: int, num_kv_heads: int, decode: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(q [Hkv, S, G * R, D], rows)``: the query padded to `max_rows` rows per sequence,
    KV heads outermost; `rows` ``[S, R]`` is each padded row's index into `query` (None
    for a decode step, whose rows need no padding)."""
    num_rows, num_q_heads, head_dim = query.shape
    num_seqs = len(starts) - 1
    group = num_q_heads // num_kv_heads
    if decode:
        q = query.reshape(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
        return q.reshape(num_kv_heads, num_seqs, group, head_dim), None
    first = torch.tensor(starts[:-1], device=query.device)
    i = torch.arange(max_rows, device=query.device)
    # Padding rows read a real row; their results are dropped.
    rows = (first[:, None] + i[None, :]).clamp(max=num_rows - 1)  # [S, R]
    q = query[rows].reshape(num_seqs, max_rows, num_kv_heads, group, head_dim)
    q = q.permute(2, 0, 3, 1, 4)  # [Hkv, S, G, R, D]
    return q.reshape(num_kv_heads, num_seqs, group * max_rows, head_dim), rows


def _visible(
    len_t: torch.Tensor,
    n_t: torch.Tensor,
    keys: int,
    max_rows: int,
    causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """bool ``[S, R or 1, keys]``: which padded keys each padded row of each sequence sees
    (its own keys; with `causal`, none after its position; with a window, only the last
    `sliding_window`). Rows sit at the ends of their sequences."""
    device = len_t.device
    k_pos = torch.arange(keys, device=device)
    visible = k_pos[None, None, :] < len_t[:, None, None]  # [S, 1, keys]
    windowed = sliding_window is not None and sliding_window > 0
    if causal or windowed:
        r = torch.arange(max_rows, device=device)
        q_pos = ((len_t - n_t)[:, None] + r[None, :])[:, :, None]  # [S, R, 1]
        if causal:
            visible = visible & (k_pos <= q_pos)
        if windowed:
            visible = visible & ((q_pos - k_pos) < sliding_window)
    return visible


def _unpad_rows(
    o: torch.Tensor,
    row_lse: torch.Tensor,
    rows: torch.Tensor,
    n_t: torch.Tensor,
    num_rows: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The real rows of padded ``o`` ``[S, R, Hq, D]`` and ``row_lse`` ``[S, R, Hq]``, at
    their places in the call's ``[num_rows, ...]`` (`rows`: each padded row's index)."""
    max_rows = o.shape[1]
    valid = torch.arange(max_rows, device=o.device)[None, :] < n_t[:, None]  # [S, R]
    out = torch.zeros(num_rows, *o.shape[2:], dtype=o.dtype, device=o.device)
    lse = torch.full((num_rows, o.shape[2]), -math.inf, dtype=o.dtype, device=o.device)
    targets = rows[valid]
    out[targets] = o[valid]
    lse[targets] = row_lse[valid]
    return out.to(dtype), lse.to(torch.float32)
