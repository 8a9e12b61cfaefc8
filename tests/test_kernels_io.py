"""write_kv, copy_blocks, gather/scatter_blocks and merge_attention_states against their
torch references (Triton through the interpreter on CPU; the ``gpu`` tests on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels.block_copy import BlockShape, block_shape
from kernels.kv_write_torch import write_kv_torch
from kernels.reference import merge_attention_states_ref, write_kv_ref

# Real Triton where there is a GPU, the interpreter on CPU tensors otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape: int, dtype=torch.float32, device=DEVICE, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


def cache_pair(num_blocks=12, hkv=3, bs=8, d=32, dtype=torch.float32, device=DEVICE, seed=0):
    # K and V halves of one pool: dim 0 strides are twice a block (the worker pool's layout).
    pool = randn(num_blocks, 2, hkv, bs, d, dtype=dtype, device=device, seed=seed)
    return pool[:, 0], pool[:, 1]


# ------------------------------------------------------------------------------ write_kv


@pytest.fixture(params=["triton", "torch"])
def write_backend(request: pytest.FixtureRequest) -> str:
    """Each backend of write_kv: the Triton kernel and the torch rows path."""
    return request.param


@pytest.mark.parametrize(("hkv", "d", "bs"), [(3, 32, 8), (1, 80, 16), (4, 64, 32)])
def test_write_kv_matches_reference(hkv: int, d: int, bs: int, write_backend: str) -> None:
    kc, vc = cache_pair(num_blocks=10, hkv=hkv, bs=bs, d=d)
    n = 23
    slots = torch.randperm(10 * bs, generator=torch.Generator().manual_seed(1))[:n].to(DEVICE)
    slots[[2, 9, 15]] = -1  # padding tokens
    key, value = randn(n, hkv, d, seed=2), randn(n, hkv, d, seed=3)
    expect_k, expect_v = kc.clone(), vc.clone()
    write_kv_ref(key, value, expect_k, expect_v, slots)
    kernels.write_kv(key, value, kc, vc, slots, backend=write_backend)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)


def test_write_kv_strided_inputs_and_int32_slots(write_backend: str) -> None:
    kc, vc = cache_pair(hkv=2, d=32)
    qkv = randn(7, 4 + 2 + 2, 32, seed=5)  # a fused projection's output
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, 4, 5, 50, 51, 90, -1], dtype=torch.int32, device=DEVICE)
    expect_k, expect_v = kc.clone(), vc.clone()
    write_kv_ref(key, value, expect_k, expect_v, slots.long())
    kernels.write_kv(key, value, kc, vc, slots, backend=write_backend)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)


def test_write_kv_empty_is_a_no_op(write_backend: str) -> None:
    kc, vc = cache_pair()
    before = kc.clone()
    empty = torch.empty(0, 3, 32, device=DEVICE)
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    kernels.write_kv(empty, empty, kc, vc, slots, backend=write_backend)
    assert torch.equal(kc, before)


def test_write_kv_torch_on_caches_whose_slots_are_not_rows() -> None:
    # Blocks 70 elements apart, not a whole number of 8-element rows: the torch path
    # indexes the slots instead.
    kc, vc = (torch.zeros(400).as_strided((5, 2, 4, 8), (70, 32, 8, 1)) for _ in range(2))
    assert kernels.slot_rows(kc, torch.tensor([3])) is None
    slots = torch.tensor([5, 17, -1, 14])
    key, value = randn(4, 2, 8, seed=8, device="cpu"), randn(4, 2, 8, seed=9, device="cpu")
    expect_k, expect_v = kc.clone(), vc.clone()
    write_kv_ref(key, value, expect_k, expect_v, slots)
    write_kv_torch(key, value, kc, vc, slots)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)


def test_slot_rows_serve_every_layer_of_a_pool() -> None:
    # One row index from any layer's cache writes the same slots of every layer.
    pool = torch.zeros(6, 3, 2, 2, 4, 8)  # [blocks, layers, K/V, heads, bs, D]
    slots = torch.tensor([1, 9, 22])
    rows = kernels.slot_rows(pool[:, 0, 0], slots)
    for layer in range(3):
        key, value = randn(3, 2, 8, seed=layer), randn(3, 2, 8, seed=10 + layer)
        want = pool.clone()
        write_kv_ref(key, value, want[:, layer, 0], want[:, layer, 1], slots)
        kernels.write_rows(rows, key, value, pool[:, layer, 0], pool[:, layer, 1])
        assert torch.equal(pool, want)


# ---------------------------------------------------------------------- block copies


def test_block_shape_collapses_layer_and_pool_views() -> None:
    pool = torch.zeros(5, 4, 2, 3, 8, 16)  # [blocks, layers, K/V, heads, bs, D]
    assert block_shape(pool) == BlockShape(rows=1, cols=4 * 2 * 3 * 8 * 16, row_stride=4 * 2 * 384)
    assert block_shape(pool[:, :, 0]) == BlockShape(rows=4, cols=384, row_stride=2 * 384)
    assert block_shape(pool[:, 1, 0]) == BlockShape(rows=1, cols=384, row_stride=384)
    assert block_shape(pool[..., :8]) == BlockShape(rows=4 * 2 * 3 * 8, cols=8, row_stride=16)
    assert block_shape(pool.transpose(4, 5)) is None  # no contiguous innermost run


@pytest.mark.parametrize("overlap", [False, True])
def test_copy_blocks_matches_reference(overlap: bool) -> None:
    kc, vc = cache_pair(num_blocks=12)
    if overlap:  # a chain: 2->5 and 5->7 must copy 5's old content
        src, dst = torch.tensor([2, 5, 9]), torch.tensor([5, 7, 2])
    else:
        src, dst = torch.tensor([1, 3, 3]), torch.tensor([4, 8, 10])
    src, dst = src.to(DEVICE), dst.to(DEVICE)
    ek, ev = kc.clone(), vc.clone()
    kernels.copy_blocks(ek, ev, src, dst, backend="torch")
    kernels.copy_blocks(kc, vc, src, dst, backend="triton")
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


def test_copy_blocks_on_whole_pool_halves() -> None:
    pool = randn(6, 3, 2, 2, 8, 16, seed=9)  # [blocks, layers, K/V, heads, bs, D]
    expect = pool.clone()
    expect[[4, 5]] = pool[[0, 2]]
    kernels.copy_blocks(
        pool[:, :, 0], pool[:, :, 1], torch.tensor([0, 2]), torch.tensor([4, 5]), backend="triton"
    )
    assert torch.equal(pool, expect)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_copy_blocks_with_one_pool_tensor_for_k_and_v(backend: str) -> None:
    pool = randn(10, 2, 2, 2, 8, 16, seed=11)  # one tensor passed as both caches
    src, dst = torch.tensor([2, 5, 9]), torch.tensor([5, 7, 2])  # a chain: copy old 5 to 7
    expect = pool.clone()
    expect[dst] = pool[src]
    kernels.copy_blocks(pool, pool, src, dst, backend=backend)
    assert torch.equal(pool, expect)


def test_gather_scatter_round_trip() -> None:
    kc, vc = cache_pair(num_blocks=9, dtype=torch.float16)
    ids = torch.tensor([7, 0, 3], dtype=torch.int32, device=DEVICE)
    k, v = kernels.gather_blocks(kc, vc, ids, backend="triton")
    rk, rv = kernels.gather_blocks(kc, vc, ids, backend="torch")
    assert k.is_contiguous() and torch.equal(k, rk) and torch.equal(v, rv)
    dst_k, dst_v = cache_pair(num_blocks=9, dtype=torch.float16, seed=4)
    untouched = [i for i in range(9) if i not in (1, 2, 8)]
    before = dst_k[untouched].clone()
    dst_ids = torch.tensor([1, 8, 2], device=DEVICE)
    kernels.scatter_blocks(dst_k, dst_v, dst_ids, k, v, backend="triton")
    assert torch.equal(dst_k[[1, 8, 2]], k) and torch.equal(dst_v[[1, 8, 2]], v)
    assert torch.equal(dst_k[untouched], before)


# --------------------------------------------------------------------------- merging


def test_merge_matches_reference_with_empty_parts() -> None:
    p, t, h, d = 5, 4, 3, 80
    outs = randn(p, t, h, d, seed=1)
    lses = randn(p, t, h, seed=2) * 3
    lses[1, 0, :] = -math.inf  # one empty part
    outs[1, 0, :] = float("nan")  # whatever an empty part holds must not leak
    lses[:, 2, 1] = -math.inf  # a row no part saw
    out, lse = kernels.merge_attention_states(outs, lses, backend="triton")
    clean = outs.nan_to_num(0.0)
    rout, rlse = merge_attention_states_ref(clean, lses)
    torch.testing.assert_close(out, rout, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, rlse, rtol=1e-6, atol=1e-6)
    assert torch.all(out[2, 1] == 0) and lse[2, 1] == -math.inf
    assert torch.isfinite(out).all()


def test_merge_many_parts_fp16() -> None:
    p, t, h, d = 37, 3, 2, 64  # more parts than one chunk of the kernel
    outs = randn(p, t, h, d, dtype=torch.float16, seed=3)
    lses = randn(p, t, h, seed=4)
    out, lse = kernels.merge_attention_states(outs, lses, backend="triton")
    rout, rlse = merge_attention_states_ref(outs, lses)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), rout.float(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_gpu_write_copy_gather_scatter(dtype: torch.dtype) -> None:
    kc, vc = cache_pair(num_blocks=4096, hkv=8, bs=16, d=128, dtype=dtype, device="cuda")
    n = 20000
    slots = torch.randperm(4096 * 16, device="cuda")[:n]
    slots[::97] = -1
    key = randn(n, 8, 128, dtype=dtype, device="cuda", seed=1)
    value = randn(n, 8, 128, dtype=dtype, device="cuda", seed=2)
    ek, ev = kc.clone(), vc.clone()
    write_kv_ref(key, value, ek, ev, slots)
    kernels.write_kv(key, value, kc, vc, slots)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)

    src = torch.randperm(4096, device="cuda")[:300]
    dst = torch.randperm(4096, device="cuda")[:300]  # overlaps src: staged path
    kernels.copy_blocks(ek, ev, src, dst, backend="torch")
    kernels.copy_blocks(kc, vc, src, dst)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)

    k, v = kernels.gather_blocks(kc, vc, src)
    assert torch.equal(k, kc[src.long()]) and torch.equal(v, vc[src.long()])
    kernels.scatter_blocks(kc, vc, dst, v, k)  # swapped on purpose: a visible change
    assert torch.equal(kc[dst.long()], v) and torch.equal(vc[dst.long()], k)


@pytest.mark.gpu
def test_gpu_merge_matches_reference() -> None:
    outs = randn(64, 33, 32, 128, device="cuda", seed=5)
    lses = randn(64, 33, 32, device="cuda", seed=6)
    lses[3:9] = -math.inf
    out, lse = kernels.merge_attention_states(outs, lses)
    rout, rlse = merge_attention_states_ref(outs, lses)
    torch.testing.assert_close(out, rout, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, rlse, rtol=1e-6, atol=1e-5)
