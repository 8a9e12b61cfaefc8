"""Multi-GPU scaling on one host: one PoolWorker per GPU, started by the real launcher.

Three measurements in one run (issue 10), each explicit about what it times:

1. **Aggregate attend throughput.** Every worker holds the same decode batch (default 64
   sequences x 4096 tokens, Llama-3-8B attention: 32 query / 8 KV heads, head_dim 128, bf16,
   block 16, 32 layers, shuffled block tables) over random K/V in its own pool. With
   1, 2, ..., N workers busy at once, four paths are timed:

   * ``kernel``: inside each actor, ``kernels.paged_attention`` on the pool's per-layer
     views with device-resident indices, one launch per layer; CUDA events around the loop.
   * ``worker``: inside each actor, ``PoolWorker.attend`` per layer (epoch fence, checks,
     host query/tables in, host output back); host clock. The actor hop left out.
   * ``step_e2e``: from the driver, one actor call per decode step that runs
     ``PoolWorker.attend`` for every layer and returns all layers' outputs; wall clock.
   * ``layer_e2e``: from the driver, one ``RayWorkerClient.attend`` per layer, each awaited
     before the next (as ``run_attention`` serves a model's sequential layers); wall clock.

   Bandwidth = bytes of K/V the kernels must read (batch x context x KV heads x head_dim x
   2 (K, V) x element size, per layer) / time. Per worker: its bytes / its own time.
   Aggregate: all bytes / the span from the first worker's start to the last one's end
   (in-actor paths start together at an agreed wall-clock instant). Scaling efficiency =
   aggregate(N) / (N x aggregate(1)).

2. **Cross-GPU prefix sharing.** Sequences whose shared prefix blocks live on worker 0 and
   whose own suffix blocks live on worker 1, attended through ``cache_service.engine.attention_plan``
   (per-worker partials + LSE merge), checked against float64 dense attention; timed per
   layer against first copying the prefix to worker 1 (``transfer_blocks``, once) and
   attending there alone. Reports the copy, the extra cost of the merge per layer and per
   decode step, and the decode steps after which copying pays.

3. **Block transfer bandwidth** worker 0 -> worker 1 through the worker path
   (``transfer_blocks``: export -> Ray object store -> import; bit-exactness sampled) for
   several sizes, against ``torch`` copies measured in this driver process of the same byte
   counts: cuda:0 -> cuda:1 (the device-to-device ceiling) and cuda:0 -> cuda:0.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are forced for this process and the workers); no NCCL is used.

Usage (repository root):
    GPU:  source .device/env.sh && python3 benchmarks/bench_multigpu.py --out DIR
    CPU:  python3 benchmarks/bench_multigpu.py --smoke --out DIR   (3 CPU workers, tiny fp32)
Writes DIR/bench_multigpu.json and DIR/bench_multigpu.md; prints the tables last. Exits 1
when a correctness check failed (the results are written first).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# Before anything can start NCCL or Ray: a program using NVLink multicast can take a shared
# host's GPUs out of service, so these stay off whatever the caller's environment says.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(MULTICAST_OFF)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402
from cache_service.control.types import Segment, SequenceView  # noqa: E402
from cache_service.engine.attention_plan import (  # noqa: E402
    AttentionPlan,
    merge_partials,
    plan_attention,
    run_attention,
)
from cache_service.engine.worker_clients import RayWorkerClient, transfer_blocks  # noqa: E402
from kernels.testing import PagedBatch, dense_attention  # noqa: E402
from workers.checks import AttendOptions  # noqa: E402
from workers.layout import KVLayout  # noqa: E402
from workers.round import Round  # noqa: E402

PATHS = ("kernel", "worker", "step_e2e", "layer_e2e")
PATH_MEANING = {
    "kernel": "in actor: paged_attention on device-resident indices, CUDA events (CPU: host clock)",
    "worker": "in actor: PoolWorker.attend per layer (checks, host in/out), host clock",
    "step_e2e": "driver: one actor call per step running every layer, wall clock",
    "layer_e2e": "driver: one RayWorkerClient.attend per layer, awaited in turn, wall clock",
}
# Tolerances of the relative L2 error against float64 dense attention (kernel tests' bounds).
TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}
SCALING_TARGET = 0.90


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures.

    Attributes:
        batch, context: decode batch per worker (sequences x KV tokens each).
        num_q_heads, num_kv_heads, head_dim, block_size, num_layers, dtype: the model's
            attention layout (Llama-3-8B by default).
        prefix_tokens: shared prefix on worker 0 in the prefix-sharing case (whole blocks,
            less than ``context``); the suffix on worker 1 fills the rest of the context.
        transfer_blocks: transfer sizes in blocks (one block = every layer's K and V).
        seconds: target length of each timed throughput run.
        prefix_iters: timed per-layer calls of each prefix-sharing variant.
        transfer_reps: timed repetitions of each transfer size.
        check_seqs: sequences checked against float64 dense attention per worker.
        max_workers: use at most this many workers (GPUs; CPU workers in smoke mode).
        smoke: CPU workers and tiny shapes (exercises every path; figures mean nothing).
        num_cpu_workers: workers of a smoke run (before ``max_workers``).

    Raises:
        ValueError: an inconsistent field (named in the message).
    """

    batch: int = 64
    context: int = 4096
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    num_layers: int = 32
    dtype: str = "bfloat16"
    prefix_tokens: int = 2048
    transfer_blocks: tuple[int, ...] = (1, 8, 64, 512)
    seconds: float = 1.0
    prefix_iters: int = 64
    transfer_reps: int = 5
    check_seqs: int = 2
    max_workers: int | None = None
    smoke: bool = False
    num_cpu_workers: int = 3

    def __post_init__(self) -> None:
        for name in ("batch", "context", "num_q_heads", "num_kv_heads", "head_dim"):
            _positive(name, getattr(self, name))
        for name in ("block_size", "num_layers", "prefix_iters", "transfer_reps"):
            _positive(name, getattr(self, name))
        _positive("check_seqs", self.check_seqs)
        _positive("num_cpu_workers", self.num_cpu_workers)
        if self.max_workers is not None:
            _positive("max_workers (--num-gpus)", self.max_workers)
        KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.prefix_tokens % self.block_size or not 0 < self.prefix_tokens < self.context:
            raise ValueError(
                f"prefix_tokens must be a positive multiple of block_size ({self.block_size}) "
                f"below context ({self.context}), got {self.prefix_tokens}"
            )
        if not self.transfer_blocks or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.transfer_blocks
        ):
            raise ValueError(
                f"transfer_blocks must be positive block counts, got {self.transfer_blocks!r}"
            )
        if not (isinstance(self.seconds, int | float) and math.isfinite(self.seconds)) or not (
            self.seconds > 0
        ):
            raise ValueError(f"seconds must be a positive number, got {self.seconds!r}")

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype
        )

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.context // self.block_size)

    @property
    def batch_blocks(self) -> int:
        """Blocks of the decode batch; the prefix region follows them in every pool."""
        return self.batch * self.blocks_per_seq

    @property
    def prefix_blocks(self) -> int:
        return self.prefix_tokens // self.block_size

    @property
    def pool_blocks(self) -> int:
        """Blocks per worker: the batch, then the prefix region (transfers reuse the pool)."""
        return max(self.batch_blocks + self.prefix_blocks, max(self.transfer_blocks))

    @property
    def kv_bytes_per_layer(self) -> int:
        """K/V bytes one layer's attention over the batch must read."""
        elem = self.layout.element_size
        return self.batch * self.context * self.num_kv_heads * self.head_dim * 2 * elem


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


SMOKE = BenchConfig(
    batch=4, context=72, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
    num_layers=2, dtype="float32", prefix_tokens=32, transfer_blocks=(1, 4), seconds=0.05,
    prefix_iters=4, transfer_reps=2, check_seqs=2, smoke=True,
)  # fmt: skip


def log(msg: str) -> None:
    print(msg, flush=True)


# -- pure arithmetic of the figures -------------------------------------------------------


@dataclass(frozen=True)
class WorkerTiming:
    """One worker's share of a concurrent run.

    Attributes:
        seconds: its own elapsed time (CUDA events for ``kernel``, else a host clock).
        start, end: wall-clock (``time.time()``) bounds of its timed region, seconds; for
            driver-timed paths, the driver's clock.
        bytes: K/V bytes its kernels read.
    """

    seconds: float
    start: float
    end: float
    bytes: int


@dataclass(frozen=True)
class ScalingPoint:
    """A path's figures with ``workers`` busy at once; bandwidths in GB/s (1e9 bytes/s)."""

    path: str
    workers: int
    rounds: int
    per_worker_GBps: tuple[float, ...]
    aggregate_GBps: float
    span_s: float
    start_skew_ms: float
    efficiency: float | None = None


def scaling_point(path: str, rounds: int, timings: Sequence[WorkerTiming]) -> ScalingPoint:
    """Per-worker and aggregate bandwidth of one concurrent run (efficiency left unset).

    Raises:
        ValueError: no timing, or a non-positive time.
    """
    if not timings:
        raise ValueError("scaling_point needs at least one worker's timing")
    if any(t.seconds <= 0 for t in timings):
        raise ValueError(f"non-positive worker time in {timings!r}")
    start = min(t.start for t in timings)
    span = max(t.end for t in timings) - start
    if span <= 0:
        raise ValueError(f"the run's wall-clock span is {span!r} s")
    return ScalingPoint(
        path=path,
        workers=len(timings),
        rounds=rounds,
        per_worker_GBps=tuple(t.bytes / t.seconds / 1e9 for t in timings),
        aggregate_GBps=sum(t.bytes for t in timings) / span / 1e9,
        span_s=span,
        start_skew_ms=(max(t.start for t in timings) - start) * 1e3,
    )


def with_efficiency(points: Sequence[ScalingPoint]) -> list[ScalingPoint]:
    """The points with ``efficiency = aggregate(N) / (N x aggregate(1))`` of their path."""
    single = {p.path: p.aggregate_GBps for p in points if p.workers == 1}
    out = []
    for p in points:
        base = single.get(p.path)
        eff = p.aggregate_GBps / (p.workers * base) if base else None
        out.append(replace(p, efficiency=eff))
    return out


def rounds_for(seconds_per_round: float, target_s: float) -> int:
    """Rounds that fill about ``target_s`` (at least 2)."""
    if seconds_per_round <= 0:
        return 2
    return max(2, math.ceil(target_s / seconds_per_round))


# -- code run inside the worker actors (handle.__ray_call__(fn, ...)) -----------------------


@dataclass(frozen=True)
class AttendArgs:
    """One attention batch on the host: query ``[T, Hq, D]`` (pool dtype), block_tables int32
    ``[S, max_blocks]``, seq_lens int32 ``[S]``, query_start_loc int32 ``[S + 1]``."""

    query: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.query, self.block_tables, self.seq_lens, self.query_start_loc

    def round(self, epoch: str, layer: int) -> Round:
        """An attend-only round of these tensors on `layer`."""
        return Round(epoch, layer, *self.tensors())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sleep_until(instant: float) -> None:
    delay = instant - time.time()
    if delay > 0:
        time.sleep(delay)


def actor_info(worker: Any) -> dict:
    """Which device the worker's pool is on (run in the actor)."""
    import ray

    pool = worker.pool
    info = {
        "worker_id": worker.describe().worker_id,
        "device": str(pool.device),
        "pid": os.getpid(),
        "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if pool.device.type == "cuda":
        props = torch.cuda.get_device_properties(pool.device)
        info["device_name"] = props.name
        info["device_uuid"] = str(getattr(props, "uuid", ""))
    return info


def actor_fill(worker: Any, seed: int) -> None:
    """Fill the whole pool with standard-normal K/V (never zeros: they hide bad indexing)."""
    pool = worker.pool
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    pool.data.normal_(generator=gen)
    _sync(pool.device)


def actor_gather(worker: Any, layer: int, block_ids: Sequence[int], num_tokens: int) -> tuple:
    """The logical K and V ``[num_tokens, Hkv, D]`` (host) that ``block_ids`` hold in
    ``layer``, first token first."""
    pool = worker.pool
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
    out = []
    for cache in (pool.key_cache(layer), pool.value_cache(layer)):
        blocks = cache.index_select(0, ids)  # [n, Hkv, bs, D]
        tokens = blocks.transpose(1, 2).reshape(-1, blocks.shape[1], blocks.shape[3])
        out.append(tokens[:num_tokens].cpu())
    return tuple(out)


def actor_kernel_loop(
    worker: Any, args: AttendArgs, rounds: int, start_at: float, return_lse: bool = False
) -> dict:
    """Time ``rounds`` x every layer of the paged-attention kernel on the worker's pool.

    One warm-up round first (compilation, caches), then the timed loop starts at wall-clock
    ``start_at``. Returns ``seconds`` (CUDA events on a GPU, else the host clock), the wall
    ``start``/``end``, and ``out`` (host) of the last layer's last call.
    """
    pool = worker.pool
    dev = pool.device
    q, tables, lens, qsl = (
        t.to(dev) for t in (args.query, args.block_tables, args.seq_lens, args.query_start_loc)
    )
    out = torch.empty_like(q)
    layers = range(pool.layout.num_layers)
    views = [(pool.key_cache(layer), pool.value_cache(layer)) for layer in layers]

    def one_round() -> None:
        for k_cache, v_cache in views:
            kernels.paged_attention(
                q, k_cache, v_cache, tables, lens, qsl,
                out=out, return_lse=return_lse, check_values=False,
            )  # fmt: skip

    one_round()
    _sync(dev)
    _sleep_until(start_at)
    start = time.time()
    if dev.type == "cuda":
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
        for _ in range(rounds):
            one_round()
        last.record()
        last.synchronize()
        seconds = first.elapsed_time(last) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(rounds):
            one_round()
        seconds = time.perf_counter() - t0
    end = time.time()
    return {"seconds": seconds, "start": start, "end": end, "out": out.cpu()}


def actor_worker_loop(
    worker: Any, epoch: str, args: AttendArgs, rounds: int, start_at: float
) -> dict:
    """Time ``rounds`` x every layer of ``PoolWorker.run_round`` (attend only) inside the actor (no hop):
    host inputs, validation, one launch, host output. Host clock."""
    layers = range(worker.pool.layout.num_layers)
    for layer in layers:  # warm-up round
        out = worker.run_round(epoch, args.round(epoch, layer))
    _sleep_until(start_at)
    start = time.time()
    t0 = time.perf_counter()
    for _ in range(rounds):
        for layer in layers:
            out = worker.run_round(epoch, args.round(epoch, layer))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "start": start, "end": time.time(), "out": out}


def actor_step(worker: Any, epoch: str, args: AttendArgs) -> list[torch.Tensor]:
    """One decode step's attention: ``PoolWorker.run_round`` on every layer, the outputs of all
    layers returned (host) as a model executor would receive them."""
    return [
        worker.run_round(epoch, args.round(epoch, layer))
        for layer in range(worker.pool.layout.num_layers)
    ]


# -- the driver's side ----------------------------------------------------------------------


@dataclass
class Workers:
    """The launched workers, in launcher order (worker i on GPU i of the placement group)."""

    handles: list[Any]
    clients: list[RayWorkerClient]
    epochs: list[str]
    info: list[dict]

    def __len__(self) -> int:
        return len(self.handles)


def call(handle: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Submit ``fn(worker, *args)`` to run inside the actor; returns its ObjectRef."""
    return handle.__ray_call__.remote(fn, *args)


def decode_batch(cfg: BenchConfig, seed: int) -> AttendArgs:
    """The decode batch: one query per sequence at its last position; block tables a random
    permutation of the pool's first ``cfg.batch_blocks`` blocks."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(cfg.batch_blocks, generator=gen)
    tables = perm.reshape(cfg.batch, cfg.blocks_per_seq).to(torch.int32)
    query = torch.randn(cfg.batch, cfg.num_q_heads, cfg.head_dim, generator=gen)
    return AttendArgs(
        query=query.to(cfg.layout.torch_dtype()),
        block_tables=tables,
        seq_lens=torch.full((cfg.batch,), cfg.context, dtype=torch.int32),
        query_start_loc=torch.arange(cfg.batch + 1, dtype=torch.int32),
    )


def dense_decode(
    query: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Float64 dense attention of one query per sequence (at its last position, so it sees
    every key) over each sequence's logical K/V ``[L_s, Hkv, D]``: ``[S, Hq, D]`` float64."""
    empty = torch.empty(0)
    batch = PagedBatch(
        query=query,
        key_cache=empty,
        value_cache=empty,
        block_tables=empty,
        seq_lens=torch.tensor([k.shape[0] for k in keys], dtype=torch.int32),
        query_start_loc=torch.arange(len(keys) + 1, dtype=torch.int32),
        keys=tuple(keys),
        values=tuple(values),
    )
    return dense_attention(batch)[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64; NaN anywhere gives NaN (which no bound accepts)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def within(err: float, tol: float) -> bool:
    return math.isfinite(err) and err < tol


def run_concurrent(
    cfg: BenchConfig,
    workers: Workers,
    count: int,
    path: str,
    args: AttendArgs,
    rounds: int,
    lead_s: float,
) -> tuple[list[WorkerTiming], list[torch.Tensor]]:
    """Run ``path`` (one of :data:`PATHS`) for ``rounds`` decode steps of every layer on the
    first ``count`` workers at once.

    Returns:
        Each worker's timing and its last layer's output ``[batch, Hq, D]`` (host).
    """
    import ray

    nbytes = rounds * cfg.num_layers * cfg.kv_bytes_per_layer
    handles = workers.handles[:count]
    if path in ("kernel", "worker"):
        start_at = time.time() + lead_s
        if path == "kernel":
            refs = [call(h, actor_kernel_loop, args, rounds, start_at) for h in handles]
        else:
            refs = [
                call(h, actor_worker_loop, workers.epochs[i], args, rounds, start_at)
                for i, h in enumerate(handles)
            ]
        results = ray.get(refs)
        timings = [WorkerTiming(r["seconds"], r["start"], r["end"], nbytes) for r in results]
        return timings, [r["out"] for r in results]
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")

    async def one(i: int) -> tuple[WorkerTiming, torch.Tensor]:
        client, epoch = workers.clients[i], workers.epochs[i]
        start, t0 = time.time(), time.perf_counter()
        last = args.query
        for _ in range(rounds):
            if path == "step_e2e":
                last = (await call(workers.handles[i], actor_step, epoch, args))[-1]
            else:
                for layer in range(cfg.num_layers):
                    last = (await client.run_round(args.round(epoch, layer))).out
        seconds = time.perf_counter() - t0
        return WorkerTiming(seconds, start, start + seconds, nbytes), last

    async def every() -> list[tuple[WorkerTiming, torch.Tensor]]:
        return list(await asyncio.gather(*(one(i) for i in range(count))))

    pairs = asyncio.run(every())
    return [t for t, _ in pairs], [o for _, o in pairs]


def start_workers(cfg: BenchConfig, namespace: str, prefix: str, num_workers: int) -> Workers:
    """Launch the workers (one per GPU through the launcher's placement group, or CPU
    workers in smoke mode) and fill every pool with random K/V (seed = worker index)."""
    import ray

    from workers.config import PoolConfig
    from workers.launcher import LaunchConfig, launch_workers

    if __name__ != "__main__":
        # Imported (tests), not run as a script: the actors cannot import this file by name,
        # so its in-actor functions travel by value.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    config = LaunchConfig(
        PoolConfig(cfg.layout, num_blocks=cfg.pool_blocks),
        num_workers=num_workers,
        namespace=namespace,
        name_prefix=prefix,
        use_gpu=not cfg.smoke,
        ready_timeout_s=180.0,
    )
    handles = launch_workers(config)
    clients = [RayWorkerClient(f"{prefix}{i}", h) for i, h in enumerate(handles)]
    descriptions = ray.get([h.describe.remote() for h in handles])
    ray.get([call(h, actor_fill, 1000 + i) for i, h in enumerate(handles)])
    info = ray.get([call(h, actor_info) for h in handles])
    for d, i in zip(descriptions, info, strict=True):
        i["pool_bytes"] = d.pool_bytes
    return Workers(handles, clients, [d.epoch for d in descriptions], info)


def measure_scaling(cfg: BenchConfig, workers: Workers) -> dict:
    """Section 1: every path with 1..N workers busy at once; outputs checked against float64
    dense attention for the first ``cfg.check_seqs`` sequences of the last layer."""
    import ray

    args = decode_batch(cfg, seed=7)
    rows = min(cfg.check_seqs, cfg.batch)
    last_layer = cfg.num_layers - 1
    refs = []
    for h in workers.handles:
        kv = ray.get(
            [
                call(h, actor_gather, last_layer, args.block_tables[s].tolist(), cfg.context)
                for s in range(rows)
            ]
        )
        refs.append(dense_decode(args.query[:rows], [k for k, _ in kv], [v for _, v in kv]))

    # Compile and warm every worker; then calibrate each path on worker 0 alone.
    ray.get(
        [call(h, actor_step, e, args) for h, e in zip(workers.handles, workers.epochs, strict=True)]
    )
    rounds: dict[str, int] = {}
    for path in PATHS:
        timings, _ = run_concurrent(cfg, workers, 1, path, args, 1, lead_s=0.05)
        rounds[path] = rounds_for(timings[0].seconds, cfg.seconds)
    log(f"rounds per run (target {cfg.seconds} s): {rounds}")

    points: list[ScalingPoint] = []
    worst = dict.fromkeys(PATHS, 0.0)
    for count in range(1, len(workers) + 1):
        for path in PATHS:
            per_round = cfg.seconds / rounds[path]
            timings, outs = run_concurrent(
                cfg, workers, count, path, args, rounds[path], lead_s=0.3 + 3 * per_round
            )
            for w, out in enumerate(outs):
                err = rel_err(out[:rows], refs[w])
                worst[path] = err if not math.isfinite(err) else max(worst[path], err)
            point = scaling_point(path, rounds[path], timings)
            points.append(point)
            log(
                f"  {count} worker(s) {path:<10} aggregate {point.aggregate_GBps:9.4g} GB/s, "
                f"per worker {min(point.per_worker_GBps):.4g}-{max(point.per_worker_GBps):.4g}"
            )
    tol = TOLERANCE[cfg.dtype]
    return {
        "kv_bytes_per_layer": cfg.kv_bytes_per_layer,
        "rounds": rounds,
        "points": [asdict(p) for p in with_efficiency(points)],
        "max_rel_err_vs_fp64_dense": worst,
        "tolerance": tol,
        "correct": all(within(e, tol) for e in worst.values()),
    }


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


async def measure_prefix_sharing(cfg: BenchConfig, workers: Workers, kernel_rounds: int) -> dict:
    """Section 2: prefix on worker 0, suffixes on worker 1; merge of partials versus
    copying the prefix to worker 1 once and attending there alone. ``kernel_rounds``: rounds
    of the in-actor kernel timing (section 1's calibration for the whole batch)."""
    import ray

    (w0, w1), (e0, e1) = workers.clients[:2], workers.epochs[:2]
    clients = {w0.worker_id: w0, w1.worker_id: w1}
    epochs = {w0.worker_id: e0, w1.worker_id: e1}
    bs, L = cfg.block_size, cfg.num_layers
    region = list(range(cfg.batch_blocks, cfg.batch_blocks + cfg.prefix_blocks))
    suffix_tokens = cfg.context - cfg.prefix_tokens
    suffix_nb = -(-suffix_tokens // bs)
    tables = decode_batch(cfg, seed=11).block_tables  # suffix blocks on worker 1
    suffixes = [tuple(tables[s, :suffix_nb].tolist()) for s in range(cfg.batch)]
    merged_views = [
        SequenceView(
            cfg.context,
            (
                Segment(w0.worker_id, 0, tuple(region)),
                Segment(w1.worker_id, cfg.prefix_tokens, suf),
            ),
        )
        for suf in suffixes
    ]
    local_views = [
        SequenceView(cfg.context, (Segment(w1.worker_id, 0, tuple(region) + suf),))
        for suf in suffixes
    ]
    merged = plan_attention(merged_views, [1] * cfg.batch, bs)
    local = plan_attention(local_views, [1] * cfg.batch, bs)
    if not merged.needs_merge or local.needs_merge:
        raise RuntimeError("the prefix-sharing plans do not have the expected shape")
    gen = torch.Generator().manual_seed(13)
    query = torch.randn(cfg.batch, cfg.num_q_heads, cfg.head_dim, generator=gen)
    query = query.to(cfg.layout.torch_dtype())

    # The copy, once per prefix (timed a few times; the prefix region of worker 1 is free).
    copy_s = []
    for _ in range(cfg.transfer_reps):
        t0 = time.perf_counter()
        await transfer_blocks(w0, e0, region, w1, e1, region)
        copy_s.append(time.perf_counter() - t0)
    copy_bytes = cfg.prefix_blocks * cfg.layout.bytes_per_block

    # Correctness on the last layer, against float64 dense over prefix + suffix.
    layer = L - 1
    rows = min(cfg.check_seqs, cfg.batch)
    out_m = (await run_attention(merged, query, layer, clients, epochs)).out
    out_l = (await run_attention(local, query, layer, clients, epochs)).out
    pk, pv = ray.get(call(workers.handles[0], actor_gather, layer, region, cfg.prefix_tokens))
    keys, values = [], []
    for s in range(rows):
        sk, sv = ray.get(call(workers.handles[1], actor_gather, layer, suffixes[s], suffix_tokens))
        keys.append(torch.cat([pk, sk]))
        values.append(torch.cat([pv, sv]))
    ref = dense_decode(query[:rows], keys, values)
    errors = {
        "merged_vs_dense": rel_err(out_m[:rows], ref),
        "copied_vs_dense": rel_err(out_l[:rows], ref),
        "merged_vs_copied_all_rows": rel_err(out_m, out_l),
    }
    tol = TOLERANCE[cfg.dtype]

    # Per-layer calls, the two variants interleaved so that drift hits both alike.
    lat: dict[str, list[float]] = {"merged": [], "copied": []}
    warm = 2
    for i in range(warm + cfg.prefix_iters):
        for name, plan in (("merged", merged), ("copied", local)):
            t0 = time.perf_counter()
            await run_attention(plan, query, i % L, clients, epochs)
            if i >= warm:
                lat[name].append(time.perf_counter() - t0)

    # The host-side merge alone (what the merged variant adds after the workers answer).
    partials = {}
    for batch in merged.batches:
        q, t, n, st = batch.kernel_args(query)
        client = clients[batch.worker_id]
        partials[batch.worker_id] = await client.run_round(
            Round(
                epochs[batch.worker_id], layer, q, t, n, st, options=AttendOptions(return_lse=True)
            )
        )
    merge_s = []
    for _ in range(warm + cfg.prefix_iters):
        t0 = time.perf_counter()
        merge_partials(merged, partials)
        merge_s.append(time.perf_counter() - t0)

    kernel = await _prefix_kernel_times(cfg, workers, merged, local, query, kernel_rounds)
    p50 = {k: _median(v) for k, v in lat.items()}
    extra_layer = p50["merged"] - p50["copied"]
    copy_p50 = _median(copy_s)
    return {
        "prefix_tokens": cfg.prefix_tokens,
        "suffix_tokens": suffix_tokens,
        "copy_bytes": copy_bytes,
        "copy_s": {"first": copy_s[0], "p50": copy_p50, "all": copy_s},
        "copy_GBps": copy_bytes / copy_p50 / 1e9,
        "per_layer_e2e_s": {k: {"p50": p50[k], "min": min(v)} for k, v in lat.items()},
        "extra_per_layer_s": extra_layer,
        "extra_per_step_s": extra_layer * L,
        "break_even_steps": copy_p50 / (extra_layer * L) if extra_layer > 0 else None,
        "host_merge_s": _median(merge_s[warm:]),
        "kernel_per_layer_s": kernel,
        "rel_err": errors,
        "tolerance": tol,
        "correct": within(errors["merged_vs_dense"], tol)
        and within(errors["copied_vs_dense"], tol),
    }


async def _prefix_kernel_times(
    cfg: BenchConfig,
    workers: Workers,
    merged: AttentionPlan,
    local: AttentionPlan,
    query: torch.Tensor,
    rounds: int,
) -> dict:
    """In-actor kernel seconds per layer over ``rounds`` rounds: the merged plan's two
    batches at once (with LSE), then the copied plan's single batch on worker 1."""
    index = {c.worker_id: i for i, c in enumerate(workers.clients)}

    async def loop(plan: AttentionPlan, return_lse: bool) -> dict[str, float]:
        start_at = time.time() + 0.3
        refs = {}
        for batch in plan.batches:
            args = AttendArgs(*batch.kernel_args(query))
            handle = workers.handles[index[batch.worker_id]]
            refs[batch.worker_id] = call(
                handle, actor_kernel_loop, args, rounds, start_at, return_lse
            )
        return {w: (await r)["seconds"] / (rounds * cfg.num_layers) for w, r in refs.items()}

    merged_s = await loop(merged, True)
    copied_s = await loop(local, False)
    return {
        "rounds": rounds,
        "merged_per_worker": merged_s,
        "merged_slowest": max(merged_s.values()),
        "copied": max(copied_s.values()),
    }


def _copy_seconds(src: torch.Tensor, dst: torch.Tensor, min_bytes: int) -> float:
    """Median seconds of ``dst.copy_(src)`` (synchronising both devices around batches of
    copies that move at least ``min_bytes`` each)."""
    devices = {t.device for t in (src, dst) if t.device.type == "cuda"}

    def sync() -> None:
        for d in devices:
            torch.cuda.synchronize(d)

    reps = max(3, math.ceil(min_bytes / max(1, src.numel())))
    for _ in range(2):
        dst.copy_(src)
    sync()
    trials = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        sync()
        trials.append((time.perf_counter() - t0) / reps)
    return statistics.median(trials)


def copy_ceilings(cfg: BenchConfig, sizes: Sequence[int]) -> dict:
    """Driver-process ``torch`` copies of each byte count: cuda:0 -> cuda:1 (the device-to-
    device ceiling) and cuda:0 -> cuda:0; on CPU only a host copy. GB/s of payload (a
    same-device copy also writes as many bytes as it reads)."""
    cuda = not cfg.smoke and torch.cuda.device_count() >= 1
    dev0 = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dev1 = torch.device("cuda", 1) if cuda and torch.cuda.device_count() >= 2 else None
    min_bytes = 8 << 20 if cfg.smoke else 2 << 30
    out: dict = {
        "peer_access_0_1": torch.cuda.can_device_access_peer(0, 1) if dev1 is not None else None,
        "sizes": {},
    }
    for nbytes in sizes:
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev0)
        row: dict = {}
        same = torch.empty_like(src)
        row["same_device_GBps"] = nbytes / _copy_seconds(src, same, min_bytes) / 1e9
        del same
        if dev1 is not None:
            other = torch.empty(nbytes, dtype=torch.uint8, device=dev1)
            row["cross_device_GBps"] = nbytes / _copy_seconds(src, other, min_bytes) / 1e9
            if not torch.equal(other.to(dev0), src):
                raise RuntimeError("the cuda:0 -> cuda:1 copy did not reproduce its source")
            del other
        else:
            row["cross_device_GBps"] = None
        out["sizes"][str(nbytes)] = row
    return out


async def measure_transfers(cfg: BenchConfig, workers: Workers) -> dict:
    """Section 3: ``transfer_blocks`` worker 0 -> worker 1 for each size (random distinct
    block ids both sides), sampled blocks compared bit for bit."""
    (w0, w1), (e0, e1) = workers.clients[:2], workers.epochs[:2]
    rng = random.Random(17)
    bpb = cfg.layout.bytes_per_block
    rows = []
    for n in cfg.transfer_blocks:
        src = rng.sample(range(cfg.pool_blocks), n)
        dst = rng.sample(range(cfg.pool_blocks), n)
        times = []
        for _ in range(1 + cfg.transfer_reps):
            t0 = time.perf_counter()
            await transfer_blocks(w0, e0, src, w1, e1, dst)
            times.append(time.perf_counter() - t0)
        picks = sorted({0, n - 1, *rng.sample(range(n), min(2, n))})
        a = await w0.export_blocks(e0, [src[i] for i in picks])
        b = await w1.export_blocks(e1, [dst[i] for i in picks])
        p50 = _median(times[1:])
        rows.append(
            {
                "blocks": n,
                "bytes": n * bpb,
                "first_s": times[0],
                "p50_s": p50,
                "GBps": n * bpb / p50 / 1e9,
                "bit_exact_sampled": bool(torch.equal(a, b)),
                "sampled_blocks": len(picks),
            }
        )
        log(f"  transfer {n} blocks ({n * bpb / 2**20:.4g} MiB): {rows[-1]['GBps']:.4g} GB/s")
    ceilings = copy_ceilings(cfg, [r["bytes"] for r in rows])
    for r in rows:
        c = ceilings["sizes"][str(r["bytes"])]
        r["cross_device_GBps"] = c["cross_device_GBps"]
        r["same_device_GBps"] = c["same_device_GBps"]
        ceiling = c["cross_device_GBps"]
        r["fraction_of_d2d"] = r["GBps"] / ceiling if ceiling else None
    return {
        "path": "export_blocks -> Ray object store -> import_blocks (transfer_blocks)",
        "peer_access_0_1": ceilings["peer_access_0_1"],
        "rows": rows,
        "correct": all(r["bit_exact_sampled"] for r in rows),
        "not_implemented": "CUDA IPC and NCCL transfers (only the object-store path exists)",
    }


def environment(cfg: BenchConfig, workers: Workers | None) -> dict:
    """Device, software and placement facts of the run."""
    import ray
    import triton

    cuda = torch.cuda.is_available() and not cfg.smoke
    env = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": f"{platform.node()} / {platform.machine()} / {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "ray": ray.__version__,
        "gpus_visible": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "multicast_env": {k: os.environ.get(k) for k in MULTICAST_OFF},
    }
    if workers is not None:
        env["workers"] = workers.info
        uuids = [i.get("device_uuid") for i in workers.info if i.get("device_uuid")]
        env["distinct_gpus"] = len(set(uuids)) == len(workers) if uuids else None
    return env


def run(cfg: BenchConfig, out_dir: Path, command: str) -> dict:
    """Launch the workers, run the three sections, write the JSON and markdown."""
    import ray

    found = cfg.num_cpu_workers if cfg.smoke else torch.cuda.device_count()
    num_workers = min(found, cfg.max_workers or found)
    namespace = f"bench-multigpu-{uuid.uuid4().hex[:8]}"
    prefix = "bench-mg-"
    from workers.launcher import shutdown_workers
    from workers.ray_startup import start_local_ray

    start_local_ray(namespace, num_cpus=2 if cfg.smoke else 4)

    ray_gpus = ray.cluster_resources().get("GPU", 0.0)
    if not cfg.smoke and ray_gpus < num_workers:
        ray.shutdown()
        # The launcher would wait out its timeout for GPUs Ray does not know about.
        raise RuntimeError(
            f"torch sees {found} GPUs but Ray reports {ray_gpus}; cannot place {num_workers} "
            "workers (is CUDA_VISIBLE_DEVICES set differently for Ray?)"
        )
    result: dict = {"command": command, "config": asdict(cfg)}
    try:
        t0 = time.perf_counter()
        workers = start_workers(cfg, namespace, prefix, num_workers)
        result["startup_s"] = time.perf_counter() - t0
        result["environment"] = environment(cfg, workers)
        log(f"{len(workers)} workers up in {result['startup_s']:.1f} s: {workers.info}")
        log("section 1: aggregate attend throughput")
        result["scaling"] = measure_scaling(cfg, workers)
        if len(workers) >= 2:
            log("section 2: cross-GPU prefix sharing")
            result["prefix_sharing"] = asyncio.run(
                measure_prefix_sharing(cfg, workers, result["scaling"]["rounds"]["kernel"])
            )
            log("section 3: block transfers")
            result["transfers"] = asyncio.run(measure_transfers(cfg, workers))
        else:
            skipped = f"needs >= 2 workers, this run has {len(workers)}"
            result["prefix_sharing"] = {"skipped": skipped}
            result["transfers"] = {"skipped": skipped}
        result["total_s"] = time.perf_counter() - t0
    finally:
        shutdown_workers(namespace, prefix)
        ray.shutdown()
    result["correct"] = all(
        result[k].get("correct", True) for k in ("scaling", "prefix_sharing", "transfers")
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_multigpu.json").write_text(json.dumps(result, indent=1, default=str))
    lines = render_markdown(result)
    (out_dir / "bench_multigpu.md").write_text("\n".join(lines) + "\n")
    result["markdown"] = lines
    return result


# -- the report -------------------------------------------------------------------------------


def _num(x: float | None, fmt: str = ".4g") -> str:
    """``x`` formatted, or "n/a"."""
    return "n/a" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    """A fraction as a percentage, or "n/a"."""
    return "n/a" if x is None else f"{x * 100:.1f}%"


def render_markdown(result: dict) -> list[str]:
    """The run as a markdown report (header, one table per section, verdicts)."""
    cfg, env = result["config"], result["environment"]
    n = len(env["workers"])
    title = "CPU smoke (figures mean nothing)" if cfg["smoke"] else f"{env['device']} x {n}"
    lines = [
        f"# Multi-GPU scaling on one host (issue 10): {title}",
        "",
        f"- date: {env['date_utc']}",
        f"- command: `{result['command']}`",
        f"- host: {env['host']}; GPUs visible: {env['gpus_visible']}; workers: {n} "
        f"(distinct physical GPUs: {env.get('distinct_gpus')})",
        f"- software: python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), "
        f"triton {env['triton']}, ray {env['ray']}",
        f"- multicast switches: {env['multicast_env']}; no NCCL used",
        f"- layout: {cfg['num_layers']} layers, {cfg['num_q_heads']} query / "
        f"{cfg['num_kv_heads']} KV heads, head_dim {cfg['head_dim']}, block {cfg['block_size']}, "
        f"{cfg['dtype']}; decode batch {cfg['batch']} x {cfg['context']} tokens per worker",
        f"- startup (Ray, launcher, pools filled): {result['startup_s']:.1f} s; whole run "
        f"{result['total_s']:.1f} s; all correctness checks passed: {result['correct']}",
        "",
    ]
    lines += _scaling_lines(result["scaling"], cfg)
    lines += _prefix_lines(result["prefix_sharing"], cfg)
    lines += _transfer_lines(result["transfers"])
    return lines


def _scaling_lines(sc: dict, cfg: dict) -> list[str]:
    gb = sc["kv_bytes_per_layer"] / 1e9
    lines = [
        "## 1. Aggregate attend throughput",
        "",
        f"K/V read per layer per worker: {gb:.4g} GB; one round = {cfg['num_layers']} layers, "
        "one kernel launch each. GB/s = K/V bytes / time. Aggregate = all workers' bytes / "
        "span from the first start to the last end. Efficiency = aggregate / (N x single).",
        "",
        "| path | workers | per-worker GB/s (min-max) | aggregate GB/s | efficiency | rounds "
        "| span s | start skew ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in sorted(sc["points"], key=lambda p: (PATHS.index(p["path"]), p["workers"])):
        pw = p["per_worker_GBps"]
        lines.append(
            f"| {p['path']} | {p['workers']} | {min(pw):.4g}-{max(pw):.4g} | "
            f"{p['aggregate_GBps']:.4g} | {_pct(p['efficiency'])} | {p['rounds']} | {p['span_s']:.3f} | "
            f"{p['start_skew_ms']:.1f} |"
        )
    lines += ["", "Paths:"] + [f"- `{k}`: {v}" for k, v in PATH_MEANING.items()]
    errs = ", ".join(f"{k} {v:.1e}" for k, v in sc["max_rel_err_vs_fp64_dense"].items())
    lines += [
        "",
        f"Last layer's output vs float64 dense ({cfg['check_seqs']} sequences per worker, "
        f"every run): {errs} (bound {sc['tolerance']:.0e}): "
        f"{'pass' if sc['correct'] else 'FAIL'}.",
        "",
    ]
    multi = [p for p in sc["points"] if p["workers"] > 1]
    if cfg["smoke"]:
        lines += ["Verdict: not judged (CPU smoke run).", ""]
    elif not multi:
        lines += ["Verdict: not judged (one worker only).", ""]
    else:
        for path in PATHS:
            effs = [p["efficiency"] for p in multi if p["path"] == path]
            worst = min(effs)
            verdict = "met" if worst >= SCALING_TARGET else "MISSED"
            lines.append(
                f"- `{path}`: lowest efficiency {worst * 100:.1f}% "
                f"(target {SCALING_TARGET * 100:.0f}%): {verdict}"
            )
        lines.append("")
    return lines


def _prefix_lines(ps: dict, cfg: dict) -> list[str]:
    lines = ["## 2. Cross-GPU prefix sharing (worker 0 prefix, worker 1 suffixes)", ""]
    if "skipped" in ps:
        return [*lines, f"Not run: {ps['skipped']}.", ""]
    L = cfg["num_layers"]
    k = ps["kernel_per_layer_s"]
    e2e = ps["per_layer_e2e_s"]
    err = ps["rel_err"]
    lines += [
        f"{cfg['batch']} sequences sharing a {ps['prefix_tokens']}-token prefix (blocks on "
        f"worker 0), each with its own {ps['suffix_tokens']}-token suffix on worker 1; one decode "
        "query each. `merged`: `run_attention` over both workers (partials + LSE merge on the "
        "host). `copied`: the prefix copied to worker 1 once (`transfer_blocks`), then one "
        "worker attends alone.",
        "",
        "| variant | per-layer e2e ms p50 (min) | per step x "
        f"{L} layers ms | in-actor kernel us/layer | rel err vs fp64 dense |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| merged | {e2e['merged']['p50'] * 1e3:.3f} ({e2e['merged']['min'] * 1e3:.3f}) | "
        f"{e2e['merged']['p50'] * L * 1e3:.2f} | {k['merged_slowest'] * 1e6:.1f} (slower of the "
        f"two GPUs) | {err['merged_vs_dense']:.1e} |",
        f"| copied | {e2e['copied']['p50'] * 1e3:.3f} ({e2e['copied']['min'] * 1e3:.3f}) | "
        f"{e2e['copied']['p50'] * L * 1e3:.2f} | {k['copied'] * 1e6:.1f} | "
        f"{err['copied_vs_dense']:.1e} |",
        "",
        f"- copy once: {ps['copy_bytes'] / 2**20:.4g} MiB in {ps['copy_s']['p50'] * 1e3:.2f} ms "
        f"p50 (first {ps['copy_s']['first'] * 1e3:.2f} ms), {ps['copy_GBps']:.4g} GB/s",
        f"- extra cost of merging: {ps['extra_per_layer_s'] * 1e3:.3f} ms per layer, "
        f"{ps['extra_per_step_s'] * 1e3:.2f} ms per decode step; the host merge alone "
        f"{ps['host_merge_s'] * 1e3:.3f} ms per layer",
        "- copying pays after "
        + (
            f"{ps['break_even_steps']:.1f} decode steps"
            if ps["break_even_steps"] is not None
            else "no step: merging was not slower here"
        ),
        f"- merged vs copied, all rows: {err['merged_vs_copied_all_rows']:.1e}; correctness "
        f"(bound {ps['tolerance']:.0e}): {'pass' if ps['correct'] else 'FAIL'}",
        "- every sequence reads the same prefix blocks, so on a GPU most prefix reads hit L2 in "
        "both variants; the merged variant reads the prefix on GPU 0 while GPU 1 reads the "
        "suffixes, but pays a second worker call, the LSEs and the host merge per layer",
        "",
    ]
    return lines


def _transfer_lines(tr: dict) -> list[str]:
    lines = ["## 3. Block transfer worker 0 -> worker 1", ""]
    if "skipped" in tr:
        return [*lines, f"Not run: {tr['skipped']}.", ""]
    lines += [
        f"Worker path: {tr['path']}; p50 of the repetitions after the first. Ceilings: `torch` "
        "copies of the same bytes in the driver process (GB/s of payload; a same-device copy "
        f"also writes what it reads). Peer access cuda:0 <-> cuda:1: {tr['peer_access_0_1']}.",
        "",
        "| blocks | MiB | worker path ms p50 (first) | worker path GB/s | cuda:0->cuda:1 GB/s "
        "| cuda:0->cuda:0 GB/s | worker / d2d | bit-exact (sampled) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in tr["rows"]:
        frac = r["fraction_of_d2d"]
        lines.append(
            f"| {r['blocks']} | {r['bytes'] / 2**20:.4g} | {r['p50_s'] * 1e3:.2f} "
            f"({r['first_s'] * 1e3:.2f}) | {r['GBps']:.4g} | {_num(r['cross_device_GBps'])} | "
            f"{r['same_device_GBps']:.4g} | {_pct(frac)} | "
            f"{r['bit_exact_sampled']} ({r['sampled_blocks']} blocks) |"
        )
    lines += ["", f"Not implemented: {tr['not_implemented']}.", ""]
    return lines


# -- command line -----------------------------------------------------------------------------


def _block_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated block counts, got {text!r}"
        ) from None


def parse_config(argv: Sequence[str] | None) -> tuple[BenchConfig, Path]:
    """The run's config and output folder from the command line (errors exit with 2)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for JSON + markdown")
    parser.add_argument("--smoke", action="store_true", help="3 CPU workers, tiny fp32 shapes")
    parser.add_argument(
        "--num-gpus", type=int, help="use at most this many GPUs (smoke: CPU workers)"
    )
    parser.add_argument("--batch", type=int, help="decode sequences per worker")
    parser.add_argument("--context", type=int, help="KV tokens per sequence")
    parser.add_argument("--layers", type=int, help="layers (attends per decode step)")
    parser.add_argument("--prefix-tokens", type=int, help="shared prefix on worker 0")
    parser.add_argument("--seconds", type=float, help="target length of each timed run")
    parser.add_argument(
        "--transfer-blocks", type=_block_list, help="transfer sizes in blocks, e.g. 1,8,64"
    )
    args = parser.parse_args(argv)
    base = SMOKE if args.smoke else BenchConfig()
    overrides = {
        "max_workers": args.num_gpus,
        "batch": args.batch,
        "context": args.context,
        "num_layers": args.layers,
        "prefix_tokens": args.prefix_tokens,
        "seconds": args.seconds,
        "transfer_blocks": args.transfer_blocks,
    }
    try:
        cfg = replace(base, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        parser.error(str(exc))
    if not cfg.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: use --smoke for the CPU run")
    return cfg, args.out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, out_dir = parse_config(argv)
    command = " ".join(["python3 benchmarks/bench_multigpu.py", *argv])
    result = run(cfg, out_dir, command)
    for line in result["markdown"]:
        log(line)
    if not result["correct"]:
        log("a correctness check FAILED (see above); results written to " + str(out_dir))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
