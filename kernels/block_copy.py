"""Whole-block copies in Triton: copy-on-write inside a pool, gather out, scatter back in.

Every operation is "copy block ``src_ids[i]`` of tensor A to block ``dst_ids[i]`` of tensor
B", where dim 0 of A and B indexes blocks. A block's remaining dims must collapse to
``rows x cols`` with contiguous ``cols`` (true of one layer's cache, of a whole pool tensor,
and of the K or V half of a pool, ``pool[:, :, 0]``); one program copies one
``chunk``-element piece of one row of one block. Tensors whose blocks do not collapse so go
through torch indexing instead (same result, on any device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["BlockShape", "block_shape", "copy_block_rows"]

_CHUNK = 2048
_MAX_GRID_YZ = 65535  # CUDA's limit on grid dims 1 and 2


@dataclass(frozen=True)
class BlockShape:
    """One block of a tensor as ``rows`` runs of ``cols`` contiguous elements, ``row_stride``
    elements apart (``rows == 1`` when the whole block is contiguous)."""

    rows: int
    cols: int
    row_stride: int


def block_shape(t: torch.Tensor) -> BlockShape | None:
    """Describe one block of ``t`` (dim 0 = blocks) as rows x contiguous cols, or None."""
    sizes, strides = list(t.shape[1:]), list(t.stride()[1:])
    if not sizes:
        return BlockShape(rows=1, cols=1, row_stride=1)
    # Fold the innermost dims while each steps exactly over the ones inside it.
    cols, i = 1, len(sizes) - 1
    while i >= 0 and (sizes[i] == 1 or strides[i] == cols):
        cols *= sizes[i]
        i -= 1
    if i < 0:
        return BlockShape(rows=1, cols=cols, row_stride=cols)
    # The remaining outer dims must form one evenly strided run of rows.
    rows, row_stride = sizes[i], strides[i]
    i -= 1
    while i >= 0:
        if sizes[i] != 1 and strides[i] != row_stride * rows:
            return None
        rows *= sizes[i]
        i -= 1
    return BlockShape(rows=rows, cols=cols, row_stride=row_stride)


@triton.jit
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    cols,
    stride_src_block,
    stride_src_row,
    stride_dst_block,
    stride_dst_row,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    col = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = col < cols
    x = tl.load(src_ptr + src_block * stride_src_block + row * stride_src_row + col, mask=mask)
    tl.store(dst_ptr + dst_block * stride_dst_block + row * stride_dst_row + col, x, mask=mask)


def copy_block_rows(
    src: torch.Tensor,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every i, in place on ``dst``.

    Args:
        src, dst: tensors of one dtype whose dim 0 indexes blocks and whose other dims match.
        src_ids, dst_ids: int32/int64 ``[n]`` block indices, already range-checked. A block
            written here must not also be read here (callers stage overlapping copies).
    """
    n = src_ids.shape[0]
    if n == 0 or src[0:1].numel() == 0:
        return
    s_shape, d_shape = block_shape(src), block_shape(dst)
    if (
        s_shape is None
        or d_shape is None
        or (s_shape.rows, s_shape.cols) != (d_shape.rows, d_shape.cols)
        or s_shape.rows > _MAX_GRID_YZ
        or triton.cdiv(s_shape.cols, _CHUNK) > _MAX_GRID_YZ
    ):
        dst[dst_ids.long()] = src[src_ids.long()]
        return
    grid = (n, s_shape.rows, triton.cdiv(s_shape.cols, _CHUNK))
    _copy_rows_kernel[grid](
        src,
        dst,
        src_ids.contiguous(),
        dst_ids.contiguous(),
        s_shape.cols,
        src.stride(0),
        s_shape.row_stride,
        dst.stride(0),
        d_shape.row_stride,
        CHUNK=_CHUNK,
        num_warps=4,
    )
