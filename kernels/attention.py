"""Paged attention in Triton: the kernel, its launcher and its launch heuristics.

One program handles one (query tile, KV head, KV partition). A query tile packs
``block_q`` query tokens of one sequence times the ``group`` query heads that share the KV
head into the ``block_m`` rows of one ``tl.dot`` operand, so every K/V tile is read once per
group, not once per query head. The program walks the sequence's block table ``tile_n``
tokens at a time (several pages per tile), folding each tile into an online softmax kept in
float32 (base-2 exponentials, the scale folded into ``log2(e)``).

Decode and prefill share the kernel: ``block_q == 1`` for one query token per sequence,
larger for prefill / chunked prefill / speculative verification. When the query tiles times
KV heads cannot fill the GPU (long contexts, small batches), the KV range is split into
partitions that write float32 partial results and their log-sum-exp. By default the last
partition program of each tile to finish merges them (``AttentionConfig.fused_merge``): one
launch per call. Otherwise :mod:`kernels.merge_states` merges them in a second launch (the
same math as ``merge_attention_states``). The fused merge reads the partials either all up
front (``merge_reads="batched"``, what ``choose_config`` picks: all LSEs in one load, the
output reads issued back to back) or in dependent steps (``"serial"``, the dataclass's
default). The heuristics' measurements (H200 sweeps) are in
benchmarks/results/archive/notes-kernels.md.

Offsets that can pass 2**31 elements (block index times the pool's block stride, query and
output rows) are computed in int64.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from kernels import launch_plans
from kernels.launch import CachedLauncher, DirectLaunch, current_stream_handle
from kernels.launch_plans import LaunchPlan, keep_plan
from kernels.merge_states import merge_partitions, pdl_supported
from kernels.split_buffers import split_buffers
from kernels.validation import AttentionProblem, KernelArgumentError

__all__ = [
    "MERGE_READS",
    "AttentionConfig",
    "SplitPolicy",
    "choose_config",
    "num_q_programs",
    "num_sms",
    "paged_attention_triton",
    "with_partitions",
]

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256
# Partials the fused merge reads per step ([rows, chunk, head_dim] float32 in registers).
_MERGE_CHUNK = tl.constexpr(4)
# The fused merge's read strategies (AttentionConfig.merge_reads).
MERGE_READS = ("serial", "batched")
# Default registers per thread the batched merge may fill with output partials in flight
# (AttentionConfig.merge_read_regs): one read of all partials when they fit, else two
# chunks of half this (one summed, one prefetched). The split decode build must keep its
# residency: 3 programs per SM, bound by its 70 KB of shared memory (the grid asks for 2).
# No budget here makes the sm_90 build (bf16, head_dim 128, group 4) spill.
_MERGE_READ_REGS = 64

# Diagnostic-only kernel variants for timing experiments (results in
# benchmarks/results/archive/diag-fixed-h200.md), selected by the launcher's private
# ``_diagnostic`` argument; never used by the public API. Only
# _DIAG_RELAXED_COUNTER still computes the output (without the ordering the merge needs);
# the _DIAG_MERGE_* variants write it, wrong; the others leave it unwritten.
_DIAG_OFF = tl.constexpr(0)
_DIAG_NO_MERGE = tl.constexpr(1)  # split: store the partials, no counter, no merge
_DIAG_NO_STORES = tl.constexpr(2)  # split: neither partial stores nor merge
_DIAG_RELAXED_COUNTER = tl.constexpr(3)  # fused merge behind a relaxed (unordered) counter
_DIAG_STARTUP_ONLY = tl.constexpr(4)  # every program returns right after the sequence lookup
# The fused merge's tail in steps (the last program still takes the counter and stores):
_DIAG_MERGE_NO_READS = tl.constexpr(5)  # it stores its own partial, reads none
_DIAG_MERGE_LSE_ONLY = tl.constexpr(6)  # it reads the LSEs; the output reads wait on them, off
_DIAG_MERGE_ONE_READ = tl.constexpr(7)  # it reads the first _MERGE_CHUNK partials only
# Names the launcher accepts, joined with "+": kernel variants, plus two host-side ones:
# "cached_counters" keeps the fused merge's counters in one buffer per device even under
# CUDA-graph capture (no zero-fill kernel captured with each call; unsafe if two captured
# graphs or streams use it concurrently), and "unguarded_loops" runs the tile loops even
# when empty (the guard that skips them is the default).
_DIAG_CODES = {
    "no_merge": _DIAG_NO_MERGE.value,
    "no_stores": _DIAG_NO_STORES.value,
    "relaxed_counter": _DIAG_RELAXED_COUNTER.value,
    "startup_only": _DIAG_STARTUP_ONLY.value,
    "merge_no_reads": _DIAG_MERGE_NO_READS.value,
    "merge_lse_only": _DIAG_MERGE_LSE_ONLY.value,
    "merge_one_read": _DIAG_MERGE_ONE_READ.value,
}
_DIAG_HOST = ("cached_counters", "unguarded_loops")


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of the paged-attention kernel.

    Attributes:
        block_m: rows of the query tile (``block_q`` tokens x ``group`` heads, padded), a power
            of two >= 16 (``tl.dot`` needs 16).
        block_q: query tokens of one sequence per program (1 for decode).
        tile_n: KV tokens per loop iteration, a power of two >= 16.
        num_partitions: split-KV partitions per (query tile, KV head); 1 = no split.
        num_warps, num_stages: Triton launch options (warps per program, pipeline depth).
        fused_merge: with a split, the last partition program of each tile merges the
            partials (one launch); else a separate merge kernel runs after. ``choose_config``
            fuses: on the H200 the two cost about the same GPU time, but the second launch
            adds enough host time to make a call host-bound.
        early_ids: decode (``block_q == 1``, no sliding window) issues the query load and the
            first tiles' block-id reads at program start, in parallel with the sequence
            lookup, on the lookup's even-split guess (re-read on a miss): one dependent
            round trip less before the first K/V load.
        ids_ahead: tiles between a block-id read and the K/V loads that use it (1 or 2).
        merge_reads: how the fused merge reads the partials (see ``MERGE_READS``):
            "serial" (an online merge over ``[block_m, 4, head_dim]`` loads, each read
            waiting for the previous one's math) or "batched" (all
            LSEs in one load, then the output partials of the tile's real rows in
            independent, prefetched loads). No effect without a fused split.
        merge_read_regs: registers per thread the batched merge may fill with partials in
            flight: all partials in one read when they fit, else two chunks of half this.
    """

    block_m: int
    block_q: int
    tile_n: int
    num_partitions: int = 1
    num_warps: int = 4
    num_stages: int = 2
    fused_merge: bool = False
    early_ids: bool = False
    ids_ahead: int = 1
    merge_reads: str = "serial"
    merge_read_regs: int = _MERGE_READ_REGS

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise KernelArgumentError(f"AttentionConfig.{name} must be a power of two >= 16")
        if self.block_q < 1 or self.num_partitions < 1:
            raise KernelArgumentError("AttentionConfig.block_q and num_partitions must be >= 1")
        if self.ids_ahead not in (1, 2):
            raise KernelArgumentError("AttentionConfig.ids_ahead must be 1 or 2")
        if self.merge_read_regs < 0:
            raise KernelArgumentError("AttentionConfig.merge_read_regs must be >= 0")
        if self.merge_reads not in MERGE_READS:
            raise KernelArgumentError(
                f"AttentionConfig.merge_reads must be one of {MERGE_READS}, not {self.merge_reads!r}"
            )


@dataclass(frozen=True)
class SplitPolicy:
    """When to split the KV range: when the (query tile, KV head) programs number fewer than
    ``split_below_programs_per_sm`` per SM, split each into partitions of at least
    ``min_partition_tokens`` KV tokens until there are ``target_programs_per_sm`` per SM.

    Two per SM is what a decode program with 128-token tiles keeps resident (registers) and
    what measured fastest for small batches. A batch that already gives every SM a program
    runs faster unsplit (B=32 x L=2048 on the H200): the merge and the partials cost more
    than the second program per SM gains."""

    target_programs_per_sm: float = 2.0
    split_below_programs_per_sm: float = 1.0
    min_partition_tokens: int = 256


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_q_programs(num_q_tokens: int, num_seqs: int, block_q: int) -> int:
    """Grid size along the query axis: an upper bound on the query tiles of any batch.

    Sequence s owns tile slots starting at ``query_start_loc[s] // block_q + s`` (exactly
    ``query_start_loc[s]`` when ``block_q == 1``); the kernel finds its sequence by binary
    search over those starts, so no per-call host work or device prefix sum is needed.
    """
    if block_q == 1:
        return num_q_tokens
    return num_q_tokens // block_q + num_seqs


def choose_config(
    problem: AttentionProblem,
    dtype: torch.dtype,
    sm_count: int,
    policy: SplitPolicy = SplitPolicy(),
) -> AttentionConfig:
    """Pick tile sizes, warps, stages and the split count for one call (pure, no device read).

    Args:
        problem: sizes from validation.
        dtype: query / cache dtype.
        sm_count: streaming multiprocessors of the device (parallelism to fill).
        policy: the split heuristic's knobs.
    """
    group = problem.group
    d_pad = max(16, _next_pow2(problem.head_dim))
    decode = problem.num_q_tokens <= problem.num_seqs
    # Row and tile caps keep each program's registers and shared memory within budget (checked
    # against the sm_90 compiler's resource report): float32 dots run as exact FMA loops that
    # spill above 16 x 16 tiles; head_dim 256 halves the 16-bit tiles.
    # 64-token decode tiles with two stages beat 128-token ones at every batch measured.
    if dtype == torch.float32:
        max_rows, tile_n, num_warps, num_stages = 16, 16, 4, 2
    elif decode:
        max_rows, tile_n, num_warps, num_stages = 16, (32 if d_pad >= 256 else 64), 4, 2
    elif d_pad >= 256:
        max_rows, tile_n, num_warps, num_stages = 64, 32, 8, 2
    else:
        max_rows, tile_n, num_warps, num_stages = 128, 128, 8, 2
    if decode:
        block_q = 1
        block_m = max(16, _next_pow2(group))
    else:
        avg_q = _cdiv(problem.num_q_tokens, max(problem.num_seqs, 1))
        block_m = min(max(16, _next_pow2(group * avg_q)), max(max_rows, _next_pow2(group)))
        block_q = max(1, block_m // group)
        if block_m < 128 and dtype != torch.float32 and d_pad < 256:
            num_warps, tile_n = 4, 64

    q_tiles = _cdiv(problem.num_q_tokens, block_q) if block_q > 1 else problem.num_q_tokens
    base = max(1, q_tiles * problem.num_kv_heads)
    target = int(policy.target_programs_per_sm * sm_count)
    parts = 1
    if (
        base < policy.split_below_programs_per_sm * sm_count
        and problem.max_kv_len > policy.min_partition_tokens
    ):
        # Rounded down: a split that overshoots the target measured slower than one just
        # under it (B=4 x 16384: 8 partitions, not 9).
        parts = min(max(1, target // base), _cdiv(problem.max_kv_len, policy.min_partition_tokens))
        # The batched merge pads the partition count to a power of two (its LSE read) and
        # sizes its output reads by it: a count just above a power of two doubles the
        # merge's padded lanes for a few percent more programs, which measured slower.
        if 8 * _prev_pow2(parts) >= 7 * parts:
            parts = _prev_pow2(parts)
    if parts > 1 and dtype != torch.float32:
        # Three stages let the K/V loads run two tiles ahead of the block-id reads, which
        # `_attend_tiles` issues one tile ahead (faster than 2 stages for long split decodes).
        num_stages = 3
    return AttentionConfig(
        block_m=block_m,
        block_q=block_q,
        tile_n=tile_n,
        num_partitions=max(1, parts),
        num_warps=num_warps,
        num_stages=num_stages,
        fused_merge=parts > 1,
        # Early block-id reads measured a small gain unsplit but a loss split.
        early_ids=decode and parts == 1,
        # The batched merge's independent reads beat the serial ones on the H200.
        merge_reads="batched",
        # All 32 partials of B=1 x 32768 in one read (168 registers, still 3 programs per
        # SM) beat four chunks of 8.
        merge_read_regs=128 if d_pad <= 128 else _MERGE_READ_REGS,
    )


@lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a small fixed figure for CPU (interpreter) tensors."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@triton.jit
def _slot_start(qsl_ptr, s, BLOCK_Q: tl.constexpr):
    """First grid slot of sequence s (see :func:`num_q_programs`)."""
    start = tl.load(qsl_ptr + s)
    if BLOCK_Q > 1:
        start = start // BLOCK_Q + s
    return start


@triton.jit
def _guess_sequence(pid, num_seqs, grid_q):
    """The sequence an even split of the grid gives slot ``pid`` (exact for decode batches
    and equal prefill lengths)."""
    return tl.minimum((pid.to(tl.int64) * num_seqs // grid_q).to(tl.int32), num_seqs - 1)


@triton.jit
def _tile_ids(table_row, tile, kv_hi, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Block ids ``[TILE_N]`` (int32) of the tokens of ``tile``; 0 for tokens >= ``kv_hi``."""
    idx = tile * TILE_N + tl.arange(0, TILE_N)
    return tl.load(table_row + idx // BLOCK_SIZE, mask=idx < kv_hi, other=0)


@triton.jit
def _locate_sequence(qsl_ptr, seq_lens_ptr, pid, num_seqs, grid_q, BLOCK_Q: tl.constexpr):
    """The sequence owning grid slot ``pid``: ``(seq, first query row, query rows, KV len)``.

    The sequence is the largest s with ``start(s) <= pid``. The one an even split would give
    (exact for decode batches and equal prefill lengths) is loaded speculatively: its query
    bounds and its length in one round trip, so a hit costs one dependent load before the
    block table. A miss binary-searches (log2(num_seqs) dependent loads) and reloads.
    ``start(num_seqs) == grid_q > pid``, so ``s + 1`` may always be read.
    """
    guess = _guess_sequence(pid, num_seqs, grid_q)
    q_begin = tl.load(qsl_ptr + guess)
    q_end = tl.load(qsl_ptr + guess + 1)
    seq_len = tl.load(seq_lens_ptr + guess)
    seq = guess
    if BLOCK_Q > 1:
        hit = (q_begin // BLOCK_Q + guess <= pid) & (pid < q_end // BLOCK_Q + guess + 1)
    else:
        hit = (q_begin <= pid) & (pid < q_end)
    if not hit:
        lo = 0
        hi = num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _slot_start(qsl_ptr, mid, BLOCK_Q) <= pid:
                lo = mid
            else:
                hi = mid
        seq = lo
        q_begin = tl.load(qsl_ptr + seq)
        q_end = tl.load(qsl_ptr + seq + 1)
        seq_len = tl.load(seq_lens_ptr + seq)
    return seq, q_begin, q_end - q_begin, seq_len


@triton.jit
def _tanh(x):
    # tanh through exp keeps to ops the interpreter and every backend share; 2|x| caps the
    # exponent's argument so large inputs saturate instead of overflowing.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_head,
    v_head,
    table_row,
    block0,
    block1,
    stride_kb,
    stride_vb,
    t_from,
    t_to,
    kv_hi,
    q_pos,
    qk_scale,
    softcap,
    window,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IDS_AHEAD: tl.constexpr,
):
    """Fold KV tiles ``[t_from, t_to)`` into the online softmax ``(acc, m_i, l_i)``.

    ``block0`` (and ``block1`` when ``IDS_AHEAD == 2``) are the block ids ``[TILE_N]`` of
    tiles ``t_from`` (and ``t_from + 1``), from :func:`_tile_ids`. Scores are in base-2 units
    (``qk_scale`` carries log2(e) unless soft-capping). With ``MASKED`` False every key of
    every tile must be visible to every row.
    """
    offs_n = tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # Block ids are read IDS_AHEAD tiles ahead, so a tile's K/V loads never wait on the
    # table read that gives their addresses (with 3 pipeline stages: the split decode
    # configurations, see choose_config).
    block = block0.to(tl.int64)
    if IDS_AHEAD == 2:
        block_a = block1
    for tile in range(t_from, t_to):
        kv_idx = tile * TILE_N + offs_n
        kv_valid = kv_idx < kv_hi
        block_next = _tile_ids(table_row, tile + IDS_AHEAD, kv_hi, TILE_N, BLOCK_SIZE)
        k_rows = k_head + block * stride_kb + (kv_idx % BLOCK_SIZE) * HEAD_DIM
        v_rows = v_head + block * stride_vb + (kv_idx % BLOCK_SIZE) * HEAD_DIM
        if HEAD_DIM == HEAD_DIM_PAD:
            if MASKED:
                k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_valid[:, None], other=0.0)
            else:
                k = tl.load(k_rows[:, None] + dims[None, :])
        else:
            kv_mask = kv_valid[:, None] & (dims < HEAD_DIM)[None, :]
            k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if USE_SOFTCAP:
            s = softcap * _tanh(s * (qk_scale / softcap)) * 1.4426950408889634
        else:
            s = s * qk_scale
        if MASKED:
            visible = kv_valid[None, :]
            if CAUSAL:
                visible = visible & (kv_idx[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & ((q_pos[:, None] - kv_idx[None, :]) < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key keeps max -inf: shift by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_shift = m_new
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HEAD_DIM == HEAD_DIM_PAD:
            if MASKED:
                v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_valid[:, None], other=0.0)
            else:
                v = tl.load(v_rows[:, None] + dims[None, :])
        else:
            v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
        if IDS_AHEAD == 2:
            block = block_a.to(tl.int64)
            block_a = block_next
        else:
            block = block_next.to(tl.int64)
    return acc, m_i, l_i


@triton.jit
def _masked_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_head,
    v_head,
    table_row,
    stride_kb,
    stride_vb,
    t_from,
    t_to,
    kv_hi,
    q_pos,
    qk_scale,
    softcap,
    window,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IDS_AHEAD: tl.constexpr,
):
    """Fold the masked tiles ``[t_from, t_to)`` (causal diagonal, sequence end, window) into
    ``(acc, m_i, l_i)``: they start where the unmasked ones stopped, with their own first
    block ids."""
    ids0 = _tile_ids(table_row, t_from, kv_hi, TILE_N, BLOCK_SIZE)
    ids1 = ids0
    if IDS_AHEAD == 2:
        ids1 = _tile_ids(table_row, t_from + 1, kv_hi, TILE_N, BLOCK_SIZE)
    return _attend_tiles(
        acc, m_i, l_i, q, k_head, v_head, table_row, ids0, ids1, stride_kb, stride_vb,
        t_from, t_to, kv_hi, q_pos, qk_scale, softcap, window,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, CAUSAL, USE_WINDOW, USE_SOFTCAP,
        DOT_PRECISION, IDS_AHEAD,
    )  # fmt: skip


# Counts that change with the batch (sequences, query programs) are not specialized on:
# Triton would otherwise compile a variant per (== 1, % 16) class of each, and a server
# coalescing 8, 16, 24, ... sequences meets them while serving, each compile a stall of
# around a second. They bound loops and index the grid; no address alignment rests on them.
@triton.jit(do_not_specialize=["num_seqs", "grid_q"])
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    lse_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    num_seqs,
    grid_q,
    num_parts,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_vb,
    stride_bts,
    max_blocks,
    stride_ot,
    stride_oh,
    qk_scale,
    softcap,
    window,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
    EARLY_IDS: tl.constexpr,
    IDS_AHEAD: tl.constexpr,
    GUARD_LOOPS: tl.constexpr,
    DIAG: tl.constexpr,
    MERGE_BATCHED: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    MERGE_PARTS_PAD: tl.constexpr,
    MERGE_CHUNK_PARTS: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    if LAUNCH_DEPENDENTS:
        # The merge kernel (launched programmatically dependent) may start its launch now;
        # it waits for this grid's completion before reading anything.
        gdc_launch_dependents()
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    if EARLY_IDS:
        # Unsplit decode without a window (the launcher checks): slot pid_q holds query
        # token pid_q and the program starts at tile 0 whatever the sequence, so the query
        # and the first tiles' block ids (of the guessed sequence's table row) are read
        # before the lookup resolves, in the same round trip as its loads.
        guess = _guess_sequence(pid_q, num_seqs, grid_q)
        guess_row = block_tables_ptr + guess.to(tl.int64) * stride_bts
        ids0 = _tile_ids(guess_row, 0, max_blocks * BLOCK_SIZE, TILE_N, BLOCK_SIZE)
        ids1 = ids0
        if IDS_AHEAD == 2:
            ids1 = _tile_ids(guess_row, 1, max_blocks * BLOCK_SIZE, TILE_N, BLOCK_SIZE)
        q = tl.load(
            q_ptr + pid_q.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=(rows < GROUP)[:, None] & dim_valid[None, :],
            other=0.0,
        )
    seq, q_begin, n_q, seq_len = _locate_sequence(
        qsl_ptr, seq_lens_ptr, pid_q, num_seqs, grid_q, BLOCK_Q
    )
    if BLOCK_Q > 1:
        first_slot = q_begin // BLOCK_Q + seq
    else:
        first_slot = q_begin
    q_lo = (pid_q - first_slot) * BLOCK_Q
    if q_lo >= n_q:
        return  # a spare slot of the grid's upper bound
    if DIAG == _DIAG_STARTUP_ONLY:
        # Diagnostic: start-up alone. The condition always holds, but the compiler cannot
        # know it, so the lookup's loads stay and the rest of the kernel still compiles.
        if seq_len >= 0:
            return

    q_idx = q_lo + rows // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < n_q)
    q_pos = seq_len - n_q + q_idx

    q_row = (q_begin + q_idx).to(tl.int64)
    if not EARLY_IDS:
        q = tl.load(
            q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )

    # The KV range any row of this tile can see; partitions split it in whole tiles.
    last_q = tl.minimum(q_lo + BLOCK_Q, n_q) - 1
    kv_hi = seq_len
    if CAUSAL:
        kv_hi = seq_len - n_q + last_q + 1
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - n_q + q_lo - window + 1, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(kv_hi, TILE_N)
    if SPLIT:
        # Partitions split this tile's own KV range, read on the device, not the block
        # table's capacity the launcher knows: a sequence much shorter than its table
        # would leave most partitions empty and the rest long.
        tiles_per_part = tl.cdiv(tl.maximum(tile_hi - tile_lo, 0), num_parts)
        t_begin = tile_lo + part * tiles_per_part
        t_end = tl.minimum(tile_hi, t_begin + tiles_per_part)
    else:
        # part is 0 (one partition), but as a runtime value: with a start the compiler can
        # fold to 0 the unsplit sm_90 decode build takes 147 registers instead of 117, and
        # three programs per SM instead of four.
        t_begin = tile_lo + part
        t_end = tile_hi

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Tiles every row sees whole need no mask: no bounds checks on the loads, no score
    # masking. Only the tiles at the causal diagonal / sequence end (and, with a window, all
    # of them) take the masked loop.
    if USE_WINDOW:
        t_full = t_begin
    elif CAUSAL:
        t_full = (seq_len - n_q + q_lo + 1) // TILE_N
    else:
        t_full = seq_len // TILE_N
    t_split = tl.minimum(tl.maximum(t_full, t_begin), t_end)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    if EARLY_IDS:
        if seq != guess:  # the guess missed (not a plain decode batch): read the right row
            ids0 = _tile_ids(table_row, t_begin, kv_hi, TILE_N, BLOCK_SIZE)
            if IDS_AHEAD == 2:
                ids1 = _tile_ids(table_row, t_begin + 1, kv_hi, TILE_N, BLOCK_SIZE)
            else:
                ids1 = ids0
        # Ids past the sequence (-1 in the table) become 0, as _tile_ids gives them.
        ids0 = tl.where(t_begin * TILE_N + tl.arange(0, TILE_N) < kv_hi, ids0, 0)
        ids1 = tl.where((t_begin + 1) * TILE_N + tl.arange(0, TILE_N) < kv_hi, ids1, 0)
    else:
        ids0 = _tile_ids(table_row, t_begin, kv_hi, TILE_N, BLOCK_SIZE)
        ids1 = ids0
        if IDS_AHEAD == 2:
            ids1 = _tile_ids(table_row, t_begin + 1, kv_hi, TILE_N, BLOCK_SIZE)
    k_head = k_ptr + kv_head * (BLOCK_SIZE * HEAD_DIM)
    v_head = v_ptr + kv_head * (BLOCK_SIZE * HEAD_DIM)
    if GUARD_LOOPS:
        # An empty loop is not free: its ids read waits a round trip after the previous
        # loop has drained, and its pipeline prologue / epilogue still run. Decode at a
        # tile-aligned length (every partition of B=1 x 32768) has no masked tile at all.
        # Skipping empty loops measured faster at every decode case on the H200.
        if t_begin < t_split:
            acc, m_i, l_i = _attend_tiles(
                acc, m_i, l_i, q, k_head, v_head, table_row, ids0, ids1, stride_kb, stride_vb,
                t_begin, t_split, kv_hi, q_pos, qk_scale, softcap, window,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, False, CAUSAL, USE_WINDOW,
                USE_SOFTCAP, DOT_PRECISION, IDS_AHEAD,
            )  # fmt: skip
        if t_split < t_end:
            acc, m_i, l_i = _masked_tiles(
                acc, m_i, l_i, q, k_head, v_head, table_row, stride_kb, stride_vb,
                t_split, t_end, kv_hi, q_pos, qk_scale, softcap, window,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, CAUSAL, USE_WINDOW, USE_SOFTCAP,
                DOT_PRECISION, IDS_AHEAD,
            )  # fmt: skip
    else:
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_head, v_head, table_row, ids0, ids1, stride_kb, stride_vb,
            t_begin, t_split, kv_hi, q_pos, qk_scale, softcap, window,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, False, CAUSAL, USE_WINDOW, USE_SOFTCAP,
            DOT_PRECISION, IDS_AHEAD,
        )  # fmt: skip
        acc, m_i, l_i = _masked_tiles(
            acc, m_i, l_i, q, k_head, v_head, table_row, stride_kb, stride_vb,
            t_split, t_end, kv_hi, q_pos, qk_scale, softcap, window,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, CAUSAL, USE_WINDOW, USE_SOFTCAP,
            DOT_PRECISION, IDS_AHEAD,
        )  # fmt: skip

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    # Natural-log LSE from the base-2 running max and sum; -inf marks a row that saw no key.
    lse = tl.where(
        seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf")
    )
    store_mask = row_valid[:, None] & dim_valid[None, :]
    # lse [T, Hq], part_out [T, Hq, P, D] and part_lse [T, Hq, P] are the launcher's own
    # contiguous buffers: their strides follow from the sizes.
    num_heads = tl.num_programs(1) * GROUP
    out_rows = out_ptr + q_row * stride_ot + head * stride_oh
    lse_rows = lse_ptr + q_row * num_heads + head
    if SPLIT:
        stride_pp = HEAD_DIM
        stride_plp = 1
        part_rows = part_out_ptr + (q_row * num_heads + head) * (num_parts * HEAD_DIM)
        part_lse_rows = part_lse_ptr + (q_row * num_heads + head) * num_parts
        if DIAG == _DIAG_NO_STORES:
            # Diagnostic: the partials are computed but not stored. The condition never holds
            # (l_i >= 0), but the compiler cannot know: the work is not optimised away.
            if tl.sum(l_i, 0) < 0.0:
                tl.store(part_rows[:, None] + part * stride_pp + dims[None, :], o, mask=store_mask)
                tl.store(part_lse_rows + part * stride_plp, lse, mask=row_valid)
        else:
            tl.store(part_rows[:, None] + part * stride_pp + dims[None, :], o, mask=store_mask)
            tl.store(part_lse_rows + part * stride_plp, lse, mask=row_valid)
        if FUSED_MERGE and DIAG != _DIAG_NO_MERGE and DIAG != _DIAG_NO_STORES:
            # The last partition program of this (query tile, KV head) to finish merges all
            # partials, saving a second launch. Every thread's partial stores precede the
            # barrier; the counter's acq_rel atomic publishes them (release) to the program
            # that reads the final count (acquire), which then resets the counter for the
            # next call. (_DIAG_RELAXED_COUNTER drops the ordering: timing only, racy.)
            tl.debug_barrier()
            counter = counter_ptr + pid_q * tl.num_programs(1) + kv_head
            if DIAG == _DIAG_RELAXED_COUNTER:
                finished = tl.atomic_add(counter, 1, sem="relaxed")
            else:
                finished = tl.atomic_add(counter, 1, sem="acq_rel")
            if finished == num_parts - 1:
                tl.store(counter, 0)
                if MERGE_BATCHED:
                    _merge_batched_and_store(
                        part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, q_begin, q_lo, n_q,
                        kv_head, num_parts, num_heads, stride_ot, stride_oh,
                        HEAD_DIM, HEAD_DIM_PAD, GROUP, BLOCK_Q, WRITE_LSE,
                        MERGE_ROWS, MERGE_PARTS_PAD, MERGE_CHUNK_PARTS,
                    )  # fmt: skip
                else:
                    if DIAG != _DIAG_MERGE_NO_READS:  # (diagnostic: its own partial as output)
                        o, lse = _merge_partials(
                            part_rows, part_lse_rows, num_parts, stride_pp, stride_plp,
                            row_valid, dims, dim_valid, BLOCK_M, HEAD_DIM_PAD, DIAG,
                        )  # fmt: skip
                    tl.store(
                        out_rows[:, None] + dims[None, :],
                        o.to(out_ptr.dtype.element_ty),
                        mask=store_mask,
                    )
                    if WRITE_LSE:
                        tl.store(lse_rows, lse, mask=row_valid)
    else:
        tl.store(out_rows[:, None] + dims[None, :], o.to(out_ptr.dtype.element_ty), mask=store_mask)
        if WRITE_LSE:
            tl.store(lse_rows, lse, mask=row_valid)


@triton.jit
def _merge_partials(
    part_rows,
    part_lse_rows,
    num_parts,
    stride_pp,
    stride_plp,
    row_valid,
    dims,
    dim_valid,
    BLOCK_M: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DIAG: tl.constexpr,
):
    """Log-sum-exp merge of ``num_parts`` float32 partials of the tile's rows.

    Returns ``(out [BLOCK_M, HEAD_DIM_PAD] float32, lse [BLOCK_M] natural log)``. Partials
    are read ``_MERGE_CHUNK`` at a time as one ``[BLOCK_M, chunk, HEAD_DIM_PAD]`` load, so
    the merge waits on ceil(parts / chunk) reads, not one per partition. The loads bypass
    L1 (``.cg``): other programs wrote the partials. ``DIAG``: the kernel's diagnostic
    variant (``_DIAG_MERGE_LSE_ONLY`` / ``_DIAG_MERGE_ONE_READ`` read less; timing only).
    """
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    chunk = tl.arange(0, _MERGE_CHUNK)
    n_read = num_parts
    if DIAG == _DIAG_MERGE_ONE_READ:
        n_read = tl.minimum(num_parts, _MERGE_CHUNK)
    for start in range(0, n_read, _MERGE_CHUNK):
        p = start + chunk
        live = row_valid[:, None] & (p < num_parts)[None, :]
        lse_c = tl.load(
            part_lse_rows[:, None] + p[None, :] * stride_plp,
            mask=live,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        if DIAG == _DIAG_MERGE_LSE_ONLY:
            # Diagnostic: the output loads stay in the code (same registers) but wait on the
            # LSEs and are switched off by them (an LSE is never above 3e38): no traffic.
            live = live & (lse_c > 3.0e38)
        o_c = tl.load(
            part_rows[:, None, None] + p[None, :, None] * stride_pp + dims[None, None, :],
            mask=live[:, :, None] & dim_valid[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, tl.max(lse_c, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_shift)
        w = tl.exp(lse_c - m_shift[:, None])
        den = den * alpha + tl.sum(w, 1)
        # An empty partial (lse -inf, weight 0) may hold anything: select, never multiply.
        contrib = tl.where(w[:, :, None] > 0.0, w[:, :, None] * o_c, 0.0)
        acc = acc * alpha[:, None] + tl.sum(contrib, 1)
        m = m_new
    seen = den > 0.0
    out = acc / tl.where(seen, den, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, den, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _weighted_chunk(
    po_rows,
    pl_rows,
    start,
    num_parts,
    m_shift,
    row_valid,
    dims,
    dim_valid,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Issue the reads of partials ``[start, start + CHUNK)`` of the merge's rows.

    Returns ``(o [rows, CHUNK, HEAD_DIM_PAD] float32, w [rows, CHUNK] float32)``: the
    partial outputs (0 where masked) and their weights ``exp(lse - m_shift)`` (0 for empty
    or missing partials). Nothing here depends on an earlier chunk, so the loads of one
    chunk can be in flight while the previous chunk's products are summed. ``.cg``: other
    programs wrote the partials, L1 may hold stale lines.
    """
    p = start + tl.arange(0, CHUNK)
    live = row_valid[:, None] & (p < num_parts)[None, :]
    lse_c = tl.load(
        pl_rows[:, None] + p[None, :], mask=live, other=float("-inf"), cache_modifier=".cg"
    )
    o_c = tl.load(
        po_rows[:, None, None] + p[None, :, None] * HEAD_DIM + dims[None, None, :],
        mask=live[:, :, None] & dim_valid[None, None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    return o_c, tl.exp(lse_c - m_shift[:, None])


@triton.jit
def _weighted_sum(o_c, w):
    """``sum_p w[r, p] * o_c[r, p, :]`` -> ``[rows, HEAD_DIM_PAD]``; an empty partial (weight
    0, lse -inf) may hold anything (never written): select, never multiply."""
    return tl.sum(tl.where(w[:, :, None] > 0.0, w[:, :, None] * o_c, 0.0), 1)


@triton.jit
def _chunked_weighted_sum(
    po_rows,
    pl_rows,
    num_parts,
    m_shift,
    row_valid,
    dims,
    dim_valid,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """``sum_p w_p out_p`` ``[MERGE_ROWS, HEAD_DIM_PAD]`` float32 over partials
    ``[0, PARTS_PAD)`` read ``CHUNK`` at a time, each chunk's reads issued before the
    previous chunk is summed (one chunk prefetched)."""
    acc = tl.zeros([MERGE_ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    o_c, w_c = _weighted_chunk(
        po_rows, pl_rows, 0, num_parts, m_shift, row_valid, dims, dim_valid, HEAD_DIM, CHUNK
    )
    for start in tl.static_range(CHUNK, PARTS_PAD, CHUNK):
        # Issue chunk `start` before summing the previous one: its loads need nothing
        # the sum produces, so they are in flight while it runs.
        o_n, w_n = _weighted_chunk(
            po_rows, pl_rows, start, num_parts, m_shift, row_valid, dims, dim_valid,
            HEAD_DIM, CHUNK,
        )  # fmt: skip
        acc += _weighted_sum(o_c, w_c)
        o_c = o_n
        w_c = w_n
    acc += _weighted_sum(o_c, w_c)
    return acc


@triton.jit
def _merge_batched_and_store(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    q_begin,
    q_lo,
    n_q,
    kv_head,
    num_parts,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The batched fused merge: merge the tile's ``num_parts`` float32 partials (``[T, Hq,
    P, D]`` / ``[T, Hq, P]``, the launcher's buffers) and store ``out`` in its dtype and,
    with ``WRITE_LSE``, the float32 natural-log ``lse``. The math of
    ``merge_attention_states``; unlike the serial merge every read's address is known up
    front: all LSEs in one load, then the output partials of the tile's real rows
    (``MERGE_ROWS``, see ``_merge_constexprs``) in one load or chunk by chunk, prefetched."""
    rows = tl.arange(0, MERGE_ROWS)
    q_idx = q_lo + rows // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < n_q)
    head = kv_head * GROUP + rows % GROUP
    q_row = (q_begin + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    flat = q_row * num_heads + head  # (token, head) row of the partial buffers
    po_rows = part_out_ptr + flat * (num_parts * HEAD_DIM)
    pl_rows = part_lse_ptr + flat * num_parts

    p_all = tl.arange(0, PARTS_PAD)
    lse_all = tl.load(
        pl_rows[:, None] + p_all[None, :],
        mask=row_valid[:, None] & (p_all < num_parts)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    if CHUNK == PARTS_PAD:
        # One read of every partial, issued right behind the LSE read (independent of it).
        o_all = tl.load(
            po_rows[:, None, None] + p_all[None, :, None] * HEAD_DIM + dims[None, None, :],
            mask=(row_valid[:, None] & (p_all < num_parts)[None, :])[:, :, None]
            & dim_valid[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
    m = tl.max(lse_all, 1)
    # A row that no partition saw (all -inf) shifts by 0, so its weights are 0, not NaN.
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    den = tl.sum(tl.exp(lse_all - m_shift[:, None]), 1)
    if CHUNK == PARTS_PAD:
        acc = _weighted_sum(o_all, tl.exp(lse_all - m_shift[:, None]))
    else:
        acc = _chunked_weighted_sum(
            po_rows, pl_rows, num_parts, m_shift, row_valid, dims, dim_valid,
            HEAD_DIM, HEAD_DIM_PAD, MERGE_ROWS, PARTS_PAD, CHUNK,
        )  # fmt: skip
    seen = den > 0.0
    out = acc / tl.where(seen, den, 1.0)[:, None]
    out_rows = out_ptr + q_row * stride_ot + head * stride_oh
    tl.store(
        out_rows[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )
    if WRITE_LSE:
        lse = tl.where(seen, m + tl.log(tl.where(seen, den, 1.0)), float("-inf"))
        tl.store(lse_ptr + q_row * num_heads + head, lse, mask=row_valid)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs must not go through tf32 (about 1e-3 relative error): the contract is
    # float32 accuracy. 16-bit inputs multiply exactly and accumulate in float32 anyway.
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    problem: AttentionProblem,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
    _diagnostic: str = "",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the paged-attention kernel on validated arguments.

    Shapes and semantics are those of :func:`kernels.paged_attention` (arguments must have
    passed :func:`kernels.validation.check_paged_attention_args`, which gave ``problem``).

    Args:
        config: launch parameters; default from :func:`choose_config` on this device.
        _diagnostic: private, for benchmarks only: "+"-joined names of diagnostic variants
            (see ``_DIAG_CODES``); most of them skip work and leave ``out`` unwritten.

    Returns:
        ``(out, lse)``: out ``[T, Hq, D]`` in the query's dtype; lse float32 ``[T, Hq]``
        (natural log) when ``return_lse``, else None.
    """
    plan_key = None
    # A direct launcher means compiled kernels, so CUDA tensors (Triton rejects others).
    if _ATTENTION_LAUNCHER.direct:
        device_index = torch.cuda.current_device()
        stream = current_stream_handle(device_index)  # where the JIT would launch
        # Everything the launch depends on except the tensors' addresses (validated
        # arguments: the caches share the query's dtype, ``out`` its shape and dtype).
        plan_key = (
            problem,
            config,
            query.dtype,
            query.stride(),
            key_cache.stride(0),
            value_cache.stride(0),
            block_tables.dtype,
            block_tables.stride(),
            seq_lens.dtype,
            seq_lens.stride(),
            query_start_loc.dtype,
            query_start_loc.stride(),
            None if out is None else out.stride(),
            scale,
            causal,
            sliding_window,
            softcap,
            return_lse,
            _diagnostic,
            device_index,
            stream,
        )
        plan = launch_plans.PLANS.get(plan_key)
        if plan is not None:
            result = plan.launch(
                stream, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out
            )
            if result is not None:
                return result
    return _launch_and_plan(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, problem,
        scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap,
        return_lse=return_lse, out=out, config=config, diagnostic=_diagnostic,
        plan_key=plan_key,
    )  # fmt: skip


def _launch_and_plan(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    problem: AttentionProblem,
    *,
    scale: float | None,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    return_lse: bool,
    out: torch.Tensor | None,
    config: AttentionConfig | None,
    diagnostic: str,
    plan_key: tuple | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full launch (every call under the interpreter or graph capture, and the first
    of each call shape); keeps a plan under ``plan_key`` when the call allows one."""
    if problem.head_dim > _MAX_HEAD_DIM:
        raise KernelArgumentError(
            f"head_dim {problem.head_dim} is larger than the Triton kernel's {_MAX_HEAD_DIM}"
        )
    T, Hq, D = problem.num_q_tokens, problem.num_q_heads, problem.head_dim
    device = query.device
    out_given = out is not None
    if out is None:
        out = torch.empty(T, Hq, D, dtype=query.dtype, device=device)
    lse = torch.empty(T, Hq, dtype=torch.float32, device=device) if return_lse else None
    if T == 0:
        return out, lse
    config = _checked_config(problem, query.dtype, device, config)
    # Partitions split each tile's own KV range on the device; at least one tile of the
    # table's capacity each, so none is empty for a sequence that fills its table.
    parts = max(1, min(config.num_partitions, _cdiv(problem.max_kv_len, config.tile_n)))
    scale = D**-0.5 if scale is None else float(scale)
    qk_scale = scale if softcap is not None else scale * _LOG2E
    block_tables, seq_lens, query_start_loc, as_given = _kernel_indices(
        block_tables, seq_lens, query_start_loc
    )
    plannable = plan_key is not None and as_given  # a plan launches the caller's tensors
    diag, unguarded_loops, cached_counters = _parse_diagnostic(diagnostic)
    split = parts > 1
    grid_q = num_q_programs(T, problem.num_seqs, config.block_q)
    fused = split and config.fused_merge
    if split:
        part_out, part_lse, counters = split_buffers(
            device, T * Hq * parts, D, grid_q * problem.num_kv_heads if fused else 0,
            cached_counters,
        )  # fmt: skip
        counters = counters if fused else out
        plannable = plannable and fused  # the separate merge is a second launch
    else:
        part_out = part_lse = counters = out  # never dereferenced
    lse_arg = lse if lse is not None else out  # never dereferenced without WRITE_LSE
    # Programmatic dependent launch lets the merge kernel's launch overlap this kernel's tail.
    pdl = split and not fused and pdl_supported(device)
    grid = (grid_q, problem.num_kv_heads, parts)
    tensors = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out)
    tensors = (*tensors, lse_arg, part_out, part_lse, counters)
    scalars = _scalar_args(problem, grid_q, parts, tensors, qk_scale, softcap, sliding_window)
    constexprs = _constexpr_args(
        problem, config, query.dtype, parts, causal=causal, sliding_window=sliding_window,
        use_softcap=softcap is not None, fused=fused, return_lse=return_lse, pdl=pdl,
        unguarded_loops=unguarded_loops, diag=diag,
    )  # fmt: skip
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    launch = _ATTENTION_LAUNCHER(grid, (*tensors, *scalars), constexprs, **options)
    if split and not fused:
        merge_partitions(
            part_out.view(T, Hq, parts, D), part_lse.view(T, Hq, parts), out, lse, pdl=pdl
        )
    if plannable and launch is not None and (out_given or out.stride() == (Hq * D, D, 1)):
        buffers = (part_out, part_lse, counters) if split else ()
        tail = (*scalars, *constexprs.values())
        _keep_plan(plan_key, launch, grid, tensors, tail, (T, Hq, D), return_lse, buffers)
    return out, lse


def _kernel_indices(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The index tensors as the kernel reads them (contiguous lengths and offsets, table
    rows of unit stride), and whether they are the caller's own (no copy was needed)."""
    as_given = True
    if not (seq_lens.is_contiguous() and query_start_loc.is_contiguous()):
        seq_lens = seq_lens.contiguous()
        query_start_loc = query_start_loc.contiguous()
        as_given = False
    if block_tables.stride(1) != 1:  # the kernel walks a row with unit stride
        block_tables = block_tables.contiguous()
        as_given = False
    return block_tables, seq_lens, query_start_loc, as_given


def _keep_plan(
    plan_key: tuple | None,
    launch: DirectLaunch,
    grid: tuple[int, int, int],
    tensors: tuple[torch.Tensor, ...],
    tail: tuple,
    out_shape: tuple[int, int, int],
    return_lse: bool,
    buffers: tuple[torch.Tensor, ...],
) -> None:
    """Keep the launch just made as the plan of its call shape, unless a later call could
    not reuse it: a tensor off 16-byte alignment (the compiled kernel assumed it), or a
    launch under CUDA-graph capture (its buffers are the graph's own)."""
    if plan_key is None or any(t.data_ptr() % 16 for t in tensors):
        return
    if torch.cuda.is_current_stream_capturing():
        return
    keep_plan(plan_key, LaunchPlan(launch, grid, tail, out_shape, return_lse, buffers))


def _checked_config(
    problem: AttentionProblem,
    dtype: torch.dtype,
    device: torch.device,
    config: AttentionConfig | None,
) -> AttentionConfig:
    """`config`, or :func:`choose_config`'s for this device when None, checked against the
    problem (a query tile's rows must hold ``block_q`` tokens times the group's heads).

    Raises:
        KernelArgumentError: a config whose ``block_m`` is too small.
    """
    if config is None:
        config = choose_config(problem, dtype, num_sms(device))
    if config.block_m < config.block_q * problem.group:
        raise KernelArgumentError(
            f"AttentionConfig.block_m={config.block_m} cannot hold block_q={config.block_q} "
            f"tokens x {problem.group} heads"
        )
    return config


def _scalar_args(
    problem: AttentionProblem,
    grid_q: int,
    parts: int,
    tensors: tuple[torch.Tensor, ...],
    qk_scale: float,
    softcap: float | None,
    sliding_window: int | None,
) -> tuple:
    """The kernel's runtime scalars after its tensors (``num_seqs`` .. ``window``), from the
    launch's tensors (query, key_cache, value_cache, block_tables, ..., out, ...)."""
    query, key_cache, value_cache, block_tables = tensors[:4]
    out = tensors[6]
    return (
        problem.num_seqs,
        grid_q,
        parts,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        value_cache.stride(0),
        block_tables.stride(0),
        block_tables.shape[1],
        out.stride(0),
        out.stride(1),
        qk_scale,
        float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
    )


def _constexpr_args(
    problem: AttentionProblem,
    config: AttentionConfig,
    dtype: torch.dtype,
    parts: int,
    *,
    causal: bool,
    sliding_window: int | None,
    use_softcap: bool,
    fused: bool,
    return_lse: bool,
    pdl: bool,
    unguarded_loops: bool,
    diag: int,
) -> dict[str, object]:
    """The kernel's compile-time constants, in its signature's order."""
    split = parts > 1
    return {
        "HEAD_DIM": problem.head_dim,
        "HEAD_DIM_PAD": max(16, _next_pow2(problem.head_dim)),
        "BLOCK_SIZE": problem.block_size,
        "GROUP": problem.group,
        "BLOCK_M": config.block_m,
        "BLOCK_Q": config.block_q,
        "TILE_N": config.tile_n,
        "CAUSAL": bool(causal),
        "USE_WINDOW": sliding_window is not None,
        "USE_SOFTCAP": use_softcap,
        "SPLIT": split,
        "FUSED_MERGE": fused,
        "WRITE_LSE": return_lse,
        "DOT_PRECISION": _dot_precision(dtype),
        "LAUNCH_DEPENDENTS": pdl,
        # The early reads rely on slot == query token and on the program starting at tile
        # 0, which hold for unsplit one-token tiles without a window.
        "EARLY_IDS": (
            config.early_ids and config.block_q == 1 and sliding_window is None and not split
        ),
        "IDS_AHEAD": config.ids_ahead,
        "GUARD_LOOPS": not unguarded_loops,
        "DIAG": diag,
        **_merge_constexprs(fused and config.merge_reads == "batched", problem, config, parts),
    }


def _merge_constexprs(
    batched: bool, problem: AttentionProblem, config: AttentionConfig, parts: int
) -> dict[str, int | bool]:
    """The batched merge's compile-time sizes (all 1 / False for the serial merge, so its
    builds do not vary with them): real rows of a tile (``block_q * group`` rounded up to a power
    of two, at most ``block_m``), partitions padded to a power of two, and partitions per
    output read, sized so the reads in flight fill about ``config.merge_read_regs``
    registers per thread (one read when all fit, else two chunks of half that)."""
    if not batched:
        return {
            "MERGE_BATCHED": False,
            "MERGE_ROWS": 1,
            "MERGE_PARTS_PAD": 1,
            "MERGE_CHUNK_PARTS": 1,
        }
    rows = min(config.block_m, _next_pow2(config.block_q * problem.group))
    parts_pad = _next_pow2(parts)
    per_part = rows * max(16, _next_pow2(problem.head_dim))  # float32 elements per partial
    budget = config.merge_read_regs * 32 * config.num_warps  # elements the program's threads hold
    if parts_pad * per_part <= budget:
        chunk = parts_pad
    else:  # two chunks live at once (the one summed and the one prefetched)
        chunk = min(parts_pad, _prev_pow2(max(1, budget // (2 * per_part))))
    return {
        "MERGE_BATCHED": True,
        "MERGE_ROWS": rows,
        "MERGE_PARTS_PAD": parts_pad,
        "MERGE_CHUNK_PARTS": chunk,
    }


def _prev_pow2(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


_ATTENTION_LAUNCHER = CachedLauncher(_paged_attention_kernel)


def _parse_diagnostic(names: str) -> tuple[int, bool, bool]:
    """``(DIAG code, unguarded_loops, cached_counters)`` from the launcher's private
    ``_diagnostic`` string ("+"-joined names; "" = the production kernel)."""
    parts = [n for n in names.split("+") if n]
    unknown = [n for n in parts if n not in _DIAG_CODES and n not in _DIAG_HOST]
    kernel_variants = [n for n in parts if n in _DIAG_CODES]
    if unknown or len(kernel_variants) > 1:
        raise KernelArgumentError(f"unknown or conflicting diagnostic variants: {names!r}")
    code = _DIAG_CODES[kernel_variants[0]] if kernel_variants else 0
    return code, "unguarded_loops" in parts, "cached_counters" in parts


def with_partitions(config: AttentionConfig, num_partitions: int) -> AttentionConfig:
    """``config`` with another split count (tests and benchmarks force either path)."""
    return replace(config, num_partitions=num_partitions)
