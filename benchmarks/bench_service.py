"""Benchmark the whole service: decode steps through gRPC, the coordinator and the workers,
against the same kernel calls made in-process.

What one measurement is: a decode step of `batch` sequences, layer by layer, each layer one
append-and-attend RPC carrying one new token's K/V and one query row per sequence (what a
model's attention layer does). The client times every call (serialisation, loopback
network, coordinator, worker, kernels, reply); the in-process baseline times the same
`PoolWorker.write_and_attend` calls (same shapes, same growing lengths, results copied to
the host as the worker does for the service) without any RPC.

Modes:

CPU (default): a small layout, pools in the server process and then Ray CPU workers;
per-call p50/p99 and the RPC overhead over the in-process calls; and 1 client versus 4
concurrent clients (coalescing). Results go to --out as markdown.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_service.py \\
        --out benchmarks/results/service-cpu.md

H200 (--h200): the Llama-3-8B layout (32 layers, 32 query / 8 KV heads, head_dim 128, bf16,
block 16) on one GPU, its pool in the server's process and then behind a Ray actor: decode
batch 32 at context 2048, 32 layers per step,
steps/s and tokens/s through the service versus in-process, per-call p50/p99; then 8
concurrent clients of batch 8 versus one client of batch 8. Targets (issue 5): per-layer
append-and-attend p50 <= 1.5 ms at batch 32; 8 clients >= 3x the throughput of one.

    source .device/env.sh && python3 benchmarks/bench_service.py --h200 \\
        --out $OUT/service-h200.md
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import datetime
import functools
import io
import itertools
import json
import os
import platform
import pstats
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import thread_cpu
import torch
from cpu_pinning import reserve_core
from gc_time import GCTimer

from cache_service import event_loop
from cache_service.bench import (
    BenchConfig,
    BenchResult,
    fill_bases,
    free_bases,
    percentile,
    run_decode_bench,
)
from cache_service.config import CoordinatorConfig, ServiceConfig
from cache_service.event_loop import EVENT_LOOPS
from cache_service.server import start_service
from workers.actor import PoolWorker
from workers.config import PoolConfig
from workers.layout import KVLayout


@dataclass(frozen=True)
class Setup:
    """One benchmarked configuration."""

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
    # 640 calls per client: 10 steps left the ratio at the mercy of a few slow rounds
    # (1.55x to 3.05x across calls with the same code on the H200).
    concurrent_steps=20,
)


def service_config(
    setup: Setup,
    *,
    ray: bool,
    window_ms: float,
    cuda_graphs: bool = True,
    overrides: Mapping[str, Any] | None = None,
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
            "workers.cuda_graphs": cuda_graphs,
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
# concurrent clients (--phases picks some).
PHASES = ("single", "one_small", "concurrent")


def through_service(
    setup: Setup,
    *,
    ray: bool,
    window_ms: float,
    api: str = "batch",
    profile: Path | None = None,
    transport: str = "session-shm",
    cuda_graphs: bool = True,
    phases: tuple[str, ...] = PHASES,
    overrides: Mapping[str, Any] | None = None,
    pairs: int = 1,
    worker_calls: dict[str, int] | None = None,
    profile_phase: str = "single",
    loop_cpu: int | None = None,
    threads: bool = False,
    fresh_contexts: bool = False,
    alternate_checks: bool = False,
) -> dict[str, BenchResult]:
    """Start a service, run the single-client and the concurrency benchmarks, stop it.

    Results by phase; with `pairs` > 1 the one-client and concurrent runs alternate that
    many times, the later pairs' results under "one_small@2", "concurrent@2", ...

    profile: write a cProfile of the server's event-loop thread during the first run of
    `profile_phase` here, and run only that phase (it slows the run; for finding costs, not
    for the figures).
    cuda_graphs: the service's CUDA pools replay repeated layers as graphs (workers.cuda_graphs).
    phases: which of PHASES to run.
    overrides: further service configuration (`service_config`).
    loop_cpu: give the coordinator's event-loop thread this CPU's core to itself
        (`cpu_pinning.reserve_core`, before every run: clients and Ray's processes on the
        other CPUs).
    fresh_contexts: every run fills new sequences of `setup.context` tokens (as before the
        eighteenth session) instead of decoding forks of sequences filled once at the start
        (`fill_bases`; the concurrent run's clients' sequences, the single run on the first
        `setup.batch` of them): the same contexts in every run, and each run costs its
        decode steps rather than a fill of gigabytes.
    threads: print the busiest threads (this process's, the clients', Ray's) over each
        run's timed steps (`thread_cpu`; reading /proc there takes the GIL a while at both
        ends: for finding the pace setter, not for the figures).
    alternate_checks: the online correctness check off (the coordinator's checker set
        aside) for the runs of every even-numbered pair: what the check costs, read from
        alternating pairs of one service (a diagnostic; the report's ratio then mixes both).
    worker_calls: filled with the per-layer worker calls of Ray workers (warm-up included)
        that went over the worker channel ("channel"), of those as repeats ("repeats"), and
        through Ray ("ray")."""
    dtype = setup.layout.dtype
    t = TRANSPORTS[transport]
    wire = {
        "api": api,
        "session": t.session,
        "shared_memory": t.shared_memory,
        "local_session": t.local_session,
    }

    config = service_config(
        setup, ray=ray, window_ms=window_ms, cuda_graphs=cuda_graphs, overrides=overrides
    )

    async def main() -> dict[str, BenchResult]:
        running = await start_service(config)
        loop = asyncio.get_running_loop()
        # The event-loop thread's CPU clock, readable from the thread the clients run in:
        # how busy the coordinator's one thread was over the timed steps.
        loop_clock = time.pthread_getcpuclockid(threading.get_ident())
        loop_tid = threading.get_native_id()
        collector = GCTimer()
        collector.__enter__()
        try:
            out = {}
            runs = (
                ("single", BenchConfig(batch=setup.batch, context=setup.context,
                                       steps=setup.steps, num_q_heads=setup.num_q_heads,
                                       dtype=dtype, **wire)),
                ("one_small", BenchConfig(batch=setup.concurrent_batch, context=setup.context,
                                          steps=setup.concurrent_steps,
                                          num_q_heads=setup.num_q_heads, dtype=dtype,
                                          **wire)),
                ("concurrent", BenchConfig(batch=setup.concurrent_batch, context=setup.context,
                                           steps=setup.concurrent_steps,
                                           clients=setup.concurrent_clients,
                                           num_q_heads=setup.num_q_heads, dtype=dtype,
                                           **wire)),
            )  # fmt: skip
            # Alternating the one-client and concurrent runs spreads a drift of the host's
            # speed over both sides of each pair's ratio.
            runs += tuple((f"{key}@{n}", cfg) for n in range(2, pairs + 1) for key, cfg in runs[1:])
            checker = running.coordinator.correctness
            bases: tuple[tuple[str, ...], ...] = ()
            if not fresh_contexts:
                bases = await loop.run_in_executor(
                    None,
                    functools.partial(fill_bases, running.address, runs[2][1], processes=True),
                )
                runs = tuple((key, _on_bases(cfg, bases)) for key, cfg in runs)
            for key, cfg in runs:
                phase = key.split("@")[0]
                # Clients in their own processes: a client sharing the server's GIL would
                # slow both and inflate the figures.
                if (profile is not None and phase != profile_phase) or phase not in phases:
                    continue
                run = functools.partial(
                    run_decode_bench,
                    processes=True,
                    server_cpu_clock=functools.partial(time.clock_gettime, loop_clock),
                )
                if loop_cpu is not None:
                    others, moved = reserve_core(loop_cpu)
                    print(
                        f"event loop on CPU {loop_cpu}; {moved} other threads on "
                        f"{len(others)} CPUs",
                        flush=True,
                    )
                    run = functools.partial(_on_cpus, others, run)
                if alternate_checks:
                    pair = int(key.split("@")[1]) if "@" in key else 1
                    running.coordinator.correctness = checker if pair % 2 else None
                prof = cProfile.Profile() if profile is not None and key == profile_phase else None
                if prof is not None:
                    prof.enable()  # the event loop's thread: gRPC handlers and coordinator
                before = worker_rounds(running.metrics)
                checks_before = correctness_checks(running.metrics)
                now_before = local_calls(running)
                collector.reset()
                snapshots: list[tuple[float, thread_cpu.Snapshot]] = []
                if threads:
                    run = functools.partial(run, server_cpu_clock=functools.partial(
                        _clock_and_threads, functools.partial(time.clock_gettime, loop_clock),
                        snapshots,
                    ))  # fmt: skip
                loop_before = thread_cpu.thread_times(loop_tid)
                rounds_before = round_kinds(running.metrics)
                result = await loop.run_in_executor(None, run, running.address, cfg)
                loop_after = thread_cpu.thread_times(loop_tid)
                now_after = local_calls(running)
                after = worker_rounds(running.metrics)
                checks_after = correctness_checks(running.metrics)
                calls = after[1] - before[1]
                per_call = (after[0] - before[0]) / calls if calls else None
                checked = (
                    round(checks_after[0] - checks_before[0]),
                    checks_after[1] - checks_before[1],
                )
                out[key] = replace(
                    result, sequences_per_worker_call=per_call, correctness_checks=checked
                )
                # Each run's figures as it ends: a run cut short by a time limit still
                # leaves what it measured in the log.
                cpu = result.server_cpu_seconds
                print(
                    f"[{time.strftime('%H:%M:%S')}] {key}: {result.tokens_per_s:.1f} tok/s, p50 "
                    f"{result.p50_ms:.3f} ms, {per_call or 0:.1f} sequences per worker call"
                    + ("" if cpu is None else f", loop {cpu / result.wall_seconds:.2f} busy")
                    + f", {collector.line()} over the run (setup included)"
                    + f", {checked[0]} checks ({checked[1] * 1e3:.0f} ms in all)"
                    + _loop_split(loop_before, loop_after, now_after[0] - now_before[0])
                    + _rounds_line(round_kinds(running.metrics) - rounds_before)
                    + (
                        ""
                        if now_after[0] == now_before[0]
                        else f", {now_after[1] - now_before[1]} of "
                        f"{now_after[0] - now_before[0]} local-session calls from a callback"
                    ),
                    flush=True,
                )
                if len(snapshots) == 2:
                    (t0, first), (t1, last) = snapshots
                    busy = thread_cpu.busiest(first, last, t1 - t0)
                    print("  busiest threads: " + "; ".join(busy), flush=True)
                if prof is not None:
                    prof.disable()
                    text = io.StringIO()
                    stats = pstats.Stats(prof, stream=text)
                    stats.sort_stats("tottime").print_stats(60)
                    stats.sort_stats("cumulative").print_stats(60)
                    profile.write_text(text.getvalue())
            if worker_calls is not None:
                clients = list(running.coordinator._clients.values())
                worker_calls["channel"] = sum(getattr(c, "channel_calls", 0) for c in clients)
                worker_calls["ray"] = sum(getattr(c, "ray_data_calls", 0) for c in clients)
                worker_calls["repeats"] = sum(getattr(c, "channel_repeats", 0) for c in clients)
            if bases:
                await loop.run_in_executor(None, free_bases, running.address, bases)
            return out
        finally:
            collector.__exit__()
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


def _clock_and_threads(clock: Callable[[], float], snapshots: list[tuple[float, Any]]) -> float:
    """`clock()`, after keeping (now, every thread's CPU so far) in `snapshots`."""
    snapshots.append((time.perf_counter(), thread_cpu.snapshot()))
    return clock()


def _on_cpus(cpus: set[int], run: Callable[..., Any], *args: Any) -> Any:
    """`run(*args)` on a thread (and its client processes) kept to `cpus`."""
    os.sched_setaffinity(0, cpus)
    return run(*args)


def round_kinds(metrics: Any) -> collections.Counter[str]:
    """The service's worker rounds so far, from its metrics: all of them ("rounds"), their
    client calls ("parts") and those over several layers ("pages")."""
    parts, rounds = histogram_totals(metrics.worker_round_size)
    pages = sum(
        sample.value
        for family in metrics.worker_calls_over_layers.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    )
    return collections.Counter(
        {"rounds": round(rounds), "parts": round(parts), "pages": round(pages)}
    )


def _rounds_line(counts: collections.Counter[str]) -> str:
    """A run's worker rounds: how many, parts per round, the share over pages."""
    if not counts["rounds"]:
        return ""
    return (
        f", {counts['rounds']} rounds ({counts['parts'] / counts['rounds']:.2f} parts each, "
        f"{counts['pages'] / counts['rounds']:.0%} over pages of several layers)"
    )


def _loop_split(
    before: thread_cpu.ThreadTimes | None, after: thread_cpu.ThreadTimes | None, calls: int
) -> str:
    """The event-loop thread's CPU per local-session call of a run (its setup included:
    creating and forking sequences) split into Python (user) and kernel (system) time, and
    how often it slept or was preempted per call: where a call's loop time goes beyond the
    Python that the in-process diagnostics see."""
    if before is None or after is None or calls <= 0:
        return ""
    d = after - before
    return (
        f", loop per local call (setup included) user {d.user_s / calls * 1e3:.3f} ms / "
        f"system {d.system_s / calls * 1e3:.3f} ms, {d.voluntary / calls:.2f} sleeps / "
        f"{d.involuntary / calls:.2f} preemptions"
    )


def local_calls(running: Any) -> tuple[int, int]:
    """(calls, of them answered from a round's callback) of the service's local sessions
    so far; (0, 0) without them."""
    local = running.local_sessions
    return (0, 0) if local is None else (local.calls, local.calls_now)


def histogram_totals(histogram: Any) -> tuple[float, float]:
    """(sum, count) of a prometheus_client histogram over all its label sets so far
    (differences between two reads matter)."""
    total = count = 0.0
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total, count


def correctness_checks(metrics: Any) -> tuple[float, float]:
    """(checks, seconds) of the service's online correctness check so far."""
    seconds, checks = histogram_totals(metrics.correctness_check_duration)
    return checks, seconds


def worker_rounds(metrics: Any) -> tuple[float, float]:
    """(sequences, worker calls) so far, over every worker, from the service's worker
    batch-size histogram (warm-up included)."""
    return histogram_totals(metrics.worker_batch_size)


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


def decode_pool(
    setup: Setup,
    steps: int,
    name: str = "bench",
    fingerprints: bool = True,
    cuda_graphs: bool = True,
) -> DecodePool:
    """A pool filled for `steps` decode steps of `setup` after its context.

    fingerprints: record slot fingerprints on every write, as the service's pools do by
    default (they serve its online correctness check), so the in-process baseline does
    the same pool work per call as the service.
    cuda_graphs: replay repeated per-layer calls as CUDA graphs, as the service's pools do
    by default (workers.decode_graphs).
    """
    lay = setup.layout
    bs, hkv, d = lay.block_size, lay.num_kv_heads, lay.head_dim
    per_seq = -(-(setup.context + steps + 4) // bs)
    config = PoolConfig(
        lay,
        num_blocks=setup.batch * per_seq + 1,
        fingerprints=fingerprints,
        cuda_graphs=cuda_graphs,
    )
    worker = PoolWorker(name, config, setup.device)
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
    """The same write_and_attend calls on a PoolWorker in this process.

    Returns (per-call seconds, wall seconds of the timed steps).
    """
    lay = setup.layout
    warmup = 3
    pool = decode_pool(setup, warmup + setup.steps)
    worker, epoch, tables, k, q, qsl = (
        pool.worker, pool.epoch, pool.tables, pool.key, pool.query, pool.qsl
    )  # fmt: skip
    times: list[float] = []
    length = setup.context
    t_start = 0.0
    for step in range(warmup + setup.steps):
        if step == warmup:
            t_start = time.perf_counter()
        slots, seq_lens = pool.step_args(length)
        for layer in range(lay.num_layers):
            t0 = time.perf_counter()
            # The worker returns host tensors, as it does for the service, and keeps the
            # step's attention metadata under one key, as the service's plan reuse does.
            worker.write_and_attend(
                epoch, layer, slots, k, k, q, tables, seq_lens, qsl, metadata_key=step
            )
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
    """The run's correctness-checked rounds and their mean check time (warm-up included;
    each ran after its round answered)."""
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


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def report(setup: Setup, results: dict[str, dict[str, BenchResult]], base: tuple[list[float], float],
           args: argparse.Namespace,
           worker_calls: Mapping[str, Mapping[str, int]] | None = None) -> str:  # fmt: skip
    lay = setup.layout
    base_times, base_wall = base
    b50, b99 = percentile(base_times, 50), percentile(base_times, 99)
    base_steps = setup.steps / base_wall
    lines = [
        f"# Service benchmark ({setup.name})",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {platform.node()} / {platform.machine()} / {os.cpu_count()} CPUs"
        + (f" / {torch.cuda.get_device_name(0)}" if setup.device == "cuda" else ""),
        f"- python {platform.python_version()}, torch {torch.__version__}",
        f"- command: `{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`",
        f"- layout: {lay.num_layers} layers, {setup.num_q_heads} query / {lay.num_kv_heads} KV "
        f"heads, head_dim {lay.head_dim}, block {lay.block_size}, {lay.dtype}",
        f"- decode: batch {setup.batch}, context {setup.context}, {setup.steps} timed steps "
        f"of {lay.num_layers} append-and-attend calls (3 warm-up steps); batching window "
        f"{args.batch_window_ms} ms",
        "- contexts: "
        + (
            "every run fills new sequences"
            if args.fresh_contexts
            else f"the concurrent run's {setup.concurrent_clients * setup.concurrent_batch} "
            "sequences filled once per service; every run decodes forks of them (the single "
            f"run of the first {setup.batch}), freed after it"
        ),
        f"- client call: {API_TEXT[args.api]}; transports (rows): "
        + "; ".join(TRANSPORTS[t].label for t in args.transports.split(",")),
        "- online correctness check: "
        + (
            f"the service's default, {CoordinatorConfig().correctness_check_fraction} of "
            "worker rounds"
            if args.correctness_check_fraction is None
            else f"{args.correctness_check_fraction} of worker rounds"
        )
        + (
            ""
            if args.correctness_check_sequences is None
            else f", at most {args.correctness_check_sequences} sequences each"
        )
        + " (a checked round answers first, its check runs beside the traffic)"
        + ("; off in the Ray row's even-numbered pairs" if args.alternate_checks else ""),
        f"- the coordinator's event loop (server.event_loop): {args.event_loop or 'asyncio'}",
        f"- the service's CUDA pools replay repeated layers as CUDA graphs: "
        f"{'no' if args.no_graphs else 'yes'}; runs: {args.phases}",
        "- each client runs in its own process (over loopback, by the row's transport); one "
        "worker; the server's "
        "process holds the coordinator, and the pools in the rows that say so (a Ray row's "
        "pool is in a Ray actor on the same device)",
        *(
            f"- {label}: per-layer worker calls over the worker channel / through Ray: "
            f"{calls['channel']} / {calls['ray']} ({calls.get('repeats', 0)} of the channel's "
            "sent as repeats of the connection's last call)"
            for label, calls in (worker_calls or {}).items()
        ),
        "",
        "## One client: per-layer append-and-attend",
        "",
        "| path | p50 ms | p99 ms | steps/s | tokens/s | p50 overhead over in-process ms "
        "| correctness checks (ms each, after the answer) "
        "| server loop busy (its CPU ms per call) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    if base_times:
        lines.append(
            f"| in-process `PoolWorker.write_and_attend` (no RPC) | {fmt_ms(b50)} | "
            f"{fmt_ms(b99)} | {base_steps:.2f} | {base_steps * setup.batch:.1f} | - | - | - |"
        )
    for label, res in results.items():
        if "single" not in res:
            continue
        r = res["single"]
        lines.append(
            f"| service, {label} | {r.p50_ms:.3f} | {r.p99_ms:.3f} | {r.steps_per_s:.2f} | "
            f"{r.tokens_per_s:.1f} | {r.p50_ms - b50 * 1e3:.3f} | {checked(r)} | "
            f"{loop_busy(r)} |"
        )
    lines += [
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

    def per_round(r: BenchResult) -> str:
        n = r.sequences_per_worker_call
        return "-" if n is None else f"{n:.2f}"

    for label, res in results.items():
        pairs = concurrency_pairs(res)
        if not pairs:
            continue
        ratio, one, many = median_pair(pairs)
        every = ", ".join(f"{r:.2f}x" for r, _, _ in pairs)
        lines.append(
            f"| service, {label} | {one.tokens_per_s:.1f} | {many.tokens_per_s:.1f} | "
            f"{ratio:.2f}x | {many.p50_ms:.3f} | {many.p99_ms:.3f} | "
            f"{per_round(one)} / {per_round(many)} | {loop_busy(one)} / {loop_busy(many)} | "
            f"{every} |"
        )
    if setup.name == "h200":
        lines += ["", "## Targets (issue 5)", ""]
        for label, res in results.items():
            if any(phase not in res for phase in PHASES):
                continue
            r = res["single"]
            ratio, _, _ = median_pair(concurrency_pairs(res))
            lines += [
                f"- {label}: per-layer append-and-attend p50 at batch 32 <= 1.5 ms: "
                f"{r.p50_ms:.3f} ms ({'met' if r.p50_ms <= 1.5 else 'NOT met'}); 8 concurrent "
                f"clients of batch 8 >= 3x one client: {ratio:.2f}x "
                f"({'met' if ratio >= 3 else 'NOT met'})",
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--h200", action="store_true", help="the Llama-3-8B setup on one GPU")
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    parser.add_argument("--batch-window-ms", type=float, default=0.5)
    parser.add_argument("--steps", type=int, help="timed steps (default: the setup's)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray worker run")
    parser.add_argument(
        "--ray-without-channel",
        action="store_true",
        help="also run the Ray worker with workers.channel_arena_bytes=0 (every call through Ray)",
    )
    parser.add_argument(
        "--no-in-process", action="store_true",
        help="skip the runs with the pools in the server's process (the Ray run alone)",
    )  # fmt: skip
    parser.add_argument("--api", choices=tuple(API_TEXT), default="batch", help="client call")
    parser.add_argument(
        "--profile", type=Path, help="also run once under cProfile, the server's stats here"
    )
    parser.add_argument(
        "--transports",
        default="session-shm,unary",
        help=f"comma-separated client transports, of {', '.join(TRANSPORTS)}",
    )
    parser.add_argument(
        "--no-graphs", action="store_true", help="the service's pools without CUDA graphs"
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="alternate the one-client and concurrent runs this many times in one service; "
        "the report's ratio is the lower median of the pairs'",
    )
    parser.add_argument(
        "--correctness-check-fraction",
        type=float,
        help="coordinator.correctness_check_fraction (default: the service's, "
        f"{CoordinatorConfig().correctness_check_fraction}): the share of worker rounds "
        "recomputed with the reference (after their callers are answered)",
    )
    parser.add_argument(
        "--correctness-check-sequences",
        type=int,
        help="coordinator.correctness_check_sequences (default: every sequence of a checked round)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a further service setting (dotted key, JSON value), e.g. "
        "workers.channel_connections=1; repeatable",
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        help="server.event_loop: the coordinator's event loop (default: the service's, asyncio)",
    )
    parser.add_argument(
        "--fresh-contexts",
        action="store_true",
        help="every run fills new sequences (the default decodes forks of sequences filled "
        "once per service: the same contexts in every run, and runs cost their steps only)",
    )
    parser.add_argument(
        "--loop-cpu",
        type=int,
        help="the Ray row's coordinator event-loop thread on this CPU, its core kept free "
        "of every other thread of the benchmark (clients, Ray) (benchmarks/cpu_pinning.py)",
    )
    parser.add_argument(
        "--threads",
        action="store_true",
        help="print the Ray row's busiest threads over each run's timed steps (a diagnostic: "
        "it disturbs the figures a little)",
    )
    parser.add_argument(
        "--alternate-checks",
        action="store_true",
        help="the Ray row's even-numbered pairs run with the online correctness check off "
        "(a diagnostic of what the check costs; the report's ratio then mixes both)",
    )
    parser.add_argument(
        "--profile-ray",
        choices=PHASES,
        help="the Ray row runs only this phase, under cProfile (the server's event-loop "
        "thread; its stats at --profile-out); for finding costs, not for the figures",
    )
    parser.add_argument(
        "--profile-out", type=Path, default=Path("ray-profile.txt"), help="see --profile-ray"
    )
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated service runs, of {', '.join(PHASES)}",
    )
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    phases = tuple(args.phases.split(","))
    if any(p not in PHASES for p in phases):
        parser.error(f"--phases: choose among {list(PHASES)}, got {args.phases!r}")
    setup = H200 if args.h200 else CPU
    if args.steps:
        setup = replace(setup, steps=args.steps, concurrent_steps=args.steps)
    if setup.device == "cuda" and not torch.cuda.is_available():
        print("--h200 needs a CUDA device", file=sys.stderr)
        return 2
    if setup.device == "cpu":
        torch.set_num_threads(1)
    results: dict[str, dict[str, BenchResult]] = {}
    overrides = {
        "coordinator.correctness_check_fraction": args.correctness_check_fraction,
        "coordinator.correctness_check_sequences": args.correctness_check_sequences,
        "server.event_loop": args.event_loop,
    }
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set wants KEY=VALUE, got {item!r}")
        overrides[key] = json.loads(value)
    # First the pools in the coordinator's process (workers.in_process: the deployment for
    # one GPU per coordinator), over each client transport, then the same GPU behind a Ray
    # actor (the first transport).
    transports = args.transports.split(",")
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        parser.error(f"unknown transport(s) {unknown}; choose among {list(TRANSPORTS)}")
    for transport in [] if args.no_in_process else transports:
        results[f"pools in the server process, {TRANSPORTS[transport].label}"] = through_service(
            setup,
            ray=False,
            window_ms=args.batch_window_ms,
            api=args.api,
            transport=transport,
            cuda_graphs=not args.no_graphs,
            phases=phases,
            overrides=overrides,
            pairs=args.pairs,
            fresh_contexts=args.fresh_contexts,
        )
    if args.profile:
        # A shorter context: filling 8 GiB again would cost more than the profile tells.
        short = replace(setup, context=min(setup.context, 512), steps=min(setup.steps, 5))
        through_service(
            short,
            ray=False,
            window_ms=args.batch_window_ms,
            api=args.api,
            profile=args.profile,
            transport=transports[0],
            overrides=overrides,
        )
    worker_calls: dict[str, dict[str, int]] = {}
    ray_rows = [] if args.no_ray else [("", 32 << 20)]
    if args.ray_without_channel:
        ray_rows.append((" without its channel (every call through Ray)", 0))
    for suffix, arena in ray_rows:
        label = f"Ray {setup.device} worker{suffix}, {TRANSPORTS[transports[0]].label}"
        worker_calls[label] = {}
        results[label] = through_service(
            setup,
            ray=True,
            window_ms=args.batch_window_ms,
            api=args.api,
            transport=transports[0],
            cuda_graphs=not args.no_graphs,
            phases=phases,
            overrides={**overrides, "workers.channel_arena_bytes": arena},
            pairs=args.pairs,
            fresh_contexts=args.fresh_contexts,
            worker_calls=worker_calls[label],
            profile=args.profile_out if args.profile_ray else None,
            profile_phase=args.profile_ray or "single",
            loop_cpu=args.loop_cpu,
            threads=args.threads,
            alternate_checks=args.alternate_checks,
        )
    # After the service stopped, so the baseline has the device to itself (it is the single
    # client's reference, not needed without that run).
    base = in_process(setup) if "single" in phases else ([], 1.0)
    text = report(setup, results, base, args, worker_calls)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
