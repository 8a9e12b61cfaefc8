"""`kvcache`: serve the KV-cache service, run the demo, benchmark it, inspect it.

    kvcache serve  [--config FILE] [flags]   start workers + coordinator, serve until Ctrl-C
    kvcache demo   [flags]                   the end-to-end demo (exit 1 on any mismatch)
    kvcache bench  [--target HOST:PORT]      decode-step latency/throughput through the RPC
    kvcache info   --target HOST:PORT        layout, workers, capacity
    kvcache stats  --target HOST:PORT        pools, utilization, fragmentation, prefix hits
    kvcache events --target HOST:PORT        KV events (stored/removed/cleared); --follow

Flags override the configuration file (see cache_service.config for the file format).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import Any

from cache_service import event_loop
from cache_service.config import ConfigError, ServiceConfig, load_config
from cache_service.event_loop import EVENT_LOOPS, EventLoopUnavailable

__all__ = ["build_parser", "main", "service_config_from_args"]

# CLI flag -> dotted configuration key.
_OVERRIDES = {
    "host": "server.host",
    "port": "server.port",
    "max_message_mb": None,  # converted below
    "num_workers": "workers.num_workers",
    "blocks_per_worker": "workers.blocks_per_worker",
    "host_tier_blocks": "workers.host_tier_blocks",
    "device": "workers.device",
    "ray_address": "workers.ray_address",
    "ray_num_cpus": "workers.ray_num_cpus",
    "batch_window_ms": "coordinator.batch_window_ms",
    "metrics_host": "metrics.host",
    "metrics_port": "metrics.port",
    "auth_file": "auth_file",
    "store_path": "store_path",
    "num_layers": "layout.num_layers",
    "num_kv_heads": "layout.num_kv_heads",
    "head_dim": "layout.head_dim",
    "block_size": "layout.block_size",
    "dtype": "layout.dtype",
    "log_level": "log_level",
    "log_format": "log_format",
    "event_loop": "server.event_loop",
    "torch_threads": "server.torch_threads",
}


def _add_service_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("service (override the --config file)")
    g.add_argument("--config", help="YAML configuration file")
    g.add_argument("--host", help="gRPC listen address (default 127.0.0.1)")
    g.add_argument("--port", type=int, help="gRPC port (0: any free port; default 50051)")
    g.add_argument("--max-message-mb", type=int, help="largest gRPC message, MiB (default 256)")
    g.add_argument("--num-workers", type=int, help="worker pools to start (default 2)")
    g.add_argument("--blocks-per-worker", type=int, help="blocks in each pool (default 512)")
    g.add_argument(
        "--host-tier-blocks",
        type=int,
        help="host-memory blocks per worker for evicted prefix blocks (default 0: none)",
    )
    g.add_argument("--device", choices=("cpu", "cuda"), help="worker device (default cpu)")
    g.add_argument(
        "--ray-address", help="join this Ray cluster (e.g. auto) instead of starting a local Ray"
    )
    g.add_argument("--ray-num-cpus", type=int, help="CPUs of the local Ray")
    g.add_argument(
        "--in-process",
        action="store_true",
        default=None,
        help="run the pools in this process, no Ray",
    )
    g.add_argument("--batch-window-ms", type=float, help="coalescing window, ms (default 0.5)")
    g.add_argument("--metrics-host", help="Prometheus endpoint address")
    g.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (0: any free port)")
    g.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    g.add_argument("--auth-file", help="bearer-token file (YAML/JSON, see cache_service.api.auth)")
    g.add_argument("--tls-cert", help="server certificate chain (PEM)")
    g.add_argument("--tls-key", help="server private key (PEM)")
    g.add_argument("--tls-client-ca", help="require client certificates signed by this CA")
    g.add_argument(
        "--store-path",
        help="write-ahead metadata store (SQLite file): recovered at start, every mutation logged",
    )
    g.add_argument("--num-layers", type=int, help="layout: layers")
    g.add_argument("--num-kv-heads", type=int, help="layout: KV heads")
    g.add_argument("--head-dim", type=int, help="layout: head dim")
    g.add_argument("--block-size", type=int, help="layout: tokens per block")
    g.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="layout: KV dtype")
    g.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    g.add_argument("--log-format", choices=("text", "json"))
    g.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        help="the coordinator's event loop (default asyncio; uvloop needs the uvloop extra)",
    )
    g.add_argument(
        "--torch-threads",
        type=int,
        help="torch CPU threads in the server process (default: torch's choice with "
        "in-process CPU pools, else 1; 1 where co-located models share few cores)",
    )


def service_config_from_args(
    args: argparse.Namespace, base: ServiceConfig | None = None
) -> ServiceConfig:
    """The configuration file (or `base`) with the given flags applied."""
    config = (
        load_config(args.config) if getattr(args, "config", None) else (base or ServiceConfig())
    )
    overrides: dict[str, Any] = {}
    for flag, key in _OVERRIDES.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if flag == "max_message_mb":
            overrides["server.max_message_bytes"] = value << 20
        else:
            overrides[key] = value
    if getattr(args, "in_process", None):
        overrides["workers.in_process"] = True
    if getattr(args, "no_metrics", False):
        overrides["metrics.enabled"] = False
    tls = [getattr(args, n, None) for n in ("tls_cert", "tls_key")]
    if any(tls):
        if not all(tls):
            raise ConfigError("--tls-cert and --tls-key go together")
        overrides["tls.cert_file"], overrides["tls.key_file"] = tls
        overrides["tls.client_ca_file"] = getattr(args, "tls_client_ca", None)
    return config.with_overrides(overrides)


def build_parser() -> argparse.ArgumentParser:
    """The `kvcache` argument parser."""
    parser = argparse.ArgumentParser(prog="kvcache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start workers and the coordinator; serve until Ctrl-C")
    _add_service_flags(serve)

    demo = sub.add_parser("demo", help="end-to-end demo: clients sharing a prefix, checked")
    _add_service_flags(demo)
    demo.add_argument("--clients", type=int, default=3, help="concurrent clients (>= 2)")
    demo.add_argument("--prefix-tokens", type=int, default=48, help="shared prompt prefix")
    demo.add_argument("--suffix-tokens", type=int, default=9, help="each client's own prompt tail")
    demo.add_argument("--decode-steps", type=int, default=6, help="tokens decoded per client")

    bench = sub.add_parser("bench", help="decode-step latency and throughput through the RPC")
    _add_service_flags(bench)
    bench.add_argument("--target", help="benchmark this server instead of starting one")
    bench.add_argument("--token", help="bearer token for --target")
    bench.add_argument("--batch", type=int, default=8)
    bench.add_argument("--context", type=int, default=128)
    bench.add_argument("--steps", type=int, default=20)
    bench.add_argument("--clients", type=int, default=1)
    bench.add_argument("--num-q-heads", type=int, default=4)
    bench.add_argument(
        "--api",
        choices=("batch", "items"),
        default="batch",
        help="send [batch, ...] tensors (append_attend_batch) or one item per sequence",
    )

    for name, text in (
        ("info", "layout, workers and capacity"),
        ("stats", "pool statistics"),
        ("sequences", "the caller's tenant's sequences (live and lost), to find and free them"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
        p.add_argument("--token", help="bearer token")
        p.add_argument("--timeout", type=float, default=10.0, help="deadline, seconds")

    events = sub.add_parser("events", help="KV events of the prefix index, one line each")
    events.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
    events.add_argument("--token", help="bearer token")
    events.add_argument(
        "--from", dest="from_sequence", type=int, default=0,
        help="print the events after this number (0: from the oldest kept)",
    )  # fmt: skip
    events.add_argument("--worker", default="", help="only this worker's events")
    events.add_argument("--namespace", help="only this prefix-cache namespace's events")
    events.add_argument(
        "--follow", action="store_true", help="keep printing new events until Ctrl-C"
    )
    return parser


# ------------------------------------------------------------------------------ commands


async def _serve(config: ServiceConfig) -> int:
    from cache_service.api.server import configure_logging, start_service

    configure_logging(config.log_level, config.log_format)
    running = await start_service(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"kvcache serving on {running.address} (Ctrl-C drains and stops)", file=sys.stderr)
    await stop.wait()
    await running.stop()
    return 0


def _demo_config(args: argparse.Namespace) -> ServiceConfig:
    # A small layout and a free port: the demo must start fast and never collide.
    base = ServiceConfig().with_overrides(
        {
            "server.port": 0,
            "metrics.port": 0,
            "layout.num_layers": 4,
            "layout.num_kv_heads": 2,
            "layout.head_dim": 32,
            "layout.dtype": "float32",
            "workers.blocks_per_worker": 256,
            "workers.ray_num_cpus": 2,
            "coordinator.health_check_interval_s": 0,
            "log_level": "WARNING",
        }
    )
    return service_config_from_args(args, base)


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from cache_service.api.server import configure_logging
    from cache_service.cli.demo import DemoConfig, render, run_demo

    console = Console()
    config = _demo_config(args)
    configure_logging(config.log_level, config.log_format)
    cfg = DemoConfig(
        clients=args.clients,
        shared_prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        decode_steps=args.decode_steps,
    )
    mode = (
        "in-process pools"
        if config.workers.in_process
        else (
            f"Ray ({config.workers.ray_address or 'local'}), {config.workers.num_workers} "
            f"{config.workers.device} workers"
        )
    )
    console.print(f"[bold]kvcache demo[/bold]: {cfg.clients} clients, {mode}")
    with console.status("running") as status:
        report = event_loop.run(
            run_demo(config, cfg, lambda msg: status.update(msg)), config.server.event_loop
        )
    render(report, console)
    if report.ok:
        console.print(
            "[bold green]OK[/bold green]: every output equals dense attention; no block leaked"
        )
        return 0
    console.print(
        f"[bold red]FAILED[/bold red]: {report.mismatches} mismatches, "
        f"{report.leaked_blocks} blocks still used after freeing"
    )
    return 1


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from cache_service.cli.bench import BenchConfig, run_decode_bench

    cfg = BenchConfig(
        batch=args.batch,
        context=args.context,
        steps=args.steps,
        clients=args.clients,
        num_q_heads=args.num_q_heads,
        api=args.api,
    )

    async def embedded() -> Any:
        from cache_service.api.server import start_service

        running = await start_service(_demo_config(args))
        try:
            return await asyncio.get_running_loop().run_in_executor(
                None, run_decode_bench, running.address, cfg
            )
        finally:
            await running.stop()

    result = (
        run_decode_bench(args.target, cfg, token=args.token)
        if args.target
        else event_loop.run(embedded(), _demo_config(args).server.event_loop)
    )
    t = Table(
        title=f"append_attend, batch {cfg.batch}, context {cfg.context}, {cfg.clients} client(s)"
    )
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("calls timed", str(len(result.call_seconds)))
    t.add_row("per-call p50", f"{result.p50_ms:.3f} ms")
    t.add_row("per-call p99", f"{result.p99_ms:.3f} ms")
    t.add_row("steps/s (per client)", f"{result.steps_per_s:.2f}")
    t.add_row("tokens/s (all clients)", f"{result.tokens_per_s:.1f}")
    Console().print(t)
    return 0


def _info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from cache_service.client import KVCacheClient

    with KVCacheClient(args.target, token=args.token, timeout_s=args.timeout) as client:
        info = client.info()
    lay = info.layout
    console = Console()
    console.print(
        f"[bold]{args.target}[/bold] server {info.server_version}: layout L={lay.num_layers} "
        f"Hkv={lay.num_kv_heads} D={lay.head_dim} block={lay.block_size} {lay.dtype} "
        f"(fingerprint {info.fingerprint}); capacity {info.total_blocks} blocks = "
        f"{info.capacity_tokens} tokens; max message {info.max_message_bytes >> 20} MiB; "
        + (
            f"local sessions at {info.local_session_socket}"
            if info.local_session_socket
            else "no local sessions"
        )
    )
    t = Table(title="Workers")
    for col in ("worker", "device", "blocks", "epoch", "up", "calls reach it by"):
        t.add_column(col)
    for w in info.workers:
        path = w.data_path
        shown = f"[yellow]{path}[/yellow]" if path == "ray" else path or "-"
        t.add_row(
            w.worker_id,
            w.device,
            str(w.num_blocks),
            w.epoch,
            "yes" if w.up else "[red]no[/red]",
            shown,
        )
    console.print(t)
    return 0


def _stats(args: argparse.Namespace) -> int:
    from rich.console import Console

    from cache_service.cli.demo import DemoReport, render
    from cache_service.client import KVCacheClient

    with KVCacheClient(args.target, token=args.token, timeout_s=args.timeout) as client:
        stats = client.stats()
    render(DemoReport(clients=[], stats_live=stats), Console())
    return 0


def _sequences(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from cache_service.client import KVCacheClient

    with KVCacheClient(args.target, token=args.token, timeout_s=args.timeout) as client:
        entries = client.list_sequences()
    t = Table(title=f"Sequences of this tenant ({len(entries)})")
    for col in ("seq_id", "tokens", "written per layer", "state"):
        t.add_column(col)
    for e in entries:
        written = ",".join(str(w) for w in e.written) if e.written else "-"
        state = "[red]lost[/red] (free it)" if e.lost else "live"
        t.add_row(e.seq_id, str(e.num_tokens), written, state)
    Console(width=200).print(t)
    return 0


def _events(args: argparse.Namespace) -> int:
    from cache_service.client import KVCacheClient

    with (
        KVCacheClient(args.target, token=args.token) as client,
        client.kv_events(
            args.from_sequence, worker_id=args.worker, namespace=args.namespace
        ) as sub,
    ):
        try:
            for batch in sub.batches():
                for event in batch:
                    print(_event_line(event), flush=True)
                if not args.follow and sub.caught_up:
                    break
        except KeyboardInterrupt:  # Ctrl-C ends --follow: say where to resume
            pass
        print(
            f"# stream {sub.stream_id}: read up to {sub.position} (resume with --from "
            f"{sub.position}); oldest kept {sub.oldest_sequence}",
            file=sys.stderr,
        )
    return 0


def _event_line(event: Any) -> str:
    """One event: number, type, owner, worker and keys (hex, first 16 digits each)."""
    body = event.body
    owner = "public" if event.public else event.tenant or "-"
    if event.namespace:
        owner += f"/{event.namespace}"
    worker = body.worker_id or "all workers"
    if event.type == "cleared":
        return f"{event.sequence} cleared {worker}"
    keys = " ".join(h.hex()[:16] for h in body.hashes)
    line = f"{event.sequence} {event.type} {owner} {worker} {body.medium} [{keys}]"
    if event.type == "stored":
        line += f" parent {body.parent.hex()[:16]}"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `kvcache`; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from cache_service.client import KVCacheError

    try:
        if args.command == "serve":
            config = service_config_from_args(args)
            return event_loop.run(_serve(config), config.server.event_loop)
        if args.command == "demo":
            return _demo(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "info":
            return _info(args)
        if args.command == "sequences":
            return _sequences(args)
        if args.command == "events":
            return _events(args)
        return _stats(args)
    except (ConfigError, ValueError, EventLoopUnavailable) as exc:
        print(f"kvcache {args.command}: {exc}", file=sys.stderr)
        return 2
    except KVCacheError as exc:
        print(f"kvcache {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
