"""How the coordinator's batcher forms rounds for clients that call in step (a simulation).

The real `coordinator._Batcher` on a real event loop, everything around it simulated:
`--clients` client processes each make `--calls` calls one after the other over a socket
pair. Once a client has its reply it waits its think time (`--think-us`, plus up to
`--jitter-us` at random: its own work and the transit), then sends its next call. The loop spends
`--part-us` of CPU on each arriving part (what the servicer and coordinator do before the
batcher) and `--reply-us` on each reply; a round blocks the loop for `--round-us` plus
`--round-part-us` per part (an in-process pool's worker call runs inline), or with
`--async-worker` takes that long without holding the loop (a worker in another process,
e.g. a Ray actor: the next round gathers meanwhile). The same runs with one client give
the reference.

Prints, for one client and for all of them: calls per second, parts per round, why rounds
left, and the ratio of the two throughputs. The defaults are near what the H200 host's
server measured (about 0.4 ms of loop time per part in full rounds).

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_batching_sim.py --clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import random
import socket
import time
from typing import Any

import diag_batch_trace
import torch

from cache_service.coordinator import _Batcher, _Part


def _spin(seconds: float) -> None:
    """Hold the CPU (and the loop) for `seconds`, as Python work would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _client(sock: socket.socket, calls: int, think_s: float, jitter_s: float, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(calls):
        time.sleep(think_s + rng.random() * jitter_s)  # oversleeps by tens of us: think less
        sock.send(b"x")
        sock.recv(1)


async def _run(clients: int, args: argparse.Namespace) -> tuple[float, list[int]]:
    """(calls per second, parts of each round) for `clients` simulated clients."""
    loop = asyncio.get_running_loop()
    rounds: list[int] = []

    async def worker_call(key: Any, parts: list[_Part]) -> None:
        rounds.append(len(parts))
        seconds = (args.round_us + args.round_part_us * len(parts)) * 1e-6
        if args.async_worker:
            await asyncio.sleep(seconds)
        else:
            _spin(seconds)
        for p in parts:
            p.future.set_result(None)

    batcher = _Batcher((0, "w0", 32), args.window_ms * 1e-3, 256, worker_call, overlap=args.overlap)
    pairs = [socket.socketpair() for _ in range(clients)]

    def arrived(i: int) -> None:
        pairs[i][0].recv(64)
        _spin(args.part_us * 1e-6)
        part = _Part(views=[], num_queries=[1] * 8, seq_ids=[f"c{i}s{j}" for j in range(8)],
                     query=torch.empty(0), writes={}, return_lse=False)  # fmt: skip
        part.future = loop.create_future()

        def reply(_: Any) -> None:
            _spin(args.reply_us * 1e-6)
            pairs[i][0].send(b"r")

        part.future.add_done_callback(reply)
        batcher.submit(part)

    for i, (server_end, _) in enumerate(pairs):
        server_end.setblocking(False)
        loop.add_reader(server_end.fileno(), arrived, i)
    procs = [
        multiprocessing.get_context("fork").Process(
            target=_client,
            args=(pairs[i][1], args.calls, args.think_us * 1e-6, args.jitter_us * 1e-6, i),
        )
        for i in range(clients)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        await asyncio.sleep(0.005)
    wall = time.perf_counter() - t0
    for server_end, client_end in pairs:
        loop.remove_reader(server_end.fileno())
        server_end.close()
        client_end.close()
    return clients * args.calls / wall, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--calls", type=int, default=400, help="calls per client")
    parser.add_argument("--window-ms", type=float, default=0.5)
    parser.add_argument("--think-us", type=float, default=250.0)
    parser.add_argument("--jitter-us", type=float, default=150.0)
    parser.add_argument("--part-us", type=float, default=250.0)
    parser.add_argument("--reply-us", type=float, default=60.0)
    parser.add_argument("--round-us", type=float, default=300.0)
    parser.add_argument("--round-part-us", type=float, default=40.0)
    parser.add_argument(
        "--async-worker", action="store_true", help="rounds run off the loop (another process)"
    )
    parser.add_argument(
        "--overlap", action="store_true", help="coordinator.overlap_rounds: two groups take turns"
    )
    args = parser.parse_args()
    diag_batch_trace.instrument()
    one, _ = asyncio.run(_run(1, args))
    start = len(diag_batch_trace.events)
    many, rounds = asyncio.run(_run(args.clients, args))
    reasons = collections.Counter(
        e["reason"] for e in diag_batch_trace.events[start:] if e["e"] == "batch"
    )
    sizes = collections.Counter(rounds)
    print(f"one client: {one:.0f} calls/s; {args.clients} clients: {many:.0f} calls/s; "
          f"ratio {many / one:.2f}x")  # fmt: skip
    print("parts per round: " + ", ".join(f"{k}: {v}" for k, v in sorted(sizes.items())))
    print("why rounds left: " + ", ".join(f"{k}: {v}" for k, v in reasons.most_common()))


if __name__ == "__main__":
    main()
