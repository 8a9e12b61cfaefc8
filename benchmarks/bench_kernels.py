"""Benchmark the paged-attention kernels on one CUDA device, against dense SDPA and FlexAttention.

Measures, in one run so machine noise cancels in the ratios:

* the device's copy ceiling: a large device-to-device copy, (bytes read + written) / time;
* decode cases (Llama-3-8B heads: 32 query, 8 KV, head_dim 128; bf16; block 16; random
  out-of-order block tables): our kernel, dense ``scaled_dot_product_attention`` (enable_gqa)
  on contiguous K/V, and FlexAttention's paged attention (page 128) on the same values;
* prefill: 8 sequences x 2048 new tokens over 2048 cached, TFLOP/s, against SDPA (causal,
  bottom-right aligned) on the same data laid out dense;
* write_kv of 64k tokens against the copy ceiling.

Achieved bandwidth = bytes the kernel must move (every cached K/V byte of every KV head once,
plus queries, outputs, block tables and lengths) / median time (``triton.testing.do_bench``,
which flushes the L2 before every run). Every timed output is also checked against float64
dense attention. ``--sweep`` additionally times a grid of launch configurations per case.

Usage (from the repository root):
    PYTHONPATH=. python3 benchmarks/bench_kernels.py --out DIR [--sweep] [--no-flex]
        [--merge-reads serial|batched]          # on a CUDA device
    PYTHONPATH=. python3 benchmarks/bench_kernels.py --smoke
        # on the CPU through Triton's interpreter: one small decode and prefill case, checked
        # against float64 dense attention and timed against the torch reference (seconds;
        # interpreter timings mean nothing)
Prints its tables (command, device, date first); --out also writes kernels-<device>.md and
bench.json there.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import math
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# --smoke runs the kernels on the CPU: Triton's interpreter must be on before triton loads.
if "--smoke" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.testing

import kernels
from kernels.attention import (
    MERGE_READS,
    AttentionConfig,
    choose_config,
    num_sms,
    paged_attention_triton,
)
from kernels.kv_write import WriteKVConfig, write_kv_triton
from kernels.testing import PagedBatch, dense_attention, make_paged_batch, rel_l2
from kernels.validation import check_paged_attention_args


@dataclass(frozen=True)
class BenchSettings:
    """Model shape and timing knobs shared by every case."""

    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    flex_page: int = 128
    # A long warm-up per timing: an idle H200 drops its SM clock (345 MHz seen at start) and
    # short, latency-bound kernels timed before it ramps up read slow (notes-kernels.md).
    warmup_ms: float = 300.0
    rep_ms: float = 200.0
    rounds: int = 3  # ours and SDPA timed alternately, this many times each
    # The fused merge's reads on the split path (AttentionConfig.merge_reads; --merge-reads);
    # None: choose_config's pick, what the public API runs.
    merge_reads: str | None = None


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    kv_len: int
    target_vs_sdpa: float | None  # minimum throughput ratio ours / SDPA, None = report only

    @property
    def name(self) -> str:
        return f"decode B={self.batch} x L={self.kv_len}"


DECODE_CASES = (
    DecodeCase(64, 4096, 0.95),
    DecodeCase(1, 32768, 1.0),
    DecodeCase(4, 16384, 1.0),
    DecodeCase(128, 512, 0.9),
    DecodeCase(256, 128, None),
)

# Launch configurations the sweep tries: (tile_n, num_warps, num_stages) x split counts x
# fused / separate merge (run 1 of notes-kernels.md tried a wider grid).
SWEEP_TILES = ((128, 4, 3),)
SWEEP_PREFILL = ((128, 128, 8, 3),)


def log(msg: str) -> None:
    print(msg, flush=True)


def time_ms(fn: Callable[[], object], s: BenchSettings) -> float:
    """Median milliseconds of ``fn`` on the device (L2 flushed before each run)."""
    return float(
        triton.testing.do_bench(fn, warmup=s.warmup_ms, rep=s.rep_ms, return_mode="median")
    )


def copy_ceiling(s: BenchSettings) -> dict:
    n_bytes = 4 << 30
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), s)
    return {"bytes": 2 * n_bytes, "ms": ms, "gbps": 2 * n_bytes / ms / 1e6}


def attention_bytes(batch: PagedBatch) -> int:
    """Bytes a paged-attention call must move: K/V once, queries, outputs, tables, lengths."""
    kv = sum(k.numel() + v.numel() for k, v in zip(batch.keys, batch.values, strict=True))
    elem = batch.query.element_size()
    q = batch.query.numel()
    tables = (
        sum(math.ceil(k.shape[0] / batch.key_cache.shape[2]) for k in batch.keys)
        * batch.block_tables.element_size()
    )
    lens = batch.seq_lens.numel() * 4 + batch.query_start_loc.numel() * 4
    return (kv + 2 * q) * elem + tables + lens


def bench_config(batch: PagedBatch, s: BenchSettings) -> AttentionConfig:
    """``choose_config``'s pick for ``batch``, with the run's fused-merge reads if given
    (only the split path uses them)."""
    config = choose_config(problem_of(batch), s.dtype, num_sms(batch.query.device))
    return config if s.merge_reads is None else replace(config, merge_reads=s.merge_reads)


def problem_of(batch: PagedBatch):
    return check_paged_attention_args(
        *batch.args(), scale=None, sliding_window=None, softcap=None, out=None
    )


def ours(batch: PagedBatch, config: AttentionConfig, **kw) -> Callable[[], torch.Tensor]:
    problem = problem_of(batch)

    def fn() -> torch.Tensor:
        return paged_attention_triton(*batch.args(), problem, config=config, **kw)[0]

    return fn


def dense_kv(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical K/V as contiguous ``[B, Hkv, L, D]`` (equal lengths only)."""
    k = torch.stack(batch.keys).transpose(1, 2).contiguous()
    v = torch.stack(batch.values).transpose(1, 2).contiguous()
    return k, v


def build_flex_decode(
    batch: PagedBatch, k: torch.Tensor, v: torch.Tensor, s: BenchSettings, compile: bool = True
) -> Callable[[], torch.Tensor]:
    """FlexAttention's paged attention (torch.nn.attention.experimental) on the same values,
    pages of ``s.flex_page`` tokens placed in random order."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

    b, hkv, seq, d = k.shape
    dev = k.device
    page = s.flex_page
    n_pages = b * math.ceil(seq / page) + 1
    paged = PagedAttention(n_pages, page, b, device=dev)
    random.Random(0).shuffle(paged.empty_pages)
    for i in range(b):
        paged.reserve(torch.tensor(i), torch.tensor(seq, device=dev))
    k_cache = torch.zeros(1, hkv, n_pages * page, d, dtype=k.dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    batch_idx = torch.arange(b, device=dev, dtype=torch.int32)
    positions = torch.arange(seq, device=dev, dtype=torch.int32)[None].expand(b, seq)
    paged.assign(batch_idx, positions, k, v, k_cache, v_cache)
    mask = create_block_mask(noop_mask, b, 1, 1, seq, device=dev, BLOCK_SIZE=page)
    physical_mask = paged.convert_logical_block_mask(mask)
    score_mod = paged.get_score_mod(None)
    q = batch.query.view(b, 1, -1, d).transpose(1, 2).contiguous()  # [B, Hq, 1, D]
    attend = torch.compile(flex_attention, dynamic=False) if compile else flex_attention

    def fn() -> torch.Tensor:
        out = attend(
            q, k_cache, v_cache, block_mask=physical_mask, score_mod=score_mod, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(b, -1, d)

    return fn


def sdpa_decode(batch: PagedBatch, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    b, _, _, d = k.shape
    q = batch.query.view(b, 1, -1, d).transpose(1, 2).contiguous()

    def fn() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, -1, d)

    return fn


def bench_decode(case: DecodeCase, s: BenchSettings, sweep: bool, flex: bool) -> dict:
    log(f"--- {case.name}")
    batch = make_paged_batch(
        [case.kv_len] * case.batch,
        [1] * case.batch,
        num_q_heads=s.num_q_heads,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        block_size=s.block_size,
        dtype=s.dtype,
        device="cuda",
        seed=case.batch,
    )
    n_bytes = attention_bytes(batch)
    ref, _ = dense_attention(batch)
    config = bench_config(batch, s)
    fn = ours(batch, config)
    err = rel_l2(fn(), ref)
    row = {
        "case": case.name,
        "bytes": n_bytes,
        "config": asdict(config),
        "ours_rel_l2": err,
        "target_vs_sdpa": case.target_vs_sdpa,
    }
    k, v = dense_kv(batch)
    sdpa = sdpa_decode(batch, k, v)
    row["sdpa_rel_l2"] = rel_l2(sdpa(), ref)
    row.update(paired_times(fn, sdpa, s))
    log(
        f"ours {row['ours_ms'] * 1e3:.1f} us  sdpa {row['sdpa_ms'] * 1e3:.1f} us  per-round "
        f"SDPA/ours {[round(r, 3) for r in row['ratio_rounds']]}  config {config}  rel L2 {err:.2e}"
    )
    row["ours_graph_ms"], row["sdpa_graph_ms"] = graph_ms(fn, s), graph_ms(sdpa, s)
    row["ours_host_us"], row["sdpa_host_us"] = host_us(fn), host_us(sdpa)
    row["flex_ms"], row["flex_error"] = None, None
    if flex:
        try:
            t0 = time.time()
            fx = build_flex_decode(batch, k, v, s)
            row["flex_rel_l2"] = rel_l2(fx(), ref)
            row["flex_ms"] = time_ms(fx, s)
            log(f"flex {row['flex_ms'] * 1e3:.1f} us (built+compiled in {time.time() - t0:.0f} s)")
        except Exception as exc:
            row["flex_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"flex failed: {row['flex_error']}")
    k = v = None  # free the dense copies before the sweep
    # The public call as it ships (no value checks: no host sync) and with the opt-in value
    # checks (check_values=True reads the index tensors back: one device sync per call).
    row["public_api_ms"] = time_ms(lambda: kernels.paged_attention(*batch.args()), s)
    row["public_api_checked_ms"] = time_ms(
        lambda: kernels.paged_attention(*batch.args(), check_values=True), s
    )
    log(
        f"public API {row['public_api_ms'] * 1e3:.1f} us (default, check_values=False), "
        f"{row['public_api_checked_ms'] * 1e3:.1f} us with check_values=True"
    )
    if sweep:
        row["sweep"] = sweep_decode(batch, config, ref, s)
    return row


def paired_times(ours_fn: Callable[[], object], base_fn: Callable[[], object], s) -> dict:
    """Time ours and a baseline alternately (order flipped each round); medians + ratios."""
    ours_t, base_t = [], []
    for r in range(s.rounds):
        if r % 2 == 0:
            ours_t.append(time_ms(ours_fn, s))
            base_t.append(time_ms(base_fn, s))
        else:
            base_t.append(time_ms(base_fn, s))
            ours_t.append(time_ms(ours_fn, s))
    return {
        "ours_ms": sorted(ours_t)[len(ours_t) // 2],
        "sdpa_ms": sorted(base_t)[len(base_t) // 2],
        "ours_rounds_ms": ours_t,
        "sdpa_rounds_ms": base_t,
        "ratio_rounds": [b / o for o, b in zip(ours_t, base_t, strict=True)],
    }


def split_candidates(base: AttentionConfig) -> list[int]:
    p = base.num_partitions
    return sorted({max(1, p // 2), p, 2 * p} if p > 1 else {1, 2})


def sweep_decode(batch: PagedBatch, base: AttentionConfig, ref: torch.Tensor, s) -> list[dict]:
    results = []
    if base.num_partitions == 1:
        return results  # run 2 of notes-kernels.md swept the unsplit cases
    for tile_n, warps, stages in SWEEP_TILES:
        for parts in split_candidates(base):
            for fused in (True, False) if parts > 1 else (True,):
                cfg = replace(
                    base,
                    tile_n=tile_n,
                    num_warps=warps,
                    num_stages=stages,
                    num_partitions=parts,
                    fused_merge=fused,
                )
                row = try_config(batch, cfg, ref, lambda fn: time_ms(fn, s), "ms")
                results.append(row)
                if "ms" in row:
                    log(
                        f"  sweep tile {tile_n} w{warps} s{stages} P{parts} fused={fused}: "
                        f"{row['ms'] * 1e3:.1f} us  rel L2 {row['rel_l2']:.1e}"
                    )
    return results


def try_config(
    batch: PagedBatch,
    cfg: AttentionConfig,
    ref: torch.Tensor,
    timer: Callable[[Callable[[], torch.Tensor]], float],
    key: str,
) -> dict:
    """One config of a sweep: its output checked against ``ref`` (relative L2), then timed;
    a config that cannot run (out of registers or shared memory) is recorded, not raised.

    Returns ``{"config", key: timer's figure, "rel_l2"}`` or ``{"config", "error"}``.
    """
    try:
        fn = ours(batch, cfg)
        err = rel_l2(fn(), ref)
        value = timer(fn)
    except Exception as exc:
        return {"config": asdict(cfg), "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"config": asdict(cfg), key: value, "rel_l2": err}


def profile_calls(fn: Callable[[], object], calls: int, top: int) -> str:
    """cProfile of ``calls`` calls of ``fn`` (no sync inside), the ``top`` functions by own
    time, as text; the device is drained afterwards."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def host_us(fn: Callable[[], object], n: int = 2000) -> float:
    """Host microseconds per call: median over 5 bursts of n/5 calls without a sync (the
    device queue is drained between bursts, so a launch never blocks on a full queue).
    When this exceeds the kernel time, do_bench measures the host, not the kernel."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    bursts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n // 5):
            fn()
        bursts.append((time.perf_counter() - t0) / (n // 5) * 1e6)
        torch.cuda.synchronize()
    return sorted(bursts)[2]


def graph_ms(fn: Callable[[], object], s: BenchSettings) -> float | None:
    """Median ms of CUDA-graph replays (no launch overhead, no L2 flush): a diagnostic."""
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=s.rep_ms, return_mode="median"))
    except Exception as exc:
        log(f"graph timing failed: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def bench_prefill(s: BenchSettings, sweep: bool) -> dict:
    n_seq, new, cached = 8, 2048, 2048
    name = f"prefill {n_seq} x {new} new over {cached} cached"
    log(f"--- {name}")
    total = new + cached
    batch = make_paged_batch(
        [total] * n_seq,
        [new] * n_seq,
        num_q_heads=s.num_q_heads,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        block_size=s.block_size,
        dtype=s.dtype,
        device="cuda",
        seed=7,
    )
    # Query i (0-based) of a sequence sees cached + i + 1 keys.
    pairs = n_seq * sum(cached + i + 1 for i in range(new)) * s.num_q_heads
    flops = 4 * s.head_dim * pairs
    ref, _ = dense_attention(batch)
    config = bench_config(batch, s)
    fn = ours(batch, config)
    row = {
        "case": name,
        "flops": flops,
        "bytes": attention_bytes(batch),
        "config": asdict(config),
        "ours_rel_l2": rel_l2(fn(), ref),
        "ours_ms": time_ms(fn, s),
    }
    k, v = dense_kv(batch)
    q = batch.query.view(n_seq, new, s.num_q_heads, s.head_dim).transpose(1, 2).contiguous()
    row["sdpa_ms"], row["sdpa_variant"], row["sdpa_error"] = None, None, None
    for variant, make in sdpa_prefill_variants(q, k, v, new, total):
        try:
            sd = make()
            out = sd().transpose(1, 2).reshape(-1, s.num_q_heads, s.head_dim)
            row["sdpa_rel_l2"] = rel_l2(out, ref)
            if row["sdpa_rel_l2"] > 2e-2:
                raise RuntimeError(f"wrong result (rel L2 {row['sdpa_rel_l2']:.2e})")
            row.update(paired_times(fn, sd, s))
            row["sdpa_variant"] = variant
            log(f"sdpa ({variant}) {row['sdpa_ms']:.3f} ms")
            break
        except Exception as exc:
            row["sdpa_error"] = f"{variant}: {type(exc).__name__}: {str(exc)[:200]}"
            log(f"sdpa variant failed: {row['sdpa_error']}")
    log(f"ours {row['ours_ms']:.3f} ms = {flops / row['ours_ms'] / 1e9:.0f} TFLOP/s  {config}")
    k = v = q = None
    if sweep:
        results = []
        for block_m, tile_n, warps, stages in SWEEP_PREFILL:
            cfg = AttentionConfig(
                block_m=block_m,
                block_q=block_m // (s.num_q_heads // s.num_kv_heads),
                tile_n=tile_n,
                num_warps=warps,
                num_stages=stages,
            )
            try:
                f = ours(batch, cfg)
                err = rel_l2(f(), ref)
                ms = time_ms(f, s)
                results.append({"config": asdict(cfg), "ms": ms, "rel_l2": err})
                log(f"  sweep {cfg}: {ms:.3f} ms")
            except Exception as exc:
                results.append({"config": asdict(cfg), "error": f"{type(exc).__name__}: {exc}"})
        row["sweep"] = results
    return row


def sdpa_prefill_variants(q, k, v, new: int, total: int):
    """SDPA with bottom-right causal alignment (query i sees keys 0..total-new+i)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    sdpa = torch.nn.functional.scaled_dot_product_attention
    group = q.shape[1] // k.shape[1]

    def flash_gqa():
        bias = causal_lower_right(new, total)
        return lambda: sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

    def flash_expanded():
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        bias = causal_lower_right(new, total)

        def fn():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                return sdpa(q, ke, ve, attn_mask=bias)

        return fn

    yield "causal_lower_right, enable_gqa", flash_gqa
    yield "causal_lower_right, K/V heads expanded", flash_expanded


def bench_write_kv(s: BenchSettings, sweep: bool) -> dict:
    n_tokens = 65536
    log(f"--- write_kv {n_tokens} tokens")
    bs, hkv, d = s.block_size, s.num_kv_heads, s.head_dim
    n_blocks = n_tokens // bs + 64
    pool = torch.randn(n_blocks, 2, hkv, bs, d, device="cuda", dtype=s.dtype)
    kc, vc = pool[:, 0], pool[:, 1]
    key = torch.randn(n_tokens, hkv, d, device="cuda", dtype=s.dtype)
    value = torch.randn_like(key)
    # Prefill-like: whole blocks in random order, tokens contiguous inside a block.
    blocks = torch.randperm(n_blocks, device="cuda")[: n_tokens // bs]
    slots = (blocks[:, None] * bs + torch.arange(bs, device="cuda")[None]).reshape(-1)
    n_bytes = 2 * 2 * key.numel() * key.element_size() + slots.numel() * 8
    config = WriteKVConfig()
    write_kv_triton(key, value, kc, vc, slots, config)
    ok = torch.equal(kc[blocks[:3]].transpose(1, 2).reshape(-1, hkv, d), key[: 3 * bs])
    row = {"case": f"write_kv {n_tokens} tokens", "bytes": n_bytes, "correct": bool(ok)}
    row["ours_ms"] = time_ms(lambda: write_kv_triton(key, value, kc, vc, slots, config), s)
    row["config"] = asdict(config)
    log(f"ours {row['ours_ms'] * 1e3:.1f} us, correct={ok}")
    if sweep:
        results = []
        for tokens in (1, 4):
            for warps in (2, 4):
                cfg = WriteKVConfig(tokens_per_program=tokens, num_warps=warps)
                ms = time_ms(lambda cfg=cfg: write_kv_triton(key, value, kc, vc, slots, cfg), s)
                results.append({"config": asdict(cfg), "ms": ms})
                log(f"  sweep {cfg}: {ms * 1e3:.1f} us")
        row["sweep"] = results
    return row


def device_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,power.draw",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except Exception as exc:
        smi = f"nvidia-smi failed: {exc}"
    return {
        "name": props.name,
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _spread(row: dict) -> str:
    ratios = row.get("ratio_rounds")
    return f"({min(ratios):.2f}-{max(ratios):.2f})" if ratios else ""


def _graph_cell(row: dict) -> str:
    ours_g, sdpa_g = row.get("ours_graph_ms"), row.get("sdpa_graph_ms")
    if ours_g is None or sdpa_g is None:
        return "n/a"
    return f"{ours_g * 1e3:.1f} / {sdpa_g * 1e3:.1f}"


def _host_cell(row: dict) -> str:
    ours_h, sdpa_h = row.get("ours_host_us"), row.get("sdpa_host_us")
    return "n/a" if ours_h is None or sdpa_h is None else f"{ours_h:.0f} / {sdpa_h:.0f}"


def _fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def render(results: dict, command: str) -> str:
    """The markdown table kept in benchmarks/results/."""
    ceiling = results["copy"]["gbps"]
    dev = results["device"]
    lines = [
        "# Paged-attention kernels on the H200",
        "",
        f"- command: `{command}`",
        f"- device: {dev['name']} ({dev['sms']} SMs, {dev['memory_gib']} GiB); nvidia-smi: "
        f"{dev['nvidia_smi']}",
        f"- software: torch {dev['torch']} (CUDA {dev['cuda']}), triton {dev['triton']}, "
        f"Python {dev['python']}",
        f"- date: {dev['date_utc']}",
        f"- copy ceiling: {ceiling:.0f} GB/s (device-to-device copy of 4 GiB, read + write)",
        "- fused merge reads on the split path: "
        + (
            f"`{results['settings']['merge_reads']}` (`--merge-reads`)"
            if results["settings"].get("merge_reads")
            else "`choose_config`'s pick, as the public API (see the config in bench.json)"
        ),
        "",
        "Times are medians of `triton.testing.do_bench` (L2 flushed before each run, 300 ms "
        "warm-up); ours and SDPA are timed alternately in 3 rounds and the median round is "
        "shown, with the spread of the per-round ratios. GB/s = "
        "bytes the kernel must move (K/V once, queries, outputs, tables) / time; the same byte "
        "count is used for SDPA and Flex, so 'vs' columns are time ratios (baseline time / our "
        "time; > 1 means we are faster). The graph-replay column (CUDA graphs, no L2 flush, "
        "no launch overhead) is a diagnostic only, as is the host time per call (launch cost "
        "without a sync: when it exceeds the kernel time, do_bench times the host).",
        "",
        "| case | time (us) | GB/s | % of ceiling | vs SDPA (rounds min-max) | vs Flex | target "
        "| bf16 rel L2 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for row in results["decode"]:
        gbps = row["bytes"] / row["ours_ms"] / 1e6
        vs_sdpa = row["sdpa_ms"] / row["ours_ms"]
        vs_flex = row["flex_ms"] / row["ours_ms"] if row.get("flex_ms") else None
        target = row["target_vs_sdpa"]
        verdict = "report"
        if target is not None:
            verdict = f">= {target}x SDPA: {'met' if vs_sdpa >= target else 'MISSED'}"
        if vs_flex is not None:
            verdict += f"; >= Flex: {'met' if vs_flex >= 1.0 else 'MISSED'}"
        lines.append(
            f"| {row['case']} | {row['ours_ms'] * 1e3:.1f} | {gbps:.0f} | "
            f"{100 * gbps / ceiling:.0f}% | {vs_sdpa:.2f}x {_spread(row)} | {_fmt_ratio(vs_flex)} | "
            f"{verdict} | "
            f"{row['ours_rel_l2']:.1e} |"
        )
    pre = results.get("prefill")
    if pre:
        tflops = pre["flops"] / pre["ours_ms"] / 1e9
        vs = pre["sdpa_ms"] / pre["ours_ms"] if pre.get("sdpa_ms") else None
        lines.append(
            f"| {pre['case']} | {pre['ours_ms'] * 1e3:.0f} | {tflops:.0f} TFLOP/s | - | "
            f"{_fmt_ratio(vs)} {_spread(pre)} | n/a | report | {pre['ours_rel_l2']:.1e} |"
        )
    wk = results.get("write_kv")
    if wk:
        gbps = wk["bytes"] / wk["ours_ms"] / 1e6
        lines.append(
            f"| {wk['case']} | {wk['ours_ms'] * 1e3:.1f} | {gbps:.0f} | {100 * gbps / ceiling:.0f}% "
            f"| - | - | >= 70% of ceiling: {'met' if gbps >= 0.7 * ceiling else 'MISSED'} | {'exact' if wk.get('correct') else 'WRONG'} |"
        )
    lines += [
        "",
        "Baselines on the same data:",
        "",
        "| case | SDPA (us) | SDPA GB/s | Flex paged (us) | Flex GB/s "
        "| public API: default / check_values=True (us) | graph replay: ours / SDPA (us) | host time per call: ours / SDPA (us) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["decode"]:
        flex = row.get("flex_ms")
        flex_cells = (
            f"{flex * 1e3:.1f} | {row['bytes'] / flex / 1e6:.0f}"
            if flex
            else f"failed: {row.get('flex_error') or 'not run'} | -"
        )
        lines.append(
            f"| {row['case']} | {row['sdpa_ms'] * 1e3:.1f} | {row['bytes'] / row['sdpa_ms'] / 1e6:.0f}"
            f" | {flex_cells} | {row['public_api_ms'] * 1e3:.1f} / "
            f"{row['public_api_checked_ms'] * 1e3:.1f} | {_graph_cell(row)} | "
            f"{_host_cell(row)} |"
        )
    if pre:
        sd = pre.get("sdpa_ms")
        sd_txt = (
            f"{sd * 1e3:.0f} ({pre['flops'] / sd / 1e9:.0f} TFLOP/s, {pre['sdpa_variant']})"
            if sd
            else f"failed: {pre.get('sdpa_error')}"
        )
        lines.append(f"| {pre['case']} | {sd_txt} | - | n/a | - | - | - | - |")
    return "\n".join(lines) + "\n"


# The --smoke cases: (name, KV tokens per sequence, query tokens per sequence), fp32.
SMOKE_CASES = (
    ("decode B=4 x L=80", [80] * 4, [1] * 4),
    ("prefill B=2, 24 new over 40 cached", [64] * 2, [24] * 2),
)


def median_s(fn: Callable[[], object], runs: int) -> float:
    """Median wall seconds of `runs` calls of `fn` (after one untimed call)."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def smoke(command: str) -> str:
    """The --smoke report: each SMOKE_CASES case through `kernels.paged_attention` (the
    public call, backend "triton") on the CPU under Triton's interpreter, its error against float64 dense
    attention, and its time against the torch reference (`kernels.paged_attention_ref`)."""
    lines = [
        "# Paged-attention kernels, smoke run (CPU, Triton interpreter: timings mean nothing)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{command}`",
        f"- device: CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} CPUs; "
        f"torch {torch.__version__}, triton {triton.__version__}",
        "- shape: 8 query / 2 KV heads, head_dim 32, block 16, float32",
        "",
        "| case | ours ms | torch reference ms | rel L2 vs float64 dense |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, seq_lens, q_lens in SMOKE_CASES:
        batch = make_paged_batch(
            seq_lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16
        )
        ref, _ = dense_attention(batch)
        err = rel_l2(kernels.paged_attention(*batch.args(), backend="triton"), ref)
        if not err < 1e-4:
            raise RuntimeError(f"{name}: rel L2 {err:.2e} against dense attention")
        ours_s = median_s(lambda b=batch: kernels.paged_attention(*b.args(), backend="triton"), 3)
        ref_s = median_s(lambda b=batch: kernels.paged_attention_ref(*b.args()), 3)
        lines.append(f"| {name} | {ours_s * 1e3:.2f} | {ref_s * 1e3:.2f} | {err:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a small CPU run through Triton's interpreter"
    )
    parser.add_argument("--out", type=Path, help="also write the table and JSON to this folder")
    parser.add_argument("--sweep", action="store_true", help="also time launch-config grids")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles)")
    parser.add_argument("--only", default="", help="comma list: decode,prefill,write_kv")
    parser.add_argument(
        "--merge-reads",
        choices=MERGE_READS,
        default=None,
        help="the fused merge's reads on the split path (AttentionConfig.merge_reads; "
        "default: choose_config's pick)",
    )
    args = parser.parse_args(argv)
    command = "PYTHONPATH=. python3 " + " ".join(["benchmarks/bench_kernels.py", *sys.argv[1:]])
    if args.smoke:
        table = smoke(command)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "kernels-cpu-smoke.md").write_text(table)
        print(table, flush=True)
        return 0
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device (or --smoke, on the CPU)", file=sys.stderr)
        return 2
    if args.out is None:
        parser.error("--out DIR is needed for the GPU run (bench.json is written as it goes)")
    s = BenchSettings(merge_reads=args.merge_reads)
    parts = set(args.only.split(",")) if args.only else {"decode", "prefill", "write_kv"}
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": device_info(), "settings": {**asdict(s), "dtype": str(s.dtype)}}
    log(json.dumps(results["device"]))
    results["copy"] = copy_ceiling(s)
    torch.cuda.empty_cache()
    log(f"copy ceiling {results['copy']['gbps']:.0f} GB/s")
    results["decode"] = []
    json_path = args.out / "bench.json"
    if "decode" in parts:
        for case in DECODE_CASES:
            try:
                results["decode"].append(bench_decode(case, s, args.sweep, not args.no_flex))
            except Exception:
                traceback.print_exc()
            torch.cuda.empty_cache()
            json_path.write_text(json.dumps(results, indent=1, default=str))
    if "prefill" in parts:
        try:
            results["prefill"] = bench_prefill(s, args.sweep)
        except Exception:
            traceback.print_exc()
    if "write_kv" in parts:
        try:
            results["write_kv"] = bench_write_kv(s, args.sweep)
        except Exception:
            traceback.print_exc()
    json_path.write_text(json.dumps(results, indent=1, default=str))
    table = render(results, command)
    (args.out / "kernels-h200.md").write_text(table)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
