"""The write side of the paged cache in Triton: scatter new tokens' K/V into their slots.

One program moves ``tokens_per_program`` tokens, each ``[Hkv, D]`` for K and for V, as one
3-D tile ``[tokens, heads, head_dim]``: the source rows are read once and each
(token, head) lands as one contiguous ``head_dim`` run inside its block. Slot
``block * block_size + offset``; negative slots are skipped (padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import CachedLauncher

__all__ = ["WriteKVConfig", "write_kv_triton"]


@dataclass(frozen=True)
class WriteKVConfig:
    """Launch parameters: tokens per program (power of two) and warps per program."""

    tokens_per_program: int = 4
    num_warps: int = 4


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


# The token count changes with every batch; it only bounds the mask, so it is not
# specialized on (a compile per (== 1, % 16) class would land while serving).
@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_vcb,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
):
    tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    tok_valid = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=tok_valid, other=-1).to(tl.int64)
    keep = tok_valid & (slot >= 0)
    block = tl.where(keep, slot // BLOCK_SIZE, 0)
    offset = tl.where(keep, slot % BLOCK_SIZE, 0)

    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (
        keep[:, None, None]
        & (heads < NUM_KV_HEADS)[None, :, None]
        & (dims < HEAD_DIM)[None, None, :]
    )
    tok64 = tok.to(tl.int64)
    src_k = tok64[:, None, None] * stride_kt + heads[None, :, None] * stride_kh
    src_v = tok64[:, None, None] * stride_vt + heads[None, :, None] * stride_vh
    in_block = (heads[None, :, None] * BLOCK_SIZE + offset[:, None, None]) * HEAD_DIM
    dst_k = block[:, None, None] * stride_kcb + in_block
    dst_v = block[:, None, None] * stride_vcb + in_block
    k = tl.load(key_ptr + src_k + dims[None, None, :], mask=mask)
    tl.store(key_cache_ptr + dst_k + dims[None, None, :], k, mask=mask)
    v = tl.load(value_ptr + src_v + dims[None, None, :], mask=mask)
    tl.store(value_cache_ptr + dst_v + dims[None, None, :], v, mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    config: WriteKVConfig | None = None,
) -> None:
    """Triton path of :func:`kernels.write_kv` on validated arguments (in place).

    Args:
        key, value: ``[n, Hkv, D]``, the caches' dtype; any token/head strides.
        key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]``, inner dims contiguous.
        slot_mapping: int32/int64 ``[n]``; negative entries are skipped.
        config: launch parameters (default :class:`WriteKVConfig`).
    """
    n = key.shape[0]
    if n == 0:
        return
    config = config or WriteKVConfig()
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    tokens = config.tokens_per_program
    _WRITE_KV_LAUNCHER(
        (triton.cdiv(n, tokens), 1, 1),
        (
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping.contiguous(),
            n,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            key_cache.stride(0),
            value_cache.stride(0),
        ),
        {
            "NUM_KV_HEADS": num_kv_heads,
            "HEADS_PAD": _next_pow2(num_kv_heads),
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": _next_pow2(head_dim),
            "BLOCK_SIZE": block_size,
            "TOKENS": tokens,
        },
        num_warps=config.num_warps,
    )


_WRITE_KV_LAUNCHER = CachedLauncher(_write_kv_kernel)
