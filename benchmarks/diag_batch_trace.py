"""How the coordinator's batcher forms rounds in a service benchmark run (a diagnostic).

Runs `bench_service.py` with its arguments, the coordinator's `_Batcher` instrumented: every
part's arrival and every batch's departure (parts, sequences, why it left, callers
expected) is recorded with its time, and written as JSON lines to `--trace`. The summary
printed at the end covers the last run (the concurrent one with ``--phases
one_small,concurrent``): parts per batch, why batches left, and the time between a batch's
first part and its departure.

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_batch_trace.py --trace /tmp/trace.jsonl \
        -- --h200 --no-ray --transports local-shm --phases concurrent
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bench_service

import cache_service.coordinator as coordinator

events: list[dict[str, Any]] = []


def instrument() -> None:
    batcher = coordinator._Batcher
    submit, flush = batcher.submit, batcher._flush

    def traced_submit(self: Any, part: Any) -> None:
        events.append({"t": time.perf_counter(), "e": "part", "b": id(self),
                        "seqs": len(part.seq_ids), "in_flight": self._in_flight})  # fmt: skip
        submit(self, part)

    def traced_flush(self: Any, *args: Any, **kwargs: Any) -> None:
        if self._pending:
            reason = (
                "window" if self._due
                else "full" if self._items >= self._max_items
                else "everyone" if self._everyone_here()
                else "lone/other"
            )  # fmt: skip
            expected = len(getattr(self, "_expected", ()))
            events.append({"t": time.perf_counter(), "e": "batch", "b": id(self),
                         "parts": len(self._pending), "seqs": self._items,
                         "reason": reason, "expected": expected})  # fmt: skip
        flush(self, *args, **kwargs)

    batcher.submit = traced_submit  # type: ignore[method-assign]
    batcher._flush = traced_flush  # type: ignore[method-assign]


def summarize(events: list[dict[str, Any]]) -> str:
    """Parts per batch, reasons and gathering times of the batches after the longest pause
    between events (the start of the last run)."""
    if not events:
        return "no batches"
    gaps = [(events[i + 1]["t"] - events[i]["t"], i + 1) for i in range(len(events) - 1)]
    start = max(gaps)[1] if gaps else 0
    run = events[start:]
    batches = [e for e in run if e["e"] == "batch"]
    parts = [e for e in run if e["e"] == "part"]
    if not batches:
        return "no batches in the last run"
    first_part: dict[int, float] = {}
    gather = []
    for e in run:
        if e["e"] == "part":
            first_part.setdefault(e["b"], e["t"])
        else:
            gather.append(e["t"] - first_part.pop(e["b"], e["t"]))
    sizes = collections.Counter(b["parts"] for b in batches)
    reasons = collections.Counter(b["reason"] for b in batches)
    span = run[-1]["t"] - run[0]["t"]
    lines = [
        f"last run: {len(parts)} parts in {len(batches)} batches over {span:.3f} s "
        f"({span / max(len(parts), 1) * 1e6:.0f} us per part)",
        "parts per batch: " + ", ".join(f"{k}: {v}" for k, v in sorted(sizes.items())),
        "why batches left: " + ", ".join(f"{k}: {v}" for k, v in reasons.most_common()),
        f"first part to departure, ms: p50 {statistics.median(gather) * 1e3:.3f}, "
        f"mean {statistics.fmean(gather) * 1e3:.3f}, max {max(gather) * 1e3:.3f}",
        f"callers expected: p50 {statistics.median(b['expected'] for b in batches)}",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True, help="JSON lines written here")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- bench_service args")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    instrument()
    code = bench_service.main(bench_args)
    args.trace.write_text("".join(json.dumps(e) + "\n" for e in events))
    print(summarize(events))
    return code


if __name__ == "__main__":
    sys.exit(main())
