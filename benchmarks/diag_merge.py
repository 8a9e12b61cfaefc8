"""The serial vs the batched fused merge on the split decode cases (issue 2; notes v9).

v8 found the split path's remaining fixed cost in the fused merge's tail: the last
partition program reads the partials four at a time, each read waiting on the previous
one's math (~0.55 us per read + 0.8 us). The batched merge (``merge_reads="batched"``)
reads all LSEs at once and issues the output reads back to back. For B=1 x 32768 and
B=4 x 16384 (split), and B=64 x 4096 (unsplit: the merge does not run; a sanity row):

1. correctness of every variant against dense attention (relative L2, bf16);
2. CUDA-graph replay of serial, batched, batched with one read of all partials (a larger
   register budget: 168 registers in the sm_90 build at 32 partitions), and SDPA; and of
   v8's merge-tail ladder on the serial merge (no merge; merge without reads; LSEs only;
   one read of four partials), which says where the tail goes if batching does not help;
3. ``do_bench`` paired with SDPA (alternating rounds, L2 flushed; ``bench_kernels``'
   helpers, as ``sweep_split.py`` uses them) for serial and batched;

then a short table and ``WINNER: <merge>``: the merge whose paired ratio is higher on both
split cases, else ``serial``. Under 60 s on an H200, compiles included (estimate: no run yet).

    PYTHONPATH=. python3 benchmarks/diag_merge.py --out $OUT/diag-merge.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from bench_kernels import BenchSettings, dense_kv, log, ours, paired_times, problem_of, sdpa_decode
from sweep_split import graph_us

from kernels.attention import AttentionConfig, choose_config, num_sms
from kernels.testing import PagedBatch, dense_attention, make_paged_batch, rel_l2

# (batch, KV length, split case): the two issue-2 targets and one unsplit sanity row.
CASES = ((1, 32768, True), (4, 16384, True), (64, 4096, False))
# Variants: (label, merge_reads, register budget of the batched merge's reads or None).
VARIANTS = (
    ("serial", "serial", None),
    ("batched", "batched", 64),
    ("batched, one read", "batched", 128),
)
# Graph replay only (their output is wrong or unwritten): v8's merge tail in steps, on the
# serial merge (notes v8: added then, never run), and no merge at all, the floor. If the
# batched merge does not gain, these say where the tail's time goes. (label, _diagnostic)
LADDER = (
    ("ladder: no merge", "no_merge"),
    ("ladder: merge, no reads", "merge_no_reads"),
    ("ladder: merge, LSEs only", "merge_lse_only"),
    ("ladder: merge, one read", "merge_one_read"),
)
PAIRED = ("serial", "batched")  # the WINNER line compares these
# The unsplit sanity case runs the default kernel only (no merge runs there).
UNSPLIT = (("unsplit (no merge)", "serial", None),)
MAX_REL_L2 = 1e-2
GRAPH_REP_MS = 20.0


def decode_batch(batch_size: int, kv_len: int, s: BenchSettings) -> PagedBatch:
    """Equal-length decode batch, the benchmark's shapes (Llama-3-8B heads, bf16, block 16)."""
    return make_paged_batch(
        [kv_len] * batch_size, [1] * batch_size, num_q_heads=s.num_q_heads,
        num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, block_size=s.block_size,
        dtype=s.dtype, device="cuda", seed=batch_size * 7 + kv_len,
    )  # fmt: skip


def run_case(
    batch_size: int, kv_len: int, split: bool, s: BenchSettings, ladder: bool = True
) -> dict:
    """One case: rel L2 and graph us of every variant (split cases: and of the ladder's
    steps, graph only), SDPA's graph us, then the paired do_bench rows (split cases: serial
    and batched; unsplit: the default only)."""
    batch = decode_batch(batch_size, kv_len, s)
    ref, _ = dense_attention(batch)
    base = choose_config(problem_of(batch), s.dtype, num_sms(batch.query.device))
    k, v = dense_kv(batch)
    sdpa = sdpa_decode(batch, k, v)
    row: dict = {
        "case": f"B={batch_size} x L={kv_len}",
        "split": split,
        "config": asdict(base),
        "sdpa_graph_us": graph_us(sdpa, GRAPH_REP_MS),
        "variants": {},
    }
    log(f"--- {row['case']}: {base}; SDPA graph {row['sdpa_graph_us']:.1f} us")
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    for label, merge_reads, regs in VARIANTS if split else UNSPLIT:
        cfg: AttentionConfig = replace(base, merge_reads=merge_reads)
        if regs is not None:
            cfg = replace(cfg, merge_read_regs=regs)
        fn = ours(batch, cfg)
        err = rel_l2(fn(), ref)
        v_row: dict = {"merge_reads": merge_reads, "read_regs": regs, "rel_l2": err}
        if err < MAX_REL_L2:
            v_row["graph_us"] = graph_us(fn, GRAPH_REP_MS)
            fns[label] = fn
        row["variants"][label] = v_row
        log(f"  {label:18s} rel L2 {err:.2e}  graph {v_row.get('graph_us', float('nan')):.1f} us")
    for label, diag in LADDER if split and ladder else ():
        fn = ours(batch, base, _diagnostic=diag)
        row["variants"][label] = {"diagnostic": diag, "graph_us": graph_us(fn, GRAPH_REP_MS)}
        log(f"  {label:26s} graph {row['variants'][label]['graph_us']:.1f} us")
    for label in PAIRED if split else (UNSPLIT[0][0],):
        if label not in fns:
            continue
        t = paired_times(fns[label], sdpa, s)
        t["ratio"] = t["sdpa_ms"] / t["ours_ms"]
        row["variants"][label]["paired"] = t
        log(
            f"  do_bench {label:8s} ours {t['ours_ms'] * 1e3:.1f} us, SDPA "
            f"{t['sdpa_ms'] * 1e3:.1f} us, x SDPA {t['ratio']:.3f} "
            f"(rounds {[round(x, 3) for x in t['ratio_rounds']]})"
        )
    del batch, k, v, ref, fns
    torch.cuda.empty_cache()
    return row


def paired_ratio(row: dict, label: str) -> float:
    """A case row's paired x SDPA for one variant (0 where it was not timed)."""
    return row["variants"].get(label, {}).get("paired", {}).get("ratio", 0.0)


def winner(rows: list[dict]) -> str:
    """The merge with the higher paired x SDPA on every split case; ``serial`` otherwise
    (ties and missing rows included)."""
    split_rows = [r for r in rows if r["split"]]
    for name in PAIRED[1:]:
        if split_rows and all(
            paired_ratio(r, name) > paired_ratio(r, "serial") for r in split_rows
        ):
            return name
    return "serial"


def summary(rows: list[dict]) -> str:
    """Markdown table: per case and variant, rel L2, graph us, do_bench us and x SDPA."""
    lines = [
        "case | variant | rel L2 | graph us (SDPA) | do_bench us | x SDPA (rounds)",
        "--- | --- | ---: | ---: | ---: | ---",
    ]
    for r in rows:
        for label, v in r["variants"].items():
            p = v.get("paired")
            bench = (
                f"{p['ours_ms'] * 1e3:.1f} | {p['ratio']:.3f} "
                f"{[round(x, 3) for x in p['ratio_rounds']]}"
                if p
                else "- | -"
            )
            err = f"{v['rel_l2']:.1e}" if "rel_l2" in v else "-"
            lines.append(
                f"{r['case']} | {label} | {err} | "
                f"{v.get('graph_us', float('nan')):.1f} ({r['sdpa_graph_us']:.1f}) | {bench}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--no-ladder", action="store_true", help="skip the merge-tail ladder")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_merge needs a CUDA device", file=sys.stderr)
        return 2
    s = BenchSettings(rounds=3)
    t0 = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out: dict = {"device": torch.cuda.get_device_name(), "cases": []}
    for batch_size, kv_len, split in CASES:
        out["cases"].append(run_case(batch_size, kv_len, split, s, not args.no_ladder))
        args.out.write_text(json.dumps(out, indent=1, default=str))
        log(f"  ({time.time() - t0:.0f} s)")
    out["winner"] = winner(out["cases"])
    args.out.write_text(json.dumps(out, indent=1, default=str))
    text = summary(out["cases"])
    args.out.with_suffix(".md").write_text(f"{text}\n\nWINNER: {out['winner']}\n")
    print(text, flush=True)
    log(f"done in {time.time() - t0:.0f} s")
    print(f"WINNER: {out['winner']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
