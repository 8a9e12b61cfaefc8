"""Merging the partial attention that several workers computed for the same rows.

Each worker attends over its own blocks only and returns its output with its log-sum-exp;
the coordinator merges them exactly, as a split-KV kernel merges its partitions
(FlashDecoding). The merge is data-plane compute, so the coordinator gets it here and
`cache_service` never imports `kernels`.
"""

from __future__ import annotations

import torch

import kernels

__all__ = ["merge_states"]


def merge_states(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attention results over disjoint key sets.

    Args:
        outputs: ``[P, T, H, D]`` fp16 / bf16 / fp32, part p's output for row t.
        lses: float32 ``[P, T, H]``, natural-log softmax denominators; -inf marks a part
            that saw no key for that row.

    Returns:
        ``(out [T, H, D] in outputs' dtype, lse float32 [T, H])``.
    """
    return kernels.merge_attention_states(outputs, lses)
