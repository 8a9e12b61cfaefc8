"""The floor under one service call: a bare gRPC round trip between two Python processes
(a diagnostic for issue 5's per-layer latency).

A grpc.aio server in a child process echoes a 300-byte message (the size of a batch call's
request over shared memory); this process times round trips the ways a client can make
them: a sync unary call, the client's `CallStream` (a sync stream fed by grpc's request
thread), an aio stream driven from another thread's event loop, and aio stream and unary
calls from inside the event loop. Whatever the service adds on top of these is its own.

    python3 benchmarks/diag_grpc_floor.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Callable

import grpc

_SERVICE = "diag.Echo"
_MESSAGE = b"x" * 300


def _serve(conn: mp.connection.Connection) -> None:
    async def run() -> None:
        async def stream(requests, context):  # type: ignore[no-untyped-def]
            async for r in requests:
                yield r

        async def unary(request, context):  # type: ignore[no-untyped-def]
            return request

        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    _SERVICE,
                    {
                        "Stream": grpc.stream_stream_rpc_method_handler(stream),
                        "Unary": grpc.unary_unary_rpc_method_handler(unary),
                    },
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await server.wait_for_termination()

    asyncio.run(run())


def _report(label: str, seconds: list[float]) -> None:
    p50 = statistics.median(seconds) * 1e6
    p99 = sorted(seconds)[int(len(seconds) * 0.99)] * 1e6
    print(f"{label:<38} p50 {p50:7.1f} us   p99 {p99:7.1f} us")


def _time_sync(label: str, call: Callable[[], object], calls: int) -> None:
    for _ in range(200):
        call()
    seconds = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    _report(label, seconds)


async def _time_in_loop(target: str, calls: int) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stream = channel.stream_stream(f"/{_SERVICE}/Stream")()
        unary = channel.unary_unary(f"/{_SERVICE}/Unary")
        for label, once in (
            ("aio stream, in its event loop", None),
            ("aio unary, in its event loop", unary),
        ):
            seconds = []
            for i in range(200 + calls):
                t0 = time.perf_counter()
                if once is None:
                    await stream.write(_MESSAGE)
                    await stream.read()
                else:
                    await once(_MESSAGE)
                if i >= 200:
                    seconds.append(time.perf_counter() - t0)
            _report(label, seconds)
        await stream.done_writing()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(child,), daemon=True)
    server.start()
    target = f"127.0.0.1:{parent.recv()}"
    try:
        from cache_service.call_stream import CallStream

        channel = grpc.insecure_channel(target)
        unary = channel.unary_unary(f"/{_SERVICE}/Unary")
        _time_sync("sync unary", lambda: unary(_MESSAGE), args.calls)
        stream = CallStream(channel.stream_stream(f"/{_SERVICE}/Stream"))
        _time_sync(
            "CallStream (the client's session)", lambda: stream.call(_MESSAGE, 10), args.calls
        )
        stream.close()

        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

        async def open_stream() -> tuple[grpc.aio.Channel, grpc.aio.StreamStreamCall]:
            aio_channel = grpc.aio.insecure_channel(target)
            return aio_channel, aio_channel.stream_stream(f"/{_SERVICE}/Stream")()

        _, call = asyncio.run_coroutine_threadsafe(open_stream(), loop).result()

        async def once() -> bytes:
            await call.write(_MESSAGE)
            return await call.read()

        _time_sync(
            "aio stream, driven from another thread",
            lambda: asyncio.run_coroutine_threadsafe(once(), loop).result(),
            args.calls,
        )
        asyncio.run(_time_in_loop(target, args.calls))
    finally:
        server.kill()


if __name__ == "__main__":
    main()
