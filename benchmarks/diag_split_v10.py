"""The split decode cases after v10 (issue 2; notes-kernels.md, v10): partition count and
the batched merge's read budget, against dense SDPA.

For B=1 x 32768 and B=4 x 16384 (Llama-3-8B heads, bf16, block 16, the benchmark's
batches): every variant's relative L2 against float64 dense attention, its CUDA-graph
replay time (kernel only; the split path's captured counter fill included, as in
``bench_kernels``), then ``do_bench`` paired with SDPA (L2 flushed, 3 alternating rounds)
for ``choose_config``'s pick, the v9 configuration (33 / 8 partitions, budget 64) and the
fastest other variant in graph replay. A WINNER line per case names the best paired
variant. ``--default-only`` times ``choose_config``'s pick alone (graph and paired, plus
B=64 x 4096): run with another tree's ``kernels`` on the path, it gives the before /
after of a change in one device call.

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_split_v10.py --out $OUT/v10.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch
from bench_kernels import (
    BenchSettings,
    dense_kv,
    graph_ms,
    host_us,
    log,
    ours,
    paired_times,
    problem_of,
    sdpa_decode,
)

from kernels.attention import AttentionConfig, choose_config, num_sms, with_partitions
from kernels.testing import dense_attention, make_paged_batch, rel_l2

MAX_REL_L2 = 1e-2
# (batch, KV length, partition counts to try, the v9 count).
SPLIT_CASES = ((1, 32768, (24, 32, 33, 40), 33), (4, 16384, (8, 10, 12), 8))
UNSPLIT_CASES = ((64, 4096),)
BUDGETS = (64, 128)


def has_budget() -> bool:
    """Whether this tree's AttentionConfig has the merge read budget (v10)."""
    return any(f.name == "merge_read_regs" for f in fields(AttentionConfig))


def graph_us(fn, s: BenchSettings) -> float:
    ms = graph_ms(fn, s)
    return float("nan") if ms is None else ms * 1e3


def variant(base: AttentionConfig, parts: int, regs: int | None) -> AttentionConfig:
    cfg = replace(with_partitions(base, parts), fused_merge=True, merge_reads="batched")
    return replace(cfg, merge_read_regs=regs) if regs is not None else cfg


def time_case(batch_size: int, kv_len: int, s: BenchSettings, default_only: bool, v9: int):
    batch = make_paged_batch(
        [kv_len] * batch_size, [1] * batch_size, num_q_heads=s.num_q_heads,
        num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, block_size=s.block_size,
        dtype=s.dtype, device="cuda", seed=batch_size,
    )  # fmt: skip
    ref, _ = dense_attention(batch)
    k, v = dense_kv(batch)
    sdpa = sdpa_decode(batch, k, v)
    base = choose_config(problem_of(batch), s.dtype, num_sms(batch.query.device))
    sdpa_graph = [graph_us(sdpa, s), graph_us(sdpa, s)]
    row: dict = {
        "case": f"B={batch_size} x L={kv_len}",
        "default": asdict(base),
        "sdpa_graph_us": sdpa_graph,
        "variants": {},
    }
    log(f"--- {row['case']}: default {base}; SDPA graph {sdpa_graph}")
    fns = {}

    def add(label: str, cfg: AttentionConfig, diagnostic: str = "") -> None:
        fn = ours(batch, cfg, _diagnostic=diagnostic) if diagnostic else ours(batch, cfg)
        err = rel_l2(fn(), ref)
        entry = {"config": asdict(cfg), "diagnostic": diagnostic, "rel_l2": err}
        entry["graph_us"] = graph_us(fn, s)
        row["variants"][label] = entry
        log(f"  {label:34s} rel L2 {err:.2e}  graph {entry['graph_us']:.1f} us")
        if not diagnostic and err < MAX_REL_L2:
            fns[label] = fn

    add("default", base)
    split = base.num_partitions > 1
    if split and not default_only:
        add("default, counters not captured", base, "cached_counters")
        add("default, no merge (floor)", base, "no_merge")
        for parts in SPLIT_CASES[0][2] if batch_size == 1 else SPLIT_CASES[1][2]:
            # Both budgets where they differ in build (32 and 33 partials), else the default.
            for regs in BUDGETS if parts in (32, 33) else (base.merge_read_regs,):
                cfg = variant(base, parts, regs)
                if cfg != base:
                    add(f"P{parts} budget {regs}", cfg)
    paired = ["default"]
    if split and not default_only:
        v9_label = f"P{v9} budget 64"
        if v9_label in fns:
            paired.append(v9_label)
        others = sorted(
            (e["graph_us"], label)
            for label, e in row["variants"].items()
            if label in fns and label not in paired
        )
        if others:
            paired.append(others[0][1])
    for label in paired:
        t = paired_times(fns[label], sdpa, s)
        ratio = sorted(t["ratio_rounds"])[1]
        row["variants"][label]["paired"] = t
        log(
            f"  paired {label:27s} ours {t['ours_ms'] * 1e3:.1f} us  SDPA "
            f"{t['sdpa_ms'] * 1e3:.1f} us  x SDPA {ratio:.3f} "
            f"{[round(r, 3) for r in t['ratio_rounds']]}"
        )
    row["host_us"] = {"ours": host_us(fns["default"]), "sdpa": host_us(sdpa)}
    log(f"  host per call: ours {row['host_us']['ours']:.1f} us, SDPA {row['host_us']['sdpa']:.1f}")
    if len(paired) > 1:
        best = max(paired, key=lambda lb: sorted(row["variants"][lb]["paired"]["ratio_rounds"])[1])
        row["winner"] = best
        log(f"WINNER {row['case']}: {best}")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--default-only", action="store_true", help="choose_config's pick only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_split_v10 needs a CUDA device", file=sys.stderr)
        return 2
    default_only = args.default_only or not has_budget()
    s = BenchSettings(rounds=3)
    t0 = time.time()
    rows = []
    cases = [(b, n, v9) for b, n, _, v9 in SPLIT_CASES]
    if default_only:
        cases += [(b, n, 1) for b, n in UNSPLIT_CASES]
    for b, n, v9 in cases:
        rows.append(time_case(b, n, s, default_only, v9))
        torch.cuda.empty_cache()
        args.out.write_text(json.dumps({"rows": rows}, indent=1, default=str))
    log(f"diag_split_v10 done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
