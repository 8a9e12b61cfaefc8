"""Slot fingerprints of a write in Triton: one weighted float64 sum per token, K and V.

The pool keeps, per written slot, layer and K/V, a float64 weighted sum of the row as it was
sent (workers.fingerprints: the online correctness check recomputes it from the pool). In
torch that is about eight small ops per write (casts, products, sums, a stack, an indexed
store), each a launch and ~10 us of host time on the H200's host, on the hot path of every
append; here it is one launch. One program per token: its ``Hkv * D`` K and V values are
read once, multiplied by the weights in float64 and summed; the two sums land in the
token's row of the store (the spare row for negative slots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import CachedLauncher

__all__ = ["record_fingerprints_triton"]


# The layer and the spare row are values, not alignments: specializing on them (layer 1,
# layers 0 and 16) would compile variants per layer while serving.
@triton.jit(do_not_specialize=["layer", "spare_row"])
def _fingerprint_kernel(
    key_ptr,
    value_ptr,
    weights_ptr,
    sums_ptr,
    slot_ptr,
    layer,
    spare_row,
    stride_kt,
    stride_vt,
    stride_row,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_LAYERS: tl.constexpr,
    PAGES: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    elems = tl.arange(0, ROW_PAD)
    valid = elems < ROW
    w = tl.load(weights_ptr + elems, mask=valid, other=0.0)
    k = tl.load(key_ptr + tok * stride_kt + elems, mask=valid, other=0.0).to(tl.float64)
    v = tl.load(value_ptr + tok * stride_vt + elems, mask=valid, other=0.0).to(tl.float64)
    fk = tl.sum(k * w, axis=0)
    fv = tl.sum(v * w, axis=0)
    if PAGES:
        # Slot page * block_size + offset, page block * NUM_LAYERS + layer.
        page = slot // BLOCK_SIZE
        lyr = page % NUM_LAYERS
        row = (page // NUM_LAYERS) * BLOCK_SIZE + slot % BLOCK_SIZE
    else:
        lyr = layer
        row = slot
    row = tl.where(slot >= 0, row, spare_row)
    dst = sums_ptr + row * stride_row + lyr * 2
    tl.store(dst, fk)
    tl.store(dst + 1, fv)


def record_fingerprints_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    weights: torch.Tensor,
    sums: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer: int | None,
    block_size: int,
) -> None:
    """Fingerprint a write into ``sums`` (validated arguments, one device).

    Args:
        key, value: ``[n, Hkv, D]``, any float dtype, each token's ``[Hkv, D]`` contiguous.
        weights: float64 ``[Hkv, D]``, contiguous.
        sums: float64 ``[rows, L, 2]``, contiguous; its last ``block_size`` rows are the
            spare block that negative slots write to.
        slot_mapping: int32/int64 ``[n]``: flat slots ``block * block_size + offset``, or with
            ``layer`` None pages' slots (``page * block_size + offset``, page
            ``block * L + layer``); negative: skipped (written to the spare row).
        layer: the layer of every token, or None for slots of pages.
        block_size: tokens per block.
    """
    n = key.shape[0]
    if n == 0:
        return
    row = weights.numel()
    num_layers = sums.shape[1]
    _FINGERPRINT_LAUNCHER(
        (n, 1, 1),
        (
            key,
            value,
            weights,
            sums,
            slot_mapping.contiguous(),
            0 if layer is None else layer,
            sums.shape[0] - block_size,
            key.stride(0),
            value.stride(0),
            sums.stride(0),
        ),
        {
            "ROW": row,
            "ROW_PAD": triton.next_power_of_2(row),
            "BLOCK_SIZE": block_size,
            "NUM_LAYERS": num_layers,
            "PAGES": layer is None,
        },
        num_warps=4,
    )


_FINGERPRINT_LAUNCHER = CachedLauncher(_fingerprint_kernel)
