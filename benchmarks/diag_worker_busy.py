"""How busy the Ray worker is in a service benchmark run, call kind by call kind (a diagnostic).

When the coordinator's event loop is not saturated (bench_service's "loop busy" well below
1), the pace of concurrent clients is set elsewhere; the worker answers the channel's
calls one at a time (its lock), so its time per round is the other candidate. This runs
`bench_service.py` with its arguments and, in each Ray worker's process, times every
channel answer (``ChannelServer._answer``: unpickling, the pool's call, the reply's
pickle; waiting for the worker's lock too) and the pool's call inside it, under the lock
(``PoolWorker._fenced_run``), by method. Printed for the calls after the first quarter of
the whole run's (warm-up): calls, p50 and mean of the answer and of the pool's call, and
the share of the wall time between the first and the last of those answers that the
worker's lock was held (1: the worker never idled, every round waited for it).

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_worker_busy.py --h200 --no-in-process \\
        --transports local-shm --pairs 1 --phases concurrent [--worker-profile PATH]

``--worker-profile PATH``: also profile the worker's channel answers (cProfile, per channel
thread, merged) and write the top functions to PATH.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Any

import bench_service

_MARKS = os.path.join(tempfile.gettempdir(), f"kvcache-worker-busy-{os.getpid()}.txt")


def _actor_timers(actor: Any, path: str, profile: bool) -> None:
    """In the worker's process: every channel answer and pool call appended to `path` as
    ``kind method start end`` lines (perf_counter seconds; kind "answer" or "pool"); with
    `profile`, each answer also runs under its thread's cProfile (`_dump_profile`)."""
    import cProfile
    import threading
    import time as clock

    import workers.channel_server as cs

    profiles: list[cProfile.Profile] = []
    actor._busy_profiles = profiles

    lines: list[str] = []
    lock = threading.Lock()
    local = threading.local()

    def record(kind: str, method: str, start: float) -> None:
        line = f"{kind} {method} {start:.9f} {clock.perf_counter():.9f}\n"
        with lock:
            lines.append(line)
            if len(lines) >= 256:
                with open(path, "a") as f:
                    f.writelines(lines)
                lines.clear()

    on_pool, fenced_run = actor._on_pool, actor._fenced_run

    def named_pool(epoch: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        local.method = getattr(op, "__name__", "?")
        return on_pool(epoch, op, *args, **kwargs)

    def timed_fenced_run(epoch: Any, op: Any) -> Any:
        start = clock.perf_counter()  # under the worker's lock: its time held
        try:
            return fenced_run(epoch, op)
        finally:
            record("pool", getattr(local, "method", "?"), start)

    answer = cs.ChannelServer._answer

    def timed_answer(self: Any, arena: Any, request: bytes) -> Any:
        prof = getattr(local, "prof", None)
        if profile and prof is None:
            prof = local.prof = cProfile.Profile()
            with lock:
                profiles.append(prof)
        start = clock.perf_counter()
        local.method = "?"
        if prof is not None:
            prof.enable()
        try:
            return answer(self, arena, request)
        finally:
            if prof is not None:
                prof.disable()
            record("answer", local.method, start)

    actor._on_pool = named_pool
    actor._fenced_run = timed_fenced_run
    cs.ChannelServer._answer = timed_answer


def _dump_profile(actor: Any, path: str) -> None:
    """In the worker's process: the channel threads' profiles, merged, written to `path`
    (the top 60 functions by their own time)."""
    import io
    import pstats

    profiles = getattr(actor, "_busy_profiles", [])
    if not profiles:
        return
    text = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=text)
    for prof in profiles[1:]:
        stats.add(prof)
    stats.sort_stats("tottime").print_stats(60)
    with open(path, "w") as f:
        f.write(text.getvalue())


def _install(profile_path: str | None) -> None:
    """Wrap bench_service's start_service: once a service with Ray workers is up, install
    `_actor_timers` in each worker's process (the last lines it buffered, fewer than 256,
    are not written)."""
    import ray

    start = bench_service.start_service

    async def started(*args: Any, **kwargs: Any) -> Any:
        running = await start(*args, **kwargs)
        handles = [getattr(c, "handle", None) for c in running.coordinator._clients.values()]
        handles = [h for h in handles if h is not None]
        on = profile_path is not None
        for h in handles:
            ray.get(h.__ray_call__.remote(lambda w: _actor_timers(w, _MARKS, on)))
        if on:
            stop = running.stop

            async def stop_after_dump(*a: Any, **kw: Any) -> Any:
                for i, h in enumerate(handles):
                    where = profile_path if i == 0 else f"{profile_path}.{i}"
                    ray.get(h.__ray_call__.remote(lambda w, p=where: _dump_profile(w, p)))
                return await stop(*a, **kw)

            running.stop = stop_after_dump
        return running

    bench_service.start_service = started


def _report() -> str:
    try:
        with open(_MARKS) as f:
            rows = [line.split() for line in f]
    except OSError:
        return "(no marks from the worker's process)"
    answers = sorted((float(s), float(e), m) for k, m, s, e in rows if k == "answer")
    pools = sorted((float(s), float(e), m) for k, m, s, e in rows if k == "pool")
    answers = answers[len(answers) // 4 :]
    if not answers:
        return "(no channel answers)"
    first, last = answers[0][0], answers[-1][1]
    pools = [p for p in pools if p[0] >= first]
    held = sum(e - s for s, e, _ in pools if e <= last)
    lines = [
        f"window {last - first:.3f} s, {len(answers)} channel answers; the worker's lock held "
        f"{held / (last - first):.2f} of it (the pool's calls)",
        "",
        "| method | calls | answer p50 us | answer mean us | pool call p50 us | pool call mean us |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_method: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for s, e, m in answers:
        by_method[m][0].append(e - s)
    for s, e, m in pools:
        by_method[m][1].append(e - s)
    for method, (ans, pool) in sorted(by_method.items()):
        if not ans:
            continue

        def us(values: list[float], f: Any) -> str:
            return f"{f(values) * 1e6:.1f}" if values else "-"

        lines.append(
            f"| {method} | {len(ans)} | {us(ans, statistics.median)} | "
            f"{us(ans, statistics.fmean)} | {us(pool, statistics.median)} | "
            f"{us(pool, statistics.fmean)} |"
        )
    return "\n".join(lines)


def main() -> int:
    argv = sys.argv[1:]
    profile_path = None
    if "--worker-profile" in argv:  # ours; the rest are bench_service's
        i = argv.index("--worker-profile")
        profile_path = argv[i + 1]
        del argv[i : i + 2]
    _install(profile_path)
    try:
        code = bench_service.main(argv)
        print("\n## The Ray worker's channel answers (diag_worker_busy.py)\n")
        print(_report())
    finally:
        if os.path.exists(_MARKS):
            os.unlink(_MARKS)
    return code


if __name__ == "__main__":
    sys.exit(main())
