"""Exact merge of partial attention results (log-sum-exp weighting), in Triton.

Given P partial outputs of the same query rows over disjoint key sets, each normalised by its
own softmax denominator ``exp(lse_p)``, the full result is

    out = sum_p w_p * out_p / sum_p w_p,   w_p = exp(lse_p - max_p lse_p),
    lse = max_p lse_p + log(sum_p w_p).

Parts with ``lse = -inf`` contribute nothing; rows where every part is -inf get 0 / -inf.
The split-KV path of the paged-attention kernel and cross-worker attention both use it.
One program merges one (token, head) row; parts are read ``PART_CHUNK`` at a time.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels.launch import CachedLauncher

__all__ = ["merge_attention_states_triton", "merge_partitions", "pdl_supported"]

_PART_CHUNK = 16


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


@triton.jit
def _merge_kernel(
    parts_ptr,
    lses_ptr,
    out_ptr,
    lse_out_ptr,
    num_parts,
    num_heads,
    stride_pp,
    stride_pt,
    stride_ph,
    stride_lp,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    stride_lot,
    stride_loh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    PART_CHUNK: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    WAIT_PRIMARY: tl.constexpr,
):
    if WAIT_PRIMARY:
        # Launched programmatically dependent on the kernel that wrote the partials: wait
        # until that grid has finished and its writes are visible.
        gdc_wait()
    row = tl.program_id(0)
    token = (row // num_heads).to(tl.int64)
    head = row % num_heads

    # Pass 1: the max and the denominator from the LSEs alone (a few bytes per part).
    p_all = tl.arange(0, PARTS_PAD)
    lse_row = lses_ptr + token * stride_lt + head * stride_lh
    lse_all = tl.load(lse_row + p_all * stride_lp, mask=p_all < num_parts, other=float("-inf"))
    m = tl.max(lse_all, 0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp(lse_all - m_shift), 0)

    # Pass 2: the weighted sum of the outputs, PART_CHUNK parts at a time.
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    part_row = parts_ptr + token * stride_pt + head * stride_ph
    for start in range(0, num_parts, PART_CHUNK):
        p = start + tl.arange(0, PART_CHUNK)
        p_valid = p < num_parts
        lse_p = tl.load(lse_row + p * stride_lp, mask=p_valid, other=float("-inf"))
        w = tl.exp(lse_p - m_shift)
        # A -inf part may hold anything (even NaN); select instead of multiplying by 0.
        live = p_valid & (lse_p > float("-inf"))
        o_p = tl.load(
            part_row + p[:, None] * stride_pp + dims[None, :],
            mask=live[:, None] & dim_valid[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(tl.where(live[:, None], w[:, None] * o_p, 0.0), 0)

    seen = denom > 0.0
    merged = tl.where(seen, acc / tl.where(seen, denom, 1.0), 0.0)
    out_row = out_ptr + token * stride_ot + head * stride_oh
    tl.store(out_row + dims, merged.to(out_ptr.dtype.element_ty), mask=dim_valid)
    if WRITE_LSE:
        lse = tl.where(seen, m_shift + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
        tl.store(lse_out_ptr + token * stride_lot + head * stride_loh, lse)


def _launch(
    parts: torch.Tensor,
    part_strides: tuple[int, int, int],
    lses: torch.Tensor,
    lse_strides: tuple[int, int, int],
    num_parts: int,
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
    pdl: bool = False,
) -> None:
    num_tokens, num_heads, head_dim = out.shape
    if num_tokens * num_heads == 0:
        return
    lse_target = lse_out if lse_out is not None else lses
    lse_out_strides = (lse_out.stride(0), lse_out.stride(1)) if lse_out is not None else (0, 0)
    options = {"launch_pdl": True} if pdl else {}
    _MERGE_LAUNCHER(
        (num_tokens * num_heads, 1, 1),
        (
            parts,
            lses,
            out,
            lse_target,
            num_parts,
            num_heads,
            *part_strides,
            *lse_strides,
            out.stride(0),
            out.stride(1),
            *lse_out_strides,
        ),
        {
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": max(16, _next_pow2(head_dim)),
            "PARTS_PAD": max(16, _next_pow2(num_parts)),
            "PART_CHUNK": _PART_CHUNK,
            "WRITE_LSE": lse_out is not None,
            "WAIT_PRIMARY": pdl,
        },
        num_warps=4 if head_dim > 64 else 2,
        **options,
    )


_MERGE_LAUNCHER = CachedLauncher(_merge_kernel)


@lru_cache(maxsize=16)
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch (CUDA, sm_90+;
    never under the Triton interpreter)."""
    if device.type != "cuda" or CachedLauncher.interpreted():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _has_pdl(index)


def merge_partitions(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    pdl: bool = False,
) -> None:
    """Merge the split-KV kernel's partials into ``out`` (and ``lse``), in place.

    Args:
        part_out: float32 ``[T, H, P, D]``, each partition normalised by its own denominator.
        part_lse: float32 ``[T, H, P]``, natural-log denominators (-inf: empty partition).
        out: ``[T, H, D]``, any float dtype, last dim contiguous.
        lse: float32 ``[T, H]`` or None.
        pdl: launch programmatically dependent on the kernel that wrote the partials (it
            must be the previous launch on this stream; see :func:`pdl_supported`).
    """
    _launch(
        part_out,
        (part_out.stride(2), part_out.stride(0), part_out.stride(1)),
        part_lse,
        (part_lse.stride(2), part_lse.stride(0), part_lse.stride(1)),
        part_out.shape[2],
        out,
        lse,
        pdl,
    )


def merge_attention_states_triton(
    outputs: torch.Tensor, lses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of :func:`kernels.merge_attention_states` on validated arguments.

    Args:
        outputs: ``[P, T, H, D]`` partial outputs (fp16 / bf16 / fp32).
        lses: float32 ``[P, T, H]``.

    Returns:
        ``(out [T, H, D] in outputs' dtype, lse float32 [T, H])``.
    """
    if outputs.stride(3) != 1:
        outputs = outputs.contiguous()
    num_parts, num_tokens, num_heads, head_dim = outputs.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=outputs.dtype, device=outputs.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=outputs.device)
    _launch(
        outputs,
        (outputs.stride(0), outputs.stride(1), outputs.stride(2)),
        lses,
        (lses.stride(0), lses.stride(1), lses.stride(2)),
        num_parts,
        out,
        lse,
    )
    return out, lse
