"""A paged cache seen as rows of ``head_dim`` elements, for the torch paths.

A cache ``[num_blocks, Hkv, block_size, D]`` whose slots are contiguous rows (the pools'
layout, also when dim 0 strides over a pool's other layers) is one ``[rows, D]`` view of
its memory; many slots then move with one ``index_select`` or ``index_copy_`` over row
numbers, a copy per row: several times faster on CPU than advanced indexing, whose cost
is per element. Row numbers count from the cache's first slot, so one index serves every
layer of a pool (each layer's cache is a view at another offset with the same strides).
"""

from __future__ import annotations

import torch

__all__ = ["as_rows", "row_index"]


def row_index(
    cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor | None:
    """long ``[S * Hkv * K]``: the rows of slots ``(blocks, h, offsets)`` (int ``[S, K]``)
    for every KV head h, sequence-major then head then slot, in :func:`as_rows`; None
    where the cache's slots are not such rows (a slot's elements not contiguous, or not a
    whole number of rows apart)."""
    head_dim = cache.shape[3]
    stride = cache.stride()
    if stride[3] != 1 or stride[2] != head_dim or stride[0] % head_dim or stride[1] % head_dim:
        return None
    slots = torch.add(offsets, blocks, alpha=stride[0] // head_dim)  # int64 [S, K]
    heads = torch.arange(cache.shape[1], device=cache.device).mul_(stride[1] // head_dim)
    return (slots.unsqueeze(1) + heads.unsqueeze(1)).view(-1)


def as_rows(cache: torch.Tensor) -> torch.Tensor:
    """``[rows, D]``: the cache's memory from its first slot to its last (a pool's other
    layers in between) as rows of head_dim elements (valid where :func:`row_index` is)."""
    num_blocks, num_heads, block_size, head_dim = cache.shape
    last = (num_blocks - 1) * cache.stride(0) + (num_heads - 1) * cache.stride(1)
    return cache.as_strided((last // head_dim + block_size, head_dim), (head_dim, 1))
