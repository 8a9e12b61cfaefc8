"""The servicer's and coordinator's CPU per part of a coalesced round (a diagnostic).

In one process, without sockets or clients: `--clients` groups of 8 sequences each make
their decode step's append-and-attend session call for every layer at the same moment
(`asyncio.gather` on the servicer's `_session_call`), so the coordinator coalesces them
into rounds as it does for concurrent clients. Tensors come from shared-memory regions
(views, as on a GPU server with `--pinned`: regions marked page-locked); the pools'
write-and-attend is a zero-cost stub, or with `--device cuda` the real CUDA pools (short
contexts: the GPU's share stays small). Prints wall and CPU time per part, and the
sequences per worker call; `--profile` prints the hottest functions. Compare `--clients 1`
(solo calls) with `--clients 8`; `--now` offers each call to the servicer's callback path
first (`session_call_now`), as a local session does; `--skew` puts half the clients a layer
ahead, so that rounds go over pages of two layers as those of clients taking turns do.

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_round_cost.py --clients 8 --pinned
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import mmap
import pstats
import time
from typing import Any

import torch
from bench_service import worker_rounds
from diag_concurrency_stub import stub_pools

from cache_service import event_loop
from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.config import ServiceConfig
from cache_service.event_loop import EVENT_LOOPS, loop_name
from cache_service.request_codec import SharedTensor, encode_append_attend_batch
from cache_service.session_codec import APPEND_ATTEND_BATCH, session_message

BATCH, LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 8, 32, 8, 32, 128
_K, _V, _Q, _OUT = 0, 1 << 20, 2 << 20, 3 << 20  # offsets in each client's region


async def _main(args: argparse.Namespace) -> None:
    from cache_service import server as srv

    if args.pinned:
        # What a GPU server does for its in-process CUDA pools: calls read views.
        plain = srv.SharedRegions
        srv.SharedRegions = lambda *a, **k: plain(*a, **{**k, "pin_for_cuda": True})
    config = ServiceConfig().with_overrides(
        {
            "server.port": 0,
            "server.local_sessions": False,
            "metrics.enabled": True,
            "metrics.port": 0,
            "layout.num_layers": LAYERS,
            "layout.num_kv_heads": KV_HEADS,
            "layout.head_dim": HEAD_DIM,
            "layout.dtype": "bfloat16",
            "workers.num_workers": 1,
            "workers.blocks_per_worker": 64 * BATCH * args.clients,
            "workers.in_process": True,
            "workers.device": args.device,
            "coordinator.correctness_check_fraction": 0.0,
            "coordinator.health_check_interval_s": 0,
            "log_level": "WARNING",
        }
    )
    running = await srv.start_service(config)
    servicer, coord = running._servicer, running.coordinator
    if args.device == "cpu":
        # The stub answers at once: run it on the loop as a GPU pool's calls run, so no
        # hop to the pool's thread (and its GIL hand-offs) counts in the figures.
        for client in coord._clients.values():
            client._inline = True
    clients: list[tuple[list[str], str, torch.Tensor, torch.Tensor, Any]] = []
    try:
        for _ in range(args.clients):
            seq_ids = [(await coord.create_sequence("default", [])).seq_id for _ in range(BATCH)]
            info = await running.shared_regions.create("default", 4 << 20)
            with open(info.path, "r+b") as f:
                mem = mmap.mmap(f.fileno(), info.size_bytes)
            region = torch.frombuffer(mem, dtype=torch.uint8)
            kv = torch.randn(BATCH, 1, KV_HEADS, HEAD_DIM).bfloat16()
            q = torch.randn(BATCH, 1, Q_HEADS, HEAD_DIM).bfloat16()
            for offset, t in ((_K, kv), (_V, kv), (_Q, q)):
                region[offset : offset + t.numel() * 2].view(torch.bfloat16).copy_(t.view(-1))
            clients.append((seq_ids, info.region_id, kv, q, mem))

        def shared(t: torch.Tensor, region_id: str, offset: int) -> SharedTensor:
            return SharedTensor(t.dtype, tuple(t.shape), region_id, offset)

        prof = cProfile.Profile() if args.profile else None
        call_id = parts = 0
        t0 = cpu0 = 0.0
        # With --skew the second half of the clients runs one layer ahead (their step's
        # layer 0 made alone first): each round then holds parts of two layers, over pages.
        ahead = [args.skew and i >= len(clients) // 2 for i in range(len(clients))]

        async def calls(at: list[tuple[int, int] | None]) -> None:
            """One call for each client with a (step, layer) in `at`, all at once."""
            nonlocal call_id
            requests, origins = [], []
            for i, ((seq_ids, rid, kv, q, _), where) in enumerate(zip(clients, at, strict=True)):
                if where is None:
                    continue
                step, layer = where
                call_id += 1
                body = encode_append_attend_batch(
                    layer, seq_ids, [[step]] * BATCH, shared(kv, rid, _K),
                    shared(kv, rid, _V), shared(q, rid, _Q), False, output_to=(rid, _OUT),
                )  # fmt: skip
                message = session_message(call_id, APPEND_ATTEND_BATCH, body)
                requests.append(pb.SessionRequest.FromString(message))
                origins.append(i)
            replies = await asyncio.gather(
                *(_call(servicer, r, i, args.now) for i, r in zip(origins, requests, strict=True))
            )
            for reply in replies:
                kind = pb.SessionResponse.FromString(reply).WhichOneof("result")
                if kind == "error":
                    raise RuntimeError(pb.SessionResponse.FromString(reply).error.message)

        await calls([(0, 0) if a else None for a in ahead])
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                t0, cpu0 = time.perf_counter(), time.process_time()
                if prof is not None:
                    prof.enable()
            for layer in range(LAYERS):
                await calls([divmod(step * LAYERS + layer + a, LAYERS) for a in ahead])
                if step >= args.warmup:
                    parts += len(clients)
            if step == args.warmup - 1:
                before = worker_rounds(running.metrics)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        memo = servicer._batch_decoder
        print(f"decode memo: {memo.hits} hits, {memo.misses} misses")
        after = worker_rounds(running.metrics)
        per_call = (after[0] - before[0]) / max(after[1] - before[1], 1)
        if prof is not None:
            prof.disable()
            pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
        print(
            f"[{loop_name()}] clients={args.clients}: {wall / parts * 1e6:.0f} us wall and "
            f"{cpu / parts * 1e6:.0f} us CPU per part ({parts} parts; {per_call:.1f} "
            f"sequences per worker call; pinned views: {args.pinned}; pools: {args.device}; "
            f"skew: {args.skew})"
        )
    finally:
        await running.stop()
        for *_, mem in clients:
            mem.close()


async def _call(servicer: Any, request: pb.SessionRequest, origin: int, now: bool) -> bytes:
    """One client's session call: the usual way (a coroutine), or with `now` as a local
    session offers it first (`session_call_now`, answered from a callback)."""
    if not now:
        return await servicer._session_call(request, "default")
    answered: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    if servicer.session_call_now(request, "default", origin, answered.set_result):
        return await answered
    return await servicer._session_call(request, "default")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--pinned", action="store_true", help="regions as a GPU server pins them")
    parser.add_argument(
        "--event-loop", choices=EVENT_LOOPS, default="asyncio", help="server.event_loop"
    )
    parser.add_argument(
        "--now",
        action="store_true",
        help="offer each call to session_call_now first, as a local session does",
    )
    parser.add_argument(
        "--skew", action="store_true",
        help="half the clients one layer ahead: rounds over pages of two layers",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sort", default="tottime", help="pstats order for --profile")
    parser.add_argument("--top", type=int, default=30, help="functions --profile prints")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu: stubbed pools; cuda: the real CUDA pools",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.device == "cpu":
        stub_pools()
    event_loop.run(_main(args), args.event_loop)


if __name__ == "__main__":
    main()
