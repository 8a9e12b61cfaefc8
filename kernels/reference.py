"""Torch references for every kernel in this package.

They define the semantics the Triton kernels (and paged attention's batched torch path,
``attention_torch``) are tested against, and they are the compute path on CPU tensors, so
the whole service runs on machines without a GPU. They favour clarity over speed: a Python
loop over sequences, math in float32 (float64 inputs stay float64).

Conventions shared with the Triton kernels:

* ``key_cache`` / ``value_cache``: ``[num_blocks, num_kv_heads, block_size, head_dim]``,
  any stride on dim 0 (one pool tensor may hold every layer).
* A flat slot is ``block_index * block_size + offset``; a negative slot means "skip".
* Query ``i`` of the ``n`` query rows of a sequence of ``seq_len`` KV tokens sits at position
  ``seq_len - n + i``. With ``causal`` it sees keys ``0..position``; with ``sliding_window=w``
  it sees only keys ``k`` with ``position - k < w``.
* The log-sum-exp (LSE) is the natural log of the softmax denominator of the *scaled*
  (and soft-capped) scores, float32. A query row that sees no key gets output 0, LSE -inf.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "compute_dtype",
    "copy_blocks_ref",
    "fingerprint_rows",
    "gather_blocks_ref",
    "merge_attention_states_ref",
    "paged_attention_ref",
    "record_fingerprints_ref",
    "scatter_blocks_ref",
    "write_kv_ref",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the references compute in for inputs of `dtype`: float32, float64 kept."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def paged_attention_ref(
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
    """Attention over a paged KV cache, one sequence at a time.

    Args:
        query: ``[num_q_tokens, num_q_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_tables: int ``[num_seqs, max_blocks]``; row s maps logical block i of sequence s
            to a physical block of the caches.
        seq_lens: int ``[num_seqs]``, KV tokens of each sequence (new ones included).
        query_start_loc: int ``[num_seqs + 1]``; rows ``query_start_loc[s]:query_start_loc[s+1]``
            of ``query`` belong to sequence s and are its last tokens.
        scale: multiplier of ``q @ k``; default ``head_dim ** -0.5``.
        causal, sliding_window, softcap: see the module docstring.

    Returns:
        ``(out, lse)``: out ``[num_q_tokens, num_q_heads, head_dim]`` in the query's dtype;
        lse float32 ``[num_q_tokens, num_q_heads]``.
    """
    num_q_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    cdt = compute_dtype(query.dtype)

    out = torch.zeros(num_q_tokens, num_q_heads, head_dim, dtype=cdt, device=query.device)
    lse = torch.full((num_q_tokens, num_q_heads), -math.inf, dtype=cdt, device=query.device)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[s], starts[s + 1]
        n = q1 - q0
        if n == 0 or seq_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :num_blocks].long()
        # [nb, Hkv, bs, D] -> [nb*bs, Hkv, D], first seq_len tokens.
        k = key_cache[blocks].to(cdt).permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)
        v = value_cache[blocks].to(cdt).permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)
        k, v = k[:seq_len], v[:seq_len]
        # Query heads that share a KV head are adjacent: head h uses KV head h // group.
        q = query[q0:q1].to(cdt).reshape(n, num_kv_heads, group, head_dim)
        scores = torch.einsum("nhgd,khd->hgnk", q, k) * scale
        if softcap is not None and softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - n, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = torch.ones(n, seq_len, dtype=torch.bool, device=query.device)
        if causal:
            visible &= k_pos <= q_pos
        if sliding_window is not None and sliding_window > 0:
            visible &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~visible, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G, n]
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        o = torch.einsum("hgnk,khd->nhgd", probs, v).reshape(n, num_q_heads, head_dim)
        out[q0:q1] = o
        lse[q0:q1] = row_lse.permute(2, 0, 1).reshape(n, num_q_heads)
    return out.to(query.dtype), lse.to(torch.float32)


def merge_attention_states_ref(
    outputs: torch.Tensor, lses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attention results over disjoint key sets.

    Args:
        outputs: ``[num_parts, num_tokens, num_heads, head_dim]``, each part normalised by
            its own softmax denominator.
        lses: float32 ``[num_parts, num_tokens, num_heads]``, natural-log denominators; -inf
            marks a part that saw no key for that row.

    Returns:
        ``(out, lse)``: ``[num_tokens, num_heads, head_dim]`` in the outputs' dtype and float32
        ``[num_tokens, num_heads]``. Rows where every part is -inf get 0 and -inf.
    """
    cdt = compute_dtype(outputs.dtype)
    lse = lses.to(cdt)
    m = lse.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # [P, T, H]; exp(-inf) = 0
    denom = w.sum(dim=0)
    merged = (w[..., None] * outputs.to(cdt)).sum(dim=0) / denom.clamp_min(1e-30)[..., None]
    merged = torch.where(denom[..., None] > 0, merged, torch.zeros_like(merged))
    merged_lse = torch.where(denom > 0, m_safe + torch.log(denom), torch.full_like(m, -math.inf))
    return merged.to(outputs.dtype), merged_lse.to(torch.float32)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V into their slots, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        slot_mapping: int64 ``[num_tokens]``; token i goes to slot ``slot_mapping[i]``
            (``block * block_size + offset``); negative slots are skipped.
    """
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets, :] = key[keep].to(key_cache.dtype)
    value_cache[blocks, :, offsets, :] = value[keep].to(value_cache.dtype)


def record_fingerprints_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    weights: torch.Tensor,
    sums: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer: int | None,
    block_size: int,
) -> None:
    """Store each token's K and V fingerprints (float64 sums of the row times `weights`)
    in its slot's row of `sums`, in place (shapes as in :func:`kernels.record_fingerprints`).
    """
    slots = slot_mapping.long()
    spare = sums.shape[0] - block_size
    both = torch.stack([fingerprint_rows(key, weights), fingerprint_rows(value, weights)], dim=-1)
    if layer is None:
        num_layers = sums.shape[1]
        pages, offsets = slots.div(block_size, rounding_mode="floor"), slots % block_size
        layers = pages % num_layers
        rows = pages.div(num_layers, rounding_mode="floor") * block_size + offsets
        sums[torch.where(slots >= 0, rows, spare), layers] = both
    else:
        sums[torch.where(slots >= 0, slots, spare), layer] = both


def fingerprint_rows(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[..., Hkv, D]`` -> ``[...]`` float64: each row's sum of x * weights ``[Hkv, D]``
    (what a slot's fingerprint is; workers.fingerprints recomputes it to check one)."""
    return (x.to(torch.float64) * weights).sum((-2, -1))


def copy_blocks_ref(
    key_cache: torch.Tensor, value_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` (copy-on-write), in place.

    Works on any tensor whose dim 0 indexes blocks, e.g. one layer's cache or a whole pool.
    Sources are read before any destination is written. Passing the same tensor twice (a whole
    pool holding K and V) copies it once: a second pass would re-read rows the first one
    overwrote when ids appear on both sides.
    """
    src, dst = src.long(), dst.long()
    for cache in (key_cache,) if value_cache is key_cache else (key_cache, value_cache):
        cache[dst] = cache[src].clone()


def gather_blocks_ref(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the listed blocks out: ``(k, v)``, each ``[len(block_ids), *key_cache.shape[1:]]``."""
    ids = block_ids.long()
    return key_cache[ids].clone(), value_cache[ids].clone()


def scatter_blocks_ref(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
) -> None:
    """Write whole blocks back (the inverse of :func:`gather_blocks_ref`), in place."""
    ids = block_ids.long()
    key_cache[ids] = key_blocks.to(key_cache.dtype)
    value_cache[ids] = value_blocks.to(value_cache.dtype)
