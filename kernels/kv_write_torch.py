"""The torch backend of ``write_kv``: new tokens' K/V copied into their slots as rows.

Semantics are those of ``reference.write_kv_ref`` (tested against it): token i's K/V go to
slot ``slot_mapping[i]``; negative slots are skipped. Where the cache's slots are rows
(:mod:`kernels.cache_rows`) the write is one ``index_copy_`` per cache over a row index,
which :func:`write_rows` takes precomputed (:func:`slot_rows`: a planned step writes the
same slots on every layer); elsewhere the reference's advanced indexing.
"""

from __future__ import annotations

import torch

from kernels.cache_rows import as_rows, row_index
from kernels.reference import write_kv_ref

__all__ = ["slot_rows", "write_kv_torch", "write_rows"]


def slot_rows(cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """long ``[n * Hkv]``: the rows (:func:`kernels.cache_rows.as_rows`) of each token's
    slot, token-major then head, for slots ``slot_mapping`` (int ``[n]``, none negative)
    of a cache ``[num_blocks, Hkv, block_size, D]``; None where its slots are not rows."""
    block_size = cache.shape[2]
    slots = slot_mapping.long().view(-1, 1)
    return row_index(cache, slots // block_size, slots % block_size)


def write_rows(
    rows: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> None:
    """Write key and value (``[n, Hkv, D]``, the caches' dtype) into the rows `rows`
    (:func:`slot_rows` of the key cache; the value cache has the same strides)."""
    head_dim = key_cache.shape[3]
    as_rows(key_cache).index_copy_(0, rows, key.reshape(-1, head_dim))
    as_rows(value_cache).index_copy_(0, rows, value.reshape(-1, head_dim))


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``write_kv`` on validated arguments (shapes as there), in torch."""
    if key_cache.stride() != value_cache.stride():
        write_kv_ref(key, value, key_cache, value_cache, slot_mapping)
        return
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # skipped tokens: rare (a guarded write refused), so filtered
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    rows = slot_rows(key_cache, slot_mapping)
    if rows is None:
        write_kv_ref(key, value, key_cache, value_cache, slot_mapping)
        return
    dtype = key_cache.dtype
    write_rows(rows, key.to(dtype), value.to(dtype), key_cache, value_cache)
