"""How long a cross-process and a cross-thread wake-up takes on this host (a diagnostic).

A per-layer call through the service hands work between threads and processes several
times (client thread -> gRPC thread -> server poller -> event loop -> back). On a large
idle host each hand-off can cost a core's wake-up from a sleep state. This measures one
round trip of a byte over a pipe between two processes, and of an item through a queue
between two threads, with the two sides on any core, on one core, and on two cores;
and the same round trip when the waiting side spins instead of sleeping.

    python3 benchmarks/diag_host_wakeups.py
"""

from __future__ import annotations

import os
import queue
import statistics
import threading
import time
from multiprocessing import get_context

ROUNDS = 3000


def _pin(cpus: tuple[int, ...] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, set(cpus))


def _echo(rfd: int, wfd: int, cpus: tuple[int, ...] | None, spin: bool) -> None:
    _pin(cpus)
    if spin:
        os.set_blocking(rfd, False)
    while True:
        while True:
            try:
                b = os.read(rfd, 1)
                break
            except BlockingIOError:
                continue
        if b == b"q" or not b:
            return
        os.write(wfd, b)


def pipe_round_trip_us(
    parent: tuple[int, ...] | None, child: tuple[int, ...] | None, spin: bool = False
) -> float:
    """Median round trip of one byte parent -> child -> parent, in microseconds."""
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    proc = get_context("fork").Process(target=_echo, args=(a_r, b_w, child, spin))
    proc.start()
    saved = os.sched_getaffinity(0)
    _pin(parent)
    if spin:
        os.set_blocking(b_r, False)
    times = []
    try:
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            os.write(a_w, b"x")
            while True:
                try:
                    os.read(b_r, 1)
                    break
                except BlockingIOError:
                    continue
            times.append(time.perf_counter() - t0)
    finally:
        os.write(a_w, b"q")
        proc.join()
        os.sched_setaffinity(0, saved)
        for fd in (a_r, a_w, b_r, b_w):
            os.close(fd)
    return statistics.median(times[100:]) * 1e6


def thread_round_trip_us(cpus: tuple[int, ...] | None) -> float:
    """Median round trip of an item through two SimpleQueues between two threads (us)."""
    saved = os.sched_getaffinity(0)
    _pin(cpus)
    there: queue.SimpleQueue[object] = queue.SimpleQueue()
    back: queue.SimpleQueue[object] = queue.SimpleQueue()

    def echo() -> None:
        while (item := there.get()) is not None:
            back.put(item)

    t = threading.Thread(target=echo)
    t.start()
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        there.put(1)
        back.get()
        times.append(time.perf_counter() - t0)
    there.put(None)
    t.join()
    os.sched_setaffinity(0, saved)
    return statistics.median(times[100:]) * 1e6


def main() -> None:
    n = os.cpu_count() or 1
    far = n // 2 if n > 2 else n - 1
    cases = [
        ("pipe, any cores", lambda: pipe_round_trip_us(None, None)),
        ("pipe, one core", lambda: pipe_round_trip_us((0,), (0,))),
        ("pipe, cores 0 and 1", lambda: pipe_round_trip_us((0,), (1,))),
        (f"pipe, cores 0 and {far}", lambda: pipe_round_trip_us((0,), (far,))),
        ("pipe, any cores, both spin", lambda: pipe_round_trip_us(None, None, spin=True)),
        ("threads, any cores", lambda: thread_round_trip_us(None)),
        ("threads, one core", lambda: thread_round_trip_us((0,))),
        ("threads, cores 0-1", lambda: thread_round_trip_us((0, 1))),
    ]
    print(f"host: {n} CPUs; {ROUNDS} round trips each; median in microseconds")
    for name, fn in cases:
        print(f"{name:32s} {fn():8.1f} us")


if __name__ == "__main__":
    main()
