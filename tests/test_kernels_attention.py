"""Paged attention against float64 dense attention, on random paged batches.

CPU runs force the Triton path through the interpreter (fp16 / fp32, small shapes) and also
check the torch reference path; tests marked ``gpu`` run the full matrix (bf16, every head
dim and block size, large shapes, pools over 2**31 elements) on CUDA.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import kernels
import kernels.attention as attention_module
from kernels.attention import (
    AttentionConfig,
    SplitPolicy,
    choose_config,
    paged_attention_triton,
    with_partitions,
)
from kernels.testing import dense_attention, permute_blocks, rel_l2
from kernels.testing import make_paged_batch as _make_paged_batch
from kernels.validation import AttentionProblem, check_paged_attention_args

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP32_MAX_REL = 1e-5


def make_paged_batch(*args, **kwargs):
    """Batches on the GPU where there is one (real Triton), else on the CPU (interpreter)."""
    kwargs.setdefault("device", DEVICE)
    return _make_paged_batch(*args, **kwargs)


HALF_REL_L2 = 1e-2


def max_rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error over max abs expected value (fp32 acceptance metric)."""
    a, e = actual.double(), expected.double()
    return float((a - e).abs().max() / e.abs().max())


def run(batch, backend: str = "triton", **kw):
    return kernels.paged_attention(*batch.args(), backend=backend, return_lse=True, **kw)


def check_against_dense(batch, dtype: torch.dtype, backend: str = "triton", **kw) -> float:
    out, lse = run(batch, backend, **kw)
    ref, ref_lse = dense_attention(batch, **kw)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert torch.isfinite(out).all()
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    if dtype == torch.float32:
        err = max_rel(out, ref)
        assert err <= FP32_MAX_REL, f"fp32 max relative error {err:.2e}"
        assert (lse[seen].double() - ref_lse[seen]).abs().max() <= 1e-4
    else:
        err = rel_l2(out, ref)
        assert err <= HALF_REL_L2, f"{dtype} relative L2 error {err:.2e}"
        assert (lse[seen].double() - ref_lse[seen]).abs().max() <= 2e-2
    return err


# Ragged lengths around block boundaries (bs - 1, bs, bs + 1), a long one, one-token ones.
def ragged_lens(bs: int) -> list[int]:
    return [1, bs - 1, bs, bs + 1, 5 * bs + 3]


# (name, seq_lens(bs), q_lens(seq_lens)): decode, prefill, chunked prefill, mixed batches.
SCENARIOS = {
    "decode": (ragged_lens, lambda lens: [1] * len(lens)),
    "prefill": (lambda bs: [bs + 1, 2 * bs - 1, 7], lambda lens: list(lens)),
    "chunked": (
        ragged_lens,
        lambda lens: [min(n, q) for n, q in zip(lens, [1, 5, 16, 3, 40], strict=True)],
    ),
    "mixed_with_empty": (lambda bs: [9, 3 * bs, 2, bs + 2], lambda lens: [1, 0, 2, 7]),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2), (4, 1)])
def test_triton_matches_dense_fp32(scenario: str, hq: int, hkv: int) -> None:
    seq_fn, q_fn = SCENARIOS[scenario]
    lens = seq_fn(16)
    batch = make_paged_batch(
        lens, q_fn(lens), num_q_heads=hq, num_kv_heads=hkv, head_dim=32, block_size=16, seed=hq
    )
    check_against_dense(batch, torch.float32)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_block_sizes_and_padded_head_dims(block_size: int, head_dim: int) -> None:
    lens = ragged_lens(block_size)
    batch = make_paged_batch(
        lens,
        [1, 2, 1, 4, 9],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        seed=block_size + head_dim,
    )
    check_against_dense(batch, torch.float32)


@pytest.mark.parametrize(
    "options",
    [
        {"causal": False},
        {"sliding_window": 7},
        {"sliding_window": 1},
        {"sliding_window": 20, "causal": False},
        {"softcap": 2.5},
        {"scale": 0.3, "softcap": 30.0, "sliding_window": 16},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_masks_and_softcap(options: dict) -> None:
    lens = [1, 15, 33, 50]
    batch = make_paged_batch(
        lens, [1, 6, 33, 17], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=8, seed=3
    )
    check_against_dense(batch, torch.float32, **options)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp16_relative_l2(backend: str) -> None:
    lens = ragged_lens(16)
    batch = make_paged_batch(
        lens,
        [1, 4, 16, 2, 30],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        seed=11,
    )
    err = check_against_dense(batch, torch.float16, backend=backend)
    assert err > 0  # fp16 rounding shows; an exact zero would mean the check compared nothing


def test_reference_path_matches_dense_fp32() -> None:
    lens = ragged_lens(8)
    batch = make_paged_batch(
        lens, [1, 7, 2, 9, 4], num_q_heads=6, num_kv_heads=3, head_dim=16, block_size=8, seed=5
    )
    check_against_dense(batch, torch.float32, backend="torch", sliding_window=9)


def test_default_backend_on_cpu_is_the_reference() -> None:
    batch = make_paged_batch(
        [20, 9], [3, 1], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8
    )
    if CUDA:
        pytest.skip("CPU dispatch")
    auto = kernels.paged_attention(*batch.args())
    ref = kernels.paged_attention(*batch.args(), backend="torch")
    assert torch.equal(auto, ref)


def test_placement_invariance_is_bitwise() -> None:
    lens = [40, 3, 17, 64]
    batch = make_paged_batch(
        lens, [1, 3, 5, 20], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=8, seed=21
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        perm = torch.randperm(batch.key_cache.shape[0], generator=gen)
        moved = permute_blocks(batch, perm)
        assert not torch.equal(moved.block_tables, batch.block_tables)
        a, la = run(batch)
        b, lb = run(moved)
        assert torch.equal(a, b) and torch.equal(la, lb)


def seed_lesson_model(q, block_table, k_pool, v_pool, seq_len, block):
    """The lesson's pure-Python model: walk the block table, fold each key into an online
    softmax (running max m, denominator den, accumulator acc)."""
    d = len(q)
    m, den, acc, pos = -math.inf, 0.0, [0.0] * d, 0
    for phys in block_table:
        for t in range(block):
            if pos >= seq_len:
                break
            k, v = k_pool[phys][t], v_pool[phys][t]
            s = sum(qi * ki for qi, ki in zip(q, k, strict=True)) / math.sqrt(d)
            m_new = max(m, s)
            corr = math.exp(m - m_new) if m != -math.inf else 0.0
            p = math.exp(s - m_new)
            den = den * corr + p
            acc = [a * corr + p * vj for a, vj in zip(acc, v, strict=True)]
            m, pos = m_new, pos + 1
    return [a / den for a in acc]


def test_seed_lesson_block_table_3_1() -> None:
    block, d, seq_len = 4, 16, 7
    gen = torch.Generator().manual_seed(42)
    k_pool = torch.randn(5, block, d, generator=gen).to(DEVICE)
    v_pool = torch.randn(5, block, d, generator=gen).to(DEVICE)
    q = torch.randn(d, generator=gen).to(DEVICE)
    expected = seed_lesson_model(
        q.tolist(), [3, 1], k_pool.tolist(), v_pool.tolist(), seq_len, block
    )
    out = kernels.paged_attention(
        q.view(1, 1, d),
        k_pool.unsqueeze(1),  # [num_blocks, Hkv=1, block, D]
        v_pool.unsqueeze(1),
        torch.tensor([[3, 1]], dtype=torch.int32, device=DEVICE),
        torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        backend="triton",
    )
    expected_t = torch.tensor(expected, dtype=torch.float64, device=DEVICE)
    assert max_rel(out.view(d), expected_t) <= FP32_MAX_REL
    # ... and it is dense attention over the logical order [block 3, block 1].
    k = torch.cat([k_pool[3], k_pool[1]])[:seq_len].double()
    v = torch.cat([v_pool[3], v_pool[1]])[:seq_len].double()
    dense = torch.softmax(k @ q.double() / math.sqrt(d), dim=0) @ v
    assert max_rel(expected_t, dense) <= 1e-12


def problem_of(batch) -> AttentionProblem:
    return check_paged_attention_args(
        *batch.args(), scale=None, sliding_window=None, softcap=None, out=None
    )


@pytest.mark.parametrize("causal", [True, False])
def test_split_matches_unsplit_and_writes_every_element(causal: bool) -> None:
    lens = [130, 7, 64, 201]
    batch = make_paged_batch(
        lens, [1, 2, 1, 12], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, seed=8
    )
    problem = problem_of(batch)
    base = replace(choose_config(problem, torch.float32, sm_count=4), tile_n=32)
    results = []
    # Fused: the last partition program merges; unfused: a separate merge kernel. Each split
    # config runs twice, so the fused path's arrival counters must have been reset.
    for parts, fused in ((1, True), (3, False), (6, True), (6, True)):
        out = torch.full_like(batch.query, float("nan"))
        o, lse = paged_attention_triton(
            *batch.args(),
            problem,
            causal=causal,
            return_lse=True,
            out=out,
            config=replace(with_partitions(base, parts), fused_merge=fused),
        )
        assert o is out and not torch.isnan(out).any()
        results.append((o, lse))
    ref, _ = dense_attention(batch, causal=causal)
    for o, lse in results:
        assert max_rel(o, ref) <= FP32_MAX_REL
        torch.testing.assert_close(o, results[0][0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(lse, results[0][1], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("options", [{}, {"sliding_window": 30}, {"causal": False}])
def test_partitions_follow_each_sequence_not_the_table(options: dict) -> None:
    """Partitions split each tile's own KV range (read on the device), not the block
    table's capacity: with a table far wider than every sequence the split still covers
    each sequence exactly once (short sequences, ones shorter than a partition's tile
    count, prefill rows)."""
    lens = [130, 7, 64, 201, 16]
    batch = make_paged_batch(
        lens, [1, 2, 1, 12, 16], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
        seed=11, spare_columns=40,
    )  # fmt: skip
    problem = problem_of(batch)
    base = replace(choose_config(problem, torch.float32, sm_count=4), tile_n=16)
    ref, ref_lse = dense_attention(batch, **options)
    got = []
    for parts in (1, 5, 32):
        out = torch.full_like(batch.query, float("nan"))
        cfg = replace(with_partitions(base, parts), fused_merge=True, merge_reads="batched")
        o, lse = paged_attention_triton(
            *batch.args(), problem, return_lse=True, out=out, config=cfg, **options
        )
        assert not torch.isnan(o).any()
        assert max_rel(o, ref) <= FP32_MAX_REL
        got.append((o, lse))
    for o, lse in got[1:]:
        torch.testing.assert_close(o, got[0][0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(lse, got[0][1], rtol=2e-6, atol=2e-6)
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(got[2][1][seen].double(), ref_lse[seen], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2), (8, 1)])
def test_fused_merge_matches_the_merge_kernel(hq: int, hkv: int) -> None:
    """The last partition program's merge (group sizes 1, 3 and 8; decode and multi-row
    tiles; 19 partitions, read in chunks with a partial last one) agrees with the separate
    merge kernel and with dense attention, outputs and LSEs."""
    batch = make_paged_batch(
        [600, 9, 97], [1, 3, 5], num_q_heads=hq, num_kv_heads=hkv, head_dim=32, block_size=8,
        seed=hq * 10 + hkv,
    )  # fmt: skip
    problem = problem_of(batch)
    base = replace(choose_config(problem, torch.float32, sm_count=4), tile_n=16)
    ref, ref_lse = dense_attention(batch)
    for parts in (5, 19):
        got = []
        for fused in (True, False):
            out = torch.full_like(batch.query, float("nan"))
            cfg = replace(with_partitions(base, parts), fused_merge=fused)
            o, lse = paged_attention_triton(
                *batch.args(), problem, return_lse=True, out=out, config=cfg
            )
            assert not torch.isnan(o).any()
            got.append((o, lse))
        torch.testing.assert_close(got[0][0], got[1][0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(got[0][1], got[1][1], rtol=2e-6, atol=2e-6)
        assert max_rel(got[0][0], ref) <= FP32_MAX_REL
        torch.testing.assert_close(got[0][1].double(), ref_lse, rtol=1e-5, atol=1e-5)


# Decode batches for the early block-id reads: every sequence one query (the lookup's guess
# always hits), and one with query-less sequences (the guess misses for some slots, which
# must re-read the right table row). Lengths cross tile and block edges.
EARLY_BATCHES = {
    "decode": ([1, 15, 16, 17, 95, 160], [1, 1, 1, 1, 1, 1]),
    "guess_misses": ([40, 7, 33, 96, 5, 64], [1, 0, 0, 1, 1, 0]),
}


@pytest.mark.parametrize("batch_name", sorted(EARLY_BATCHES))
@pytest.mark.parametrize(("early", "ahead"), [(True, 1), (True, 2), (False, 2)])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 20}], ids=["full", "window"])
def test_early_ids_and_ids_ahead(batch_name: str, early: bool, ahead: int, options: dict) -> None:
    """``early_ids`` (query and first block ids read before the sequence lookup resolves)
    and ``ids_ahead=2`` (block ids two tiles ahead) give the default path's result, split
    (fused merge) and unsplit, and every output element is written. A sliding window turns
    the early reads off (partitions then start at a sequence-dependent tile)."""
    lens, q_lens = EARLY_BATCHES[batch_name]
    batch = make_paged_batch(
        lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=8, seed=len(lens)
    )
    problem = problem_of(batch)
    cfg = choose_config(problem, torch.float32, sm_count=4)
    base = replace(cfg, tile_n=16, early_ids=False, ids_ahead=1)
    assert base.block_q == 1
    ref, ref_lse = dense_attention(batch, **options)
    for parts in (1, 4):
        got = []
        for cfg in (base, replace(base, early_ids=early, ids_ahead=ahead)):
            out = torch.full_like(batch.query, float("nan"))
            cfg = replace(with_partitions(cfg, parts), fused_merge=parts > 1)
            o, lse = paged_attention_triton(
                *batch.args(), problem, return_lse=True, out=out, config=cfg, **options
            )
            assert not torch.isnan(o).any()
            got.append((o, lse))
        torch.testing.assert_close(got[1][0], got[0][0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(got[1][1], got[0][1], rtol=2e-6, atol=2e-6)
        assert max_rel(got[1][0], ref) <= FP32_MAX_REL
        seen = torch.isfinite(ref_lse)
        torch.testing.assert_close(got[1][1][seen].double(), ref_lse[seen], rtol=1e-5, atol=1e-5)


def test_ids_ahead_is_checked() -> None:
    with pytest.raises(ValueError, match="ids_ahead"):
        AttentionConfig(block_m=16, block_q=1, tile_n=32, ids_ahead=3)


def test_merge_of_partials_from_separate_calls_equals_whole() -> None:
    """Attention over keys [0, a) and [a, L) computed as two non-causal calls, merged."""
    seq_len, cut, d = 70, 29, 32
    whole = make_paged_batch(
        [seq_len], [1], num_q_heads=4, num_kv_heads=2, head_dim=d, block_size=8, seed=13
    )
    k, v = whole.keys[0], whole.values[0]
    parts = []
    for lo, hi in ((0, cut), (cut, seq_len)):
        piece = make_paged_batch(
            [hi - lo], [1], num_q_heads=4, num_kv_heads=2, head_dim=d, block_size=8, seed=lo
        )
        for j, blk in enumerate(piece.block_tables[0].tolist()):
            if blk < 0:
                break
            n = min(8, hi - lo - j * 8)
            piece.key_cache[blk, :, :n] = k[lo + j * 8 : lo + j * 8 + n].transpose(0, 1)
            piece.value_cache[blk, :, :n] = v[lo + j * 8 : lo + j * 8 + n].transpose(0, 1)
        args = (whole.query, *piece.args()[1:])
        parts.append(
            kernels.paged_attention(*args, causal=False, return_lse=True, backend="triton")
        )
    outs = torch.stack([p[0] for p in parts])
    lses = torch.stack([p[1] for p in parts])
    merged, merged_lse = kernels.merge_attention_states(outs, lses, backend="triton")
    full, _ = run(whole, causal=False)
    ref, ref_lse = dense_attention(whole, causal=False)
    assert max_rel(merged, ref) <= FP32_MAX_REL
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse.double(), ref_lse, rtol=0, atol=1e-5)


def test_out_argument_is_filled_and_returned() -> None:
    batch = make_paged_batch(
        [33, 5], [4, 5], num_q_heads=4, num_kv_heads=4, head_dim=32, block_size=8
    )
    out = torch.full_like(batch.query, float("nan"))
    got = kernels.paged_attention(*batch.args(), out=out, backend="triton")
    assert got is out and not torch.isnan(out).any()
    ref = kernels.paged_attention(*batch.args(), backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_empty_batch_and_empty_query() -> None:
    batch = make_paged_batch([5], [0], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=8)
    out, lse = run(batch)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


def test_non_contiguous_query_rows() -> None:
    batch = make_paged_batch(
        [20, 9], [3, 2], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8
    )
    wide = torch.randn(5, 4, 64, device=DEVICE)
    wide[..., :32] = batch.query
    strided = wide[..., :32]
    assert not strided.is_contiguous()
    a = kernels.paged_attention(strided, *batch.args()[1:], backend="triton")
    b = kernels.paged_attention(batch.query, *batch.args()[1:], backend="triton")
    assert torch.equal(a, b)


def test_column_strided_block_tables() -> None:
    batch = make_paged_batch(
        [40, 9, 17], [2, 1, 3], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=2
    )
    strided = batch.block_tables.t().contiguous().t()  # same values, column stride != 1
    assert strided.stride(1) != 1
    args = list(batch.args())
    a = kernels.paged_attention(*args, backend="triton")
    args[3] = strided
    b = kernels.paged_attention(*args, backend="triton")
    assert torch.equal(a, b)


class TestHeuristics:
    @staticmethod
    def problem(num_seqs: int, q_tokens: int, max_kv: int, hq: int = 32, hkv: int = 8):
        return AttentionProblem(
            num_q_tokens=q_tokens,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=128,
            num_blocks=10**6,
            block_size=16,
            num_seqs=num_seqs,
            max_blocks=max_kv // 16,
        )

    def test_long_context_small_batch_splits(self) -> None:
        cfg = choose_config(self.problem(1, 1, 32768), torch.bfloat16, sm_count=132)
        assert cfg.block_q == 1 and cfg.num_partitions >= 16

    def test_large_batch_does_not_split(self) -> None:
        cfg = choose_config(self.problem(256, 256, 2048), torch.bfloat16, sm_count=132)
        assert cfg.num_partitions == 1

    def test_batch_filling_every_sm_does_not_split(self) -> None:
        # 32 sequences x 8 KV heads = 256 programs on 132 SMs: every SM has work already.
        cfg = choose_config(self.problem(32, 32, 2048), torch.bfloat16, sm_count=132)
        assert cfg.num_partitions == 1

    @pytest.mark.parametrize("batch", [1, 4, 7])
    def test_small_batch_long_context_splits_to_just_under_two_per_sm(self, batch: int) -> None:
        cfg = choose_config(self.problem(batch, batch, 16384), torch.bfloat16, sm_count=132)
        base = batch * 8
        programs = base * cfg.num_partitions
        # Just under the target, or a power of two of partitions within 1/8 below that.
        assert cfg.num_partitions > 1 and 7 * (2 * 132 - base) < 8 * programs <= 8 * 2 * 132
        assert cfg.num_stages == 3 and cfg.fused_merge  # one launch per call

    def test_early_ids_only_for_unsplit_decode(self) -> None:
        # Measured on the H200 (notes-kernels.md, v7): a small gain unsplit, a loss split.
        unsplit = choose_config(self.problem(256, 256, 128), torch.bfloat16, sm_count=132)
        split = choose_config(self.problem(4, 4, 16384), torch.bfloat16, sm_count=132)
        prefill = choose_config(self.problem(8, 8 * 512, 4096), torch.bfloat16, sm_count=132)
        assert unsplit.num_partitions == 1 and unsplit.early_ids
        assert split.num_partitions > 1 and not split.early_ids
        assert prefill.block_q > 1 and not prefill.early_ids
        assert unsplit.ids_ahead == split.ids_ahead == prefill.ids_ahead == 1

    def test_short_context_does_not_split(self) -> None:
        cfg = choose_config(self.problem(1, 1, 256), torch.bfloat16, sm_count=132)
        assert cfg.num_partitions == 1

    def test_split_respects_minimum_partition(self) -> None:
        policy = SplitPolicy(target_programs_per_sm=100, min_partition_tokens=512)
        cfg = choose_config(self.problem(1, 1, 4096), torch.bfloat16, 132, policy)
        assert cfg.num_partitions == 4096 // 512

    @pytest.mark.parametrize("hq", [8, 32, 48, 128])
    def test_prefill_tile_holds_whole_groups(self, hq: int) -> None:
        cfg = choose_config(self.problem(8, 8 * 512, 4096, hq=hq, hkv=1), torch.float16, 132)
        assert cfg.block_q >= 1 and cfg.block_m >= cfg.block_q * hq
        assert cfg.block_m & (cfg.block_m - 1) == 0 and cfg.block_m >= 16

    def test_bad_config_is_rejected(self) -> None:
        with pytest.raises(ValueError, match="block_m"):
            AttentionConfig(block_m=24, block_q=1, tile_n=32)
        with pytest.raises(ValueError, match="tile_n"):
            AttentionConfig(block_m=16, block_q=1, tile_n=8)


# ----------------------------------------------------------------------------- GPU matrix

GPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_gpu_head_dims(dtype: torch.dtype, head_dim: int) -> None:
    bs = {64: 8, 80: 16, 96: 32, 128: 16, 256: 16}[head_dim]
    lens = [*ragged_lens(bs), 700, 1500]
    q_lens = [1, 1, 3, 1, 40, 1, 300]
    batch = make_paged_batch(
        lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=bs,
        dtype=dtype, device="cuda", seed=head_dim,
    )  # fmt: skip
    check_against_dense(batch, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (16, 16), (16, 1)])
def test_gpu_block_sizes_and_groups(dtype: torch.dtype, block_size: int, hq: int, hkv: int) -> None:
    lens = [*ragged_lens(block_size), 2048]
    batch = make_paged_batch(
        lens, [1, 2, 1, 1, 30, 1], num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
        block_size=block_size, dtype=dtype, device="cuda", seed=block_size * hq,
    )  # fmt: skip
    check_against_dense(batch, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize(
    "options",
    [
        {"causal": False},
        {"sliding_window": 100},
        {"softcap": 30.0},
        {"sliding_window": 33, "softcap": 5.0},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_gpu_masks_and_softcap(dtype: torch.dtype, options: dict) -> None:
    lens = [1, 300, 1000, 77]
    batch = make_paged_batch(
        lens, [1, 1, 250, 77], num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype=dtype, device="cuda", seed=17,
    )  # fmt: skip
    check_against_dense(batch, dtype, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_large_split_decode_and_prefill(dtype: torch.dtype) -> None:
    # Long contexts with few sequences take the split path on 132 SMs; the prefill rows
    # cover several query tiles each.
    lens = [32768, 9000, 4097, 2048]
    batch = make_paged_batch(
        lens, [1, 1, 1, 2048], num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype=dtype, device="cuda", seed=23,
    )  # fmt: skip
    check_against_dense(batch, dtype)
    decode = make_paged_batch(
        [32768], [1], num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype=dtype, device="cuda", seed=24,
    )  # fmt: skip
    cfg = choose_config(problem_of(decode), dtype, 132)
    assert cfg.num_partitions > 1
    check_against_dense(decode, dtype)


@pytest.mark.gpu
def test_gpu_split_vs_unsplit_and_placement() -> None:
    batch = make_paged_batch(
        [5000, 3, 1200], [1, 3, 1], num_q_heads=32, num_kv_heads=8, head_dim=128,
        block_size=16, dtype=torch.float32, device="cuda", seed=31,
    )  # fmt: skip
    problem = problem_of(batch)
    base = choose_config(problem, torch.float32, 132)
    outs = []
    for parts, fused in ((1, True), (7, True), (40, True), (40, False), (40, True), (7, False)):
        for _ in range(3):  # repeated launches reuse the fused merge's counters
            out = torch.full_like(batch.query, float("nan"))
            cfg = replace(with_partitions(base, parts), fused_merge=fused)
            o, lse = paged_attention_triton(
                *batch.args(), problem, return_lse=True, out=out, config=cfg
            )
            assert not torch.isnan(o).any()
            outs.append((o, lse))
    for o, lse in outs[1:]:
        torch.testing.assert_close(o, outs[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, outs[0][1], rtol=1e-6, atol=1e-5)
    perm = torch.randperm(batch.key_cache.shape[0])
    a, la = run(batch)
    b, lb = run(permute_blocks(batch, perm))
    assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.gpu
def test_gpu_pool_beyond_2_pow_31_elements() -> None:
    # 2**31 + some elements of bf16 (4.3 GB): the blocks the batch uses sit at the pool's end,
    # so block index x block stride overflows int32 unless offsets are int64.
    hkv, bs, d = 8, 16, 128
    per_block = hkv * bs * d
    num_blocks = (2**31) // per_block + 64
    key_cache = torch.randn(num_blocks, hkv, bs, d, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.randn(num_blocks, hkv, bs, d, device="cuda", dtype=torch.bfloat16)
    assert key_cache.numel() > 2**31
    small = make_paged_batch(
        [300, 40], [1, 40], num_q_heads=32, num_kv_heads=hkv, head_dim=d, block_size=bs,
        dtype=torch.bfloat16, device="cuda", seed=41, spare_blocks=0,
    )  # fmt: skip
    # Place the small batch's blocks at the end of the big pool.
    used = small.block_tables >= 0
    offset = num_blocks - small.key_cache.shape[0]
    tables = small.block_tables.clone()
    tables[used] += offset
    key_cache[offset:] = small.key_cache
    value_cache[offset:] = small.value_cache
    out = kernels.paged_attention(
        small.query, key_cache, value_cache, tables, small.seq_lens, small.query_start_loc
    )
    ref, _ = dense_attention(small)
    assert rel_l2(out, ref) <= HALF_REL_L2


@pytest.mark.gpu
def test_gpu_cached_launch_respects_specialization() -> None:
    # The second and later launches of one configuration skip Triton's argument binding
    # (kernels.launch.CachedLauncher). Alternate arguments whose alignment and stride
    # specializations differ (a query view 1 element off 16-byte alignment, a block table
    # with a row stride of 1 more) and check every call against the dense reference.
    batch = make_paged_batch(
        [700, 33, 4096], [1, 1, 1], num_q_heads=32, num_kv_heads=8, head_dim=128,
        block_size=16, dtype=torch.float16, device="cuda", seed=51,
    )  # fmt: skip
    ref, _ = dense_attention(batch)
    q = batch.query
    q_store = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    q_off = q_store[1:].view_as(q)
    q_off.copy_(q)
    wide = torch.full(
        (batch.block_tables.shape[0], batch.block_tables.shape[1] + 1), -1,
        dtype=torch.int32, device="cuda",
    )  # fmt: skip
    tables_odd = wide[:, : batch.block_tables.shape[1]]
    tables_odd.copy_(batch.block_tables)
    variants = [(q, batch.block_tables), (q_off, batch.block_tables), (q, tables_odd)]
    for parts in (1, 6):
        problem = problem_of(batch)
        cfg = with_partitions(choose_config(problem, torch.float16, 132), parts)
        for _ in range(3):
            for query, tables in variants:
                out = torch.full_like(q, float("nan"))
                paged_attention_triton(
                    query, batch.key_cache, batch.value_cache, tables, batch.seq_lens,
                    batch.query_start_loc, problem, out=out, config=cfg,
                )  # fmt: skip
                assert rel_l2(out, ref) <= HALF_REL_L2


@pytest.mark.gpu
def test_gpu_launch_plans_repeat_every_call_shape() -> None:
    """The launcher's per-shape plans (kernels.launch_plans.LaunchPlan): calls alternating
    between shapes, split (fused merge) and unsplit, with and without ``out`` and LSE, on
    two streams, each repeated so most go through a plan; every result against dense."""
    shapes = ((61, [8192]), (62, [300, 4096, 17]), (63, [64] * 200))
    batches = []
    for seed, lens in shapes:
        batches.append(
            make_paged_batch(
                lens,
                [1] * len(lens),
                num_q_heads=32,
                num_kv_heads=8,
                head_dim=128,
                block_size=16,
                dtype=torch.bfloat16,
                device="cuda",
                seed=seed,
            )
        )
    refs = [dense_attention(b) for b in batches]
    torch.cuda.synchronize()  # the inputs are ready before the side stream reads them
    side = torch.cuda.Stream()
    for _ in range(3):
        for stream in (torch.cuda.current_stream(), side):
            with torch.cuda.stream(stream):
                for b, (ref, ref_lse) in zip(batches, refs, strict=True):
                    out = torch.full_like(b.query, float("nan"))
                    o1 = kernels.paged_attention(*b.args(), check_values=False)
                    o2, lse = kernels.paged_attention(
                        *b.args(), out=out, return_lse=True, check_values=False
                    )
                    torch.cuda.current_stream().synchronize()
                    assert o2 is out
                    assert rel_l2(o1, ref) <= HALF_REL_L2 and rel_l2(o2, ref) <= HALF_REL_L2
                    assert (lse.double() - ref_lse).abs().max() <= 2e-2


# Batches for the loop guards: tile-aligned decode lengths (no masked tile at all), ragged
# ones, and prefill rows (causal diagonal inside the last tiles).
GUARD_BATCHES = {
    "aligned_decode": ([64, 128, 32], [1, 1, 1]),
    "ragged_decode": ([1, 15, 17, 95, 160], [1, 1, 1, 1, 1]),
    "prefill": ([40, 9, 70], [40, 3, 21]),
}


@pytest.mark.parametrize("batch_name", sorted(GUARD_BATCHES))
@pytest.mark.parametrize("options", [{}, {"sliding_window": 20}], ids=["full", "window"])
def test_loop_guards_match_unguarded_loops(batch_name: str, options: dict) -> None:
    """The default kernel (empty unmasked / masked tile loops skipped) gives the result of
    the v7 kernel that runs them empty (the ``unguarded_loops`` diagnostic), split (fused
    merge) and unsplit, and both write every output element."""
    lens, q_lens = GUARD_BATCHES[batch_name]
    batch = make_paged_batch(
        lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=8, seed=len(lens)
    )
    problem = problem_of(batch)
    base = replace(choose_config(problem, torch.float32, sm_count=4), tile_n=16)
    ref, _ = dense_attention(batch, **options)
    for parts in (1, 3):
        cfg = replace(with_partitions(base, parts), fused_merge=parts > 1)
        got = []
        for diag in ("unguarded_loops", ""):
            out = torch.full_like(batch.query, float("nan"))
            o, lse = paged_attention_triton(
                *batch.args(), problem, return_lse=True, out=out, config=cfg,
                _diagnostic=diag, **options,
            )  # fmt: skip
            assert not torch.isnan(o).any()
            got.append((o, lse))
        torch.testing.assert_close(got[1][0], got[0][0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(got[1][1], got[0][1], rtol=2e-6, atol=2e-6)
        assert max_rel(got[1][0], ref) <= FP32_MAX_REL


def test_diagnostic_variants_run_and_skip_their_work() -> None:
    """The benchmark-only kernel variants (notes-kernels.md, v8) compile and run: the relaxed
    counter still merges (the interpreter runs programs one by one, so no race), the
    skipping ones leave the output unwritten, the merge-tail steps write it; the counters
    stay reset for the next call."""
    batch = make_paged_batch(
        [150, 64], [1, 1], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=3
    )
    problem = problem_of(batch)
    cfg = replace(
        with_partitions(choose_config(problem, torch.float32, sm_count=4), 4),
        tile_n=16,
        fused_merge=True,
    )
    ref, _ = dense_attention(batch)
    merging = (
        (cfg, "relaxed_counter+cached_counters"),
        (cfg, "cached_counters+unguarded_loops"),
        (replace(cfg, fused_merge=False), "unguarded_loops"),
    )
    for c, diag in merging:
        out = torch.full_like(batch.query, float("nan"))
        o, _ = paged_attention_triton(*batch.args(), problem, out=out, config=c, _diagnostic=diag)
        assert max_rel(o, ref) <= FP32_MAX_REL, diag
    for diag in ("no_merge", "no_stores+cached_counters", "startup_only"):
        out = torch.full_like(batch.query, float("nan"))
        paged_attention_triton(*batch.args(), problem, out=out, config=cfg, _diagnostic=diag)
        assert torch.isnan(out).all(), diag
    # The merge-tail steps write every element (not the merged result, except one read of
    # all four partials, which is the whole merge).
    for diag in ("merge_no_reads", "merge_lse_only", "merge_one_read"):
        out = torch.full_like(batch.query, float("nan"))
        o, _ = paged_attention_triton(*batch.args(), problem, out=out, config=cfg, _diagnostic=diag)
        assert torch.isfinite(o).all(), diag
        if diag == "merge_one_read":
            assert max_rel(o, ref) <= FP32_MAX_REL
    out = torch.full_like(batch.query, float("nan"))
    o, _ = paged_attention_triton(*batch.args(), problem, out=out, config=cfg)
    assert max_rel(o, ref) <= FP32_MAX_REL


@pytest.mark.parametrize("diag", ["bogus", "no_merge+no_stores", "unguarded_loops+x"])
def test_diagnostic_names_are_checked(diag: str) -> None:
    batch = make_paged_batch(
        [20], [1], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=8, seed=1
    )
    with pytest.raises(ValueError, match="diagnostic"):
        paged_attention_triton(*batch.args(), problem_of(batch), _diagnostic=diag)


# The v9 batched fused merge (AttentionConfig.merge_reads, notes-kernels.md v9): partition
# counts from 2 to 16 (powers of two and not), batches whose short sequences leave whole
# partitions empty (LSE -inf), GQA groups 1 / 3 / 4 / 8.
MERGE_LENS = [150, 1, 9, 64]


def merge_cfg(batch, parts: int, merge_reads: str, **overrides) -> AttentionConfig:
    """A fused split config over 16-token tiles (so short batches still split)."""
    base = replace(choose_config(problem_of(batch), batch.query.dtype, sm_count=4), tile_n=16)
    return replace(
        with_partitions(base, parts), fused_merge=True, merge_reads=merge_reads, **overrides
    )


def run_merge(batch, cfg: AttentionConfig, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one launch into a NaN-filled output (unwritten elements show)."""
    out = torch.full_like(batch.query, float("nan"))
    o, lse = paged_attention_triton(
        *batch.args(), problem_of(batch), return_lse=True, out=out, config=cfg, **kw
    )
    assert not torch.isnan(o).any()
    return o, lse


def assert_matches_dense(batch, o: torch.Tensor, lse: torch.Tensor, **kw) -> None:
    ref, ref_lse = dense_attention(batch, **kw)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    if batch.query.dtype == torch.float32:
        assert max_rel(o, ref) <= FP32_MAX_REL
        assert (lse[seen].double() - ref_lse[seen]).abs().max() <= 1e-4
    else:
        assert rel_l2(o, ref) <= HALF_REL_L2
        assert (lse[seen].double() - ref_lse[seen]).abs().max() <= 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("parts", [3, 8])
def test_batched_merge_matches_dense_and_serial(
    dtype: torch.dtype, hq: int, hkv: int, parts: int
) -> None:
    """The batched merge gives the dense result (and LSE) and agrees with the serial merge
    to float32 rounding (same math, another summation order)."""
    batch = make_paged_batch(
        MERGE_LENS, [1] * len(MERGE_LENS), num_q_heads=hq, num_kv_heads=hkv, head_dim=32,
        block_size=8, dtype=dtype, seed=hq * 10 + parts,
    )  # fmt: skip
    o_b, lse_b = run_merge(batch, merge_cfg(batch, parts, "batched"))
    o_s, lse_s = run_merge(batch, merge_cfg(batch, parts, "serial"))
    assert_matches_dense(batch, o_b, lse_b)
    tol = 2e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(o_b, o_s, rtol=tol, atol=tol)
    torch.testing.assert_close(lse_b, lse_s, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("parts", [2, 5, 7, 13, 16])
@pytest.mark.parametrize("read_regs", [64, 0], ids=["one_read", "chunked"])
def test_batched_merge_partition_counts_and_chunks(parts: int, read_regs: int) -> None:
    """Every partition count, padded to a power of two, in one read of all partials or (a
    budget of no registers) one partition per read with the next one prefetched."""
    batch = make_paged_batch(
        [250, 3, 33], [1, 1, 1], num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=8,
        seed=parts,
    )  # fmt: skip
    cfg = merge_cfg(batch, parts, "batched", merge_read_regs=read_regs)
    sizes = attention_module._merge_constexprs(True, problem_of(batch), cfg, parts)
    assert sizes["MERGE_PARTS_PAD"] == attention_module._next_pow2(parts)
    assert (sizes["MERGE_CHUNK_PARTS"] == 1) == (read_regs == 0)
    for _ in range(2):  # the counters are left at zero for the next call
        o, lse = run_merge(batch, cfg)
        assert_matches_dense(batch, o, lse)


@pytest.mark.parametrize(
    "options", [{}, {"sliding_window": 40}, {"causal": False}], ids=["causal", "window", "full"]
)
def test_batched_merge_prefill_tiles(options: dict) -> None:
    """Split prefill tiles (several query tokens x group rows per tile) merge all their real
    rows, with windows and without the causal mask."""
    batch = make_paged_batch(
        [90, 41, 7], [5, 3, 7], num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=8, seed=8
    )
    cfg = merge_cfg(batch, 4, "batched")
    assert cfg.block_q > 1
    o, lse = run_merge(batch, cfg, **options)
    assert_matches_dense(batch, o, lse, **options)


def test_merge_sizes_for_the_split_decode_configs() -> None:
    """The batched merge's compile-time sizes at the H200 split cases (Llama-3-8B heads,
    head_dim 128): 4 real rows; B=1 x 32768 in 32 partitions (33 rounded down to a power of
    two), read at once under choose_config's budget of 128 registers, in chunks of 8 under
    the default 64; B=4 x 16384 (8 partitions) in one read; the serial merge compiles the
    v8 kernel (sizes 1)."""
    problem = AttentionProblem(
        num_q_tokens=1, num_q_heads=32, num_kv_heads=8, head_dim=128, num_blocks=10**6,
        block_size=16, num_seqs=1, max_blocks=32768 // 16 + 1,
    )  # fmt: skip
    cfg = choose_config(problem, torch.bfloat16, 132)
    assert (cfg.block_m, cfg.num_partitions, cfg.merge_reads) == (16, 32, "batched")
    sizes = attention_module._merge_constexprs
    assert sizes(True, problem, cfg, 32) == {
        "MERGE_BATCHED": True, "MERGE_ROWS": 4, "MERGE_PARTS_PAD": 32, "MERGE_CHUNK_PARTS": 32,
    }  # fmt: skip
    low = replace(cfg, merge_read_regs=64)
    assert sizes(True, problem, low, 32)["MERGE_CHUNK_PARTS"] == 8
    assert sizes(True, problem, low, 8)["MERGE_CHUNK_PARTS"] == 8
    assert sizes(False, problem, cfg, 32) == {
        "MERGE_BATCHED": False, "MERGE_ROWS": 1, "MERGE_PARTS_PAD": 1, "MERGE_CHUNK_PARTS": 1,
    }  # fmt: skip


def test_merge_reads_is_checked() -> None:
    assert AttentionConfig(block_m=16, block_q=1, tile_n=16).merge_reads == "serial"
    with pytest.raises(ValueError, match="merge_reads"):
        AttentionConfig(block_m=16, block_q=1, tile_n=16, merge_reads="parallel")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_batched_merge_long_splits(dtype: torch.dtype) -> None:
    """bf16 / fp16 / fp32 at Llama-3-8B heads: one long decode (one read of 8, chunks of 32
    and 33 -> 64 padded partitions), a ragged batch with empty partitions, against dense
    attention and the serial merge; repeated launches reuse the counters."""
    batch = make_paged_batch(
        [9000, 3, 1200, 4096], [1, 1, 1, 1], num_q_heads=32, num_kv_heads=8, head_dim=128,
        block_size=16, dtype=dtype, device="cuda", seed=77,
    )  # fmt: skip
    base = choose_config(problem_of(batch), dtype, 132)
    for parts in (8, 32, 33, 40):
        got = {}
        for merge_reads in ("serial", "batched", "batched"):
            cfg = replace(with_partitions(base, parts), fused_merge=True, merge_reads=merge_reads)
            got[merge_reads] = run_merge(batch, cfg)
        assert_matches_dense(batch, *got["batched"])
        torch.testing.assert_close(got["batched"][0], got["serial"][0], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got["batched"][1], got["serial"][1], rtol=1e-5, atol=1e-5)
