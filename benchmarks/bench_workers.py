"""Benchmark attention through a PoolWorker Ray actor against the kernel in-process.

One decode step of a batch (default 64 sequences x 4096 cached tokens, Llama-3-8B heads:
32 query, 8 KV, head_dim 128, bf16, block 16, shuffled block tables), one layer, timed as:

* ``kernel``: ``kernels.paged_attention`` on device-resident indices (no checks, no copies);
  CUDA events via ``triton.testing.do_bench`` (median).
* ``pool``: ``KVPool.attend`` in-process with host inputs and a host result - the same work
  the actor does (validation, host->device indices and query, device->host output).
* ``actor``: ``ray.get(worker.attend.remote(...))`` round trip (median wall time).
* ``actor_pipelined``: N calls submitted at once, wall time / N (throughput per call).
* ``actor_noop``: ``ray.get(worker.epoch.remote())`` - the bare actor hop.
* ``actor_step``: ``write_and_attend`` of one new token per sequence (a model layer's step).

The actor's pool gets the in-process pool's blocks through ``import_blocks`` (timed: host ->
actor -> device), so both compute on identical data; their outputs must match bit for bit,
and the first sequences are checked against float64 dense attention.

Usage (repository root):
    GPU:  python3 benchmarks/bench_workers.py --out DIR
    CPU:  python3 benchmarks/bench_workers.py --smoke --out DIR   (tiny shapes, fp32)
Writes DIR/bench_workers.json and DIR/bench_workers.txt; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels
from workers.config import PoolConfig
from workers.layout import KVLayout
from workers.pool import KVPool
from workers.transport import pack


@dataclass(frozen=True)
class Shape:
    """The benchmarked batch."""

    batch: int = 64
    context: int = 4096
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    iters: int = 100
    warmup: int = 10
    import_chunk_blocks: int = 1024


SMOKE = Shape(
    batch=4, context=70, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
    dtype="float32", iters=10, warmup=2, import_chunk_blocks=7,
)  # fmt: skip


def log(msg: str) -> None:
    print(msg, flush=True)


def wall_median(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median wall-clock seconds of ``fn()`` (which must synchronise itself)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dense_check(q, pool: KVPool, tables, seq_len: int, out: torch.Tensor, rows: int) -> float:
    """Worst relative L2 error of ``out`` against float64 dense attention, first ``rows``."""
    worst = 0.0
    k_cache, v_cache = pool.key_cache(0), pool.value_cache(0)
    group = q.shape[1] // k_cache.shape[1]
    for s in range(rows):
        blocks = tables[s, : math.ceil(seq_len / k_cache.shape[2])].long().to(k_cache.device)
        k = k_cache[blocks].permute(0, 2, 1, 3).reshape(-1, k_cache.shape[1], k_cache.shape[3])
        v = v_cache[blocks].permute(0, 2, 1, 3).reshape(-1, v_cache.shape[1], v_cache.shape[3])
        k = k[:seq_len].double().cpu().repeat_interleave(group, 1)
        v = v[:seq_len].double().cpu().repeat_interleave(group, 1)
        qs = q[s].double().cpu()  # [Hq, D], the last position: sees every key
        p = torch.softmax(torch.einsum("hd,khd->hk", qs, k) * q.shape[2] ** -0.5, dim=-1)
        ref = torch.einsum("hk,khd->hd", p, v)
        err = float((out[s].double().cpu() - ref).norm() / ref.norm())
        worst = max(worst, err)
    return worst


def run(shape: Shape, out_dir: Path) -> dict:
    import ray

    from workers.launcher import LaunchConfig, launch_workers, shutdown_workers
    from workers.ray_startup import start_local_ray

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    layout = KVLayout(1, shape.num_kv_heads, shape.head_dim, shape.block_size, shape.dtype)
    dtype = layout.torch_dtype()
    blocks_per_seq = math.ceil(shape.context / shape.block_size)
    # Scratch blocks first: the timed step writes one new token per sequence there.
    scratch = math.ceil(shape.batch / shape.block_size)
    num_blocks = scratch + shape.batch * blocks_per_seq
    kv_bytes = shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * 2
    kv_bytes *= layout.element_size
    result: dict = {
        "shape": asdict(shape),
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ray": ray.__version__,
        },
        "pool_bytes": num_blocks * layout.bytes_per_block,
        "kv_bytes_read_per_call": kv_bytes,
    }

    gen = torch.Generator(device="cpu").manual_seed(0)
    pool = KVPool(layout, num_blocks, device)
    # Random (never zero) KV, drawn on the device: a 1 GiB pool is slow to draw on the host.
    pool.data.normal_(generator=torch.Generator(device=device).manual_seed(1))
    perm = torch.randperm(num_blocks - scratch, generator=gen) + scratch
    tables = perm.reshape(shape.batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32)
    qsl = torch.arange(shape.batch + 1, dtype=torch.int32)
    query = torch.randn(shape.batch, shape.num_q_heads, shape.head_dim, generator=gen).to(dtype)
    new_k = torch.randn(shape.batch, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
    step_slots = torch.arange(shape.batch, dtype=torch.int64)  # distinct scratch slots

    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    start_local_ray(namespace, num_cpus=4)
    prefix = "bench-worker-"
    try:
        config = LaunchConfig(
            PoolConfig(layout, num_blocks=num_blocks),
            num_workers=1,
            namespace=namespace,
            name_prefix=prefix,
            use_gpu=cuda,
        )
        (worker,) = launch_workers(config)
        desc = ray.get(worker.describe.remote())
        epoch = desc.epoch
        result["actor_device"] = desc.device
        log(f"worker {desc.worker_id} on {desc.device}, pool {desc.pool_bytes / 2**30:.2f} GiB")

        # Same blocks in the actor's pool, shipped through the object store.
        t0 = time.perf_counter()
        for lo in range(0, num_blocks, shape.import_chunk_blocks):
            ids = list(range(lo, min(num_blocks, lo + shape.import_chunk_blocks)))
            data = pack(pool.export_blocks(ids), readonly=True)
            ray.get(worker.import_blocks.remote(epoch, ids, data))
        seconds = time.perf_counter() - t0
        result["import_GBps"] = num_blocks * layout.bytes_per_block / seconds / 1e9
        log(f"imported the pool into the actor at {result['import_GBps']:.2f} GB/s")

        # What RayWorkerClient sends: tensors packed as raw-byte numpy arrays (out-of-band
        # through the object store, workers.transport); the actor packs its results too.
        w_query, w_tables, w_seq_lens, w_qsl, w_slots, w_new_k = (
            pack(t, readonly=True) for t in (query, tables, seq_lens, qsl, step_slots, new_k)
        )

        # Correctness: actor == in-process, bit for bit; both close to float64 dense.
        local_out = pool.attend(0, query, tables, seq_lens, qsl).cpu()
        actor_out = ray.get(worker.attend.remote(epoch, 0, w_query, w_tables, w_seq_lens, w_qsl))
        result["actor_equals_in_process"] = bool(torch.equal(local_out, actor_out))
        result["max_rel_err_vs_fp64_dense"] = dense_check(
            query, pool, tables, shape.context, local_out, min(4, shape.batch)
        )
        log(
            f"actor == in-process: {result['actor_equals_in_process']}, "
            f"rel err vs fp64 dense: {result['max_rel_err_vs_fp64_dense']:.2e}"
        )
        if not result["actor_equals_in_process"]:
            raise SystemExit("the actor's output differs from the in-process pool's")

        # Timings.
        dev_args = (
            query.to(device),
            pool.key_cache(0),
            pool.value_cache(0),
            tables.to(device),
            seq_lens.to(device),
            qsl.to(device),
        )

        def kernel_call() -> object:
            return kernels.paged_attention(*dev_args, check_values=False)

        if cuda:
            import triton.testing

            kernel_s = triton.testing.do_bench(kernel_call, return_mode="median") / 1e3
        else:
            kernel_s = wall_median(kernel_call, shape.iters, shape.warmup)

        def pool_call() -> object:
            return pool.attend(0, query, tables, seq_lens, qsl).cpu()

        def actor_call() -> object:
            return ray.get(worker.attend.remote(epoch, 0, w_query, w_tables, w_seq_lens, w_qsl))

        def actor_noop() -> object:
            return ray.get(worker.epoch.remote())

        def actor_step() -> object:
            return ray.get(
                worker.write_and_attend.remote(
                    epoch, 0, w_slots, w_new_k, w_new_k, w_query, w_tables, w_seq_lens, w_qsl
                )
            )

        timings = {
            "kernel": kernel_s,
            "pool": wall_median(pool_call, shape.iters, shape.warmup),
            "actor": wall_median(actor_call, shape.iters, shape.warmup),
            "actor_noop": wall_median(actor_noop, shape.iters, shape.warmup),
            "actor_step": wall_median(actor_step, shape.iters, shape.warmup),
        }
        refs = [
            worker.attend.remote(epoch, 0, w_query, w_tables, w_seq_lens, w_qsl) for _ in range(3)
        ]
        ray.get(refs)
        t0 = time.perf_counter()
        refs = [
            worker.attend.remote(epoch, 0, w_query, w_tables, w_seq_lens, w_qsl)
            for _ in range(shape.iters)
        ]
        ray.get(refs)
        timings["actor_pipelined"] = (time.perf_counter() - t0) / shape.iters
        result["seconds"] = timings
        result["actor_hop_overhead_us"] = {
            "actor_minus_pool": (timings["actor"] - timings["pool"]) * 1e6,
            "actor_minus_kernel": (timings["actor"] - timings["kernel"]) * 1e6,
            "pipelined_minus_kernel": (timings["actor_pipelined"] - timings["kernel"]) * 1e6,
            "noop_round_trip": timings["actor_noop"] * 1e6,
        }
        result["kernel_GBps"] = kv_bytes / kernel_s / 1e9
    finally:
        shutdown_workers(namespace, prefix)
        ray.shutdown()

    lines = [
        f"bench_workers: batch {shape.batch} x {shape.context} tokens, heads "
        f"{shape.num_q_heads}/{shape.num_kv_heads}, D {shape.head_dim}, {shape.dtype}, "
        f"block {shape.block_size}, on {result['device']}",
        f"{'path':<18}{'us/call':>12}{'seq/s':>14}{'x kernel':>10}",
    ]
    for name, seconds in result["seconds"].items():
        lines.append(
            f"{name:<18}{seconds * 1e6:>12.1f}{shape.batch / seconds:>14.0f}"
            f"{seconds / result['seconds']['kernel']:>10.2f}"
        )
    hop = result["actor_hop_overhead_us"]
    lines += [
        f"actor hop overhead: {hop['actor_minus_pool']:.1f} us vs in-process pool, "
        f"{hop['actor_minus_kernel']:.1f} us vs bare kernel, "
        f"{hop['pipelined_minus_kernel']:.1f} us pipelined; no-op round trip "
        f"{hop['noop_round_trip']:.1f} us",
        f"kernel reads {kv_bytes / 1e9:.3f} GB of KV per call: {result['kernel_GBps']:.0f} GB/s; "
        f"pool import through Ray {result['import_GBps']:.2f} GB/s",
        f"actor == in-process bitwise: {result['actor_equals_in_process']}; rel err vs fp64 "
        f"dense {result['max_rel_err_vs_fp64_dense']:.2e}",
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_workers.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "bench_workers.txt").write_text("\n".join(lines) + "\n")
    return {"result": result, "table": lines}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and table")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes (runs on CPU)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--context", type=int)
    parser.add_argument("--iters", type=int)
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else Shape()
    overrides = {k: getattr(args, k) for k in ("batch", "context", "iters") if getattr(args, k)}
    shape = Shape(**{**asdict(shape), **overrides})
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: use --smoke for the CPU run")
    outcome = run(shape, args.out)
    for line in outcome["table"]:
        log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
