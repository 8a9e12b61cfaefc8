"""Launch-config grid for the split-KV decode cases (a diagnostic for issue 2's targets).

For each small-batch decode case (B=1 x 32768, B=4 x 16384 by default) it times every
(tile_n, num_warps, num_stages, partitions) of a grid with CUDA-graph replays (kernel time
only, cheap), then times the fastest few and ``choose_config``'s pick with ``do_bench``
(L2 flushed, host launch included), alternating with dense SDPA on the same data, which is
how ``bench_kernels.py`` scores the targets. Every timed config is first checked against
dense attention (relative L2).

    PYTHONPATH=. python3 benchmarks/sweep_split.py --out $OUT/sweep-split.json

``--v7`` instead times the v7 variants (early block-id reads, ids two tiles ahead, deeper
pipelines, 32-token tiles, 1.5x partitions) of every decode case; ``--scan`` fits graph
time = fixed + per-token cost for B=1 over KV lengths, ours and SDPA (notes-kernels.md, v7).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton.testing
from bench_kernels import (
    BenchSettings,
    dense_kv,
    host_us,
    log,
    ours,
    paired_times,
    problem_of,
    profile_calls,
    sdpa_decode,
    try_config,
)

from kernels.attention import AttentionConfig, choose_config, num_sms
from kernels.testing import dense_attention, make_paged_batch, rel_l2

CASES = ((1, 32768), (4, 16384), (64, 4096), (128, 512), (256, 128))
TILES = (64, 128)
WARPS = (4,)
STAGES = (2, 3, 4)
PARTITIONS = (8, 12, 16, 24, 32, 48, 64)


def graph_us(fn, rep_ms: float) -> float:
    return 1e3 * float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def sweep_case(batch_size: int, kv_len: int, s: BenchSettings, top: int, rep_ms: float) -> dict:
    batch = make_paged_batch(
        [kv_len] * batch_size,
        [1] * batch_size,
        num_q_heads=s.num_q_heads,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        block_size=s.block_size,
        dtype=s.dtype,
        device="cuda",
        seed=batch_size,
    )
    ref, _ = dense_attention(batch)
    base = choose_config(problem_of(batch), s.dtype, num_sms(batch.query.device))
    k, v = dense_kv(batch)
    sdpa = sdpa_decode(batch, k, v)
    sdpa_graph = graph_us(sdpa, rep_ms)
    log(f"--- B={batch_size} x L={kv_len}: default {base}; SDPA graph {sdpa_graph:.1f} us")
    rows = []
    # Unsplit cases (every SM already has a program) keep their split count.
    split_counts = PARTITIONS if base.num_partitions > 1 else (1,)
    grid = itertools.product(TILES, WARPS, STAGES, split_counts)
    for tile, warps, stages, parts in grid:
        cfg = replace(
            base,
            tile_n=tile,
            num_warps=warps,
            num_stages=stages,
            num_partitions=parts,
        )
        row = try_config(batch, cfg, ref, lambda fn: graph_us(fn, rep_ms), "graph_us")
        rows.append(row)
        if "graph_us" in row:
            log(
                f"  tile {tile:3d} w{warps} s{stages} P{parts:2d}: {row['graph_us']:6.1f} us  "
                f"rel L2 {row['rel_l2']:.1e}"
            )
    ok = sorted(
        (r for r in rows if "graph_us" in r and r["rel_l2"] < 1e-2), key=lambda r: r["graph_us"]
    )
    finalists = [AttentionConfig(**r["config"]) for r in ok[:top]]
    if base not in finalists:
        finalists.append(base)
    paired = []
    for cfg in finalists:
        t = paired_times(ours(batch, cfg), sdpa, s)
        t["config"] = asdict(cfg)
        t["ratio"] = t["sdpa_ms"] / t["ours_ms"]
        paired.append(t)
        log(
            f"  do_bench {cfg}: ours {t['ours_ms'] * 1e3:.1f} us, SDPA {t['sdpa_ms'] * 1e3:.1f} us,"
            f" SDPA/ours {t['ratio']:.3f} (rounds {[round(x, 3) for x in t['ratio_rounds']]})"
        )
    # Host time per call with short bursts (the launch queue never fills).
    host = {str(asdict(c)): host_us(ours(batch, c), n=250) for c in [*finalists[:1], base]}
    log(f"  host us per call: {list(host.values())}")
    return {
        "case": f"B={batch_size} x L={kv_len}",
        "host_us": host,
        "default": asdict(base),
        "sdpa_graph_us": sdpa_graph,
        "grid": rows,
        "paired": paired,
    }


def host_diagnosis(s: BenchSettings) -> dict:
    """Host time per call of the split path's variants at B=1 x 32768 (separate merge with
    and without programmatic dependent launch, fused merge, no split), and a profile."""
    import kernels.attention as attention

    batch = make_paged_batch(
        [32768], [1], num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim, block_size=s.block_size, dtype=s.dtype, device="cuda", seed=1,
    )  # fmt: skip
    base = choose_config(problem_of(batch), s.dtype, num_sms(batch.query.device))
    out: dict = {}
    variants = {
        "split, PDL merge": (base, True),
        "split, plain merge": (base, False),
        "split, fused merge": (replace(base, fused_merge=True), True),
        "no split": (replace(base, num_partitions=1), True),
    }
    real_pdl = attention.pdl_supported
    for name, (cfg, pdl) in variants.items():
        attention.pdl_supported = real_pdl if pdl else (lambda device: False)
        try:
            fn = ours(batch, cfg)
            out[name] = {"host_us": host_us(fn, n=250), "graph_us": graph_us(fn, 20.0)}
        finally:
            attention.pdl_supported = real_pdl
        log(f"  host diag {name}: {out[name]}")
    fn = ours(batch, base)
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out["profile"] = profile_calls(fn, 300, 18)
    log(out["profile"])
    return out


def merge_ab(s: BenchSettings) -> list[dict]:
    """The split cases with the default config, merged by the separate (PDL) kernel and by
    the last partition program: graph replay, host time, and do_bench against SDPA."""
    rows = []
    for b, n in CASES[:2]:
        batch = make_paged_batch(
            [n] * b, [1] * b, num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim, block_size=s.block_size, dtype=s.dtype, device="cuda", seed=b,
        )  # fmt: skip
        ref, _ = dense_attention(batch)
        base = choose_config(problem_of(batch), s.dtype, num_sms(batch.query.device))
        k, v = dense_kv(batch)
        sdpa = sdpa_decode(batch, k, v)
        for fused in (False, True):
            cfg = replace(base, fused_merge=fused)
            fn = ours(batch, cfg)
            row = {"case": f"B={b} x L={n}", "config": asdict(cfg), "rel_l2": rel_l2(fn(), ref)}
            row["graph_us"], row["host_us"] = graph_us(fn, 20.0), host_us(fn, n=250)
            row.update(paired_times(fn, sdpa, s))
            row["ratio"] = row["sdpa_ms"] / row["ours_ms"]
            rows.append(row)
            log(
                f"  merge A/B B={b} fused={fused}: graph {row['graph_us']:.1f} us, host "
                f"{row['host_us']:.0f} us, do_bench {row['ours_ms'] * 1e3:.1f} vs SDPA "
                f"{row['sdpa_ms'] * 1e3:.1f} us = {row['ratio']:.3f} "
                f"(rounds {[round(x, 3) for x in row['ratio_rounds']]})"
            )
    return rows


def v7_variants(base: AttentionConfig) -> dict[str, AttentionConfig]:
    """The v7 variants of one case's default config (notes-kernels.md, v7): early block-id
    reads, ids two tiles ahead, deeper pipelines, 32-token tiles, three programs per SM."""
    early = replace(base, early_ids=True)
    both = replace(early, ids_ahead=2)
    out = {"base": base, "early": early, "ahead2": replace(base, ids_ahead=2), "early+ahead2": both}
    if base.num_partitions == 1:
        return out
    p15 = base.num_partitions * 3 // 2
    out.update(
        {
            "s4": replace(base, num_stages=4),
            "s4 early": replace(early, num_stages=4),
            "s4 early+ahead2": replace(both, num_stages=4),
            "t32 s5 early+ahead2": replace(both, tile_n=32, num_stages=5),
            "t32 s6 early+ahead2": replace(both, tile_n=32, num_stages=6),
            "P1.5 early": replace(early, num_partitions=p15),
            "P1.5 early+ahead2": replace(both, num_partitions=p15),
            "P1.5 t32 s5 early+ahead2": replace(both, tile_n=32, num_stages=5, num_partitions=p15),
        }
    )
    return out


def v7_case(batch_size: int, kv_len: int, s: BenchSettings, top: int) -> dict:
    """Every v7 variant of one decode case: rel L2 against dense attention, graph replay
    (SDPA's before and after), then do_bench paired with SDPA for the base, ``early`` and
    the ``top`` fastest others."""
    batch = make_paged_batch(
        [kv_len] * batch_size, [1] * batch_size, num_q_heads=s.num_q_heads,
        num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, block_size=s.block_size,
        dtype=s.dtype, device="cuda", seed=batch_size,
    )  # fmt: skip
    ref, _ = dense_attention(batch)
    base = choose_config(problem_of(batch), s.dtype, num_sms(batch.query.device))
    k, v = dense_kv(batch)
    sdpa = sdpa_decode(batch, k, v)
    name = f"B={batch_size} x L={kv_len}"
    row: dict = {"case": name, "default": asdict(base), "sdpa_rel_l2": rel_l2(sdpa(), ref)}
    row["sdpa_graph_us"] = [graph_us(sdpa, 20.0)]
    variants = v7_variants(base)
    grid = {}
    for label, cfg in variants.items():
        r = try_config(batch, cfg, ref, lambda fn: graph_us(fn, 20.0), "graph_us")
        grid[label] = r
        log(
            f"  {name} {label:26s} {r.get('graph_us', float('nan')):6.1f} us  {r.get('rel_l2', r.get('error'))}"
        )
    row["sdpa_graph_us"].append(graph_us(sdpa, 20.0))
    row["grid"] = grid
    ok = sorted(
        (lb for lb, r in grid.items() if "graph_us" in r and r["rel_l2"] < 1e-2 and lb != "base"),
        key=lambda lb: grid[lb]["graph_us"],
    )
    chosen = ["base", *dict.fromkeys(["early", *ok[:top]])]
    row["paired"] = {}
    for label in chosen:
        if label != "base" and label not in ok:
            continue
        t = paired_times(ours(batch, variants[label]), sdpa, s)
        t["ratio"] = t["sdpa_ms"] / t["ours_ms"]
        row["paired"][label] = t
        log(
            f"  {name} do_bench {label:26s} ours {t['ours_ms'] * 1e3:6.1f} us  SDPA "
            f"{t['sdpa_ms'] * 1e3:6.1f} us  x{t['ratio']:.3f} rounds "
            f"{[round(x, 3) for x in t['ratio_rounds']]}"
        )
    return row


def v7_summary(rows: list[dict]) -> str:
    lines = ["case | variant | graph us | x SDPA graph | do_bench us | x SDPA do_bench | rel L2"]
    for row in rows:
        sg = sum(row["sdpa_graph_us"]) / len(row["sdpa_graph_us"])
        for label, r in row["grid"].items():
            g = r.get("graph_us")
            p = row["paired"].get(label)
            db = f"{p['ours_ms'] * 1e3:.1f} | {p['ratio']:.3f}" if p else "- | -"
            gs = f"{g:.1f} | {sg / g:.3f}" if g else f"error {r.get('error', '')[:60]} | -"
            lines.append(f"{row['case']} | {label} | {gs} | {db} | {r.get('rel_l2', 0):.1e}")
        lines.append(f"{row['case']} | SDPA | {row['sdpa_graph_us']} | - | - | -")
    return "\n".join(lines)


def length_scan(
    s: BenchSettings, parts: int = 32, lengths: tuple[int, ...] = (8192, 16384, 32768, 65536)
) -> list[dict]:
    """B=1 decode at several KV lengths with a fixed split count (the partition length grows
    with L): graph replay of ours (default config otherwise) and SDPA, and the least-squares
    line t = a + b * L of each, separating a fixed cost per call (a) from a cost per token
    (b, i.e. bandwidth)."""
    rows = []
    for n in lengths:
        batch = make_paged_batch(
            [n], [1], num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim, block_size=s.block_size, dtype=s.dtype, device="cuda", seed=n,
        )  # fmt: skip
        base = choose_config(problem_of(batch), s.dtype, num_sms(batch.query.device))
        cfg = replace(base, num_partitions=parts)
        k, v = dense_kv(batch)
        fn, sdpa = ours(batch, cfg), sdpa_decode(batch, k, v)
        ref, _ = dense_attention(batch)
        row = {"kv_len": n, "config": asdict(cfg), "rel_l2": rel_l2(fn(), ref)}
        row["ours_us"], row["sdpa_us"] = graph_us(fn, 20.0), graph_us(sdpa, 20.0)
        rows.append(row)
        log(f"  scan B=1 L={n}: ours {row['ours_us']:.1f} us  SDPA {row['sdpa_us']:.1f} us")
    for key in ("ours_us", "sdpa_us"):
        xs = [r["kv_len"] for r in rows]
        ys = [r[key] for r in rows]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        log(f"  scan fit {key}: {my - b * mx:.2f} us + {b * 1e3:.3f} us per 1k tokens")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--top", type=int, default=3, help="grid winners timed with do_bench")
    parser.add_argument("--rep-ms", type=float, default=25.0, help="graph replay time per config")
    parser.add_argument("--host-only", action="store_true", help="only the host-time diagnosis")
    parser.add_argument("--merge-ab", action="store_true", help="only the merge A/B")
    parser.add_argument("--v7", action="store_true", help="only the v7 variants, every case")
    parser.add_argument("--scan", action="store_true", help="only the B=1 length scan")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_split needs a CUDA device", file=sys.stderr)
        return 2
    s = BenchSettings(rounds=3)
    t0 = time.time()
    out = {"device": torch.cuda.get_device_name(), "cases": []}
    if args.scan:
        out["scan"] = length_scan(s)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=str))
        return 0
    if args.v7:
        out["v7"] = []
        for b, n in CASES:
            out["v7"].append(v7_case(b, n, s, args.top))
            torch.cuda.empty_cache()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=1, default=str))
        print(v7_summary(out["v7"]), flush=True)
        log(f"done in {time.time() - t0:.0f} s")
        return 0
    if args.merge_ab:
        out["merge_ab"] = merge_ab(s)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=str))
        return 0
    out["host"] = host_diagnosis(s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    for b, n in [] if args.host_only else CASES:
        out["cases"].append(sweep_case(b, n, s, args.top, args.rep_ms))
        torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=str))
    log(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
