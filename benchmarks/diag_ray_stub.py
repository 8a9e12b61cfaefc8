"""The coordinator's event-loop CPU per call behind a Ray worker, without a GPU (a diagnostic).

The H200's Ray row (bench_service.py --h200 --no-in-process --transports local-shm) on a
CPU host: one Ray actor's pool with Llama-3-8B heads and layers in bf16, its
write-and-attend a zero-cost stub (what is left is the service: client transport,
servicer, coordinator, batching, worker channel), clients in their own processes over the
local session with shared-memory tensors. Runs one client of batch 32, one of batch 8 and
`--clients` of batch 8 (alternating `--pairs` times), and prints per run the calls' p50,
tokens/s, sequences per worker call and the event loop's CPU per call (its thread's clock),
the figure both targets of the H200 row are bound by.

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_ray_stub.py [--clients 8] [--pairs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import json
import threading
import time
from dataclasses import replace

import ray
from bench_service import H200, TRANSPORTS, service_config, worker_rounds

from cache_service.bench import BenchConfig, run_decode_bench
from cache_service.server import start_service


def _stub_pool() -> None:
    """In the actor: the pool's write-and-attend, per layer, by pages and over layers
    (rounds over several layers), returns zeros at once (diag_concurrency_stub.stub_pools,
    defined here so that Ray ships it by value)."""
    import torch

    import workers.pool as wp

    def fake(self, layer, slot_mapping, key, value, query, *a, return_lse=False, out=None, **kw):
        o = torch.zeros_like(query) if out is None else out.zero_()
        return (o, torch.zeros(query.shape[:2])) if return_lse else o

    def fake_pages(self, slot_mapping, key, value, query, *a, return_lse=False, out=None, **kw):
        # A round's parts (workers.parts): zeros into each output part given.
        q = torch.cat(query) if isinstance(query, list) else query
        o = torch.zeros_like(q) if out is None else [p.zero_() for p in out]
        return (o, torch.zeros(q.shape[:2])) if return_lse else o

    def fake_layers(self, seq_layers, slot_layers, *a, **kw):
        return fake_pages(self, *a, **kw)

    wp.KVPool.write_and_attend = fake
    wp.KVPool.write_and_attend_pages = fake_pages
    wp.KVPool.write_and_attend_layers = fake_layers


async def _main(args: argparse.Namespace) -> None:
    setup = replace(H200, device="cpu", context=args.context, blocks=768, steps=args.steps)
    config = service_config(
        setup,
        ray=True,
        window_ms=0.5,
        overrides={
            "metrics.enabled": True,
            "metrics.port": 0,
            "workers.warm_up_query_heads": [],
            # The stub answers zeros: the online check would flag every round it picks.
            "coordinator.correctness_check_fraction": 0.0,
            **dict(_setting(item) for item in args.set),
        },
    )
    running = await start_service(config)
    loop = asyncio.get_running_loop()
    try:
        for client in running.coordinator._clients.values():
            await loop.run_in_executor(
                None, ray.get, client.handle.__ray_call__.remote(lambda w: _stub_pool())
            )
        wire = TRANSPORTS["local-shm"]
        common = {
            "context": setup.context,
            "steps": args.steps,
            "num_q_heads": setup.num_q_heads,
            "dtype": setup.layout.dtype,
            "session": wire.session,
            "shared_memory": wire.shared_memory,
            "local_session": wire.local_session,
        }
        many = f"{args.clients} clients, batch 8"
        runs = [("one client, batch 32", BenchConfig(batch=32, **common))]
        for _ in range(args.pairs):
            runs += [
                ("one client, batch 8", BenchConfig(batch=8, **common)),
                (many, BenchConfig(batch=8, clients=args.clients, **common)),
            ]
        kinds = {"batch32": "one client, batch 32", "one": "one client, batch 8", "many": many}
        wanted = {kinds[k] for k in args.runs.split(",")}
        runs = [(name, cfg) for name, cfg in runs if name in wanted]
        clock = time.pthread_getcpuclockid(threading.get_ident())
        run = functools.partial(
            run_decode_bench,
            processes=True,
            server_cpu_clock=functools.partial(time.clock_gettime, clock),
        )
        prof = cProfile.Profile() if args.profile is not None else None
        for name, cfg in runs:
            before = worker_rounds(running.metrics)
            if prof is not None:
                prof.enable()  # this thread: the event loop's
            result = await loop.run_in_executor(None, run, running.address, cfg)
            if prof is not None:
                prof.disable()
            after = worker_rounds(running.metrics)
            per_call = (after[0] - before[0]) / max(after[1] - before[1], 1)
            cpu = result.server_cpu_seconds or 0.0
            print(
                f"{name:<22} {result.tokens_per_s:9.1f} tok/s  p50 {result.p50_ms:.3f} ms  "
                f"{per_call:5.1f} seq/worker call  loop {cpu / result.wall_seconds:.2f} busy, "
                f"{cpu / len(result.call_seconds) * 1e3:.3f} ms CPU per call",
                flush=True,
            )
        if prof is not None:
            prof.dump_stats(args.profile)
    finally:
        await running.stop()


def _setting(item: str) -> tuple[str, object]:
    key, _, value = item.partition("=")
    return key, json.loads(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument(
        "--profile", help="write a cProfile of the event loop's thread over the runs here"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument(
        "--runs", default="batch32,one,many", help="of batch32, one, many (comma-separated)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a further service setting (dotted key, JSON value); repeatable",
    )  # fmt: skip
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
