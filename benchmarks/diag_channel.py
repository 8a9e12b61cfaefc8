"""Where a worker-channel call's time goes (a diagnostic).

One PoolWorker Ray actor (CUDA if there is one, else CPU) with a decode step's blocks
(`--batch` sequences of `--context` tokens; the blocks are not filled: timing only), and
this process as the coordinator would be: an asyncio loop calling the worker. For each
path, per-call wall time over `--calls` calls of one layer after another:

* `in actor`: PoolWorker.write_and_attend inside the actor process (no transport), its
  inputs in page-locked memory as the channel's arena is;
* `channel`: RayWorkerClient over the worker channel, and inside the actor for those
  calls the server's answer time (`_answer`: decoding, the call, encoding) and the call's
  own (`_channel_call`); with `--tcp`, over TCP with the tensors in the messages (the
  path to a worker on another node, measured on one host);
* `channel, no-op`: a second channel server in the actor whose call returns at once: the
  socket round trip and both ends' message handling alone;
* `ray`: the same call through Ray (no channel).

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_channel.py            # CPU, small
    PYTHONPATH=.:benchmarks python3 benchmarks/diag_channel.py --h200     # Llama-3-8B
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from typing import Any

import ray
import torch

from cache_service.bench import percentile
from cache_service.worker_channel import ChannelOptions, WorkerChannel
from cache_service.worker_clients import RayWorkerClient
from workers.config import PoolConfig
from workers.launcher import LaunchConfig, launch_workers, shutdown_workers
from workers.layout import KVLayout
from workers.ray_startup import start_local_ray


def _inputs(layout: KVLayout, q_heads: int, batch: int, context: int) -> dict[str, Any]:
    dtype = layout.torch_dtype()
    per_seq = -(-(context + 1) // layout.block_size)
    tables = torch.arange(batch * per_seq, dtype=torch.int32).reshape(batch, per_seq)
    slots = tables[:, context // layout.block_size].long() * layout.block_size
    slots += context % layout.block_size
    return {
        "slots": slots,
        "key": torch.randn(batch, layout.num_kv_heads, layout.head_dim).to(dtype),
        "query": torch.randn(batch, q_heads, layout.head_dim).to(dtype),
        "tables": tables,
        "lens": torch.full((batch,), context + 1, dtype=torch.int32),
        "qsl": torch.arange(batch + 1, dtype=torch.int32),
    }


def _in_actor(
    worker: Any,
    epoch: str,
    x: dict[str, Any],
    layers: int,
    calls: int,
    pause_s: float = 0.0,
    thread: bool = False,
) -> list[float]:
    """Runs inside the actor: write_and_attend on page-locked copies of the inputs, one call
    after another, or `pause_s` of sleep between calls (as a decode loop's calls arrive),
    on the actor's thread or (`thread`) on a new one (as the channel's calls run)."""
    pinned = {k: v.pin_memory() if torch.cuda.is_available() else v for k, v in x.items()}
    out = torch.empty_like(pinned["query"])
    times: list[float] = []

    def loop() -> None:
        for i in range(calls):
            if pause_s:
                time.sleep(pause_s)
            t0 = time.perf_counter()
            worker.write_and_attend(
                epoch, i % layers, pinned["slots"], pinned["key"], pinned["key"],
                pinned["query"], pinned["tables"], pinned["lens"], pinned["qsl"],
                metadata_key=1, out=out,
            )  # fmt: skip
            times.append(time.perf_counter() - t0)

    if thread:
        runner = threading.Thread(target=loop)
        runner.start()
        runner.join()
    else:
        loop()
    return times


def _instrument(worker: Any) -> None:
    """Runs inside the actor: time the channel server's answers and calls, and record when
    each request was read and its answer began and ended (perf_counter: one clock for all
    processes of the host, so service_breakdown lines them up with the caller's)."""
    import workers.channel_server as channel_server

    worker.diag = {"answer": [], "call": [], "read": [], "answer_start": [], "answer_end": []}
    diag = worker.diag
    server = worker._channel
    answer, call, read = server._answer, worker._channel_call, channel_server._read_request

    def timed_read(conn: Any, arena: Any) -> Any:
        request = read(conn, arena)
        diag["read"].append(time.perf_counter())
        return request

    def timed_answer(arena: Any, request: bytes) -> Any:
        t0 = time.perf_counter()
        try:
            return answer(arena, request)
        finally:
            t1 = time.perf_counter()
            diag["answer"].append(t1 - t0)
            diag["answer_start"].append(t0)
            diag["answer_end"].append(t1)

    def timed_call(method: str, args: Any, kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(method, args, kwargs)
        finally:
            diag["call"].append(time.perf_counter() - t0)

    channel_server._read_request = timed_read
    server._answer = timed_answer
    server._call = timed_call


def _noop_server(worker: Any, tcp: bool) -> Any:
    """Runs inside the actor: a second channel server whose call does nothing."""
    from workers.channel_server import ChannelServer

    worker.noop = ChannelServer(
        lambda m, a, k: a[5], pin_for_cuda=torch.cuda.is_available(), node_id=None, name="noop"
    )
    if tcp:
        return worker.noop.listen_tcp(ray.util.get_node_ip_address())
    return worker.noop.address()


def _row(name: str, times: list[float]) -> str:
    ms = [t * 1e3 for t in times]
    return f"| {name} | {percentile(ms, 50):.3f} | {percentile(ms, 90):.3f} | {percentile(ms, 99):.3f} |"


async def _client_side(handle: Any, epoch: str, x: dict[str, Any], layers: int, calls: int,
                       arena: int, tcp: bool) -> dict[str, list[float]]:  # fmt: skip
    fast = await RayWorkerClient.connect(handle, channel=ChannelOptions(arena, force_tcp=tcp))
    slow = await RayWorkerClient.connect(handle)
    out = torch.empty_like(x["query"])
    args = (x["slots"], x["key"], x["key"], x["query"], x["tables"], x["lens"], x["qsl"])
    timings: dict[str, list[float]] = {"channel": [], "ray": []}
    for name, client, n in (("channel", fast, calls), ("ray", slow, max(calls // 5, 20))):
        for i in range(n + 20):
            t0 = time.perf_counter()
            await client.write_and_attend(epoch, i % layers, *args, metadata_key=1, out=out)
            if i >= 20:
                timings[name].append(time.perf_counter() - t0)
    address = await asyncio.to_thread(ray.get, handle.__ray_call__.remote(_noop_server, tcp))
    noop = await WorkerChannel.connect(address, arena, tcp=tcp)
    timings["noop"] = []
    for i in range(calls + 20):
        t0 = time.perf_counter()
        await noop.call("write_and_attend", (epoch, i % layers, *args), {}, out)
        if i >= 20:
            timings["noop"].append(time.perf_counter() - t0)
    noop.close()
    fast.close()
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--h200", action="store_true", help="Llama-3-8B layout, batch 32, 2048")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--tcp", action="store_true", help="the channel over TCP")
    parser.add_argument(
        "--pause-ms", type=float, default=1.0, help="sleep between in-actor calls (second rows)"
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if args.h200:
        layout, q_heads, batch, context = KVLayout(32, 8, 128, 16, "bfloat16"), 32, 32, 2048
    else:
        layout, q_heads, batch, context = KVLayout(4, 2, 64, 16, "float32"), 8, 8, 128
    namespace = f"diag-channel-{uuid.uuid4().hex[:6]}"
    start_local_ray(namespace, num_cpus=4)
    blocks = batch * (-(-(context + 1) // layout.block_size)) + 16
    (handle,) = launch_workers(
        LaunchConfig(PoolConfig(layout, num_blocks=blocks), num_workers=1, namespace=namespace,
                     name_prefix="diag-", use_gpu=cuda, torch_threads=None if cuda else 1)
    )  # fmt: skip
    try:
        epoch = ray.get(handle.epoch.remote())
        x = _inputs(layout, q_heads, batch, context)
        layers = layout.num_layers
        in_actor = {
            (pause, thread): ray.get(
                handle.__ray_call__.remote(
                    _in_actor, epoch, x, layers, args.calls + 20, pause, thread
                )
            )[20:]
            for pause in (0.0, args.pause_ms / 1e3)
            for thread in (False, True)
        }
        ray.get(handle.channel_address.remote())
        ray.get(handle.__ray_call__.remote(_instrument))
        timings = asyncio.run(
            _client_side(handle, epoch, x, layers, args.calls, 32 << 20, args.tcp)
        )
        server = ray.get(handle.__ray_call__.remote(lambda w: w.diag))
        print(f"device {'cuda' if cuda else 'cpu'}, batch {batch}, context {context}, "
              f"{layers} layers, {args.calls} calls per path, channel over "
              f"{'TCP' if args.tcp else 'a Unix socket and shared memory'}")  # fmt: skip
        print("| path | p50 ms | p90 ms | p99 ms |\n| --- | ---: | ---: | ---: |")
        for (pause, thread), times in in_actor.items():
            how = f"{pause * 1e3:g} ms apart" if pause else "back to back"
            where = "a new thread" if thread else "the actor's thread"
            print(_row(f"in actor: PoolWorker.write_and_attend, {how}, on {where}", times))
        print(_row("channel: round trip from the caller", timings["channel"]))
        print(_row("channel: server's answer (in the actor)", server["answer"][20:]))
        print(_row("channel: the call alone (in the actor)", server["call"][20:]))
        print(_row("channel, no-op call: round trip", timings["noop"]))
        print(_row("ray: round trip (no channel)", timings["ray"]))
    finally:
        shutdown_workers(namespace, "diag-")
        ray.shutdown()


if __name__ == "__main__":
    main()
