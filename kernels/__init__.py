"""Paged-attention compute: Triton kernels for CUDA tensors, torch references for CPU tensors.

Public API (shapes, dtypes and units in each function's docstring):
``paged_attention``, ``merge_attention_states``, ``write_kv``, ``copy_blocks``,
``gather_blocks``, ``scatter_blocks``.

NOTE: initial version dispatching to the references only; the Triton dispatch and argument
validation land with the kernels.
"""

from __future__ import annotations

import torch

from kernels.reference import (
    copy_blocks_ref,
    gather_blocks_ref,
    merge_attention_states_ref,
    paged_attention_ref,
    scatter_blocks_ref,
    write_kv_ref,
)

__all__ = [
    "copy_blocks",
    "gather_blocks",
    "merge_attention_states",
    "paged_attention",
    "scatter_blocks",
    "write_kv",
]


def paged_attention(
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
    return_lse: bool = False,
    out: torch.Tensor | None = None,
):
    """See :func:`kernels.reference.paged_attention_ref`. Returns out, or (out, lse)."""
    o, lse = paged_attention_ref(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap,
    )
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if return_lse else o


merge_attention_states = merge_attention_states_ref
write_kv = write_kv_ref
copy_blocks = copy_blocks_ref
gather_blocks = gather_blocks_ref
scatter_blocks = scatter_blocks_ref
