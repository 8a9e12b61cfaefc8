"""Where the host time of one in-process ``PoolWorker.write_and_attend`` goes (a diagnostic).

Runs ``bench_service.in_process`` (the service benchmark's baseline: batch 32 decode calls on
one pool, results copied to the host) under cProfile and prints the functions by own time.

    PYTHONPATH=. python3 benchmarks/profile_in_process.py --h200
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
from dataclasses import replace

from bench_service import CPU, H200, in_process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--h200", action="store_true", help="the Llama-3-8B setup on one GPU")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args(argv)
    setup = replace(H200 if args.h200 else CPU, steps=args.steps, context=args.context)
    in_process(setup)  # warm: compiles, allocator, staging buffer
    prof = cProfile.Profile()
    prof.enable()
    times, _ = in_process(setup)
    prof.disable()
    print(f"{len(times)} calls, p50 {statistics.median(times) * 1e3:.3f} ms (under cProfile)")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
