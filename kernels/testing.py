"""Random paged batches and a float64 dense-attention oracle, for tests and benchmarks.

A :class:`PagedBatch` starts from *logical* per-sequence K/V (what a dense implementation
would hold), then scatters whole blocks of it to random, non-contiguous, out-of-order
physical blocks of a pool whose K and V halves interleave (so dim 0 of each cache has a
stride larger than one block). Block-table entries past each sequence's last block hold -1,
which a kernel must never dereference. :func:`dense_attention` computes the expected result
from the logical K/V in float64, independently of the paged reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

__all__ = ["PagedBatch", "dense_attention", "make_paged_batch", "permute_blocks", "rel_l2"]


@dataclass(frozen=True)
class PagedBatch:
    """Arguments of one ``paged_attention`` call plus the logical K/V they were made from.

    Attributes:
        query: ``[T, Hq, D]``.
        key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]`` views of one pool tensor
            ``[num_blocks, 2, Hkv, block_size, D]``.
        block_tables: int32 ``[S, max_blocks]`` (-1 past each sequence's blocks).
        seq_lens, query_start_loc: int32 ``[S]`` and ``[S + 1]``.
        keys, values: per sequence, the logical ``[seq_len, Hkv, D]`` K/V.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    def args(self) -> tuple[torch.Tensor, ...]:
        """The six positional arguments of ``paged_attention``."""
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
        )


def make_paged_batch(
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    spare_columns: int = 1,
) -> PagedBatch:
    """Build a random batch: sequence s has ``seq_lens[s]`` KV tokens, the last ``q_lens[s]``
    of them new (queries). Values are standard normal (never zeros).

    Args:
        seed: seeds the values (drawn on ``device``) and the block placement (on the CPU).
        spare_blocks: unused pool blocks (holding noise) beyond those the batch needs.
        spare_columns: extra block-table columns (holding -1) beyond the longest sequence.
    """
    if len(seq_lens) != len(q_lens):
        raise ValueError("seq_lens and q_lens must have one entry per sequence")
    if any(q > s for q, s in zip(q_lens, seq_lens, strict=True)):
        raise ValueError("a sequence cannot have more query tokens than KV tokens")
    device = torch.device(device)
    values_gen = torch.Generator(device=device).manual_seed(seed)
    place_gen = torch.Generator().manual_seed(seed + 1)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq, default=0) + spare_columns

    def randn(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=values_gen, device=device, dtype=torch.float32)
        return x.to(dtype)

    pool = randn(num_blocks, 2, num_kv_heads, block_size, head_dim)
    key_cache, value_cache = pool[:, 0], pool[:, 1]
    physical = torch.randperm(num_blocks, generator=place_gen)
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    keys, values = [], []
    cursor = 0
    for s, n in enumerate(seq_lens):
        k = randn(n, num_kv_heads, head_dim)
        v = randn(n, num_kv_heads, head_dim)
        keys.append(k)
        values.append(v)
        nb = blocks_per_seq[s]
        if nb == 0:
            continue
        ids = physical[cursor : cursor + nb]
        cursor += nb
        tables[s, :nb] = ids.to(torch.int32)
        ids_dev = ids.to(device)
        # Pad the logical K/V to whole blocks, then one indexed write per sequence; the tail
        # of a partial last block keeps the pool's noise.
        for logical, cache in ((k, key_cache), (v, value_cache)):
            padded = torch.cat([logical, cache.new_zeros(nb * block_size - n, *logical.shape[1:])])
            blocks = padded.view(nb, block_size, num_kv_heads, head_dim).transpose(1, 2)
            tail = n - (nb - 1) * block_size
            cache[ids_dev[:-1]] = blocks[:-1]
            cache[ids_dev[-1], :, :tail] = blocks[-1, :, :tail]
    query = randn(sum(q_lens), num_q_heads, head_dim)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return PagedBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        keys=tuple(keys),
        values=tuple(values),
    )


def permute_blocks(batch: PagedBatch, perm: torch.Tensor) -> PagedBatch:
    """The same logical batch with physical block b moved to ``perm[b]`` (tables follow).

    Args:
        perm: int64 ``[num_blocks]``, a permutation of the pool's block ids.
    """
    num_blocks = batch.key_cache.shape[0]
    pool = torch.empty(
        (num_blocks, 2, *batch.key_cache.shape[1:]),
        dtype=batch.key_cache.dtype,
        device=batch.key_cache.device,
    )
    dest = perm.to(batch.key_cache.device)
    pool[dest, 0] = batch.key_cache
    pool[dest, 1] = batch.value_cache
    tables = batch.block_tables.clone()
    used = tables >= 0
    tables[used] = perm.to(tables.device)[tables[used].long()].to(tables.dtype)
    return replace(batch, key_cache=pool[:, 0], value_cache=pool[:, 1], block_tables=tables)


def dense_attention(
    batch: PagedBatch,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention over the logical K/V, one sequence at a time.

    Returns:
        ``(out float64 [T, Hq, D], lse float64 [T, Hq])``; rows that see no key get 0, -inf.
    """
    query = batch.query.double()
    num_q, hq, d = query.shape
    hkv = batch.keys[0].shape[1] if batch.keys else 1
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(num_q, hq, d, dtype=torch.float64, device=query.device)
    lse = torch.full((num_q, hq), -math.inf, dtype=torch.float64, device=query.device)
    starts = batch.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q0, q1 = starts[s], starts[s + 1]
        n, seq_len = q1 - q0, k.shape[0]
        if n == 0:
            continue
        kk = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", query[q0:q1], kk) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - n, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = torch.ones(n, seq_len, dtype=torch.bool, device=query.device)
        if causal:
            visible &= k_pos <= q_pos
        if sliding_window is not None:
            visible &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~visible, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", probs, vv)
        lse[q0:q1] = row_lse.transpose(0, 1)
    return out, lse


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64."""
    a, e = actual.double(), expected.double()
    return float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e))
