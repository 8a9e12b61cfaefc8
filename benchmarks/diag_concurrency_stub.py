"""The service's own cost under concurrent clients, without a GPU (a diagnostic).

A service whose pools' write-and-attend is a zero-cost stub (what is left is the gRPC or
local-session transport, the servicer, the coordinator and the batching) serves one
client of batch 8 and then `--clients` client processes of batch 8, Llama-3-8B heads and
layers in bf16. Per run it prints tokens/s, per-call p50/p99, the server's CPU time per
session call (setup included) and the server process's garbage collections with the
longest pauses (`gc.callbacks`), so collector stalls show next to the latency tail.
`--profile FILE` writes a cProfile of the server's event loop during the concurrent run.

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_concurrency_stub.py [--no-gc-freeze]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import time
from typing import Any

import torch

from cache_service import event_loop
from cache_service.bench import BenchConfig, run_decode_bench
from cache_service.config import ServiceConfig
from cache_service.event_loop import EVENT_LOOPS, loop_name
from cache_service.server import start_service


def stub_pools() -> None:
    """Replace the pools' write-and-attend (per layer, by pages, over layers) by zeros."""
    import workers.pool as wp

    def write_and_attend(self: Any, layer: int, slots: Any, key: Any, value: Any,
                         query: torch.Tensor, *a: Any, return_lse: bool = False,
                         out: torch.Tensor | None = None, **kw: Any) -> Any:  # fmt: skip
        o = torch.zeros_like(query) if out is None else out
        return (o, torch.zeros(query.shape[:2])) if return_lse else o

    def write_and_attend_pages(self: Any, slots: Any, key: Any, value: Any,
                               query: Any, *a: Any, return_lse: bool = False,
                               out: list[torch.Tensor] | None = None,
                               **kw: Any) -> Any:  # fmt: skip
        # A round's parts (workers.parts): zeros into each output part given.
        q = torch.cat(query) if isinstance(query, list) else query
        o = torch.zeros_like(q) if out is None else [p.zero_() for p in out]
        return (o, torch.zeros(q.shape[:2])) if return_lse else o

    def write_and_attend_layers(self: Any, seq_layers: Any, slot_layers: Any, *a: Any,
                                **kw: Any) -> Any:  # fmt: skip
        return write_and_attend_pages(self, *a, **kw)

    wp.KVPool.write_and_attend = write_and_attend
    wp.KVPool.write_and_attend_pages = write_and_attend_pages
    wp.KVPool.write_and_attend_layers = write_and_attend_layers


class _Pauses:
    """Every collection of this process: (generation, seconds)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seen.append((info["generation"], time.perf_counter() - self._t0))

    def worst(self, n: int = 3) -> str:
        top = sorted(self.seen, key=lambda p: -p[1])[:n]
        return ", ".join(f"gen {g} {s * 1e3:.2f} ms" for g, s in top) or "none"


async def _main(args: argparse.Namespace) -> None:
    config = ServiceConfig().with_overrides(
        {
            "server.port": 0,
            "server.gc_freeze": not args.no_gc_freeze,
            "metrics.enabled": False,
            "layout.num_layers": 32,
            "layout.num_kv_heads": 8,
            "layout.head_dim": 128,
            "layout.dtype": "bfloat16",
            "workers.num_workers": 1,
            "workers.blocks_per_worker": 4096,
            "workers.in_process": True,
            "coordinator.health_check_interval_s": 0,
            # The stub's zeros are not attention: the online check would flag them.
            "coordinator.correctness_check_fraction": 0.0,
            "log_level": "WARNING",
        }
    )
    running = await start_service(config)
    loop = asyncio.get_running_loop()
    pauses = _Pauses()
    try:
        for clients in (1, args.clients):
            bench = BenchConfig(batch=8, context=64, steps=args.steps, clients=clients,
                                num_q_heads=32, dtype="bfloat16",
                                local_session=not args.grpc)  # fmt: skip
            prof = cProfile.Profile() if args.profile and clients > 1 else None
            pauses.seen.clear()
            sessions = running.local_sessions
            calls0 = sessions.calls if sessions is not None else 0
            cpu0 = time.process_time()
            if prof is not None:
                prof.enable()
            result = await loop.run_in_executor(
                None, lambda b=bench: run_decode_bench(running.address, b, processes=True)
            )
            if prof is not None:
                prof.disable()
                prof.dump_stats(args.profile)
            cpu = time.process_time() - cpu0
            calls = (sessions.calls - calls0) if sessions is not None and not args.grpc else 0
            per_call = f"{cpu / calls * 1e3:.3f} ms" if calls else "-"
            print(
                f"[{loop_name()}] clients={clients}: {result.tokens_per_s:.1f} tok/s, p50 "
                f"{result.p50_ms:.3f} ms, p99 {result.p99_ms:.3f} ms; server CPU per local call "
                f"{per_call} (setup included); {len(pauses.seen)} collections, longest: "
                f"{pauses.worst()}",
                flush=True,
            )
    finally:
        await running.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per client")
    parser.add_argument("--grpc", action="store_true", help="the gRPC stream, not local sessions")
    parser.add_argument("--no-gc-freeze", action="store_true", help="server.gc_freeze false")
    parser.add_argument(
        "--event-loop", choices=EVENT_LOOPS, default="asyncio", help="server.event_loop"
    )
    parser.add_argument("--profile", help="cProfile of the concurrent run's server, to this file")
    args = parser.parse_args()
    stub_pools()
    event_loop.run(_main(args), args.event_loop)


if __name__ == "__main__":
    main()
