"""Bounded load on the whole service: 64 concurrent clients on loopback for 60 s.

Each client is a thread with its own connection and at most two live sequences; it mixes
create (often with one of a few shared system prompts, so prefixes are shared between
clients), streamed append (all layers), decode steps (one append-and-attend per layer),
attend, fork and free. A quarter of the attention outputs are compared on the client with
float64 dense attention over K/V the client rebuilds from the token ids. The run is bounded
by time and by an operation count. At the end every client frees its sequences and the
pools must hold no used block.

The server (coordinator + gRPC; with --workers ray its pools are two Ray CPU worker
processes, with --workers local they sit in the server process) runs in a child process,
whose resident memory is sampled every second: "flat" means no upward trend after warm-up.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_load.py \\
        --out benchmarks/results/load-cpu.md
    PYTHONPATH=. .venv/bin/python benchmarks/bench_load.py --smoke    # seconds

Prints a Markdown report (date, machine, command first); exits 1 on any error, mismatch or
block left in use.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import torch

from cache_service.cli.load_gen import (
    OPS,
    LoadConfig,
    LoadResult,
    ServerProcess,
    percentile,
    read_rss_bytes,
    run_load,
    scrape_metric,
)
from cache_service.client import KVCacheClient
from cache_service.config import ServiceConfig

MiB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-ops", type=int, default=1_000_000, help="operation count bound")
    p.add_argument("--workers", choices=("ray", "local"), default="ray")
    p.add_argument("--check-fraction", type=float, default=0.25, help="client-side checks")
    p.add_argument("--online-check", type=float, default=0.01, help="server-side check fraction")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before RSS is 'warm'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the markdown report here (also printed)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run: 4 clients for 5 s, pools in the server process, 1 s warm-up "
        "(seconds; the figures mean little)",
    )
    args = p.parse_args()
    if args.smoke:
        args.clients, args.duration, args.workers, args.warmup = 4, 5.0, "local", 1.0
    return args


def service_config(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig().with_overrides(
        {
            "server.port": 0,
            "metrics.port": 0,
            "layout.num_layers": 4,
            "layout.num_kv_heads": 2,
            "layout.head_dim": 32,
            "layout.block_size": 16,
            "layout.dtype": "float32",
            "workers.num_workers": 2,
            "workers.blocks_per_worker": 1024,
            "workers.in_process": args.workers == "local",
            "workers.ray_num_cpus": 2,
            "workers.namespace": f"kvcache-bench-load-{os.getpid()}",
            "coordinator.correctness_check_fraction": args.online_check,
            "log_level": "WARNING",
        }
    )


def slope_mib_per_min(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS over time, MiB per minute."""
    if len(samples) < 2:
        return 0.0
    ts = torch.tensor([t for t, _ in samples], dtype=torch.float64)
    ys = torch.tensor([b for _, b in samples], dtype=torch.float64) / MiB
    tc = ts - ts.mean()
    return float((tc * (ys - ys.mean())).sum() / (tc * tc).sum()) * 60.0


def report(
    args: argparse.Namespace,
    config: ServiceConfig,
    result: LoadResult,
    rss_idle: int,
    rss_after: int,
    server: dict[str, float],
    used_after: list[int],
) -> str:
    lay = config.layout
    warm = [(t, b) for t, b in result.rss if t >= args.warmup]
    warm_start = warm[0][1] if warm else 0
    warm_max = max((b for _, b in warm), default=0)
    end = result.rss[-1][1] if result.rss else 0
    ops_s = result.total_ops / result.wall_s
    lines = [
        "# Load benchmark (cpu)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()} / {platform.machine()} / {os.cpu_count()} CPUs",
        f"- python {platform.python_version()}, torch {torch.__version__}",
        f"- command: `{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`",
        f"- layout: {lay.num_layers} layers, 4 query / {lay.num_kv_heads} KV heads, head_dim "
        f"{lay.head_dim}, block {lay.block_size}, {lay.dtype}; 2 workers x 1024 blocks "
        f"({'Ray CPU worker processes' if args.workers == 'ray' else 'in the server process'})",
        f"- load: {args.clients} clients (threads, one connection each, loopback), "
        f"{args.duration:.0f} s or {args.max_ops} operations; client-side dense check of "
        f"{args.check_fraction:.0%} of attention outputs; online (server) check fraction "
        f"{args.online_check}",
        "",
        "## Outcome",
        "",
        f"- operations: {result.total_ops} in {result.wall_s:.1f} s ({ops_s:.1f}/s)",
        f"- unexpected errors: {len(result.errors)}",
        f"- attention outputs checked against dense: {result.checked}, mismatches "
        f"{result.mismatches}, max |err| {result.max_abs_err:.2e}",
        f"- prompt tokens found cached at create (prefix sharing): {result.prefix_hit_tokens}",
        f"- used blocks per worker after every sequence was freed: {used_after}",
        f"- server-side: non-OK RPC statuses {server['non_ok']:.0f} of "
        f"{server['rpcs']:.0f} RPCs; online correctness mismatches "
        f"{server['mismatches']:.0f}",
        "",
        "## Operations",
        "",
        "| operation | count | per s | p50 ms | p99 ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for op in OPS:
        lat = result.latency_s[op]
        lines.append(
            f"| {op} | {result.ops[op]} | {result.ops[op] / result.wall_s:.1f} | "
            f"{percentile(lat, 50) * 1e3:.1f} | {percentile(lat, 99) * 1e3:.1f} |"
        )
    lines += [
        "",
        "append_attend is a decode step: one append-and-attend RPC per layer (4 RPCs); append",
        "is one streamed Append of 1-8 tokens on every layer; create includes appending the",
        "uncached part of the prompt.",
        "",
        "## Coordinator memory (resident set of the server process)",
        "",
        f"- before the load: {rss_idle / MiB:.1f} MiB",
        f"- at {args.warmup:.0f} s (warm): {warm_start / MiB:.1f} MiB; highest after: "
        f"{warm_max / MiB:.1f} MiB; at the end: {end / MiB:.1f} MiB",
        f"- trend after warm-up (least squares): {slope_mib_per_min(warm):+.2f} MiB/min",
        f"- after all sequences were freed: {rss_after / MiB:.1f} MiB",
        "",
        "| t s | RSS MiB |",
        "| ---: | ---: |",
    ]
    for t, b in result.rss[:: max(1, len(result.rss) // 12)]:
        lines.append(f"| {t:.0f} | {b / MiB:.1f} |")
    if result.errors:
        lines += ["", "## Errors (first 10)", ""] + [f"- {e}" for e in result.errors[:10]]
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    config = service_config(args)
    layout = config.layout.kv_layout()
    load = LoadConfig(
        clients=args.clients,
        duration_s=args.duration,
        max_ops=args.max_ops,
        check_fraction=args.check_fraction,
        seed=args.seed,
    )
    with ServerProcess(config) as server:
        print(f"server pid {server.pid} at {server.address}", flush=True)
        rss_idle = read_rss_bytes(server.pid)
        result = run_load(
            server.address,
            layout,
            load,
            rss_pid=server.pid,
            progress=lambda t, n: print(f"  {t:5.0f} s  {n} operations", flush=True),
        )
        with KVCacheClient(server.address) as client:
            stats = client.stats()
        rss_after = read_rss_bytes(server.pid)
        url = server.metrics_url
        rpcs = scrape_metric(url, "kvcache_rpc_requests_total") if url else float("nan")
        ok = scrape_metric(url, "kvcache_rpc_requests_total", {"code": "OK"}) if url else 0.0
        server_side = {
            "rpcs": rpcs,
            "non_ok": rpcs - ok,
            "mismatches": scrape_metric(url, "kvcache_correctness_mismatches_total") if url else 0,
        }
    text = report(
        args,
        config,
        result,
        rss_idle,
        rss_after,
        server_side,
        [w.used_blocks for w in stats.workers],
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    failed = result.errors or result.mismatches or any(w.used_blocks for w in stats.workers)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
