"""How busy the Ray worker is in a service benchmark run, call kind by call kind (a diagnostic).

When the coordinator's event loop is not saturated (bench_service's "loop busy" well below
1), the pace of concurrent clients is set elsewhere; the worker answers the channel's
calls one at a time (its lock), so its time per round is the other candidate. This runs
`bench_service.py` with its arguments and, in each Ray worker's process, times every
channel answer (``ChannelServer._answer``: unpickling, the pool's call, the reply's
pickle; waiting for the worker's lock too) and the pool's call inside it, under the lock
(``PoolWorker._fenced_run``), by method, and the pool's steps inside its calls (checks,
staging, kernels, delivery). Printed for the calls after the first quarter of
the whole run's (warm-up): calls, p50 and mean of the answer and of the pool's call, and
the share of the wall time between the first and the last of those answers that the
worker's lock was held (1: the worker never idled, every round waited for it).

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_worker_busy.py --h200 --no-in-process \\
        --transports local-shm --pairs 1 --phases concurrent
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Any

import bench_service
from ray_worker_hooks import on_ray_workers

_MARKS = os.path.join(tempfile.gettempdir(), f"kvcache-worker-busy-{os.getpid()}.txt")


def _actor_timers(actor: Any, path: str) -> None:
    """In the worker's process: every channel answer, pool call and step of the pool's
    calls appended to `path` as ``kind method start end`` lines (perf_counter seconds;
    kind "answer", "pool" or "step")."""
    import threading
    import time as clock

    import workers.channel_server as cs

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
        start = clock.perf_counter()
        local.method = "?"
        try:
            return answer(self, arena, request)
        finally:
            record("answer", local.method, start)

    actor._on_pool = named_pool
    actor._fenced_run = timed_fenced_run
    cs.ChannelServer._answer = timed_answer

    # The pool's steps inside its calls, timed the same way (kind "step", named
    # "<method>:<step>"; no waits added: a step that ends in a wait for the device holds
    # the device's time too).
    import workers.pool as wp

    def timed_step(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def step(*args: Any, **kwargs: Any) -> Any:
            start = clock.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                record("step", f"{getattr(local, 'method', '?')}:{name}", start)

        setattr(owner, name, step)

    for name in ("stand_in", "check_write", "check_attend", "check_out_parts", "fill"):
        timed_step(wp, name)
    for name in (
        "_on_device", "_guarded", "_write_pages_on_device", "_attend_on_device",
        "_deliver", "_deliver_parts", "_cached_metadata", "_finish",
    ):  # fmt: skip
        timed_step(actor._pool, name)
    graphs = actor._pool._graphs  # a CUDA pool's graphs: the replay and its inputs' load
    if graphs is not None:
        for name in ("run", "_load", "_load_metadata"):
            timed_step(graphs, name)
    if actor._pool._stager is not None:  # packing the host parts and the one transfer
        for name in ("to_device", "load"):
            timed_step(actor._pool._stager, name)


def _install() -> None:
    """`_actor_timers` in each Ray worker's process once the service is up (the last lines
    it buffered, fewer than 256, are not written)."""
    on_ray_workers(lambda w: _actor_timers(w, _MARKS))


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
    steps: dict[str, list[float]] = defaultdict(list)
    for k, m, s, e in rows:
        if k == "step" and float(s) >= first:
            steps[m].append(float(e) - float(s))
    step_lines = [
        "",
        "| the pool's step | calls | p50 us | mean us |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, values in sorted(steps.items()):
        step_lines.append(
            f"| {name} | {len(values)} | {statistics.median(values) * 1e6:.1f} | "
            f"{statistics.fmean(values) * 1e6:.1f} |"
        )
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
    return "\n".join(lines + step_lines)


def main() -> int:
    _install()
    try:
        code = bench_service.main(sys.argv[1:])
        print("\n## The Ray worker's channel answers (diag_worker_busy.py)\n")
        print(_report())
    finally:
        if os.path.exists(_MARKS):
            os.unlink(_MARKS)
    return code


if __name__ == "__main__":
    sys.exit(main())
