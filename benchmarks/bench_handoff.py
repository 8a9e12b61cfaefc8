"""What handing one layer to another process costs, next to the same work in one process.

A step lease sends each layer of a co-located model to the process that holds the KV pool
(docs/architecture.md, "Step leases"). This measures that mechanism alone, without the
service: a client process puts a layer's tensor into memory the worker process maps,
records an interprocess CUDA event, rings the worker over a Unix SOCK_SEQPACKET socket
and waits for the answer; the worker's stream waits for the client's event, runs a small
operation on the tensor, records its own event and answers; the client's stream waits for
that event and reads the result. The baseline runs the same operations in one process on
one stream. Two regimes: back to back (the GPU's share of the handoff shows: the device
switches between the two processes' contexts twice per layer) and with a busy-wait of
`--gap-us` between layers (a model's own host work per layer, which hides the device's
share when the host is the bottleneck). On a CPU the tensor is in a shared file and the
answer means the result is in place; the worker runs torch on one thread (with a thread
per core in both processes, their spinning OpenMP workers took the cores from each other
and a handoff cost milliseconds on a 2-core VM).

    .venv/bin/python benchmarks/bench_handoff.py --smoke      # CPU, seconds
    source .device/env.sh && python3 benchmarks/bench_handoff.py --layers 2000

Prints a Markdown report (date, machine, command first).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import pickle
import platform
import socket
import sys
import tempfile
import time
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing

SHAPE = (32, 32, 64)  # a decode layer's query: 32 rows, 32 heads, head_dim 64


def _worker(sock: socket.socket, device: str) -> None:
    """The pool's side: maps nothing, owns the tensor; serves layers until told to stop."""
    dev = torch.device(device)
    torch.set_num_threads(1)  # see the module docstring
    hello = pickle.loads(sock.recv(1 << 16))
    done = None
    if dev.type == "cuda":
        staging = torch.zeros(SHAPE, dtype=torch.bfloat16, device=dev)
        ready = torch.cuda.Event.from_ipc_handle(dev, hello)
        done = torch.cuda.Event(interprocess=True)
        shared = (bytes(ForkingPickler.dumps(staging)), done.ipc_handle())
    else:
        path = hello
        staging = torch.from_file(path, shared=True, size=_numel(), dtype=torch.float32)
        staging = staging.view(SHAPE)
        shared = (None, None)
    sock.send(pickle.dumps(shared))
    stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    while True:
        message = sock.recv(64)
        if not message or message == b"q":
            return
        if stream is not None:
            stream.wait_event(ready)
        staging.mul_(1.0001).add_(1)
        if stream is not None and done is not None:
            done.record(stream)
        sock.send(b"\x00")


def _numel() -> int:
    return SHAPE[0] * SHAPE[1] * SHAPE[2]


def _spin(gap_s: float) -> None:
    end = time.perf_counter() + gap_s
    while time.perf_counter() < end:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cross_process(device: torch.device, layers: int, gap_us: float) -> tuple[float, float]:
    """(wall, client host time) per layer, microseconds, handing each layer to a worker."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_worker, args=(b, device.type), daemon=True)
    proc.start()
    b.close()
    tmp = None
    try:
        if device.type == "cuda":
            ready = torch.cuda.Event(interprocess=True)
            ready.record()
            a.send(pickle.dumps(ready.ipc_handle()))
            memory, done_handle = pickle.loads(a.recv(1 << 16))
            staging = ForkingPickler.loads(memory)
            done = torch.cuda.Event.from_ipc_handle(device, done_handle)
            x = torch.randn(SHAPE, device=device).to(torch.bfloat16)
            stream = torch.cuda.current_stream(device)
        else:
            tmp = tempfile.NamedTemporaryFile(prefix="kvcache-handoff-", delete=False)
            tmp.truncate(_numel() * 4)
            tmp.close()
            a.send(pickle.dumps(tmp.name))
            pickle.loads(a.recv(1 << 16))
            staging = torch.from_file(tmp.name, shared=True, size=_numel(), dtype=torch.float32)
            staging = staging.view(SHAPE)
            x = torch.randn(SHAPE)
            ready = done = stream = None

        def layer() -> None:
            staging.copy_(x * 2)
            if stream is not None:
                ready.record(stream)
            a.send(b"x" * 25)
            a.recv(64)
            if stream is not None:
                stream.wait_event(done)
            x.copy_(staging)

        return _timed(layer, device, layers, gap_us)
    finally:
        a.send(b"q")
        proc.join(timeout=30)
        a.close()
        if tmp is not None:
            os.unlink(tmp.name)


def one_process(device: torch.device, layers: int, gap_us: float) -> float:
    """Wall time per layer, microseconds, of the same operations on one stream."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    staging = torch.zeros(SHAPE, dtype=dtype, device=device)
    x = torch.randn(SHAPE, device=device).to(dtype)

    def layer() -> None:
        staging.copy_(x * 2)
        staging.mul_(1.0001).add_(1)
        x.copy_(staging)

    return _timed(layer, device, layers, gap_us)[0]


def _timed(layer, device: torch.device, layers: int, gap_us: float) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    for _ in range(min(50, layers)):
        layer()
    _sync(device)
    host = 0.0
    start = time.perf_counter()
    for _ in range(layers):
        t = time.perf_counter()
        layer()
        host += time.perf_counter() - t
        if gap_us:
            _spin(gap_us * 1e-6)
    _sync(device)
    wall = time.perf_counter() - start
    return wall / layers * 1e6, host / layers * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, few layers (seconds)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--layers", type=int, default=1000, help="layers per measurement")
    parser.add_argument("--gap-us", type=float, default=300.0, help="host work between layers")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.layers = "cpu", 200
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    print("# Handing a layer to another process")
    print()
    print(f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}")
    print(f"- command: `benchmarks/bench_handoff.py {' '.join(sys.argv[1:])}`".rstrip())
    print(f"- device: {name}; torch {torch.__version__}, python {platform.python_version()}")
    print(f"- layer: a {SHAPE} tensor, {args.layers} layers per row")
    print()
    print("| host work between layers | one process, us/layer | handed to a worker, us/layer "
          "| of which the client's host, us | extra per layer, us |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: |")
    for gap in (0.0, args.gap_us):
        base = one_process(device, args.layers, gap)
        wall, host = cross_process(device, args.layers, gap)
        print(f"| {gap:.0f} us | {base:.1f} | {wall:.1f} | {host:.1f} | {wall - base:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
