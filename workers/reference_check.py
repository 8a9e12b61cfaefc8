"""The online correctness check's recomputation on a pool: its staged inputs and the torch
reference over the pool's blocks (`KVPool.reference_inputs` / `reference_output`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from workers.checks import AttendOptions
from workers.fingerprints import BadSlot

__all__ = ["ReferenceInputs", "reference_attention"]


@dataclass(frozen=True)
class ReferenceInputs:
    """An online check's recomputation, staged (`KVPool.reference_inputs`): the layer,
    query ``[T, Hq, D]``, int32 block tables ``[S, max_blocks]``, seq_lens ``[S]`` and
    query_start_loc ``[S + 1]`` on the pool's device (tensors of its own), the options, and
    the slots whose data no longer matches its fingerprint."""

    layer: int
    query: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    options: AttendOptions
    bad: list[BadSlot]


def reference_attention(
    inputs: ReferenceInputs, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch reference attention of `inputs` over the layer's caches
    ``[num_blocks, Hkv, block_size, D]``, whatever the pool's backend, its errors as they
    are: ``(out [T, Hq, D] pool dtype, lse float32 [T, Hq] or None)``."""
    options = inputs.options
    result = kernels.paged_attention(
        inputs.query.contiguous(),
        key_cache,
        value_cache,
        inputs.block_tables,
        inputs.seq_lens,
        inputs.query_start_loc,
        scale=options.scale,
        causal=options.causal,
        sliding_window=options.sliding_window,
        softcap=options.softcap,
        return_lse=options.return_lse,
        backend="torch",
        check_values=False,
    )
    return result if isinstance(result, tuple) else (result, None)
