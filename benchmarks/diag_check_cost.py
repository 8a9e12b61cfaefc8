"""What the online correctness check costs a worker per checked round (a diagnostic).

In this process, a pool as the H200 bench fills it (Llama-3-8B layout, bf16, context 2048,
fingerprints on), for decode rounds of 8, 32 and 64 sequences: the time of the pool's
kernel attention, of its ``reference_attend`` (the check's recomputation plus the slot
fingerprint check), and of its parts: the per-sequence loop reference
(``kernels.reference.paged_attention_ref``), the batched torch path
(``kernels.attention_torch.paged_attention_torch``) and the fingerprint check alone.
Each figure is the median of `--repeats` calls, synchronised, in ms; the two references'
largest difference is printed too.

    source .device/env.sh && python3 benchmarks/diag_check_cost.py
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from bench_service import H200, decode_pool

from kernels.attention_torch import paged_attention_torch
from kernels.reference import paged_attention_ref


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    _sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _row(batch: int, repeats: int, device: str, context: int, profile: bool = False) -> str:
    """The table row of decode rounds of `batch` sequences."""
    setup = replace(H200, batch=batch, device=device, context=context)
    pool = decode_pool(setup, 2, name=f"check{batch}")
    worker, epoch = pool.worker, pool.epoch
    kv = worker.pool
    layer = 5
    lens = torch.full((batch,), setup.context, dtype=torch.int32)
    query = pool.query.to(device)
    tables, lens_d, qsl = (t.to(device) for t in (pool.tables, lens, pool.qsl))
    index_args = (tables, lens_d, qsl)
    cache_args = (query, kv._data[:, layer, 0], kv._data[:, layer, 1], *index_args)
    loop = paged_attention_ref(*cache_args)
    batched = paged_attention_torch(*cache_args)
    diff = float((loop[0].float() - batched[0].float()).abs().max())
    figures = [
        _median_ms(lambda: worker.attend(epoch, layer, query, *index_args), repeats),
        _median_ms(lambda: worker.reference_attend(epoch, layer, query, *index_args), repeats),
        _median_ms(lambda: paged_attention_ref(*cache_args), repeats),
        _median_ms(lambda: paged_attention_torch(*cache_args), repeats),
        _median_ms(lambda: kv._fingerprints.check(kv._data, layer, tables, lens_d), repeats),
    ]
    row = f"| {batch} | " + " | ".join(f"{f:.2f}" for f in figures) + f" | {diff:.2e} |"
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(repeats):
            worker.reference_attend(epoch, layer, query, *index_args)
        _sync()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        row += f"\n\nreference_attend of {batch} sequences, {repeats} calls:\n```\n"
        row += text.getvalue().strip() + "\n```\n"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--context", type=int, default=H200.context)
    parser.add_argument("--profile", type=int, help="also profile reference_attend at this batch")
    args = parser.parse_args()
    print("| sequences | kernel attend | reference_attend (pool) | loop reference | batched "
          "reference | fingerprint check | max difference loop vs batched |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in (int(b) for b in args.batches.split(",")):
        print(
            _row(batch, args.repeats, args.device, args.context, batch == args.profile), flush=True
        )


if __name__ == "__main__":
    main()
