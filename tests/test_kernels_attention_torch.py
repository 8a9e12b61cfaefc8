"""The batched torch path of paged attention against the per-sequence loop reference, and
the torch backend's dispatch between them (CPU runs; the GPU-marked test checks CUDA).

``kernels.attention_torch.paged_attention_torch`` pads a chunk's sequences and computes them
together; ``kernels.reference.paged_attention_ref`` loops over sequences (the oracle). Both
compute in float32, so they agree to float32 rounding whatever the chunking: one chunk, a
sequence per chunk, or chunks cut by a budget, and whichever computes the attention itself
on CPU: the fused CPU kernel, or the matrix products that CUDA and a softcap take.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import attention_torch
from kernels.attention_torch import (
    MAX_CPU_ELEMENTS,
    attend_planned,
    padded_elements,
    paged_attention_torch,
    plan_paged_attention,
)
from kernels.cache_rows import row_index
from kernels.reference import paged_attention_ref
from kernels.testing import dense_attention, make_paged_batch
from kernels.validation import KernelArgumentError

# (seq_lens, q_lens): decode over ragged lengths around block boundaries, prefill, chunked
# prefill, sequences without rows or keys among others, one long sequence among short,
# a decode step whose rows are not one per sequence.
CASES = {
    "decode": ([1, 7, 8, 9, 43], [1, 1, 1, 1, 1]),
    "decode_one": ([30], [1]),
    "decode_with_a_rowless_sequence": ([5, 9, 12], [1, 0, 1]),
    "prefill": ([9, 15, 7], [9, 15, 7]),
    "chunked": ([1, 7, 8, 9, 43], [1, 5, 8, 3, 40]),
    "empty_rows_and_keys": ([9, 24, 2, 0, 10], [1, 0, 2, 0, 7]),
    "one_long": ([3, 200, 5, 4], [1, 3, 5, 2]),
}
OPTIONS = [
    {},
    {"causal": False},
    {"sliding_window": 5},
    {"sliding_window": 12, "causal": False},
    {"softcap": 2.5, "scale": 0.3},
]


@pytest.fixture(params=["fused", "matmul"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each of the two ways the attention itself is computed on CPU tensors."""
    if request.param == "matmul":
        monkeypatch.setattr(attention_torch, "_FLASH_CPU", None)
    return request.param


def _pair(batch, max_chunk_elements: int, **options):
    args = batch.args()
    got = paged_attention_torch(*args, max_chunk_elements=max_chunk_elements, **options)
    want = paged_attention_ref(*args, **options)
    return got, want


def _assert_close(got, want) -> None:
    (out, lse), (ref, ref_lse) = got, want
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "-".join(map(str, o.items())) or "default"
)
@pytest.mark.parametrize("budget", [1 << 26, 1], ids=["one-chunk", "chunk-per-sequence"])
def test_matches_the_loop_reference(case: str, options: dict, budget: int, cpu_path: str) -> None:
    seq_lens, q_lens = CASES[case]
    batch = make_paged_batch(
        seq_lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=8, seed=11
    )
    _assert_close(*_pair(batch, budget, **options))


@pytest.mark.parametrize("budget", [3_000, 20_000, 60_000])
def test_chunks_cut_by_the_budget_change_nothing(budget: int) -> None:
    # Lengths spread so that budgets between one sequence and all of them cut chunks of
    # different sizes; the output is the same as computed in one chunk.
    seq_lens = [1, 40, 17, 3, 64, 9, 33, 2, 50, 16]
    q_lens = [1, 4, 17, 1, 2, 9, 1, 2, 8, 16]
    batch = make_paged_batch(
        seq_lens, q_lens, num_q_heads=4, num_kv_heads=4, head_dim=8, block_size=4, seed=2
    )
    got = paged_attention_torch(*batch.args(), max_chunk_elements=budget)
    whole = paged_attention_torch(*batch.args())
    _assert_close(got, paged_attention_ref(*batch.args()))
    torch.testing.assert_close(got[0], whole[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(dtype: torch.dtype) -> None:
    batch = make_paged_batch(
        [5, 30, 17], [1, 4, 17], num_q_heads=4, num_kv_heads=1, head_dim=16, block_size=8,
        dtype=dtype, seed=4,
    )  # fmt: skip
    (out, lse), (ref, ref_lse) = _pair(batch, 1 << 26)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # Both round the float32 (float64) result to the dtype once: equal but for a rare
    # last-place difference from the order of the float32 sums.
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_table_entries_past_a_sequence_are_never_read() -> None:
    # Columns past each sequence's blocks hold -1 (make_paged_batch) or ids out of the
    # pool: the padded gather clamps them, the mask hides them.
    batch = make_paged_batch(
        [3, 25, 10], [1, 2, 3], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=8,
        spare_columns=3,
    )  # fmt: skip
    tables = batch.block_tables.clone()
    for s, n in enumerate([3, 25, 10]):
        tables[s, -(-n // 8) :] = 10_000 + s
    args = list(batch.args())
    args[3] = tables
    got = paged_attention_torch(*args)
    _assert_close(got, paged_attention_ref(*batch.args()))


def test_matches_dense_attention() -> None:
    batch = make_paged_batch(
        [12, 40, 1], [12, 3, 1], num_q_heads=6, num_kv_heads=3, head_dim=16, block_size=8,
        seed=8,
    )  # fmt: skip
    out, lse = paged_attention_torch(*batch.args(), sliding_window=7)
    ref, ref_lse = dense_attention(batch, sliding_window=7)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], atol=1e-5, rtol=1e-5)


def test_no_rows_at_all() -> None:
    batch = make_paged_batch(
        [4, 9], [0, 0], num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4
    )
    out, lse = paged_attention_torch(*batch.args())
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


@pytest.mark.parametrize("case", ["decode", "chunked", "empty_rows_and_keys"])
@pytest.mark.parametrize("budget", [1 << 26, 1], ids=["one-chunk", "chunk-per-sequence"])
def test_slots_past_a_sequence_may_hold_nan(case: str, budget: int, cpu_path: str) -> None:
    # Freed blocks are poisoned with NaN and a sequence's last block is partly written:
    # keys and values past each sequence's length must not reach its output.
    seq_lens, q_lens = CASES[case]
    batch = make_paged_batch(
        seq_lens, q_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=8, seed=5
    )
    k, v = batch.key_cache.clone(), batch.value_cache.clone()
    written = torch.zeros(k.shape[0], k.shape[2], dtype=torch.bool)  # [blocks, slots]
    for s, n in enumerate(seq_lens):
        for j in range(-(-n // 8)):
            written[int(batch.block_tables[s, j]), : min(8, n - 8 * j)] = True
    hidden = ~written[:, None, :, None].expand_as(k)
    k[hidden], v[hidden] = float("nan"), float("nan")
    args = list(batch.args())
    args[1], args[2] = k, v
    got = paged_attention_torch(*args, max_chunk_elements=budget)
    _assert_close(got, paged_attention_ref(*batch.args()))


@pytest.mark.parametrize("case", ["decode", "chunked"])
def test_a_pool_holding_every_layer(case: str, cpu_path: str) -> None:
    # The pools pass one layer of a [blocks, layers, 2, ...] tensor: dim 0 strided.
    batch = make_paged_batch(
        *CASES[case], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=3
    )
    pool = torch.randn(batch.key_cache.shape[0], 3, 2, *batch.key_cache.shape[1:])
    pool[:, 1, 0], pool[:, 1, 1] = batch.key_cache, batch.value_cache
    args = list(batch.args())
    args[1], args[2] = pool[:, 1, 0], pool[:, 1, 1]
    _assert_close(paged_attention_torch(*args), paged_attention_ref(*batch.args()))


def test_table_entries_past_a_sequence_may_name_poisoned_blocks(cpu_path: str) -> None:
    # A freed block is poisoned with NaN and may still be named past a sequence's blocks
    # (a table row reused without clearing): its keys and values must not be read.
    seq_lens, q_lens = [3, 25, 10], [1, 2, 3]
    batch = make_paged_batch(
        seq_lens, q_lens, num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=8,
        spare_blocks=1, spare_columns=2,
    )  # fmt: skip
    used = {int(b) for b in batch.block_tables.flatten() if b >= 0}
    (freed,) = set(range(batch.key_cache.shape[0])) - used
    k, v = batch.key_cache.clone(), batch.value_cache.clone()
    k[freed], v[freed] = float("nan"), float("nan")
    tables = batch.block_tables.clone()
    for s, n in enumerate(seq_lens):
        tables[s, -(-n // 8) :] = freed
    args = list(batch.args())
    args[1], args[2], args[3] = k, v, tables
    _assert_close(paged_attention_torch(*args), paged_attention_ref(*batch.args()))


def test_a_cache_whose_slots_are_not_rows(cpu_path: str) -> None:
    # A [blocks, block_size, Hkv, D] tensor seen as [blocks, Hkv, block_size, D]: a slot's
    # heads are not block_size rows apart, so the gather takes advanced indexing instead.
    batch = make_paged_batch(
        *CASES["chunked"], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=8, seed=9
    )
    args = list(batch.args())
    for i in (1, 2):
        args[i] = args[i].transpose(1, 2).contiguous().transpose(1, 2)
        assert row_index(args[i], *torch.zeros(2, 1, 1, dtype=torch.long)) is None
    _assert_close(paged_attention_torch(*args), paged_attention_ref(*batch.args()))


@pytest.mark.parametrize("options", [{}, {"causal": False, "sliding_window": 2}], ids=str)
def test_rows_before_a_sequence_may_see_no_key(options: dict, cpu_path: str) -> None:
    # More rows than keys (validation refuses it; the conventions still define it): rows at
    # negative positions see no key when causal (0 and -inf), and only keys in the window.
    batch = make_paged_batch(
        [6, 10], [6, 2], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=8, seed=7
    )
    args = list(batch.args())
    args[4] = torch.tensor([3, 10], dtype=batch.seq_lens.dtype)
    want = paged_attention_ref(*args, **options)
    if not options:
        assert torch.isinf(want[1][:3]).all() and not torch.isinf(want[1][3:]).any()
    _assert_close(paged_attention_torch(*args, **options), want)


def test_padded_elements_counts_the_padded_scores() -> None:
    # 3 sequences x 4 heads x the most rows (5) x the most keys in whole blocks (24).
    assert padded_elements(4, 8, [0, 1, 6, 8], [3, 20, 9]) == 3 * 4 * 5 * 24
    assert padded_elements(4, 8, [0], []) == 0


def _distinct_results(batch) -> tuple:
    # The two paths round differently in the last place for some rows: which one answered
    # shows in the bits (asserted here, so the dispatch tests below can fail).
    batched, loop = paged_attention_torch(*batch.args()), paged_attention_ref(*batch.args())
    assert not torch.equal(batched[0], loop[0])
    return batched, loop


def test_the_cpu_torch_backend_batches_a_small_call() -> None:
    batch = make_paged_batch(
        [40, 12, 1], [3, 12, 1], num_q_heads=6, num_kv_heads=3, head_dim=16, block_size=8,
        seed=5,
    )  # fmt: skip
    assert padded_elements(6, 8, batch.query_start_loc.tolist(), [40, 12, 1]) <= (MAX_CPU_ELEMENTS)
    batched, _ = _distinct_results(batch)
    got = kernels.paged_attention(*batch.args(), backend="torch", return_lse=True)
    assert torch.equal(got[0], batched[0]) and torch.equal(got[1], batched[1])


def test_the_cpu_torch_backend_loops_over_a_large_call() -> None:
    # One head, a prefill long enough that its padded scores exceed the budget.
    n = int(MAX_CPU_ELEMENTS**0.5) + 16
    batch = make_paged_batch(
        [n, 5], [n, 1], num_q_heads=1, num_kv_heads=1, head_dim=4, block_size=16, seed=6
    )
    assert padded_elements(1, 16, batch.query_start_loc.tolist(), [n, 5]) > MAX_CPU_ELEMENTS
    _, loop = _distinct_results(batch)
    got = kernels.paged_attention(*batch.args(), backend="torch", return_lse=True)
    assert torch.equal(got[0], loop[0]) and torch.equal(got[1], loop[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_torch_backend_batches_on_cuda() -> None:
    batch = make_paged_batch(
        [12, 40, 1], [12, 3, 1], num_q_heads=6, num_kv_heads=3, head_dim=16, block_size=8,
        device="cuda",
    )  # fmt: skip
    got = kernels.paged_attention(*batch.args(), backend="torch", return_lse=True)
    want = paged_attention_torch(*batch.args())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _assert_close(got, paged_attention_ref(*batch.args()))


@pytest.mark.parametrize("case", ["decode", "chunked"])
def test_one_plan_serves_every_layer_of_a_pool(case: str, cpu_path: str) -> None:
    # Planned once from one layer's caches, run on each layer of a pool holding several:
    # the same answer, bit for bit, as the call made on that layer alone.
    batch = make_paged_batch(
        *CASES[case], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=8, seed=4
    )
    num_blocks = batch.key_cache.shape[0]
    pool = torch.randn(num_blocks, 3, 2, 2, 8, 8, generator=torch.Generator().manual_seed(8))
    args = batch.args()
    plan = plan_paged_attention(args[0], pool[:, 0, 0], pool[:, 0, 1], *args[3:], sliding_window=6)
    for layer in range(3):
        kc, vc = pool[:, layer, 0], pool[:, layer, 1]
        got = attend_planned(plan, args[0], kc, vc, scale=0.4)
        want = paged_attention_torch(args[0], kc, vc, *args[3:], scale=0.4, sliding_window=6)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), layer
        _assert_close(
            got, paged_attention_ref(args[0], kc, vc, *args[3:], scale=0.4, sliding_window=6)
        )


def test_a_plan_refuses_queries_or_caches_of_another_geometry() -> None:
    batch = make_paged_batch(
        *CASES["decode"], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=8
    )
    args = batch.args()
    plan = plan_paged_attention(*args)
    with pytest.raises(KernelArgumentError, match="serves queries"):
        attend_planned(plan, args[0][:2], args[1], args[2])
    with pytest.raises(KernelArgumentError, match="geometry"):
        attend_planned(plan, args[0], args[1].contiguous()[:-1], args[2])
