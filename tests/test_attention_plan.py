"""Cross-worker attention: planning, per-worker batches and the exact merge of partials."""

from __future__ import annotations

import asyncio
import random
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from round_calls import attend
from workers_support import Segment, SequenceView, dense_attention, place_sequence, rel_err

from cache_service.engine.attention_plan import (
    AttentionPlan,
    AttentionPlanError,
    KernelEntry,
    LayerPages,
    WorkerWrite,
    merge_partials,
    plan_attention,
    run_attention,
)
from cache_service.engine.worker_clients import LocalWorkerClient
from cache_service.engine.worker_interface import AttentionResult
from workers.config import PoolConfig
from workers.errors import InvalidWorkerRequest
from workers.layout import KVLayout
from workers.pages import check_page_count, page_tables
from workers.pool import KVPool

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BS, dtype="float32")


def execute(plan: AttentionPlan, query: torch.Tensor, pools: dict[str, KVPool], layer: int = 0):
    """Run a plan on in-process pools (synchronously) and merge."""
    results = {}
    for batch in plan.batches:
        q, tables, lens, starts = batch.kernel_args(query)
        value = attend(
            pools[batch.worker_id],
            layer,
            q,
            tables,
            lens,
            starts,
            causal=plan.causal,
            return_lse=plan.needs_merge,
        )
        results[batch.worker_id] = (
            AttentionResult(*value) if isinstance(value, tuple) else AttentionResult(value, None)
        )
    return merge_partials(plan, results)


def make_pools(names: str, num_blocks: int = 64) -> dict[str, KVPool]:
    return {w: KVPool(LAYOUT, num_blocks, "cpu") for w in names}


def view(seq_len: int, *pieces: tuple[str, tuple[int, ...]]) -> SequenceView:
    segs, start = [], 0
    for worker, blocks in pieces:
        segs.append(Segment(worker, start, blocks))
        start += len(blocks) * BS
    return SequenceView(seq_len, tuple(segs))


# -- planning (pure) -------------------------------------------------------------------


def test_one_worker_is_one_entry_without_merge():
    v = view(10, ("a", (7, 3, 5)))
    plan = plan_attention([v], [4], BS)
    assert not plan.needs_merge
    assert plan.batches[0].entries == (KernelEntry(0, (7, 3, 5), 10, 0, 4, 0),)


def test_a_round_over_layers_names_each_sequences_layer_and_the_worker_makes_the_pages():
    # The coordinator names each sequence's layer; the page ids (block * num_layers +
    # layer, padding included) are the worker's (workers.pages).
    plan = plan_attention([view(10, ("a", (7, 3, 5))), view(4, ("a", (2,)))], [1, 1], BS)
    (batch,) = plan.batches
    _, tables, _, _ = batch.kernel_args(torch.zeros(2, 4, 16))
    layers = LayerPages(np.array([1, 0])).layers_of(batch)
    assert layers == [1, 0]
    pages = page_tables(tables, torch.tensor(layers, dtype=torch.int32), LAYOUT)
    want = tables.to(torch.int64) * 2 + torch.tensor([[1], [0]])
    assert torch.equal(pages.to(torch.int64), want)
    assert pages[0, :3].tolist() == [15, 7, 11] and pages[1, 0].item() == 4
    # The most blocks whose pages fit int32 on 32 layers, and one more: refused.
    deep = KVLayout(num_layers=32, num_kv_heads=2, head_dim=16, block_size=BS, dtype="float32")
    top = (2**31 - 1) // 32
    check_page_count(top, deep)
    with pytest.raises(InvalidWorkerRequest, match="int32 page ids"):
        check_page_count(top + 1, deep)


def test_decode_over_two_workers_splits_into_whole_and_partial_segments():
    # keys [0, 8) on a, [8, 10) on b; one query at position 9.
    v = view(10, ("a", (1, 2)), ("b", (6,)))
    plan = plan_attention([v], [1], BS)
    assert plan.num_parts == 2
    by_worker = {b.worker_id: b.entries for b in plan.batches}
    assert by_worker["a"] == (KernelEntry(0, (1, 2), 8, 0, 1, 0),)
    assert by_worker["b"] == (KernelEntry(0, (6,), 2, 0, 1, 1),)


def test_prefill_chunk_crossing_a_boundary():
    # seq_len 11, 5 queries at positions 6..10; segment a holds [0, 8), b holds [8, 11).
    v = view(11, ("a", (4, 9)), ("b", (2,)))
    plan = plan_attention([v], [5], BS)
    by_worker = {b.worker_id: b.entries for b in plan.batches}
    # Positions 6, 7 see a's keys 0..p: one entry of seq_len 8 with those 2 rows last.
    # Positions 8, 9, 10 see all of a: one single-query entry each.
    assert by_worker["a"] == (
        KernelEntry(0, (4, 9), 8, 0, 2, 0),
        KernelEntry(0, (4, 9), 8, 2, 1, 0),
        KernelEntry(0, (4, 9), 8, 3, 1, 0),
        KernelEntry(0, (4, 9), 8, 4, 1, 0),
    )
    # Positions 6, 7 see nothing of b; 8..10 see keys 8..p of b.
    assert by_worker["b"] == (KernelEntry(0, (2,), 3, 2, 3, 1),)


def test_partial_entry_uses_only_the_blocks_it_needs():
    v = view(12, ("a", (1, 2, 3)))
    # Query 0 of 3 at position 9: keys 0..11 on one worker: the whole table.
    plan = plan_attention([v], [3], BS)
    assert plan.batches[0].entries[0].block_indices == (1, 2, 3)
    v2 = view(12, ("a", (1, 2, 3)), ("b", (5,)))  # b reserved ahead: no written key there
    plan2 = plan_attention([v2], [3], BS)
    assert [b.worker_id for b in plan2.batches] == ["a"]
    assert not plan2.needs_merge


def test_non_causal_chunks_queries_to_segment_length():
    v = view(10, ("a", (1,)), ("b", (2, 3)))  # a holds 4 keys, b holds 6
    plan = plan_attention([v], [10], BS, causal=False)
    by_worker = {b.worker_id: b.entries for b in plan.batches}
    assert [(e.first_row, e.num_rows, e.seq_len) for e in by_worker["a"]] == [
        (0, 4, 4),
        (4, 4, 4),
        (8, 2, 4),
    ]
    assert [(e.first_row, e.num_rows, e.seq_len) for e in by_worker["b"]] == [(0, 6, 6), (6, 4, 6)]


def test_rows_of_several_sequences_are_consecutive():
    views = [view(5, ("a", (1, 2))), view(3, ("b", (3,))), view(9, ("a", (4, 5, 6)))]
    plan = plan_attention(views, [2, 0, 3], BS)
    assert plan.num_rows == 5
    assert plan.batches[0].rows() == [0, 1, 2, 3, 4]
    assert [e.sequence for e in plan.batches[0].entries] == [0, 2]


@pytest.mark.parametrize(
    ("views", "counts", "message"),
    [
        ([view(5, ("a", (1, 2)))], [6], "num_queries[0]"),
        ([view(5, ("a", (1, 2)))], [1, 1], "num_queries has 2 entries"),
        ([view(9, ("a", (1, 2)))], [1], "covers 8 tokens"),
        ([SequenceView(5, (Segment("a", 4, (1, 2)),))], [1], "start_token is 4"),
        ([SequenceView(5, (Segment("a", 0, (1,)), Segment("b", 4, ())))], [1], "holds no block"),
        ([view(5, ("a", (1, -2)))], [1], "block_indices"),
        ([view(-1, ("a", (1,)))], [0], "seq_len"),
    ],
)
def test_inconsistent_views_are_refused(views, counts, message):
    with pytest.raises(AttentionPlanError, match=re.escape(message)):
        plan_attention(views, counts, BS)


def test_sliding_window_is_refused_across_workers_only():
    one = view(9, ("a", (1, 2, 3)))
    assert plan_attention([one], [2], BS, sliding_window=3).batches
    two = view(9, ("a", (1, 2)), ("b", (3,)))
    with pytest.raises(AttentionPlanError, match="sliding_window"):
        plan_attention([two], [2], BS, sliding_window=3)


# -- numerics: split equals one worker and the dense oracle ------------------------------


def _run_case(pieces, n, *, hq=4, causal=True, seed=0):
    """A sequence over ``pieces`` vs. the same sequence on one pool vs. dense float64."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    total_blocks = sum(c for _, c in pieces)
    seq_len = rng.randint((total_blocks - 1) * BS + 1, total_blocks * BS)
    n = min(n, seq_len)
    k = torch.randn(seq_len, 2, 16, generator=gen)
    v = torch.randn(seq_len, 2, 16, generator=gen)
    q = torch.randn(n, hq, 16, generator=gen)
    pools = make_pools({w for w, _ in pieces} | {"one"})
    split = place_sequence(pools, pieces, k, v, rng)
    whole = place_sequence(pools, [("one", total_blocks)], k, v, rng)
    got = execute(plan_attention([split], [n], BS, causal=causal), q, pools)
    single = execute(plan_attention([whole], [n], BS, causal=causal), q, pools)
    ref_out, ref_lse = dense_attention(q, k, v, causal=causal)
    return got, single, ref_out, ref_lse


@pytest.mark.parametrize(
    ("pieces", "n"),
    [
        ([("a", 3), ("b", 2)], 1),  # decode over two workers
        ([("a", 2), ("b", 2), ("c", 3)], 1),  # three workers
        ([("a", 2), ("b", 3)], 7),  # prefill chunk crossing the boundary
        ([("a", 1), ("b", 1), ("c", 2)], 13),  # chunk crossing two boundaries
        ([("a", 2), ("b", 1), ("a", 2)], 9),  # a worker holding two runs
    ],
)
@pytest.mark.parametrize("hq", [2, 8])  # MHA and GQA (group 4)
def test_split_equals_single_worker_and_dense(pieces, n, hq):
    got, single, ref_out, ref_lse = _run_case(pieces, n, hq=hq)
    assert got.out.shape == ref_out.shape
    assert rel_err(got.out, single.out) < 1e-5
    assert rel_err(got.out, ref_out) < 1e-5
    assert torch.allclose(got.lse.double(), ref_lse, atol=1e-4)


def test_non_causal_split_equals_dense():
    got, single, ref_out, _ = _run_case([("a", 1), ("b", 2)], 11, causal=False)
    assert rel_err(got.out, ref_out) < 1e-5
    assert rel_err(got.out, single.out) < 1e-5


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    runs=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    n=st.integers(1, 20),
    hq=st.sampled_from([2, 4]),
    seed=st.integers(0, 10_000),
)
def test_any_segmentation_matches_dense(runs, n, hq, seed):
    workers = "abc"
    # Adjacent runs on different workers, as a block table's segments are.
    pieces = [(workers[i % 3], c) for i, c in enumerate(runs)]
    got, _, ref_out, _ = _run_case(pieces, n, hq=hq, seed=seed)
    assert rel_err(got.out, ref_out) < 1e-5


def test_batch_of_sequences_on_different_layouts_is_one_launch_per_worker():
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    pools = make_pools("ab")
    taken: dict[str, set[int]] = {}
    specs = [([("a", 2), ("b", 2)], 14, 1), ([("b", 3)], 10, 4), ([("a", 1), ("b", 1)], 6, 6)]
    views, counts, qs, refs = [], [], [], []
    for pieces, seq_len, n in specs:
        k, v = (
            torch.randn(seq_len, 2, 16, generator=gen),
            torch.randn(seq_len, 2, 16, generator=gen),
        )
        q = torch.randn(n, 4, 16, generator=gen)
        views.append(place_sequence(pools, pieces, k, v, rng, taken=taken))
        counts.append(n)
        qs.append(q)
        refs.append(dense_attention(q, k, v)[0])
    plan = plan_attention(views, counts, BS)
    assert sorted(b.worker_id for b in plan.batches) == ["a", "b"]
    got = execute(plan, torch.cat(qs), pools)
    assert rel_err(got.out, torch.cat(refs)) < 1e-5


def test_merge_refuses_missing_or_wrong_results():
    plan = plan_attention([view(6, ("a", (1,)), ("b", (2,)))], [2], BS)
    out = AttentionResult(torch.zeros(2, 2, 16), torch.zeros(2, 2))
    with pytest.raises(AttentionPlanError, match="no result from worker 'b'"):
        merge_partials(plan, {"a": out})
    with pytest.raises(AttentionPlanError, match="returned 1 rows"):
        merge_partials(plan, {"a": out, "b": AttentionResult(out.out[:1], out.lse[:1])})
    with pytest.raises(AttentionPlanError, match="no LSE"):
        merge_partials(plan, {"a": out, "b": AttentionResult(out.out, None)})


# -- through the async worker interface ------------------------------------------------


def test_run_attention_writes_then_attends_across_local_workers():
    """One decode step of a sequence whose last block is on another worker: the new token
    is written on b and every worker attends in the same call."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    config = PoolConfig(LAYOUT, num_blocks=32)
    clients = {w: LocalWorkerClient(w, config) for w in "ab"}
    try:
        seq_len = 10  # 9 written, the 10th arrives with the step
        k, v = (
            torch.randn(seq_len, 2, 16, generator=gen),
            torch.randn(seq_len, 2, 16, generator=gen),
        )
        q = torch.randn(1, 4, 16, generator=gen)
        pools = {w: c.worker._pool for w, c in clients.items()}
        prefix = place_sequence(pools, [("a", 2), ("b", 1)], k[:9], v[:9], rng, layer=1)
        b_block = prefix.segments[1].block_indices[0]
        full = SequenceView(seq_len, prefix.segments)
        plan = plan_attention([full], [1], BS)

        async def step():
            epochs = {w: (await c.describe()).epoch for w, c in clients.items()}
            write = WorkerWrite(torch.tensor([b_block * BS + 1]), k[9:], v[9:])
            return await run_attention(plan, q, 1, clients, epochs, writes={"b": write})

        got = asyncio.run(step())
        ref_out, _ = dense_attention(q, k, v)
        assert rel_err(got.out, ref_out) < 1e-5
    finally:
        for c in clients.values():
            c.close()


def test_with_the_block_manager_a_prefill_chunk_spilling_to_a_second_worker():
    """The real control plane places a sequence on worker a until it is full, then on b;
    a 7-token chunk written across the boundary attends exactly like dense attention."""
    from cache_service.control.block_manager import BlockManager, BlockManagerConfig

    gen = torch.Generator().manual_seed(7)
    manager = BlockManager(BlockManagerConfig(BS, LAYOUT.num_layers, LAYOUT.fingerprint()))
    config = PoolConfig(LAYOUT, num_blocks=3)
    clients = {w: LocalWorkerClient(w, config) for w in "ab"}
    for w in clients:
        manager.add_worker(w, 3)
    seq = manager.create_sequence("tenant").seq_id
    k, v = torch.randn(17, 2, 16, generator=gen), torch.randn(17, 2, 16, generator=gen)
    q = torch.randn(17, 4, 16, generator=gen)

    async def step(lo: int, hi: int):
        epochs = {w: (await c.describe()).epoch for w, c in clients.items()}
        plan = manager.prepare_write("tenant", seq, 0, list(range(lo, hi)))
        assert plan.start == lo and not plan.copies
        writes = {}
        for w in clients:
            rows = [i for i, (worker, _) in enumerate(plan.slots) if worker == w]
            if rows:
                slots = [plan.slots[i][1] for i in rows]
                idx = torch.tensor(rows) + lo
                writes[w] = WorkerWrite(slots, k[idx], v[idx])
        manager.commit_write("tenant", seq, 0, hi - lo)
        view = manager.attention_view("tenant", seq, 0)
        attention = plan_attention([view], [hi - lo], BS)
        out = await run_attention(attention, q[lo:hi], 0, clients, epochs, writes=writes)
        return view, out

    try:
        _, first = asyncio.run(step(0, 10))
        view, second = asyncio.run(step(10, 17))
        assert [s.worker_id for s in view.segments] == ["a", "b"]
        ref, _ = dense_attention(q, k, v)
        assert rel_err(first.out, ref[:10]) < 1e-5
        assert rel_err(second.out, ref[10:]) < 1e-5
    finally:
        for c in clients.values():
            c.close()


def test_run_attention_refuses_unknown_worker_before_calling():
    plan = plan_attention([view(6, ("a", (1,)), ("z", (2,)))], [1], BS)
    client = LocalWorkerClient("a", PoolConfig(LAYOUT, num_blocks=4))
    try:
        with pytest.raises(AttentionPlanError, match="'z'"):
            asyncio.run(run_attention(plan, torch.zeros(1, 2, 16), 0, {"a": client}, {"a": "x"}))
    finally:
        client.close()
