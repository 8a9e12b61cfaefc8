"""Where the time of one in-process ``PoolWorker.write_and_attend`` goes, stage by stage
(a diagnostic for issue 5: the worker's share of a service call).

The service benchmark's baseline (batch 32 decode at context 2048, Llama-3-8B heads, bf16,
32 layers per step) with each stage of the call timed on the host, p50 per call:

* ``checks``: argument validation of the write and the attention (workers.checks; with
  the step's metadata key, the attention's index checks run once per step);
* ``staging``: packing the request's host tensors into one pinned buffer and its copy;
* ``write launch`` / ``attention launch``: the kernels' Python launch paths (validation,
  config, the launch; not their GPU time);
* ``graph run``: with CUDA graphs (the default), a repeated call's copy into the graph's
  buffers and its replay (such a call has no write or attention launch of its own);
* ``to host``: the results' copy to the host, which waits for the kernels;
* ``other``: the rest of the call (epoch fence, argument plumbing).

and, apart, the kernels' GPU time (CUDA events from before the write to after the
attention, with no host stalls in between).

    source .device/env.sh && python3 benchmarks/pool_call_breakdown.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from bench_service import H200, decode_pool

import workers.decode_graphs as graphs_mod
import workers.pool as pool_mod

STAGES = ("checks", "staging", "write launch", "attention launch", "graph run", "to host")


def timed(record: dict[str, list[float]], stage: str, fn: Callable[..., Any]) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record[stage].append(time.perf_counter() - t0)

    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--no-key", action="store_true", help="no metadata_key: validate and stage every call"
    )
    parser.add_argument(
        "--no-fingerprints", action="store_true", help="a pool without slot fingerprints"
    )
    parser.add_argument("--no-graphs", action="store_true", help="no CUDA-graph replay")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    setup = H200
    lay = setup.layout
    pool_data = decode_pool(
        setup,
        3 + args.steps + 1,
        name="bd",
        fingerprints=not args.no_fingerprints,
        cuda_graphs=not args.no_graphs,
    )
    worker, epoch, tables, k, q, qsl = (
        pool_data.worker, pool_data.epoch, pool_data.tables, pool_data.key, pool_data.query,
        pool_data.qsl,
    )  # fmt: skip

    record: dict[str, list[float]] = defaultdict(list)
    pool_mod.check_write = timed(record, "checks", pool_mod.check_write)
    pool_mod.check_attend = timed(record, "checks", pool_mod.check_attend)
    pool_cls = pool_mod.KVPool
    pool_cls._on_device = timed(record, "staging", pool_cls._on_device)
    pool_cls._write_on_device = timed(record, "write launch", pool_cls._write_on_device)
    pool_cls._attend_on_device = timed(record, "attention launch", pool_cls._attend_on_device)
    pool_cls._deliver = timed(record, "to host", pool_cls._deliver)
    graphs_cls = graphs_mod.DecodeGraphs
    graphs_cls.run = timed(record, "graph run", graphs_cls.run)

    totals: list[float] = []
    gpu_ms: list[float] = []
    length = setup.context
    # Three warm-up steps: the first runs each layer eagerly, the second captures its graph.
    for step in range(3 + args.steps):
        slots, seq_lens = pool_data.step_args(length)
        # One metadata key per step unless --no-key: what the service's plan reuse sends.
        key = None if args.no_key else step
        for layer in range(lay.num_layers):
            call_args = (epoch, layer, slots, k, k, q, tables, seq_lens, qsl)
            if step < 3:  # warm-up
                worker.write_and_attend(*call_args, metadata_key=key)
                continue
            before = {stage: len(v) for stage, v in record.items()}
            t0 = time.perf_counter()
            worker.write_and_attend(*call_args, metadata_key=key)
            totals.append(time.perf_counter() - t0)
            for stage in STAGES:  # one sample per stage per call (checks: two, summed)
                samples = record[stage][before.get(stage, 0) :]
                record[f"call {stage}"].append(sum(samples))
        length += 1
        if step == 3:
            record.clear()
            totals.clear()
    # GPU time of the two kernels, without the host in between: events around the pool's
    # device-side halves with the inputs already staged, queued behind a sleep kernel so the
    # GPU runs them back to back.
    pool = worker._pool
    slots, seq_lens = pool_data.step_args(length)
    staged = pool._on_device(torch.tensor(slots, dtype=torch.int64), k, k, q, tables, seq_lens, qsl)
    options = pool_mod.AttendOptions(True, False, None, None, None)
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # keeps the GPU busy while the host launches the two
        start.record()
        pool._write_on_device(0, *staged[:3])
        pool._attend_on_device(0, *staged[3:], options)
        end.record()
        end.synchronize()
        gpu_ms.append(start.elapsed_time(end))

    def p50_us(xs: list[float]) -> float:
        return statistics.median(xs) * 1e6 if xs else 0.0

    total = p50_us(totals)
    print(f"in-process write_and_attend, batch {setup.batch}, context {setup.context}: "
          f"p50 {total:.0f} us per call over {len(totals)} calls")  # fmt: skip
    parts = 0.0
    for stage in STAGES:
        value = p50_us(record[f"call {stage}"])
        parts += value
        print(f"  {stage:<17} {value:7.0f} us")
    print(f"  {'other':<17} {total - parts:7.0f} us")
    print(
        f"GPU time of the write and the attention (events): {statistics.median(gpu_ms) * 1e3:.0f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
