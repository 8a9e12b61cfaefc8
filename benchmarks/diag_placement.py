"""Does block placement cost the split-KV decode cases anything? (a diagnostic, issue 2)

For the small-batch decode cases (B=1 x 32768, B=4 x 16384, Llama-3-8B heads, bf16, block
16) it times, with CUDA-graph replays (kernel time only) and the default launch config:

* ``random``: the benchmark's data (blocks placed at random, out of order);
* ``in order``: the same K/V copied into a pool whose blocks lie in logical order
  (block table = 0, 1, 2, ...), so every tile reads consecutive pages;
* ``separate K/V``: in order, with keys and values in two pools instead of one pool
  interleaving each block's K and V;
* dense SDPA on contiguous K/V, the baseline of the targets.

Every variant is checked against dense attention first. If ``in order`` is as slow as
``random``, placement is not what the split path loses to SDPA.

    PYTHONPATH=. python3 benchmarks/diag_placement.py
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton.testing
from bench_kernels import BenchSettings, dense_kv, problem_of, sdpa_decode

from kernels.attention import choose_config, num_sms, paged_attention_triton
from kernels.testing import PagedBatch, dense_attention, make_paged_batch, rel_l2


def graph_us(fn, rep_ms: float) -> float:
    return 1e3 * float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def in_order(batch: PagedBatch, separate: bool) -> PagedBatch:
    """The batch's K/V in a pool whose blocks follow the logical order of the sequences."""
    rows = []
    for s in range(batch.block_tables.shape[0]):
        nb = -(-int(batch.seq_lens[s]) // batch.key_cache.shape[2])
        rows.append(batch.block_tables[s, :nb].long())
    ids = torch.cat(rows).to(batch.key_cache.device)
    if separate:
        key_cache = batch.key_cache[ids].contiguous()
        value_cache = batch.value_cache[ids].contiguous()
    else:
        pool = torch.stack([batch.key_cache[ids], batch.value_cache[ids]], dim=1).contiguous()
        key_cache, value_cache = pool[:, 0], pool[:, 1]
    tables = torch.full_like(batch.block_tables, -1)
    start = 0
    for s, r in enumerate(rows):
        tables[s, : len(r)] = torch.arange(start, start + len(r), dtype=torch.int32)
        start += len(r)
    return PagedBatch(
        query=batch.query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables.to(batch.block_tables.device),
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        keys=batch.keys,
        values=batch.values,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rep-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    s = BenchSettings()
    for b, n in ((1, 32768), (4, 16384)):
        batch = make_paged_batch(
            [n] * b, [1] * b, num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim, block_size=s.block_size, dtype=s.dtype, device="cuda",
        )  # fmt: skip
        ref, _ = dense_attention(batch)
        k, v = dense_kv(batch)
        row = {"SDPA": graph_us(sdpa_decode(batch, k, v), args.rep_ms)}
        variants = {
            "random": batch,
            "in order": in_order(batch, separate=False),
            "separate K/V": in_order(batch, separate=True),
        }
        for name, variant in variants.items():
            problem = problem_of(variant)
            config = choose_config(problem, variant.query.dtype, num_sms(variant.query.device))

            def fn(variant=variant, problem=problem, config=config) -> torch.Tensor:
                return paged_attention_triton(*variant.args(), problem, config=config)[0]

            err = rel_l2(fn(), ref)
            if err > 2e-2:
                raise SystemExit(f"B={b}: {name} differs from dense attention (rel L2 {err:.2e})")
            row[name] = graph_us(fn, args.rep_ms)
        cells = ", ".join(f"{k} {t:.1f} us" for k, t in row.items())
        print(f"B={b} x L={n} (graph replay, {config}): {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
