"""The coordinator's append-and-attend on batches whose tensors share one buffer (what the
servicer decodes a request into) and on separate tensors: same answers, same checks.

The fast paths (one finite-check pass per buffer, rows handed on as views, one dtype
conversion per part) must give exactly what the item-by-item path gives, and the checks
must still name the bad item and change nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from service_support import HQ, LAYOUT, dense_attention, run_coordinator

from cache_service.engine.coordinator import AppendAttendItem, AttendItem, Coordinator
from cache_service.errors import InvalidRequest

HKV, D, L = LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.num_layers
B = 5


def run(scenario: Callable[[Coordinator], Any], workers: int = 1, blocks: int = 64) -> None:
    run_coordinator(scenario, workers=workers, blocks=blocks)


def packed_items(
    seq_ids: list[str], token: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor
) -> list[AppendAttendItem]:
    """Items whose key / value / query are rows of one tensor each (back to back)."""
    return [
        AppendAttendItem(s, [token], k[i : i + 1], v[i : i + 1], q[i : i + 1])
        for i, s in enumerate(seq_ids)
    ]


def separate_items(
    seq_ids: list[str], token: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor
) -> list[AppendAttendItem]:
    return [
        AppendAttendItem(
            s, [token], k[i : i + 1].clone(), v[i : i + 1].clone(), q[i : i + 1].clone()
        )
        for i, s in enumerate(seq_ids)
    ]


@pytest.mark.parametrize("make", [packed_items, separate_items])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_steps_match_dense_attention(make, dtype) -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        gen = torch.Generator().manual_seed(1)
        history: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for token in range(9):  # crosses block boundaries (block size 4)
            for layer in range(L):
                k = torch.randn(B, HKV, D, generator=gen).to(dtype)
                v = torch.randn(B, HKV, D, generator=gen).to(dtype)
                q = torch.randn(B, HQ, D, generator=gen).to(dtype)
                results = await coord.append_attend("t", layer, make(seqs, token, k, v, q))
                history.setdefault(layer, []).append((k, v))
                ks = torch.stack([x for x, _ in history[layer]], 1)  # [B, T, HKV, D]
                vs = torch.stack([y for _, y in history[layer]], 1)
                for i, res in enumerate(results):
                    assert res.out.dtype == dtype and res.out.shape == (1, HQ, D)
                    ref, _ = dense_attention(q[i : i + 1], ks[i], vs[i])
                    tol = 1e-5 if dtype == torch.float32 else 2e-2
                    assert torch.allclose(res.out.double(), ref, atol=tol), (token, layer, i)
        coord.block_manager.check_integrity()

    run(scenario)


def test_items_of_mixed_dtypes_get_their_own_dtype_back() -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(3)]
        gen = torch.Generator().manual_seed(2)
        k = torch.randn(3, 1, HKV, D, generator=gen)
        q = torch.randn(3, 1, HQ, D, generator=gen)
        dtypes = [torch.float16, torch.float32, torch.bfloat16]
        items = [
            AppendAttendItem(s, [1], k[i].to(dt), k[i].to(dt), q[i].to(dt))
            for i, (s, dt) in enumerate(zip(seqs, dtypes, strict=True))
        ]
        results = await coord.append_attend("t", 0, items)
        for i, (res, dt) in enumerate(zip(results, dtypes, strict=True)):
            assert res.out.dtype == dt
            ref, _ = dense_attention(q[i].to(dt), k[i].to(dt), k[i].to(dt))
            assert torch.allclose(res.out.double(), ref, atol=3e-2)

    run(scenario)


@pytest.mark.parametrize("field", ["key", "value", "query"])
def test_a_nan_in_a_shared_buffer_names_its_item_and_changes_nothing(field) -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        gen = torch.Generator().manual_seed(3)
        k = torch.randn(B, HKV, D, generator=gen)
        v = torch.randn(B, HKV, D, generator=gen)
        q = torch.randn(B, HQ, D, generator=gen)
        await coord.append_attend("t", 0, packed_items(seqs, 1, k, v, q))
        before = coord.stats()
        bad = {"key": k, "value": v, "query": q}[field]
        bad[3, 1, 2] = float("inf") if field == "value" else float("nan")
        with pytest.raises(InvalidRequest, match=rf"items\[3\]\.{field} contains NaN"):
            await coord.append_attend("t", 0, packed_items(seqs, 2, k, v, q))
        assert coord.stats() == before
        for s in seqs:
            assert coord.block_manager.sequence_info("t", s).written[0] == 1
        coord.block_manager.check_integrity()

    run(scenario)


def test_huge_finite_values_are_not_mistaken_for_infinities() -> None:
    """Their float32 sum overflows: the exact check must clear them."""

    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        k = torch.full((B, HKV, D), 3e38)
        q = torch.zeros(B, HQ, D)
        results = await coord.append_attend("t", 0, packed_items(seqs, 1, k, k, q))
        assert all(torch.equal(r.out, torch.full((1, HQ, D), 3e38)) for r in results)

    run(scenario)


def test_sequences_spread_over_two_workers_still_match() -> None:
    """Tiny pools: sequences spill onto the second worker, so a call has a coalescible
    part per worker and a multi-worker part, each taking a subset of the shared rows."""

    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(3)]
        gen = torch.Generator().manual_seed(4)
        history: list[list[torch.Tensor]] = [[] for _ in seqs]
        for token in range(14):
            k = torch.randn(3, HKV, D, generator=gen)
            q = torch.randn(3, HQ, D, generator=gen)
            items = packed_items(seqs, token, k, k, q)
            results = await coord.append_attend("t", 0, items)
            await coord.append_attend("t", 1, items)
            for i, res in enumerate(results):
                history[i].append(k[i])
                kk = torch.stack(history[i])
                ref, _ = dense_attention(q[i : i + 1], kk, kk)
                assert torch.allclose(res.out.double(), ref, atol=1e-5), (token, i)
        spread = [
            len({seg.worker_id for seg in coord.block_manager.attention_view("t", s, 0).segments})
            for s in seqs
        ]
        assert max(spread) == 2  # the scenario did exercise a sequence on two workers
        coord.block_manager.check_integrity()

    run(scenario, workers=2, blocks=6)


@pytest.mark.parametrize("workers", [1, 2])
def test_stacked_results_are_the_items_rows_in_order(workers: int) -> None:
    """`stacked=True` (the batch RPCs) gives every item's rows in item order as one tensor,
    equal to the per-item results, whether one part holds every item (its output handed on)
    or the items sit on two workers (one part each, concatenated); with and without LSE."""

    def rows(seqs: list[str], token: int, k: torch.Tensor, q: torch.Tensor) -> list:
        return [AppendAttendItem(s, [token], k[i], -k[i], q[i]) for i, s in enumerate(seqs)]

    async def scenario(coord: Coordinator) -> None:
        gen = torch.Generator().manual_seed(9)
        prompt = torch.randn(B, L, 1, HKV, D, generator=gen)
        twins: dict[str, list[str]] = {"per_item": [], "stacked": []}
        for seqs in twins.values():
            for i in range(B):
                # Written right away, so the next sequence's home is the emptier worker.
                seqs.append((await coord.create_sequence("t")).seq_id)
                await coord.append("t", seqs[-1], None, [0], prompt[i], -prompt[i])
        per_item, stacked = twins["per_item"], twins["stacked"]
        for token in range(1, 6):  # across a block boundary (block size 4)
            for layer in range(L):
                k = torch.randn(B, 1, HKV, D, generator=gen)
                q = torch.randn(B, 2 if token == 5 else 1, HQ, D, generator=gen)
                lse = layer == 0
                want = await coord.append_attend("t", layer, rows(per_item, token, k, q), lse)
                (got,) = await coord.append_attend(
                    "t", layer, rows(stacked, token, k, q), lse, stacked=True
                )
                assert torch.equal(got.out, torch.cat([r.out for r in want]))
                if lse:
                    assert torch.equal(got.lse, torch.cat([r.lse for r in want]))
                else:
                    assert got.lse is None
        (att,) = await coord.attend(
            "t", 0, [AttendItem(s, q[i]) for i, s in enumerate(stacked)], stacked=True
        )
        ref = await coord.attend("t", 0, [AttendItem(s, q[i]) for i, s in enumerate(per_item)])
        assert torch.equal(att.out, torch.cat([r.out for r in ref]))
        homes = {coord.block_manager.sequence_info("t", s).workers for s in stacked}
        assert len(homes) == workers  # two workers: the concatenation path ran
        coord.block_manager.check_integrity()

    run(scenario, workers=workers)
