"""The whole service: per-layer append-and-attend calls through the client, the coordinator
and a worker, against the same pool calls made in-process; and concurrent clients against one.

One measurement is a decode step of `batch` sequences, layer by layer, each layer one
append-and-attend call carrying one new token's K/V and one query row per sequence (what a
model's attention layer does). The client times every call (serialisation, loopback,
coordinator, worker, kernels, reply); the in-process baseline times the same
`PoolWorker.run_round` calls (same shapes, same growing lengths, host results)
without any RPC. Every client runs in its own process; every run decodes forks of contexts
filled once per service, so each run costs its decode steps only.

Rows: the pools in the server's process over each client transport (--transports), then
the pool behind a Ray actor over its worker channel (the first transport; --no-ray skips it).
Tables: one client (p50/p99 per call, steps/s, tokens/s, the overhead over in-process), and
N concurrent clients against one client of the same batch (tokens/s ratio, --pairs
alternating pairs, the row shows the pair of the lower median ratio).

    python benchmarks/bench_service.py --smoke             # seconds on a CPU; figures mean nothing
    source .device/env.sh && python3 benchmarks/bench_service.py --h200 --phases host_tier \\
        --out $OUT/host-tier-h200.md   # restore of 1 GiB vs a pinned copy; hit rates at 4x
    python benchmarks/bench_service.py                     # CPU: a small layout, Ray CPU worker
    source .device/env.sh && python3 benchmarks/bench_service.py --h200 --no-in-process \\
        --transports local-shm --pairs 8 --out $OUT/service-h200.md
        # one GPU, the Llama-3-8B layout: batch 32 at context 2048; 8 clients of batch 8

Prints a Markdown report (command, machine, device, date first); --out also writes it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import functools
import itertools
import json
import os
import platform
import random
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cache_service import event_loop
from cache_service.api.server import start_service
from cache_service.cli.bench import (
    BenchConfig,
    BenchResult,
    fill_bases,
    free_bases,
    percentile,
    run_decode_bench,
)
from cache_service.cli.host_tier_bench import HitRates, report_lines, restore_vs_copy
from cache_service.config import CoordinatorConfig, ServiceConfig
from cache_service.engine.coordinator import Coordinator
from cache_service.engine.worker_clients import LocalWorkerClient
from cache_service.event_loop import EVENT_LOOPS
from workers.actor import PoolWorker
from workers.config import PoolConfig
from workers.layout import KVLayout
from workers.round import Round


@dataclass(frozen=True)
class Setup:
    """One benchmarked configuration: the layout, the single client's decode batch and the
    concurrency runs' clients."""

    name: str
    layout: KVLayout
    num_q_heads: int
    batch: int
    context: int
    steps: int
    device: str  # "cpu" | "cuda"
    blocks: int
    concurrent_clients: int
    concurrent_batch: int
    concurrent_steps: int


SMOKE = Setup(
    name="cpu-smoke",
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32"),
    num_q_heads=4,
    batch=2,
    context=32,
    steps=3,
    device="cpu",
    blocks=64,
    concurrent_clients=2,
    concurrent_batch=1,
    concurrent_steps=3,
)

CPU = Setup(
    name="cpu",
    layout=KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32"),
    num_q_heads=8,
    batch=8,
    context=128,
    steps=30,
    device="cpu",
    blocks=512,
    concurrent_clients=4,
    concurrent_batch=2,
    concurrent_steps=15,
)

H200 = Setup(
    name="h200",
    layout=KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16"),
    num_q_heads=32,
    batch=32,
    context=2048,
    steps=10,
    device="cuda",
    blocks=9000,
    concurrent_clients=8,
    concurrent_batch=8,
    # 640 calls per client: with 10 steps a few slow rounds swing the ratio.
    concurrent_steps=20,
)


def service_config(
    setup: Setup, *, ray: bool, window_ms: float, overrides: Mapping[str, Any] | None = None
) -> ServiceConfig:
    """The service of `setup`; `overrides`: further dotted keys (None values: defaults)."""
    lay = setup.layout
    return ServiceConfig().with_overrides(
        {
            "server.port": 0,
            "metrics.enabled": False,
            "layout.num_layers": lay.num_layers,
            "layout.num_kv_heads": lay.num_kv_heads,
            "layout.head_dim": lay.head_dim,
            "layout.block_size": lay.block_size,
            "layout.dtype": lay.dtype,
            "workers.num_workers": 1,
            "workers.blocks_per_worker": setup.blocks,
            "workers.device": setup.device,
            "workers.in_process": not ray,
            # The model's query heads: the pools compile the decode kernels before serving.
            "workers.warm_up_query_heads": [setup.num_q_heads],
            "workers.ray_num_cpus": 2 if setup.device == "cpu" else None,
            "coordinator.batch_window_ms": window_ms,
            "coordinator.health_check_interval_s": 0,
            "log_level": "WARNING",
            **(overrides or {}),
        }
    )


@dataclass(frozen=True)
class Transport:
    """How a benchmark client sends its batch calls (KVCacheClient's options)."""

    session: bool  # as messages of one Session (else unary RPCs)
    shared_memory: bool  # tensors through a shared-memory region (else bytes)
    local_session: bool  # the Session over the server's local socket (else gRPC)
    label: str  # how report rows name it


# Client transports (--transports).
TRANSPORTS = {
    "session-shm": Transport(True, True, False, "Session stream, shared-memory tensors"),
    "local-shm": Transport(
        True, True, True, "local session (Unix socket, no gRPC), shared-memory tensors"
    ),
    "session": Transport(True, False, False, "Session stream, tensor bytes"),
    "unary-shm": Transport(False, True, False, "unary RPCs, shared-memory tensors"),
    "unary": Transport(False, False, False, "unary RPCs, tensor bytes"),
}

# The service runs: one client of the main batch, one client of the concurrency batch, the
# concurrent clients; then the host tier's figures (cache_service.cli.host_tier_bench);
# --phases picks some.
SERVICE_PHASES = ("single", "one_small", "concurrent")
PHASES = (*SERVICE_PHASES, "host_tier")


@dataclass(frozen=True)
class HostTierSetup:
    """The host tier phase of a setup: bytes restored, and the hit-rate workload (a GPU
    pool of `gpu_blocks`, prefixes of `prefix_blocks`, 4x the pool in all)."""

    restore_bytes: int
    repeats: int
    gpu_blocks: int
    prefix_blocks: int
    requests: int


HOST_TIER = {
    "cpu-smoke": HostTierSetup(4 << 20, 3, 8, 2, 40),
    "cpu": HostTierSetup(64 << 20, 5, 32, 4, 200),
    # 1 GiB of 2 MiB Llama-3-8B blocks; a 512 MiB pool, prefixes of 256 tokens.
    "h200": HostTierSetup(1 << 30, 10, 256, 16, 200),
}


def through_service(
    setup: Setup,
    *,
    ray: bool,
    window_ms: float,
    api: str = "batch",
    transport: str = "session-shm",
    phases: tuple[str, ...] = PHASES,
    overrides: Mapping[str, Any] | None = None,
    pairs: int = 1,
    worker_calls: dict[str, int] | None = None,
) -> dict[str, BenchResult]:
    """Start a service, run the single-client and the concurrency benchmarks, stop it.

    Returns results by phase; with `pairs` > 1 the one-client and concurrent runs alternate
    that many times, the later pairs' results under "one_small@2", "concurrent@2", ...
    worker_calls: filled with the service's per-layer worker data calls by path
    ("in_process", "channel", "ray"; warm-up included), read from its metrics.
    """
    t = TRANSPORTS[transport]
    wire = {
        "api": api,
        "session": t.session,
        "shared_memory": t.shared_memory,
        "local_session": t.local_session,
        "num_q_heads": setup.num_q_heads,
        "dtype": setup.layout.dtype,
        "context": setup.context,
    }
    config = service_config(setup, ray=ray, window_ms=window_ms, overrides=overrides)

    async def main() -> dict[str, BenchResult]:
        running = await start_service(config)
        loop = asyncio.get_running_loop()
        # The event-loop thread's CPU clock, readable from the thread the clients run in:
        # how busy the coordinator's one thread was over the timed steps.
        loop_clock = time.pthread_getcpuclockid(threading.get_ident())
        server_cpu = functools.partial(time.clock_gettime, loop_clock)
        try:
            small = {"batch": setup.concurrent_batch, "steps": setup.concurrent_steps}
            runs = (
                ("single", BenchConfig(batch=setup.batch, steps=setup.steps, **wire)),
                ("one_small", BenchConfig(**small, **wire)),
                ("concurrent", BenchConfig(**small, clients=setup.concurrent_clients, **wire)),
            )
            # Alternating the one-client and concurrent runs spreads a drift of the host's
            # speed over both sides of each pair's ratio.
            runs += tuple((f"{key}@{n}", cfg) for n in range(2, pairs + 1) for key, cfg in runs[1:])
            fill = functools.partial(fill_bases, running.address, runs[2][1], processes=True)
            bases = await loop.run_in_executor(None, fill)
            out = {}
            for key, cfg in runs:
                if key.split("@")[0] not in phases:
                    continue
                # Clients in their own processes: a client sharing the server's GIL would
                # slow both and inflate the figures.
                run = functools.partial(
                    run_decode_bench, processes=True, server_cpu_clock=server_cpu
                )
                before = _counters(running)
                result = await loop.run_in_executor(
                    None, run, running.address, _on_bases(cfg, bases)
                )
                delta = _counters(running) - before
                per_call = delta["sequences"] / delta["calls"] if delta["calls"] else None
                checked = (delta["checks"], delta["check_us"] / 1e6)
                out[key] = replace(
                    result, sequences_per_worker_call=per_call, correctness_checks=checked
                )
                # Each run's figures as it ends: a run cut short by a time limit still
                # leaves what it measured in the log.
                print(
                    f"[{time.strftime('%H:%M:%S')}] {key}: {_run_line(result, delta)}", flush=True
                )
            if worker_calls is not None:
                worker_calls.update(data_calls(running.metrics))
            await loop.run_in_executor(None, free_bases, running.address, bases)
            return out
        finally:
            await running.stop()

    return event_loop.run(main(), config.server.event_loop)


def _on_bases(cfg: BenchConfig, bases: tuple[tuple[str, ...], ...]) -> BenchConfig:
    """`cfg` decoding forks of `bases` (filled by `fill_bases` for the concurrent run):
    its clients' batches cut in order from all of the bases' sequences."""
    pool = [seq_id for ids in bases for seq_id in ids]
    need = cfg.clients * cfg.batch
    if need > len(pool):
        raise ValueError(f"{need} sequences wanted, {len(pool)} filled")
    per_client = tuple(tuple(pool[i * cfg.batch : (i + 1) * cfg.batch]) for i in range(cfg.clients))
    return replace(cfg, bases=per_client)


def _counters(running: Any) -> collections.Counter[str]:
    """The service's counters so far, from its metrics and its local sessions: worker calls
    and their sequences, worker rounds, their parts and those over pages of several layers,
    online correctness checks and their time (us), local-session calls and those answered
    from a round's callback. Differences between two reads are a run's."""
    m = running.metrics
    sequences, calls = histogram_totals(m.worker_batch_size)
    parts, rounds = histogram_totals(m.worker_round_size)
    check_s, checks = histogram_totals(m.correctness_check_duration)
    local = running.local_sessions
    return collections.Counter(
        {
            "sequences": round(sequences),
            "calls": round(calls),
            "rounds": round(rounds),
            "parts": round(parts),
            "pages": round(counter_total(m.worker_calls_over_layers)),
            "checks": round(checks),
            "check_us": round(check_s * 1e6),
            "local_calls": 0 if local is None else local.calls,
            "local_now": 0 if local is None else local.calls_now,
        }
    )


def _run_line(result: BenchResult, d: collections.Counter[str]) -> str:
    """One run's figures for the log: throughput, latency, the server loop's busy share,
    worker calls and rounds, correctness checks, local-session callbacks."""
    cpu = result.server_cpu_seconds
    line = f"{result.tokens_per_s:.1f} tok/s, p50 {result.p50_ms:.3f} ms"
    if d["calls"]:
        line += f", {d['sequences'] / d['calls']:.1f} sequences per worker call"
    if cpu is not None and result.wall_seconds:
        line += f", loop {cpu / result.wall_seconds:.2f} busy"
    if d["rounds"]:
        line += (
            f", {d['rounds']} rounds ({d['parts'] / d['rounds']:.2f} parts each, "
            f"{d['pages'] / d['rounds']:.0%} over pages of several layers)"
        )
    line += f", {d['checks']} checks ({d['check_us'] / 1e3:.0f} ms in all)"
    if d["local_calls"]:
        line += f", {d['local_now']} of {d['local_calls']} local-session calls from a callback"
    return line


def histogram_totals(histogram: Any) -> tuple[float, float]:
    """(sum, count) of a prometheus_client histogram over all its label sets so far."""
    total = count = 0.0
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total, count


def counter_total(counter: Any, **labels: str) -> float:
    """A prometheus_client counter's total over its label sets matching `labels`."""
    return sum(
        sample.value
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
        and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def data_calls(metrics: Any) -> dict[str, int]:
    """Per-layer worker data calls so far by path (kvcache_worker_data_calls_total)."""
    return {
        path: round(counter_total(metrics.worker_data_calls, path=path))
        for path in ("in_process", "channel", "ray")
    }


@dataclass
class DecodePool:
    """A PoolWorker holding `setup.batch` sequences of `setup.context` tokens on every
    layer, and the host tensors of their decode calls (the in-process baseline's data).

    Attributes:
        worker, epoch: the pool and its epoch.
        block_size: tokens per block.
        tables: int32 ``[batch, blocks per sequence]`` (sequence s owns a contiguous run).
        key: ``[batch, Hkv, D]`` new K (and V) per step; query ``[batch, Hq, D]``.
        qsl: int32 ``[batch + 1]``, one query row per sequence.
    """

    worker: PoolWorker
    epoch: str
    block_size: int
    tables: torch.Tensor
    key: torch.Tensor
    query: torch.Tensor
    qsl: torch.Tensor

    def step_args(self, length: int) -> tuple[list[int], torch.Tensor]:
        """Slots of the new tokens at position `length` and the seq_lens after them."""
        bs = self.block_size
        batch = self.tables.shape[0]
        slots = [int(self.tables[s, length // bs]) * bs + length % bs for s in range(batch)]
        return slots, torch.full((batch,), length + 1, dtype=torch.int32)


def decode_pool(setup: Setup, steps: int) -> DecodePool:
    """A pool filled for `steps` decode steps of `setup` after its context, configured as
    the service's pools are by default (slot fingerprints, CUDA graphs on a GPU)."""
    lay = setup.layout
    bs, hkv, d = lay.block_size, lay.num_kv_heads, lay.head_dim
    per_seq = -(-(setup.context + steps + 4) // bs)
    # Fingerprints on every write: the service's pools keep them for its online check.
    config = PoolConfig(lay, num_blocks=setup.batch * per_seq + 1, fingerprints=True)
    worker = PoolWorker("bench", config, setup.device)
    epoch = worker.epoch()
    dtype = lay.torch_dtype()
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(lay.num_layers, setup.context, hkv, d, generator=gen).to(dtype)
    tables = torch.arange(setup.batch * per_seq, dtype=torch.int32).reshape(setup.batch, per_seq)
    for s in range(setup.batch):
        slots = [int(tables[s, t // bs]) * bs + t % bs for t in range(setup.context)]
        worker.write(epoch, None, slots, kv, kv)
    k = torch.randn(setup.batch, hkv, d, generator=gen).to(dtype)
    q = torch.randn(setup.batch, setup.num_q_heads, d, generator=gen).to(dtype)
    qsl = torch.arange(setup.batch + 1, dtype=torch.int32)
    return DecodePool(worker, epoch, bs, tables, k, q, qsl)


def in_process(setup: Setup) -> tuple[list[float], float]:
    """The same rounds (``run_round``) on a PoolWorker in this process.

    Returns (per-call seconds, wall seconds of the timed steps).
    """
    lay = setup.layout
    warmup = 3
    pool = decode_pool(setup, warmup + setup.steps)
    times: list[float] = []
    length = setup.context
    t_start = 0.0
    for step in range(warmup + setup.steps):
        if step == warmup:
            t_start = time.perf_counter()
        slots, seq_lens = pool.step_args(length)
        for layer in range(lay.num_layers):
            t0 = time.perf_counter()
            # Host results, as the worker returns them to the service; the step's attention
            # metadata kept under one key, as the service's plan for a step is.
            pool.worker.run_round(pool.epoch, Round(
                pool.epoch, layer, pool.query, pool.tables, seq_lens, pool.qsl, slots,
                pool.key, pool.key, step_key=step,
            ))  # fmt: skip
            if step >= warmup:
                times.append(time.perf_counter() - t0)
        length += 1
    return times, time.perf_counter() - t_start


API_TEXT = {
    "batch": "`append_attend_batch` (the batch as `[batch, ...]` tensors)",
    "items": "`append_attend` (one `AppendAttendItem` per sequence)",
}


def concurrency_pairs(res: dict[str, BenchResult]) -> list[tuple[float, BenchResult, BenchResult]]:
    """(ratio, one client, concurrent) of each alternating pair of runs, in run order."""
    out = []
    for n in itertools.count(1):
        suffix = "" if n == 1 else f"@{n}"
        one, many = res.get(f"one_small{suffix}"), res.get(f"concurrent{suffix}")
        if one is None or many is None:
            return out
        ratio = many.tokens_per_s / one.tokens_per_s if one.tokens_per_s else 0.0
        out.append((ratio, one, many))
    return out


def median_pair(
    pairs: list[tuple[float, BenchResult, BenchResult]],
) -> tuple[float, BenchResult, BenchResult]:
    """The pair of the lower median ratio (of two, the smaller)."""
    ranked = sorted(pairs, key=lambda p: p[0])
    return ranked[(len(ranked) - 1) // 2]


def checked(r: BenchResult) -> str:
    """The run's correctness-checked rounds and their mean check time in ms (each ran after
    its round answered)."""
    if r.correctness_checks is None:
        return "-"
    n, seconds = r.correctness_checks
    return f"{n} ({seconds / n * 1e3:.1f})" if n else "0"


def loop_busy(r: BenchResult) -> str:
    """The server's event-loop thread over the timed steps: its CPU time as a fraction of
    the wall time, and per append-and-attend call in ms."""
    cpu = r.server_cpu_seconds
    if cpu is None or not r.wall_seconds:
        return "-"
    calls = r.config.steps * r.layers * r.config.clients
    return f"{cpu / r.wall_seconds:.2f} ({cpu / calls * 1e3:.3f})"


def per_round(r: BenchResult) -> str:
    """Sequences per worker call over the run (warm-up included)."""
    n = r.sequences_per_worker_call
    return "-" if n is None else f"{n:.2f}"


def device_name(setup: Setup) -> str:
    """The device the pools ran on, as the report names it."""
    if setup.device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()})"


def report(
    setup: Setup,
    results: dict[str, dict[str, BenchResult]],
    base: tuple[list[float], float],
    args: argparse.Namespace,
    worker_calls: Mapping[str, Mapping[str, int]],
) -> str:
    """The Markdown report: how it ran, then the one-client and the concurrency tables."""
    lay = setup.layout
    fraction = CoordinatorConfig().correctness_check_fraction
    lines = [
        f"# Service benchmark ({setup.name})",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{' '.join(['benchmarks/bench_service.py', *sys.argv[1:]])}`",
        f"- device: {device_name(setup)}; host {platform.node()} / {os.cpu_count()} CPUs",
        f"- python {platform.python_version()}, torch {torch.__version__}",
        f"- layout: {lay.num_layers} layers, {setup.num_q_heads} query / {lay.num_kv_heads} KV "
        f"heads, head_dim {lay.head_dim}, block {lay.block_size}, {lay.dtype}",
        f"- decode: batch {setup.batch}, context {setup.context}, {setup.steps} timed steps "
        f"of {lay.num_layers} append-and-attend calls (3 warm-up steps); batching window "
        f"{args.batch_window_ms} ms; every run decodes forks of contexts filled once",
        f"- client call: {API_TEXT[args.api]}; each client in its own process",
        f"- service settings beyond the defaults (online correctness check {fraction} of "
        f"rounds, event loop asyncio, CUDA graphs on): {', '.join(args.set) or 'none'}",
        *(
            f"- {label}: per-layer worker data calls in process / over the worker channel / "
            f"through Ray: {c['in_process']} / {c['channel']} / {c['ray']}"
            for label, c in worker_calls.items()
        ),
    ]
    if "single" in args.phase_list:
        lines += single_section(setup, results, base)
    if {"one_small", "concurrent"} <= set(args.phase_list):
        lines += concurrency_section(setup, results, args)
    return "\n".join(lines) + "\n"


def single_section(
    setup: Setup, results: dict[str, dict[str, BenchResult]], base: tuple[list[float], float]
) -> list[str]:
    """The one-client table: in-process, then each service row."""
    base_times, base_wall = base
    b50 = percentile(base_times, 50) if base_times else 0.0
    lines = [
        "",
        "## One client: per-layer append-and-attend",
        "",
        "| path | p50 ms | p99 ms | steps/s | tokens/s | p50 overhead over in-process ms "
        "| correctness checks (ms each, after the answer) "
        "| server loop busy (its CPU ms per call) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    if base_times:
        steps = setup.steps / base_wall
        lines.append(
            f"| in-process `PoolWorker.run_round` (no RPC) | {b50 * 1e3:.3f} | "
            f"{percentile(base_times, 99) * 1e3:.3f} | {steps:.2f} | {steps * setup.batch:.1f} "
            "| - | - | - |"
        )
    for label, res in results.items():
        if "single" in res:
            r = res["single"]
            over = f"{r.p50_ms - b50 * 1e3:.3f}" if base_times else "-"
            lines.append(
                f"| service, {label} | {r.p50_ms:.3f} | {r.p99_ms:.3f} | {r.steps_per_s:.2f} | "
                f"{r.tokens_per_s:.1f} | {over} | {checked(r)} | {loop_busy(r)} |"
            )
    return lines


def concurrency_section(
    setup: Setup, results: dict[str, dict[str, BenchResult]], args: argparse.Namespace
) -> list[str]:
    """The concurrency table: each service row's pairs of one against many clients."""
    lines = [
        "",
        f"## Concurrency: {setup.concurrent_clients} clients of batch {setup.concurrent_batch} "
        f"versus one client of batch {setup.concurrent_batch} ({setup.concurrent_steps} timed "
        f"steps each; {args.pairs} alternating pair(s) of runs, the row is the pair of the "
        "lower median ratio)",
        "",
        "| path | one client tokens/s | concurrent tokens/s | ratio | concurrent p50 ms | p99 ms "
        "| sequences per worker call: one / concurrent "
        "| server loop busy (its CPU ms per call): one / concurrent | every pair's ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, res in results.items():
        pairs = concurrency_pairs(res)
        if pairs:
            ratio, one, many = median_pair(pairs)
            every = ", ".join(f"{r:.2f}x" for r, _, _ in pairs)
            lines.append(
                f"| service, {label} | {one.tokens_per_s:.1f} | {many.tokens_per_s:.1f} | "
                f"{ratio:.2f}x | {many.p50_ms:.3f} | {many.p99_ms:.3f} | "
                f"{per_round(one)} / {per_round(many)} | {loop_busy(one)} / {loop_busy(many)} "
                f"| {every} |"
            )
    return lines


async def _hit_rate(
    layout: KVLayout,
    device: str,
    gpu_blocks: int,
    host_blocks: int,
    prefix_blocks: int,
    num_prefixes: int,
    requests: int,
    seed: int,
) -> float:
    bs = layout.block_size
    client = LocalWorkerClient(
        "w0", PoolConfig(layout, num_blocks=gpu_blocks, host_blocks=host_blocks), device
    )
    coord = Coordinator(layout, [client], CoordinatorConfig(correctness_check_fraction=0.0))
    await coord.start()
    gen = torch.Generator().manual_seed(seed)
    dtype = layout.torch_dtype()

    def prompt(i: int, own: int) -> list[int]:
        return [100_000 * (i + 1) + t for t in range(prefix_blocks * bs)] + [own]

    async def serve(tokens: list[int]) -> int:
        created = await coord.create_sequence("bench", tokens)
        cached = created.num_cached_tokens
        rest = tokens[cached:]
        shape = (layout.num_layers, len(rest), layout.num_kv_heads, layout.head_dim)
        k = torch.randn(shape, generator=gen).to(dtype)
        await coord.append("bench", created.seq_id, None, rest, k, k)
        await coord.free("bench", created.seq_id)
        return cached

    try:
        for i in range(num_prefixes):
            await serve(prompt(i, 0))
        rng = random.Random(seed)
        hits = 0
        for r in range(requests):
            hits += await serve(prompt(rng.randrange(num_prefixes), r + 1))
        coord.block_manager.check_integrity()
    finally:
        await coord.close()
        client.close()
    return hits / (requests * prefix_blocks * bs)


def hit_rates(
    layout: KVLayout,
    device: str,
    gpu_blocks: int,
    prefix_blocks: int,
    requests: int,
    seed: int = 0,
) -> HitRates:
    """The workload of `4 * gpu_blocks` prefix blocks under an unbounded pool, the GPU
    pool with a host tier holding every prefix, and the GPU pool alone."""
    num_prefixes = 4 * gpu_blocks // prefix_blocks
    prefix_total = num_prefixes * prefix_blocks
    # Room for every prefix plus the requests' own blocks: nothing is ever evicted.
    unbounded_blocks = prefix_total + 2 * (prefix_blocks + 1)

    def run(gpu: int, host: int) -> float:
        return asyncio.run(
            _hit_rate(layout, device, gpu, host, prefix_blocks, num_prefixes, requests, seed)
        )

    return HitRates(
        gpu_blocks,
        prefix_total,
        prefix_blocks,
        num_prefixes,
        requests,
        unbounded=run(unbounded_blocks, 0),
        tiered=run(gpu_blocks, prefix_total),
        gpu_only=run(gpu_blocks, 0),
    )


def host_tier(setup: Setup) -> list[str]:
    """The host tier phase: restore versus a pinned copy, and the hit rates at 4x the pool
    (cache_service.cli.host_tier_bench), as report lines."""
    h = HOST_TIER[setup.name]
    device = "cuda" if setup.device == "cuda" else "cpu"
    restore = restore_vs_copy(setup.layout, device, h.restore_bytes, h.repeats)
    print(f"[{time.strftime('%H:%M:%S')}] host tier restore: {restore}", flush=True)
    rates = hit_rates(setup.layout, device, h.gpu_blocks, h.prefix_blocks, h.requests)
    print(f"[{time.strftime('%H:%M:%S')}] host tier hit rates: {rates}", flush=True)
    return ["", *report_lines(restore, rates)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--h200", action="store_true", help="the Llama-3-8B setup on one GPU")
    size.add_argument(
        "--smoke", action="store_true", help="the smallest CPU run (seconds; figures mean nothing)"
    )
    parser.add_argument("--out", type=Path, help="also write the Markdown report here")
    parser.add_argument("--batch-window-ms", type=float, default=0.5)
    parser.add_argument("--steps", type=int, help="timed steps of every run (default: the setup's)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray worker row")
    parser.add_argument(
        "--no-in-process", action="store_true",
        help="skip the rows with the pools in the server's process (the Ray row alone)",
    )  # fmt: skip
    parser.add_argument("--api", choices=tuple(API_TEXT), default="batch", help="client call")
    parser.add_argument(
        "--transports",
        default="session-shm,unary",
        help=f"comma-separated client transports, of {', '.join(TRANSPORTS)}; the Ray row "
        "uses the first",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="alternate the one-client and concurrent runs this many times in one service; "
        "the report's ratio is the lower median of the pairs'",
    )
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated service runs, of {', '.join(PHASES)}",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a further service setting (dotted key, JSON value), e.g. "
        'coordinator.correctness_check_fraction=0 or server.event_loop="uvloop" '
        f"(event loops: {', '.join(EVENT_LOOPS)}); repeatable",
    )
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    args.phase_list = tuple(args.phases.split(","))
    if any(p not in PHASES for p in args.phase_list):
        parser.error(f"--phases: choose among {list(PHASES)}, got {args.phases!r}")
    args.transport_list = args.transports.split(",")
    unknown = [t for t in args.transport_list if t not in TRANSPORTS]
    if unknown:
        parser.error(f"unknown transport(s) {unknown}; choose among {list(TRANSPORTS)}")
    args.overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set wants KEY=VALUE, got {item!r}")
        try:
            args.overrides[key] = json.loads(value)
        except json.JSONDecodeError as exc:
            parser.error(f"--set {key}: the value is not JSON ({exc}): {value!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup = H200 if args.h200 else SMOKE if args.smoke else CPU
    if args.steps:
        setup = replace(setup, steps=args.steps, concurrent_steps=args.steps)
    if setup.device == "cuda" and not torch.cuda.is_available():
        print("--h200 needs a CUDA device", file=sys.stderr)
        return 2
    if setup.device == "cpu":
        torch.set_num_threads(1)
    results: dict[str, dict[str, BenchResult]] = {}
    worker_calls: dict[str, dict[str, int]] = {}
    common = {
        "window_ms": args.batch_window_ms,
        "api": args.api,
        "phases": args.phase_list,
        "overrides": args.overrides,
        "pairs": args.pairs,
    }
    # The pools in the coordinator's process (workers.in_process: one GPU per coordinator)
    # over each client transport, then the same device behind a Ray actor.
    rows = [] if args.no_in_process else [(False, t) for t in args.transport_list]
    rows += [] if args.no_ray else [(True, args.transport_list[0])]
    if not set(args.phase_list) & set(SERVICE_PHASES):
        rows = []
    for ray, transport in rows:
        where = f"Ray {setup.device} worker" if ray else "pools in the server process"
        label = f"{where}, {TRANSPORTS[transport].label}"
        worker_calls[label] = {}
        results[label] = through_service(
            setup, ray=ray, transport=transport, worker_calls=worker_calls[label], **common
        )
    # After the services stopped, so the baseline has the device to itself (it is the
    # single client's reference, not needed without that run).
    base = in_process(setup) if "single" in args.phase_list else ([], 1.0)
    text = report(setup, results, base, args, worker_calls)
    if "host_tier" in args.phase_list:
        text += "\n" + "\n".join(host_tier(setup)) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
