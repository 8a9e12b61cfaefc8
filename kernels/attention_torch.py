"""The torch backend of paged attention: the sequences of a chunk in one batched pass.

What ``kernels.paged_attention(backend="torch")`` runs on CUDA tensors: the recomputation
of the service's online correctness check on GPU pools. Its semantics are those of
``reference.paged_attention_ref`` (the oracle it is tested against, and the conventions in
that module's docstring), which loops over sequences, a dozen small launches each; this
pads a chunk's sequences to the longest and computes them together, a few launches per
chunk (a decode round of 32 sequences: one chunk or two). On CPU tensors the loop stays
the faster (each sequence's keys stay in cache) and remains the path. Chunks keep their
padded intermediates within a budget of elements, sequences of similar lengths together.
"""

from __future__ import annotations

import math

import torch

from kernels.reference import compute_dtype

__all__ = ["paged_attention_torch"]

# Elements of a chunk's padded float intermediates (scores, keys, values, queries): 2**26
# float32 elements are 256 MiB. A sequence alone may exceed it (then it is its own chunk).
MAX_CHUNK_ELEMENTS = 1 << 26


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
        query: ``[T, Hq, D]``; key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]``.
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
    out = torch.zeros(num_rows, num_q_heads, head_dim, dtype=cdt, device=query.device)
    lse = torch.full((num_rows, num_q_heads), -math.inf, dtype=cdt, device=query.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    # Sequences with rows and keys; the others' rows keep 0 and -inf.
    work = sorted(
        (s for s in range(len(lens)) if starts[s + 1] > starts[s] and lens[s] > 0),
        key=lambda s: (lens[s], starts[s + 1] - starts[s]),
    )

    def run(seqs: list[int]) -> None:
        _attend_chunk(query, key_cache, value_cache, block_tables, seqs, starts, lens,
                      out, lse, scale, causal, sliding_window, softcap)  # fmt: skip

    per_key = 2 * num_kv_heads * head_dim  # a padded key position's K and V
    chunk: list[int] = []
    rows_max = keys_max = 0
    for s in work:
        n, length = starts[s + 1] - starts[s], lens[s]
        r, k = max(rows_max, n), max(keys_max, length)
        elements = (len(chunk) + 1) * (num_q_heads * r * (k + head_dim) + per_key * k)
        if chunk and elements > max_chunk_elements:
            run(chunk)
            chunk, r, k = [], n, length
        chunk.append(s)
        rows_max, keys_max = r, k
    if chunk:
        run(chunk)
    return out.to(query.dtype), lse.to(torch.float32)


def _attend_chunk(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqs: list[int],
    starts: list[int],
    lens: list[int],
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float | None,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """The sequences `seqs` padded to the longest (rows and keys), their rows of `out` and
    `lse` (compute dtype) written."""
    device = query.device
    num_rows, num_q_heads, head_dim = query.shape
    num_blocks, num_kv_heads, block_size = key_cache.shape[:3]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    cdt = out.dtype
    c = len(seqs)
    n_rows = [starts[s + 1] - starts[s] for s in seqs]
    max_rows, max_keys = max(n_rows), max(lens[s] for s in seqs)
    width = -(-max_keys // block_size)

    index = torch.tensor(seqs, device=device)
    n_t = torch.tensor(n_rows, device=device)
    len_t = torch.tensor([lens[s] for s in seqs], device=device)
    first = torch.tensor([starts[s] for s in seqs], device=device)
    # Table entries past a sequence's own blocks may hold anything: clamped to a real
    # block, whose keys the mask hides.
    tables = block_tables[index, :width].long().clamp(0, num_blocks - 1)

    def gathered(cache: torch.Tensor) -> torch.Tensor:
        # [c, width, Hkv, bs, D] -> [c, keys, Hkv, D]
        blocks = cache[tables].permute(0, 1, 3, 2, 4).reshape(c, width * block_size, -1, head_dim)
        return blocks[:, :max_keys].to(cdt)

    k, v = gathered(key_cache), gathered(value_cache)
    i = torch.arange(max_rows, device=device)
    valid = i[None, :] < n_t[:, None]  # [c, rows]
    rows = (first[:, None] + i[None, :]).clamp(max=num_rows - 1)  # padding reads a real row
    q = query[rows].to(cdt).reshape(c, max_rows, num_kv_heads, group, head_dim)
    scores = torch.einsum("cnhgd,ckhd->chgnk", q, k) * scale
    if softcap is not None and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = (len_t - n_t)[:, None] + i[None, :]  # [c, rows]
    k_pos = torch.arange(max_keys, device=device)[None, None, :]
    visible = k_pos < len_t[:, None, None]  # [c, 1, keys]
    if causal:
        visible = visible & (k_pos <= q_pos[:, :, None])
    if sliding_window is not None and sliding_window > 0:
        visible = visible & ((q_pos[:, :, None] - k_pos) < sliding_window)
    scores = scores.masked_fill(~visible[:, None, None], -math.inf)
    row_lse = torch.logsumexp(scores, dim=-1)  # [c, Hkv, G, rows]
    probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("chgnk,ckhd->cnhgd", probs, v).reshape(c, max_rows, num_q_heads, head_dim)
    targets = rows[valid]
    out[targets] = o[valid]
    lse[targets] = row_lse.permute(0, 3, 1, 2).reshape(c, max_rows, num_q_heads)[valid]
