"""Where a lone client's per-layer call spends its wall time, seen from the server (a diagnostic).

Runs `bench_service.py` with the given arguments (e.g. the H200's Ray row, one client of
batch 32: ``--h200 --no-in-process --transports local-shm --phases single``) with probes on
the server's event loop at four points of each local-session call that reaches a worker
channel: (a) the client's request arrives, (b) the request to the worker is written, (c)
the worker's reply arrives, (d) the client's reply is written. Printed per stretch: its
wall time and the loop thread's CPU time (median and mean of the calls after the first
quarter), and the client's turn (from a reply written to the next request's arrival: the
client's own work and the two socket hops). A call's wall time is about
pre + worker + post + client turn.

The probes wrap methods of ``cache_service.local_sessions._Connection`` and
``cache_service.worker_channel._Connection`` in this process (the clients run in their
own processes, untouched); each costs about a microsecond. With a Ray worker, probes in
the actor's process too (installed through ``__ray_call__`` once the service started) mark
each channel call there: the request read (``_read_request`` entered and left), the answer
(``_answer`` left), the reply framed (just before its ``sendall``) and the thread back to
waiting (``_readable`` entered). Both processes read CLOCK_MONOTONIC (``perf_counter``), so
the worker's stretch splits into the hop to the worker, its reading, its answer, its send
and the hop back; the actor writes its marks to a file every 64 calls.

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_call_timeline.py --h200 \\
        --no-in-process --transports local-shm --phases single
"""

from __future__ import annotations

import bisect
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import bench_service
from ray_worker_hooks import on_ray_workers

import cache_service.local_sessions as local_sessions
import cache_service.worker_channel as worker_channel

_WORKER_MARKS = os.path.join(tempfile.gettempdir(), f"kvcache-timeline-{os.getpid()}.txt")

_STRETCHES = {
    "pre": ("a", "b", "request in -> worker request written (servicer, coordinator, channel)"),
    "worker": ("b", "c", "worker request written -> its reply in (the worker's process)"),
    "post": ("c", "d", "worker reply in -> client reply written (back up the stack)"),
    "client": ("d", "a", "client reply written -> next request in (client, two socket hops)"),
}


class _Probes:
    """Marks per call: wall clock and the loop thread's CPU clock at each point."""

    def __init__(self) -> None:
        self.marks: dict[str, tuple[float, float]] = {}
        self.wall: dict[str, list[float]] = defaultdict(list)
        self.cpu: dict[str, list[float]] = defaultdict(list)
        # (before the request's write, after it, the reply's arrival): perf_counter seconds
        self.worker_calls: list[tuple[float, float, float]] = []

    def mark(self, point: str) -> None:
        now = (time.perf_counter(), time.thread_time())
        for name, (start, end, _) in _STRETCHES.items():
            if end == point and start in self.marks:
                began = self.marks[start]
                self.wall[name].append(now[0] - began[0])
                self.cpu[name].append(now[1] - began[1])
        if point == "a":
            self.marks.clear()  # a call's marks start afresh at its arrival
        self.marks[point] = now
        if point == "c" and "b0" in self.marks:
            self.worker_calls.append((self.marks["b0"][0], self.marks["b"][0], now[0]))

    def report(self) -> str:
        lines = [
            "| stretch | calls | wall p50 us | wall mean us | loop CPU p50 us | loop CPU mean us |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, (_, _, text) in _STRETCHES.items():
            wall, cpu = self.wall[name], self.cpu[name]
            wall, cpu = wall[len(wall) // 4 :], cpu[len(cpu) // 4 :]
            if not wall:
                continue
            lines.append(
                f"| {name}: {text} | {len(wall)} | {statistics.median(wall) * 1e6:.1f} | "
                f"{statistics.fmean(wall) * 1e6:.1f} | {statistics.median(cpu) * 1e6:.1f} | "
                f"{statistics.fmean(cpu) * 1e6:.1f} |"
            )
        return "\n".join(lines)


def _install(probes: _Probes) -> None:
    session = local_sessions._Connection
    channel = worker_channel._Connection

    def wrap(cls: type, name: str, before: str | None, after: str | None) -> None:
        original = getattr(cls, name)

        def probed(self: Any, *args: Any, **kwargs: Any) -> Any:
            if before is not None:
                probes.mark(before)
            result = original(self, *args, **kwargs)
            if after is not None:
                probes.mark(after)
            return result

        setattr(cls, name, probed)

    wrap(session, "data_received", "a", None)
    wrap(session, "_write", None, "d")
    wrap(channel, "exchange", "b0", "b")
    wrap(channel, "data_received", "c", None)


def _actor_probes(actor: Any, path: str) -> None:
    """In the worker's process: marks of every channel call, appended to `path` as lines
    of ``thread point perf_counter`` (points: r0 read begins, r1 read done, p0 / p1 the
    pool's call begins / ends (``actor._on_pool``), ans answer done, snd about to send,
    idle back to waiting)."""
    import threading
    import time as clock

    import workers.channel_server as cs

    marks: list[str] = []
    lock = threading.Lock()

    def mark(point: str) -> None:
        line = f"{threading.get_ident()} {point} {clock.perf_counter():.9f}\n"
        with lock:
            marks.append(line)
            if len(marks) >= 5 * 64:
                with open(path, "a") as f:
                    f.writelines(marks)
                marks.clear()

    def around(owner: object, name: str, before: str | None, after: str | None) -> None:
        original = getattr(owner, name)

        def probed(*args: object, **kwargs: object) -> object:
            if before is not None:
                mark(before)
            result = original(*args, **kwargs)
            if after is not None:
                mark(after)
            return result

        setattr(owner, name, probed)

    around(actor, "_on_pool", "p0", "p1")
    around(cs, "_read_request", "r0", "r1")
    around(cs.ChannelServer, "_answer", None, "ans")
    around(cs, "frame", "snd", None)
    around(cs, "_readable", "idle", None)


def _install_actor_probes() -> None:
    """`_actor_probes` in each Ray worker's process once the service is up."""
    on_ray_workers(lambda w: _actor_probes(w, _WORKER_MARKS))


def _worker_report(calls: list[tuple[float, float, float]]) -> str:
    """The worker's stretch split by the actor's marks (those that fall between the
    coordinator's write of a call and its reply's arrival)."""
    try:
        with open(_WORKER_MARKS) as f:
            rows = [line.split() for line in f]
    except OSError:
        return "(no marks from the worker's process)"
    events = sorted((float(t), p) for _, p, t in rows)
    times = [t for t, _ in events]
    spans: dict[str, list[float]] = defaultdict(list)
    names = {
        "to worker": ("b0", "r0"),
        "worker reads the request": ("r0", "r1"),
        "worker answers (unpickle, the pool's call, pickle)": ("r1", "ans"),
        "  of which before the pool's call (unpickle, checks)": ("r1", "p0"),
        "  of which the pool's call (KVPool)": ("p0", "p1"),
        "  of which after it (the reply's pickle)": ("p1", "ans"),
        "worker frames": ("ans", "snd"),
        "reply to the coordinator (from the worker's send)": ("snd", "c"),
        "coordinator's own write of the request": ("b0", "b"),
    }
    for b0, b, c in calls[len(calls) // 4 :]:
        i, j = bisect.bisect_left(times, b0), bisect.bisect_right(times, c)
        seen = {p: t for t, p in events[i:j]}
        seen.update(b0=b0, b=b, c=c)
        for name, (x, y) in names.items():
            if x in seen and y in seen:
                spans[name].append(seen[y] - seen[x])
        # the send itself: from framing to the thread waiting again (after this call)
        k = bisect.bisect_right(times, seen.get("snd", c))
        after = next((t for t, p in events[k:] if p == "idle"), None)
        if "snd" in seen and after is not None and after - seen["snd"] < 0.01:
            spans["worker's sendall (until it waits again)"].append(after - seen["snd"])
    lines = ["| stretch | calls | p50 us | mean us |", "| --- | ---: | ---: | ---: |"]
    for name, values in spans.items():
        if values:
            lines.append(
                f"| {name} | {len(values)} | {statistics.median(values) * 1e6:.1f} | "
                f"{statistics.fmean(values) * 1e6:.1f} |"
            )
    return "\n".join(lines)


def main() -> int:
    probes = _Probes()
    _install(probes)
    _install_actor_probes()
    try:
        code = bench_service.main(sys.argv[1:])
        print("\n## Server-side timeline of a call (diag_call_timeline.py)\n")
        print(probes.report())
        print("\n## The worker's stretch, by the worker's own marks\n")
        print(_worker_report(probes.worker_calls))
    finally:
        if os.path.exists(_WORKER_MARKS):
            os.unlink(_WORKER_MARKS)
    return code


if __name__ == "__main__":
    sys.exit(main())
