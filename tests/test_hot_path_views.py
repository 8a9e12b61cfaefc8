"""The append-and-attend hot path over cached block ids: `OneWorkerView` plans are the
general plans, kernel tables are built right, and the coordinator's answers stay exact
through forks (copy-on-write), frees and block reuse, and the servicer's joined spans."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from service_support import HQ, LAYOUT, dense_attention, run_coordinator

import cache_service.engine.rounds as rounds_module
from cache_service.control.types import Segment, SequenceView
from cache_service.engine.attention_plan import (
    AttentionPlanError,
    OneWorkerView,
    plan_attention,
    run_attention,
)
from cache_service.engine.coordinator import AppendAttendItem, Coordinator, JoinedFields

HKV, D, BS = LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.block_size


# -- planning ----------------------------------------------------------------------------


def _views(seq_len: int, ids: list[int]) -> tuple[OneWorkerView, SequenceView]:
    fast = OneWorkerView(seq_len, "w", np.array(ids, dtype=np.int32))
    general = SequenceView(seq_len, (Segment("w", 0, tuple(ids)),))
    return fast, general


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_one_worker_views_plan_like_segments(causal: bool, seed: int) -> None:
    rng = random.Random(seed)
    fast, general, nq = [], [], []
    for _ in range(rng.randint(1, 7)):
        seq_len = rng.randint(1, 40)
        extra = rng.randint(0, 2)  # blocks reserved past seq_len (another layer ahead)
        ids = rng.sample(range(100), -(-seq_len // BS) + extra)
        f, g = _views(seq_len, ids)
        fast.append(f)
        general.append(g)
        nq.append(rng.choice([0, 1, 1, min(seq_len, rng.randint(1, 9))]))
    a = plan_attention(fast, nq, BS, causal=causal)
    b = plan_attention(general, nq, BS, causal=causal)
    assert (a.num_rows, a.num_parts, a.causal) == (b.num_rows, b.num_parts, b.causal)
    query = torch.randn(a.num_rows, HQ, D)
    for x, y in zip(a.batches, b.batches, strict=True):
        assert x.worker_id == y.worker_id and x.rows() == y.rows()
        for ex, ey in zip(x.entries, y.entries, strict=True):
            assert list(ex.block_indices) == list(ey.block_indices)
            assert ex._replace(block_indices=()) == ey._replace(block_indices=())
        for tx, ty in zip(x.kernel_args(query), y.kernel_args(query), strict=True):
            assert tx.dtype == ty.dtype and torch.equal(tx, ty)


def test_one_worker_view_checks() -> None:
    with pytest.raises(AttentionPlanError, match="1-D int32"):
        OneWorkerView(4, "w", np.array([1], dtype=np.int64))
    with pytest.raises(AttentionPlanError, match="1-D int32"):
        OneWorkerView(4, "w", [1])  # type: ignore[arg-type]
    short, _ = _views(9, [1, 2])
    with pytest.raises(AttentionPlanError, match="covers 8 tokens"):
        plan_attention([short], [1], BS)
    fast, general = _views(6, [3, 4])
    assert fast.segments == general.segments  # the generic form, for generic consumers
    with pytest.raises(AttentionPlanError, match="num_queries"):
        plan_attention([fast], [7], BS)


def test_a_negative_block_id_is_refused_before_any_worker_is_called() -> None:
    bad = OneWorkerView(5, "w", np.array([2, -1], dtype=np.int32))
    ok, _ = _views(5, [3, 4])
    plan = plan_attention([ok, bad], [1, 1], BS)

    class NoCalls:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"worker called: {name}")

    async def main() -> None:
        with pytest.raises(AttentionPlanError, match="negative"):
            await run_attention(plan, torch.randn(2, HQ, D), 0, {"w": NoCalls()}, {"w": "e"})

    asyncio.run(main())


def test_mixed_view_kinds_build_one_table() -> None:
    fast, _ = _views(9, [7, 8, 9])
    _, general = _views(5, [1, 2])
    plan = plan_attention([fast, general], [1, 2], BS)
    _, tables, lens, starts = plan.batches[0].kernel_args(torch.randn(3, HQ, D))
    # Zero-padded to 16 columns: one kernel specialization whatever the longest row.
    assert tables.tolist() == [[7, 8, 9] + [0] * 13, [1, 2] + [0] * 14]
    assert lens.tolist() == [9, 5] and starts.tolist() == [0, 1, 3]


def test_block_tables_are_padded_to_a_multiple_of_16_columns() -> None:
    for longest in (1, 15, 16, 17, 33):
        view, _ = _views(longest * BS, list(range(longest)))
        short, _ = _views(BS, [longest])
        plan = plan_attention([view, short], [1, 1], BS)
        _, tables, _, _ = plan.batches[0].kernel_args(torch.randn(2, HQ, D))
        width = -(-longest // 16) * 16
        assert tables.shape == (2, width), longest
        assert tables[0].tolist() == list(range(longest)) + [0] * (width - longest)
        assert tables[1].tolist() == [longest] + [0] * (width - 1)


# -- the coordinator ---------------------------------------------------------------------


def run(scenario: Callable[[Coordinator], Any], blocks: int = 64) -> None:
    run_coordinator(scenario, blocks=blocks)


class History:
    """Per sequence and layer, the K/V it holds (for dense attention)."""

    def __init__(self) -> None:
        self.kv: dict[tuple[str, int], list[torch.Tensor]] = {}

    def add(self, seq_id: str, layer: int, k: torch.Tensor) -> torch.Tensor:
        self.kv.setdefault((seq_id, layer), []).append(k)
        return torch.cat(self.kv[(seq_id, layer)])

    def fork(self, parent: str, child: str) -> None:
        for (s, layer), ks in list(self.kv.items()):
            if s == parent:
                self.kv[(child, layer)] = list(ks)


async def step(
    coord: Coordinator,
    seqs: list[str],
    token: int,
    hist: History,
    gen: torch.Generator,
    *,
    joined: bool = False,
) -> None:
    """One decode step of every sequence on every layer (key = value), checked against
    dense attention."""
    for layer in range(LAYOUT.num_layers):
        k = torch.randn(len(seqs), 1, HKV, D, generator=gen)
        q = torch.randn(len(seqs), 1, HQ, D, generator=gen)
        items = [AppendAttendItem(s, [token], k[i], k[i], q[i]) for i, s in enumerate(seqs)]
        spans = JoinedFields(k.view(-1), k.view(-1), q.view(-1)) if joined else None
        results = await coord.append_attend("t", layer, items, joined=spans)
        for i, (s, res) in enumerate(zip(seqs, results, strict=True)):
            kk = hist.add(s, layer, k[i])
            ref, _ = dense_attention(q[i], kk, kk)
            assert torch.allclose(res.out.double(), ref, atol=1e-5), (s, token, layer)


def spy_views(monkeypatch: pytest.MonkeyPatch) -> list[type]:
    """The types of the views the coordinator plans with."""
    seen: list[type] = []
    real = rounds_module.plan_attention

    def spy(views: Any, *args: Any, **kwargs: Any) -> Any:
        seen.extend(type(v) for v in views)
        return real(views, *args, **kwargs)

    monkeypatch.setattr(rounds_module, "plan_attention", spy)
    return seen


@pytest.mark.parametrize("joined", [False, True])
def test_forks_copy_on_write_frees_and_reuse_stay_exact(monkeypatch, joined: bool) -> None:
    seen = spy_views(monkeypatch)

    async def scenario(coord: Coordinator) -> None:
        gen = torch.Generator().manual_seed(5)
        hist = History()
        parent = (await coord.create_sequence("t")).seq_id
        other = (await coord.create_sequence("t")).seq_id
        for token in range(6):  # parent's second block is half full
            await step(coord, [parent, other], token, hist, gen, joined=joined)
        child = (await coord.fork("t", parent)).seq_id
        hist.fork(parent, child)
        before = coord.stats().cow_copies
        for token in range(6, 15):  # both write into the shared block: copy-on-write
            await step(coord, [parent, child, other], token, hist, gen, joined=joined)
        assert coord.stats().cow_copies > before
        await coord.free("t", other)
        fresh = (await coord.create_sequence("t")).seq_id  # reuses the freed blocks
        for token in range(15, 22):
            await step(coord, [child, fresh, parent], token, hist, gen, joined=joined)
        coord.block_manager.check_integrity()

    run(scenario)
    assert seen and set(seen) == {OneWorkerView}  # the cached-ids path served every call


def test_eviction_under_pressure_stays_exact() -> None:
    async def scenario(coord: Coordinator) -> None:
        gen = torch.Generator().manual_seed(6)
        hist = History()
        for round_ in range(4):
            # Each round's sequence is freed (its full blocks stay cached) and the next
            # round's sequences take those blocks back by eviction.
            seqs = [(await coord.create_sequence("t")).seq_id for _ in range(2)]
            for token in range(9):
                await step(coord, seqs, 100 * round_ + token, hist, gen)
            for s in seqs:
                await coord.free("t", s)
        assert coord.stats().evictions > 0
        coord.block_manager.check_integrity()

    run(scenario, blocks=8)


def test_a_wrong_joined_hint_is_ignored() -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(3)]
        gen = torch.Generator().manual_seed(7)
        k = torch.randn(3, 1, HKV, D, generator=gen)
        q = torch.randn(3, 1, HQ, D, generator=gen)
        items = [AppendAttendItem(s, [1], k[i], k[i], q[i]) for i, s in enumerate(seqs)]
        wrong = JoinedFields(torch.zeros(7), k.view(-1)[1:], torch.zeros_like(q).view(-1))
        results = await coord.append_attend("t", 0, items, joined=wrong)
        for i, res in enumerate(results):
            ref, _ = dense_attention(q[i], k[i], k[i])
            assert torch.allclose(res.out.double(), ref, atol=1e-5)

    run(scenario)
