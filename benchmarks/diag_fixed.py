"""Where the split path's fixed ~5 us per call goes (issue 2; notes-kernels.md, v8).

Subtraction in CUDA-graph replay (kernel time, no host time): the split decode kernel with
parts of its work switched off through the launcher's private ``_diagnostic`` variants
(no merge; no partial stores either; a relaxed merge counter; start-up only; the fused
merge's counters kept out of the captured graph), the separate merge kernel, the unsplit
kernel (B=1), and the fix v8 adopted (empty tile loops skipped, now the default kernel), at
B=1 x 8k and 32k and B=4 x 4k and 16k: per variant, fixed cost = t(short) - (t(long) -
t(short)) / (long / short - 1). Then ``do_bench`` paired with SDPA (alternating rounds, L2
flushed) of the v7 kernel and the default on every decode case of ``bench_kernels.py``.

The ladder runs on the v7 kernel (``unguarded_loops``), as it did when the v8 figures were
taken (the fix was then the opt-in candidate ``guard_loops``; notes-kernels.md, v8). The
three "merge:" rows (the merge tail in steps) were added after that call and have not run.

    PYTHONPATH=. python3 benchmarks/diag_fixed.py --out $OUT/diag-fixed.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from bench_kernels import BenchSettings, dense_kv, log, paired_times, problem_of, sdpa_decode
from sweep_split import graph_us

from kernels.attention import AttentionConfig, choose_config, num_sms
from kernels.testing import PagedBatch, dense_attention, make_paged_batch, rel_l2

# (batch, short length, long length): the fixed cost is read off the two lengths.
SCAN_CASES = ((1, 8192, 32768), (4, 4096, 16384))
PAIRED_CASES = ((1, 32768), (4, 16384), (64, 4096), (128, 512), (256, 128))
# The v7 kernel (empty tile loops run): the ladder's base. "" is today's default.
V7 = "unguarded_loops"


def decode_batch(batch_size: int, kv_len: int, s: BenchSettings) -> PagedBatch:
    """Equal-length decode batch (one query token per sequence), the benchmark's shapes."""
    return make_paged_batch(
        [kv_len] * batch_size, [1] * batch_size, num_q_heads=s.num_q_heads,
        num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, block_size=s.block_size,
        dtype=s.dtype, device="cuda", seed=batch_size * 7 + kv_len,
    )  # fmt: skip


def call(batch: PagedBatch, cfg: AttentionConfig, diag: str):
    """A no-argument call of the launcher with a diagnostic variant (``diag`` may be "")."""
    from kernels.attention import paged_attention_triton

    problem = problem_of(batch)

    def fn() -> torch.Tensor:
        return paged_attention_triton(*batch.args(), problem, config=cfg, _diagnostic=diag)[0]

    return fn


def variants(base: AttentionConfig, batch_size: int) -> dict[str, tuple[AttentionConfig, str]]:
    """Label -> (config, diagnostic) of the subtraction ladder for one split case."""
    cc = "+cached_counters"
    out = {
        "default (fused, acq_rel)": (base, V7),
        "counters not captured": (base, V7 + cc),
        "no merge": (base, V7 + "+no_merge" + cc),
        "no merge, no partial stores": (base, V7 + "+no_stores" + cc),
        "relaxed counter": (base, V7 + "+relaxed_counter" + cc),
        "start-up only": (base, V7 + "+startup_only" + cc),
        # The merge tail in steps (added after the v8 call; not yet run on a device).
        "merge: counter + store, no reads": (base, V7 + "+merge_no_reads" + cc),
        "merge: LSE reads only": (base, V7 + "+merge_lse_only" + cc),
        "merge: first read only": (base, V7 + "+merge_one_read" + cc),
        "separate merge kernel": (replace(base, fused_merge=False), V7),
        "candidate guard_loops": (base, ""),
        "candidate + counters not captured": (base, cc[1:]),
    }
    if batch_size == 1:
        out["unsplit (8 programs)"] = (replace(base, num_partitions=1, num_stages=2), V7)
    return out


def time_variant(batch: PagedBatch, cfg: AttentionConfig, diag: str, ref: torch.Tensor) -> dict:
    """rel L2 against dense attention, then graph replay in us. The output is not poisoned:
    variants that skip the merge leave whatever the allocator's block held (often an earlier
    variant's correct result), so their rel L2 means nothing."""
    fn = call(batch, cfg, diag)
    row: dict = {"config": asdict(cfg), "diag": diag}
    try:
        fn()  # compile, and create the cached buffers before any capture
        torch.cuda.synchronize()
        got = fn()
        row["rel_l2"] = rel_l2(got, ref)
        row["graph_us"] = graph_us(fn, 20.0)
    except Exception as exc:  # a variant that cannot run is reported, not fatal
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def scan(s: BenchSettings) -> list[dict]:
    """The subtraction ladder at two lengths per batch size, with SDPA alongside."""
    rows = []
    for b, short, long in SCAN_CASES:
        for n in (short, long):
            batch = decode_batch(b, n, s)
            ref, _ = dense_attention(batch)
            base = choose_config(problem_of(batch), s.dtype, num_sms(batch.query.device))
            k, v = dense_kv(batch)
            sdpa = sdpa_decode(batch, k, v)
            row = {"batch": b, "kv_len": n, "default": asdict(base), "variants": {}}
            row["sdpa_graph_us"] = [graph_us(sdpa, 20.0)]
            for label, (cfg, diag) in variants(base, b).items():
                r = time_variant(batch, cfg, diag, ref)
                row["variants"][label] = r
                log(f"  B={b} L={n} {label:36s} {r.get('graph_us', float('nan')):7.1f} us  "
                    f"rel L2 {r.get('rel_l2', r.get('error'))}")  # fmt: skip
            row["sdpa_graph_us"].append(graph_us(sdpa, 20.0))
            log(f"  B={b} L={n} SDPA graph {row['sdpa_graph_us']}")
            rows.append(row)
            del batch, k, v, ref
            torch.cuda.empty_cache()
    return rows


def fixed_cost(t_short: float, t_long: float, ratio: float) -> float:
    """Intercept of the line through (1, t_short) and (ratio, t_long): the cost at zero
    length, in the units of t."""
    return t_short - (t_long - t_short) / (ratio - 1.0)


def paired(s: BenchSettings) -> list[dict]:
    """do_bench paired with SDPA, the v7 kernel ("default" in the v8 run) vs today's default
    ("candidate"), every benchmark decode case."""
    rows = []
    for b, n in PAIRED_CASES:
        batch = decode_batch(b, n, s)
        ref, _ = dense_attention(batch)
        base = choose_config(problem_of(batch), s.dtype, num_sms(batch.query.device))
        k, v = dense_kv(batch)
        sdpa = sdpa_decode(batch, k, v)
        for label, diag in (("default", V7), ("candidate", "")):
            fn = call(batch, base, diag)
            err = rel_l2(fn(), ref)
            row = {"case": f"B={b} x L={n}", "variant": label, "rel_l2": err}
            if err < 1e-2:
                row.update(paired_times(fn, sdpa, s))
                row["ratio"] = row["sdpa_ms"] / row["ours_ms"]
                row["graph_us"] = graph_us(fn, 20.0)
            rows.append(row)
            log(f"  do_bench B={b} x L={n} {label:9s} rel L2 {err:.1e} ours "
                f"{row.get('ours_ms', float('nan')) * 1e3:6.1f} us SDPA "
                f"{row.get('sdpa_ms', float('nan')) * 1e3:6.1f} us x{row.get('ratio', 0):.3f} "
                f"rounds {[round(x, 3) for x in row.get('ratio_rounds', [])]} "
                f"graph {row.get('graph_us', float('nan')):.1f}")  # fmt: skip
        del batch, k, v, ref
        torch.cuda.empty_cache()
    return rows


def summary(scan_rows: list[dict], paired_rows: list[dict]) -> str:
    """The short tables printed last: graph us per variant and length, the fixed part,
    then do_bench x SDPA."""
    lines = ["variant | " + " | ".join(f"B={r['batch']} L={r['kv_len']}" for r in scan_rows)
             + " | fixed B=1 | fixed B=4"]  # fmt: skip
    labels = list(scan_rows[0]["variants"])
    for label in [*labels, "SDPA"]:
        ts = []
        for r in scan_rows:
            if label == "SDPA":
                ts.append(min(r["sdpa_graph_us"]))
            else:
                ts.append(r["variants"].get(label, {}).get("graph_us", float("nan")))
        fixed = []
        for i, (_, short, long) in enumerate(SCAN_CASES):
            fixed.append(fixed_cost(ts[2 * i], ts[2 * i + 1], long / short))
        cells = " | ".join(f"{t:.1f}" for t in ts + fixed)
        lines.append(f"{label} | {cells}")
    lines.append("")
    lines.append("case | variant | do_bench us | SDPA us | x SDPA (rounds) | graph us")
    for r in paired_rows:
        if "ratio" not in r:
            lines.append(f"{r['case']} | {r['variant']} | rel L2 {r['rel_l2']:.1e} (skipped)")
            continue
        lines.append(
            f"{r['case']} | {r['variant']} | {r['ours_ms'] * 1e3:.1f} | {r['sdpa_ms'] * 1e3:.1f}"
            f" | {r['ratio']:.3f} {[round(x, 3) for x in r['ratio_rounds']]} | {r['graph_us']:.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--no-paired", action="store_true", help="graph-replay ladder only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_fixed needs a CUDA device", file=sys.stderr)
        return 2
    s = BenchSettings(rounds=3)
    t0 = time.time()
    out: dict = {"device": torch.cuda.get_device_name()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out["scan"] = scan(s)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    log(f"scan done in {time.time() - t0:.0f} s")
    out["paired"] = [] if args.no_paired else paired(s)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    text = summary(out["scan"], out["paired"])
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text, flush=True)
    log(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
