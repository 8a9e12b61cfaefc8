"""record_fingerprints (the write's slot fingerprints) against its torch reference: Triton
through the interpreter on CPU, real Triton where there is a GPU."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.reference import record_fingerprints_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HKV, D, BS, LAYERS, BLOCKS = 2, 48, 4, 3, 6


def make(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(n, HKV, D, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(n, HKV, D, generator=gen).to(dtype).to(DEVICE)
    weights = (torch.rand(HKV, D, generator=gen) + 0.5).double().to(DEVICE)
    # Poisoned store (never zeros): every entry a kernel should leave alone keeps its value.
    sums = torch.randn((BLOCKS + 1) * BS, LAYERS, 2, generator=gen).double().to(DEVICE)
    return key, value, weights, sums


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("pages", [False, True])
def test_fingerprints_match_the_reference(dtype: torch.dtype, pages: bool) -> None:
    n = 9
    key, value, weights, sums = make(n, dtype, seed=1)
    limit = BLOCKS * BS * (LAYERS if pages else 1)
    gen = torch.Generator().manual_seed(2)
    slots = torch.randperm(limit, generator=gen)[:n].to(DEVICE)
    slots[[1, 6]] = -1  # padding tokens: the spare block
    layer = None if pages else 2
    expect = sums.clone()
    record_fingerprints_ref(key, value, weights, expect, slots, layer, BS)
    kernels.record_fingerprints(key, value, weights, sums, slots, layer, BS, backend="triton")
    # Real rows exactly where the reference put them (summation order: ~1e-16 relative).
    real = slots >= 0
    rows = slots[real]
    if pages:
        pg = rows // BS
        lyr, rows = pg % LAYERS, (pg // LAYERS) * BS + rows % BS
        got, want = sums[rows, lyr], expect[rows, lyr]
    else:
        got, want = sums[rows, 2], expect[rows, 2]
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    # Everything else untouched, but for the spare block the padding tokens write to.
    mask = torch.ones_like(sums, dtype=torch.bool)
    mask[BLOCKS * BS :] = False
    if pages:
        mask[rows, lyr] = False
    else:
        mask[rows, 2] = False
    assert torch.equal(sums[mask], expect[mask])


def test_an_empty_write_changes_nothing() -> None:
    key, value, weights, sums = make(0, torch.float32, seed=3)
    before = sums.clone()
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    kernels.record_fingerprints(key, value, weights, sums, slots, 0, BS, backend="triton")
    assert torch.equal(sums, before)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("weights dtype", r"weights must have dtype in \(float64\)"),
        ("layer", r"layer must be None or an int in \[0, 3\)"),
        ("slot", r"slot_mapping holds slot 24, past the 24 slots sums covers"),
        ("key shape", r"key shape \(2, 3, 48\) does not match weights \(2, 48\)"),
        ("sums rows", r"rows a multiple of block_size 4"),
    ],
)
def test_bad_arguments_are_refused_and_nothing_is_written(change: str, message: str) -> None:
    key, value, weights, sums = make(2, torch.float32, seed=4)
    slots = torch.tensor([0, 5], device=DEVICE)
    layer: int | None = 0
    if change == "weights dtype":
        weights = weights.float()
    elif change == "layer":
        layer = 3
    elif change == "slot":
        slots = torch.tensor([0, BLOCKS * BS], device=DEVICE)
    elif change == "key shape":
        key = torch.randn(2, 3, D, device=DEVICE)
    else:
        sums = sums[:-1]
    before = sums.clone()
    with pytest.raises(kernels.KernelArgumentError, match=message):
        kernels.record_fingerprints(key, value, weights, sums, slots, layer, BS)
    assert torch.equal(sums, before)
