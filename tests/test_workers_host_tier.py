"""The worker's host tier (workers/host_tier.py) through KVPool and PoolWorker: offload and
restore copy whole blocks exactly, in runs, with clear errors for bad ids; on CUDA (marked
gpu) the tier is pinned and attention after a restore reads the restored blocks."""

from __future__ import annotations

import pytest
import round_calls
import torch
from workers_support import dense_attention

from workers.actor import PoolWorker
from workers.config import PoolConfig
from workers.errors import InvalidWorkerRequest, PoolAllocationError
from workers.host_tier import copy_runs
from workers.layout import KVLayout
from workers.pool import KVPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def filled_pool(device: str, blocks: int = 6, host: int = 5) -> KVPool:
    pool = KVPool(LAYOUT, blocks, device, host_blocks=host, cuda_graphs=False)
    gen = torch.Generator().manual_seed(1)
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen).to(pool.data.device))
    return pool


def test_copy_runs_join_consecutive_pairs_only() -> None:
    assert copy_runs([3, 1, 2], [7, 5, 6]) == [(1, 5, 3)]
    assert copy_runs([0, 1, 2], [4, 9, 5]) == [(0, 4, 1), (1, 9, 1), (2, 5, 1)]
    assert copy_runs([], []) == []


def test_offload_then_restore_gives_back_the_blocks_exactly() -> None:
    pool = filled_pool("cpu")
    before = pool.data.clone()
    assert pool.offload_blocks([4, 0, 1], [2, 3, 4]) == 3 * LAYOUT.bytes_per_block
    pool.data.zero_()
    assert pool.restore_blocks([3, 4, 2], [5, 2, 3]) == 3 * LAYOUT.bytes_per_block
    assert torch.equal(pool.data[5], before[0])
    assert torch.equal(pool.data[2], before[1])
    assert torch.equal(pool.data[3], before[4])
    assert not pool.data[0].any()  # nothing else written


@pytest.mark.parametrize(
    ("call", "args", "message"),
    [
        ("offload_blocks", ([0, 1], [0]), "2 source ids but 1"),
        ("offload_blocks", ([6], [0]), r"block_ids\[0\] = 6"),
        ("offload_blocks", ([0, 1], [2, 2]), "more than once"),
        ("restore_blocks", ([5], [0]), r"host_ids\[0\] = 5"),
        ("restore_blocks", ([0, 1], [3, 3]), "more than once"),
        ("restore_blocks", ([0.5], [0]), "list of ints"),
    ],
)
def test_bad_ids_are_refused_and_change_nothing(call, args, message) -> None:
    pool = filled_pool("cpu")
    before = pool.data.clone()
    with pytest.raises(InvalidWorkerRequest, match=message):
        getattr(pool, call)(*args)
    assert torch.equal(pool.data, before)


def test_a_pool_without_a_tier_refuses_moves_and_a_negative_size_is_refused() -> None:
    pool = KVPool(LAYOUT, 4, "cpu")
    assert pool.host_blocks == 0
    with pytest.raises(InvalidWorkerRequest, match="no host tier"):
        pool.offload_blocks([0], [0])
    with pytest.raises(PoolAllocationError, match="host_blocks"):
        PoolConfig(LAYOUT, num_blocks=4, host_blocks=-1)


def test_the_worker_reports_its_tier_and_fences_moves_by_epoch() -> None:
    worker = PoolWorker("w0", PoolConfig(LAYOUT, num_blocks=4, host_blocks=3), device="cpu")
    assert worker.describe().host_blocks == 3
    epoch = worker.epoch()
    assert worker.offload_blocks(epoch, [0], [1]) == LAYOUT.bytes_per_block
    assert worker.restore_blocks(epoch, [1], [2]) == LAYOUT.bytes_per_block
    with pytest.raises(Exception, match="epoch"):
        worker.restore_blocks("stale", [1], [2])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_the_tier_is_pinned_on_cuda_and_attention_reads_restored_blocks(device: str) -> None:
    pool = filled_pool(device, blocks=8, host=8)
    assert pool._host_tier is not None
    assert pool._host_tier.data.is_pinned() == (device == "cuda")
    before = pool.data.clone()
    pool.offload_blocks([0, 1, 2], [0, 1, 2])
    pool.release_blocks([0, 1, 2])
    pool.data[:3].fill_(float("nan"))
    pool.restore_blocks([0, 1, 2], [5, 6, 7])  # then attention on the pool's stream
    q = torch.randn(1, 4, LAYOUT.head_dim, device=device)
    tables = torch.tensor([[5, 6, 7]], dtype=torch.int32, device=device)
    lens = torch.tensor([12], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=device)
    out = round_calls.attend(pool, 0, q, tables, lens, starts, to_host=True)[0]
    assert torch.equal(pool.data[5:8].cpu(), before[:3].cpu())
    # Dense attention over the blocks as they were before the offload.
    k = before[:3, 0, 0].cpu().permute(0, 2, 1, 3).reshape(-1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    v = before[:3, 0, 1].cpu().permute(0, 2, 1, 3).reshape(-1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    ref, _ = dense_attention(q.cpu(), k, v)
    assert torch.allclose(out.double().cpu(), ref, atol=1e-4)
