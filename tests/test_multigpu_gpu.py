"""Several GPUs of one host: one PoolWorker per GPU from the real launcher, a sequence whose
prefix lives on GPU 0 and suffix on GPU 1 attended through partials + merge (and after
copying the prefix over), bit-exact GPU-to-GPU block transfers, and
benchmarks/bench_multigpu.py at a small size on every GPU.

Marked ``gpu``; every test needs at least 2 CUDA devices and is skipped, saying so, with
fewer. Run on the multi-GPU machine (Ray carried, see ../shared/device/README.md):
    source .device/env.sh && python3 -m pytest tests/test_multigpu_gpu.py -q
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from workers_support import dense_attention, rel_err

from cache_service.control.types import Segment, SequenceView
from cache_service.engine.attention_plan import plan_attention, run_attention
from cache_service.engine.worker_clients import transfer_blocks

NUM_GPUS = torch.cuda.device_count()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        NUM_GPUS < 2, reason=f"needs >= 2 CUDA devices, this machine has {NUM_GPUS}"
    ),
]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_multigpu.py"
BF16_BOUND = 1e-2


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_multigpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_multigpu"] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()
# Llama-3-8B attention heads, two layers, a few hundred blocks per GPU.
CFG = bench.BenchConfig(
    batch=4, context=512, num_layers=2, prefix_tokens=256, transfer_blocks=(1, 16, 64),
    seconds=0.1, prefix_iters=4, transfer_reps=2,
)  # fmt: skip


def test_benchmark_runs_on_every_gpu_at_a_small_size(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--batch", "8", "--context", "512",
         "--layers", "2", "--prefix-tokens", "256", "--seconds", "0.2",
         "--transfer-blocks", "1,16"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((out / "bench_multigpu.json").read_text())
    assert result["correct"] is True
    env = result["environment"]
    assert len(env["workers"]) == NUM_GPUS and env["distinct_gpus"] is True
    counts = {(p["path"], p["workers"]) for p in result["scaling"]["points"]}
    assert counts == {(path, n) for path in bench.PATHS for n in range(1, NUM_GPUS + 1)}
    for row in result["transfers"]["rows"]:
        assert row["cross_device_GBps"] > 0 and row["bit_exact_sampled"] is True


@pytest.fixture(scope="module")
def gpu_workers():
    import ray

    from workers.launcher import shutdown_workers
    from workers.ray_startup import start_local_ray

    namespace = f"test-multigpu-gpu-{uuid.uuid4().hex[:8]}"
    prefix = "mg-test-"
    start_local_ray(namespace, num_cpus=4)
    try:
        yield bench.start_workers(CFG, namespace, prefix, NUM_GPUS)
    finally:
        shutdown_workers(namespace, prefix)
        ray.shutdown()


def test_one_worker_per_gpu_each_on_its_own_device(gpu_workers):
    info = gpu_workers.info
    assert len(info) == NUM_GPUS
    assert all(i["device"].startswith("cuda") for i in info)
    assert len({i["device_uuid"] for i in info}) == NUM_GPUS
    assert len({tuple(i["ray_gpu_ids"]) for i in info}) == NUM_GPUS


def test_prefix_on_gpu0_and_suffix_on_gpu1_match_dense_merged_and_after_copying(gpu_workers):
    (w0, w1), (e0, e1) = gpu_workers.clients[:2], gpu_workers.epochs[:2]
    clients = {w0.worker_id: w0, w1.worker_id: w1}
    epochs = {w0.worker_id: e0, w1.worker_id: e1}
    layer, bs = 1, CFG.block_size
    gen = torch.Generator().manual_seed(3)
    rng = random.Random(3)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    # A 240-token shared prefix (15 blocks) on GPU 0; three suffixes of different lengths on
    # GPU 1, with 5 new queries each (a chunk, causal), written through the workers.
    prefix_len, suffix_lens, n_q = 240, (1, 77, 300), 5
    pk, pv = randn(prefix_len, 8, 128), randn(prefix_len, 8, 128)
    free0 = rng.sample(range(CFG.pool_blocks), CFG.pool_blocks)
    free1 = rng.sample(range(CFG.pool_blocks), CFG.pool_blocks)
    prefix_blocks = tuple(free0[: prefix_len // bs])

    async def scenario():
        slots = [prefix_blocks[i // bs] * bs + i % bs for i in range(prefix_len)]
        await w0.write(e0, layer, slots, pk, pv)
        views, refs, queries = [], [], []
        for suffix_len in suffix_lens:
            sk, sv = randn(suffix_len, 8, 128), randn(suffix_len, 8, 128)
            blocks = tuple(free1.pop() for _ in range(-(-suffix_len // bs)))
            slots = [blocks[i // bs] * bs + i % bs for i in range(suffix_len)]
            await w1.write(e1, layer, slots, sk, sv)
            seq_len = prefix_len + suffix_len
            views.append(
                SequenceView(
                    seq_len,
                    (Segment(w0.worker_id, 0, prefix_blocks), Segment(w1.worker_id, prefix_len, blocks)),
                )
            )  # fmt: skip
            q = randn(min(n_q, seq_len), 32, 128)
            queries.append(q)
            refs.append(dense_attention(q, torch.cat([pk, sk]), torch.cat([pv, sv]))[0])
        query, ref = torch.cat(queries), torch.cat(refs)
        plan = plan_attention(views, [q.shape[0] for q in queries], bs)
        assert plan.needs_merge
        merged = await run_attention(plan, query, layer, clients, epochs)
        # Copy the prefix next to the suffixes, then attend on GPU 1 alone.
        copies = tuple(free1.pop() for _ in prefix_blocks)
        await transfer_blocks(w0, e0, prefix_blocks, w1, e1, copies)
        local_views = [
            SequenceView(v.seq_len, (Segment(w1.worker_id, 0, copies + v.segments[1].block_indices),))
            for v in views
        ]  # fmt: skip
        local_plan = plan_attention(local_views, [q.shape[0] for q in queries], bs)
        assert not local_plan.needs_merge
        local = await run_attention(local_plan, query, layer, clients, epochs)
        return merged.out, local.out, ref

    merged, local, ref = asyncio.run(scenario())
    assert not torch.isnan(merged).any() and not torch.isnan(local).any()
    assert rel_err(merged, ref) < BF16_BOUND
    assert rel_err(local, ref) < BF16_BOUND
    assert rel_err(merged, local) < BF16_BOUND


def test_blocks_move_between_gpus_bit_exact(gpu_workers):
    (w0, w1), (e0, e1) = gpu_workers.clients[:2], gpu_workers.epochs[:2]
    src, dst = [5, 0, 77, 31], [9, 140, 2, 3]

    async def scenario():
        await transfer_blocks(w0, e0, src, w1, e1, dst)
        return await w0.export_blocks(e0, src), await w1.export_blocks(e1, dst)

    a, b = asyncio.run(scenario())
    assert a.abs().sum() > 0  # random K/V, not an all-zero pool
    assert torch.equal(a, b)


def test_benchmark_sections_on_the_launched_workers(gpu_workers):
    transfers = asyncio.run(bench.measure_transfers(CFG, gpu_workers))
    assert transfers["correct"] is True
    assert transfers["peer_access_0_1"] in (True, False)
    assert all(r["cross_device_GBps"] > 0 for r in transfers["rows"])
    sharing = asyncio.run(bench.measure_prefix_sharing(CFG, gpu_workers, kernel_rounds=2))
    assert sharing["correct"] is True
    assert sharing["rel_err"]["merged_vs_dense"] < BF16_BOUND
