"""Planning once per decode step: the block manager's repeatable writes and batch commit,
and the coordinator reusing one layer's plan for the step's other layers.

The reuse must be invisible: every layer's output equals dense attention, errors are the
ones the full path raises, and anything that changes a sequence between two layers of a
step (a cancelled write, a freed sequence, a lost worker, other token ids) makes the next
layer plan from scratch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from round_calls import round_form
from service_support import dense_attention, run_coordinator
from test_block_manager import unchanged

from cache_service.config import CoordinatorConfig
from cache_service.control.block_manager import BlockManager, BlockManagerConfig
from cache_service.engine.coordinator import AppendAttendItem, Coordinator, StackedAppendAttend
from cache_service.engine.errors import WorkerLost
from cache_service.engine.steps import Step, StepCache
from cache_service.engine.worker_clients import LocalWorkerClient
from cache_service.errors import InvalidRequest, SequenceLost, SequenceNotFound
from workers.config import PoolConfig
from workers.layout import KVLayout
from workers.round import Round

BS = 4
LAYERS = 3


def manager() -> BlockManager:
    m = BlockManager(BlockManagerConfig(block_size=BS, num_layers=LAYERS, layout_fingerprint="fp"))
    m.add_worker("w0", 32)
    return m


def planned(m: BlockManager, seq_ids: list[str], tokens: list[int]) -> Any:
    """A decode step's layer-0 positions reserved and its block ids read (the attention
    views), as the coordinator plans a step; returns the plans."""
    plans = m.prepare_writes("t", 0, [(s, [tok]) for s, tok in zip(seq_ids, tokens, strict=True)])
    for s, plan in zip(seq_ids, plans, strict=True):
        assert m.block_ids("t", s, -(-(plan.start + 1) // BS)) is not None
    return plans


def first_layer(m: BlockManager, seq_ids: list[str], tokens: list[int]) -> Any:
    """Layer 0 of a decode step as the coordinator runs it: plan, read the block ids,
    commit, snapshot; returns (plans, snapshot)."""
    plans = planned(m, seq_ids, tokens)
    m.commit_writes("t", 0, [(s, 1) for s in seq_ids])
    return plans, m.snapshot_writes("t", seq_ids, plans)


# ---- block manager ----------------------------------------------------------------------


def test_a_repeatable_write_gets_the_plan_prepare_write_would_give() -> None:
    m = manager()
    seqs = [m.create_sequence("t").seq_id for _ in range(3)]
    for token in range(6):  # crosses a block boundary
        tokens = [100 + token + i for i in range(3)]
        plans, snap = first_layer(m, seqs, tokens)
        assert snap is not None and snap.starts == tuple(p.start for p in plans)
        for layer in range(1, LAYERS):
            assert m.repeatable(snap, layer, tokens)
            again = m.prepare_writes(
                "t", layer, [(s, [t]) for s, t in zip(seqs, tokens, strict=True)]
            )
            assert [p.slots for p in again] == [p.slots for p in plans]
            assert all(not p.copies for p in again)
            m.commit_writes("t", layer, [(s, 1) for s in seqs])
            # Once committed, the same layer is past the snapshot's positions.
            assert not m.repeatable(snap, layer, tokens)
    m.check_integrity()


@pytest.mark.parametrize(
    "change",
    [
        "other_tokens",
        "bool_token",
        "table_changed",
        "freed",
        "worker_lost",
        "short_list",
        "bad_layer",
    ],
)
def test_anything_that_changes_the_plan_makes_a_write_unrepeatable(change: str) -> None:
    m = manager()
    seqs = [m.create_sequence("t").seq_id for _ in range(2)]
    _, snap = first_layer(m, seqs, [7, 8])
    tokens: list[Any] = [7, 8]
    layer = 1
    if change == "other_tokens":
        tokens = [7, 9]
    elif change == "bool_token":
        m2 = manager()
        s2 = [m2.create_sequence("t").seq_id]
        _, snap = first_layer(m2, s2, [1])
        assert m2.repeatable(snap, 1, [1])
        assert not m2.repeatable(snap, 1, [True])
        return
    elif change == "table_changed":
        # What a copy-on-write or a rolled-back reservation does to a table: any change
        # but growth drops its block row (cache_service.control.block_rows).
        seq = m._seqs[seqs[1]]
        seq.truncate_table(len(seq.table))
    elif change == "freed":
        m.free("t", seqs[0])
    elif change == "worker_lost":
        m.lose_worker("w0")
    elif change == "short_list":
        tokens = [7]
    elif change == "bad_layer":
        layer = LAYERS
    assert not m.repeatable(snap, layer, tokens)


def test_a_write_needing_copy_on_write_is_not_snapshotted() -> None:
    m = manager()
    seq = m.create_sequence("t").seq_id
    m.prepare_write("t", seq, None, [1, 2])
    m.commit_write("t", seq, None, 2)
    m.fork("t", seq)  # shares the half-full last block
    plans = m.prepare_writes("t", 0, [(seq, [3])])
    assert plans[0].copies
    m.block_ids("t", seq, 1)
    assert m.snapshot_writes("t", [seq], plans) is None


def test_commit_writes_is_all_or_nothing_and_names_the_write() -> None:
    m = manager()
    seqs = [m.create_sequence("t").seq_id for _ in range(2)]
    m.prepare_writes("t", 0, [(s, [1, 2]) for s in seqs])
    msg = unchanged(
        m, lambda: m.commit_writes("t", 0, [(seqs[0], 2), ("nope", 2)]), SequenceNotFound
    )
    assert "write 2 of 2" in msg
    msg = unchanged(
        m, lambda: m.commit_writes("t", 0, [(seqs[0], 2), (seqs[1], 3)]), InvalidRequest
    )
    assert "passes the 2 reserved tokens" in msg and "write 2 of 2" in msg
    msg = unchanged(
        m, lambda: m.commit_writes("t", 0, [(seqs[0], 1), (seqs[0], 1)]), InvalidRequest
    )
    assert "appears twice" in msg
    unchanged(m, lambda: m.commit_writes("other", 0, [(seqs[0], 1)]), SequenceNotFound)
    unchanged(m, lambda: m.commit_writes("t", 0, [(seqs[0], -1)]), InvalidRequest)
    unchanged(m, lambda: m.commit_writes("t", LAYERS, [(seqs[0], 1)]), InvalidRequest)
    m.commit_writes("t", 0, [(s, 2) for s in seqs])
    assert [m.sequence_info("t", s).written for s in seqs] == [(2, 0, 0)] * 2
    m.check_integrity()


def test_the_step_cache_forgets_freed_sequences_and_stays_bounded() -> None:
    m = manager()
    cache = StepCache(capacity=2)

    steps = []
    for i in range(3):
        seqs = [m.create_sequence("t").seq_id for _ in range(2)]
        _, snap = first_layer(m, seqs, [i, i])
        steps.append(Step(snap, "w0", [1, 1], [], [0, 0]))
        cache.put(steps[-1])
    assert len(cache) == 2
    assert cache.get("t", steps[0].snapshot.seq_ids) is None  # least recently used: gone
    cache.forget_sequence(steps[1].snapshot.seq_ids[1])
    assert cache.get("t", steps[1].snapshot.seq_ids) is None
    assert cache.get("t", steps[2].snapshot.seq_ids) is steps[2]
    assert cache.get("other", steps[2].snapshot.seq_ids) is None


# ---- coordinator ------------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=2, head_dim=16, block_size=BS, dtype="float32")
HKV, D, HQ = 2, 16, 4
B = 4


def run(scenario: Callable[[Coordinator], Any]) -> None:
    run_coordinator(scenario, layout=LAYOUT)


class Model:
    """Random K/V/Q per step and layer, with the dense history to check outputs against."""

    def __init__(self, seqs: list[str]) -> None:
        self.seqs = list(seqs)
        self.gen = torch.Generator().manual_seed(5)
        self.history: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def items(self, token: int, layer: int) -> tuple[list[AppendAttendItem], torch.Tensor]:
        n = len(self.seqs)
        k = torch.randn(n, 1, HKV, D, generator=self.gen)
        v = torch.randn(n, 1, HKV, D, generator=self.gen)
        q = torch.randn(n, 1, HQ, D, generator=self.gen)
        self._pending = (layer, k, v)
        items = [AppendAttendItem(s, [token], k[i], v[i], q[i]) for i, s in enumerate(self.seqs)]
        return items, q

    def check(self, results: list[Any], q: torch.Tensor) -> None:
        layer, k, v = self._pending
        for i, (s, res) in enumerate(zip(self.seqs, results, strict=True)):
            hist = self.history.setdefault((s, layer), [])
            hist.append((k[i], v[i]))
            ks = torch.cat([x for x, _ in hist])
            vs = torch.cat([y for _, y in hist])
            ref, _ = dense_attention(q[i], ks, vs)
            assert torch.allclose(res.out.double(), ref, atol=1e-5), (s, layer)


def counting(coord: Coordinator) -> list[int]:
    """Count the block manager's prepare_writes calls (the full planning path)."""
    calls = [0]
    real = coord.block_manager.prepare_writes

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    coord.block_manager.prepare_writes = wrapped  # type: ignore[method-assign]
    return calls


def test_a_decode_step_plans_once_and_every_layer_matches_dense_attention() -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        calls = counting(coord)
        steps = 7  # crosses block boundaries (block size 4)
        for token in range(steps):
            for layer in range(LAYERS):
                items, q = model.items(token, layer)
                model.check(await coord.append_attend("t", layer, items), q)
        assert calls[0] == steps  # layer 0 of each step; the other layers reused its plan
        coord.block_manager.check_integrity()
        for s in seqs:
            assert coord.block_manager.sequence_info("t", s).written == (steps,) * LAYERS

    run(scenario)


def test_a_fork_between_layers_keeps_both_sequences_exact() -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        for token in range(5):  # the last block is partly full: a fork shares it
            for layer in range(LAYERS):
                items, q = model.items(token, layer)
                model.check(await coord.append_attend("t", layer, items), q)
        items, q = model.items(5, 0)
        model.check(await coord.append_attend("t", 0, items), q)
        fork = await coord.fork("t", seqs[0])
        assert fork.num_cached_tokens == 5  # layers 1..2 have not written position 5 yet
        for layer in range(1, LAYERS):
            items, q = model.items(5, layer)
            model.check(await coord.append_attend("t", layer, items), q)
        # The fork continues over its copy of the history: layer 0 holds position 5
        # already (written before the fork), layers 1..2 do not. Position 5 sits in the
        # block both share and is reserved for both: a model computes the same K/V for
        # the same token after the same prefix, which is what the fork writes there.
        for (s, layer), hist in list(model.history.items()):
            if s == seqs[0]:
                model.history[(fork.seq_id, layer)] = list(hist[: 6 if layer == 0 else 5])
        child = Model([fork.seq_id])
        child.history = model.history
        for layer in range(1, LAYERS):
            items, q = child.items(5, layer)
            k5, v5 = model.history[(seqs[0], layer)][5]
            child._pending = (layer, k5[None], v5[None])
            items = [AppendAttendItem(fork.seq_id, [5], k5, v5, items[0].query)]
            child.check(await coord.append_attend("t", layer, items), q)
        # From position 6 on the two differ: the first to reserve it copies the block.
        for layer in range(LAYERS):
            items, q = child.items(6, layer)
            child.check(await coord.append_attend("t", layer, items), q)
        # The original, unaffected by the fork's own K/V at position 6.
        for layer in range(LAYERS):
            items, q = model.items(6, layer)
            model.check(await coord.append_attend("t", layer, items), q)
        coord.block_manager.check_integrity()

    run(scenario)


def test_other_token_ids_on_a_later_layer_get_the_full_paths_error() -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        items, _ = model.items(1, 0)
        await coord.append_attend("t", 0, items)
        items, _ = model.items(1, 1)
        items[2] = AppendAttendItem(seqs[2], [2], items[2].key, items[2].value, items[2].query)
        before = coord.block_manager.to_records()
        with pytest.raises(InvalidRequest, match=r"items\[2\]: position 0 holds token 1, got 2"):
            await coord.append_attend("t", 1, items)
        assert coord.block_manager.to_records() == before
        coord.block_manager.check_integrity()

    run(scenario)


def test_freeing_a_sequence_mid_step_forgets_its_step() -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        items, q = model.items(0, 0)
        model.check(await coord.append_attend("t", 0, items), q)
        assert len(coord._steps) == 1
        await coord.free("t", seqs[1])
        assert len(coord._steps) == 0
        model.seqs = [s for s in seqs if s != seqs[1]]
        calls = counting(coord)
        for layer in range(1, LAYERS):
            items, q = model.items(0, layer)
            model.check(await coord.append_attend("t", layer, items), q)
        assert calls[0] == 1  # a new batch: planned once, then reused
        coord.block_manager.check_integrity()

    run(scenario)


def test_another_tenant_naming_the_same_batch_does_not_reuse_the_step() -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(2)]
        model = Model(seqs)
        items, _ = model.items(0, 0)
        await coord.append_attend("t", 0, items)
        items, _ = model.items(0, 1)
        with pytest.raises(SequenceNotFound):
            await coord.append_attend("intruder", 1, items)
        assert all(coord.block_manager.sequence_info("t", s).written[1] == 0 for s in seqs)

    run(scenario)


class KeyRecorder:
    """A worker client that notes the step key of every round it passes on."""

    def __init__(self, inner: LocalWorkerClient) -> None:
        self.inner = inner
        self.keys: list[int | None] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def run_round(self, rnd: Round) -> Any:
        self.keys.append(rnd.step_key)
        return await self.inner.run_round(rnd)


def test_a_steps_later_layers_reach_the_worker_under_the_steps_key() -> None:
    # Every round of a decode step carries the key the step got when it was planned (its
    # first layer); the worker validates the step's metadata once and serves the later
    # layers from the copy it keeps under that key. A new step is a new key.
    async def main() -> list[int | None]:
        inner = LocalWorkerClient("w0", PoolConfig(LAYOUT, num_blocks=64))
        client = KeyRecorder(inner)
        coord = Coordinator(LAYOUT, [client], CoordinatorConfig(correctness_check_fraction=0.0))
        await coord.start()
        try:
            model = Model([(await coord.create_sequence("t")).seq_id for _ in range(B)])
            for token in range(3):
                hits = inner.worker.pool.metadata_hits
                for layer in range(LAYERS):
                    items, q = model.items(token, layer)
                    model.check(await coord.append_attend("t", layer, items), q)
                assert inner.worker.pool.metadata_hits - hits == LAYERS - 1
        finally:
            await coord.close()
            inner.close()
        return client.keys

    keys = asyncio.run(main())
    assert len(keys) == 3 * LAYERS and all(isinstance(k, int) for k in keys)
    per_step = [set(keys[i : i + LAYERS]) for i in range(0, len(keys), LAYERS)]
    assert all(len(s) == 1 for s in per_step)  # one key for every layer of a step
    assert len(set().union(*per_step)) == 3  # a new key each step


# ---- the stacked batch's short path (append_attend_stacked) ----------------------------


def stacked(items: list[AppendAttendItem]) -> StackedAppendAttend:
    """The items as the batch RPC's decoder hands them over: one stacked tensor a field."""
    return StackedAppendAttend(
        [it.seq_id for it in items],
        [t for it in items for t in it.token_ids],
        torch.stack([it.key for it in items]),
        torch.stack([it.value for it in items]),
        torch.stack([it.query for it in items]),
    )


def short_paths(coord: Coordinator) -> list[int]:
    """Count the calls that took the short path (a step repeated under the locks)."""
    taken = [0]
    real = coord._repeats.repeat_step

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = await real(*args, **kwargs)
        taken[0] += result is not None
        return result

    coord._repeats.repeat_step = wrapped  # type: ignore[method-assign]
    return taken


def test_stacked_batches_take_the_short_path_and_match_dense_attention() -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        calls, taken = counting(coord), short_paths(coord)
        steps = 6  # crosses block boundaries (block size 4)
        for token in range(steps):
            for layer in range(LAYERS):
                items, q = model.items(token, layer)
                res = await coord.append_attend_stacked("t", layer, stacked(items), True)
                assert res.out.shape == (B, HQ, D) and res.lse.shape == (B, HQ)
                model.check([_Row(res.out[i : i + 1]) for i in range(B)], q)
        assert calls[0] == steps  # layer 0 plans
        assert taken[0] == steps * (LAYERS - 1)  # every other layer took the short path
        coord.block_manager.check_integrity()
        for s in seqs:
            assert coord.block_manager.sequence_info("t", s).written == (steps,) * LAYERS

    run(scenario)


class _Row:
    """One sequence's rows of a stacked result, shaped as Model.check reads them."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out


def spoil(batch: StackedAppendAttend, how: str) -> StackedAppendAttend:
    if how == "nan query":
        query = batch.query.clone()
        query[2, 0, 1, 3] = float("nan")
        return batch._replace(query=query)
    if how == "inf key":
        key = batch.key.clone()
        key[1, 0, 0, 0] = float("inf")
        return batch._replace(key=key)
    assert how == "other token"
    tokens = list(batch.token_ids)
    tokens[2] = 2
    return batch._replace(token_ids=tokens)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("nan query", r"items\[2\]\.query contains NaN or infinite values"),
        ("inf key", r"items\[1\]\.key contains NaN or infinite values"),
        ("other token", r"items\[2\]: position 0 holds token 1, got 2"),
    ],
)
def test_what_the_short_path_refuses_gets_the_full_paths_error(how: str, message: str) -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        items, _ = model.items(1, 0)
        await coord.append_attend_stacked("t", 0, stacked(items))
        items, _ = model.items(1, 1)
        before = coord.block_manager.to_records()
        taken = short_paths(coord)
        with pytest.raises(InvalidRequest, match=message):
            await coord.append_attend_stacked("t", 1, spoil(stacked(items), how))
        assert taken[0] == 0
        assert coord.block_manager.to_records() == before
        coord.block_manager.check_integrity()
        # The batch as sent by a well-behaved client still goes the short way afterwards.
        items, q = model.items(1, 1)
        res = await coord.append_attend_stacked("t", 1, stacked(items))
        assert taken[0] == 1
        model.check([_Row(res.out[i : i + 1]) for i in range(B)], q)

    run(scenario)


def watch_finite_checks(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """Record how the coordinator checks rounds for NaN/inf: the parts of each round it
    checked part by part (after a worker refused it), and the rounds whose values it
    summed itself (each as its number of parts)."""
    import cache_service.engine.rounds as rounds_module

    looked_at: list[int] = []
    joined: list[int] = []
    real, real_joined = rounds_module._finite_parts, rounds_module._joined_finite

    def finite_parts(parts: list[Any]) -> list[Any]:
        looked_at.append(len(parts))
        return real(parts)

    def joined_finite(parts: list[Any], *a: Any) -> bool:
        if not all(p.finite_checked for p in parts):
            joined.append(len(parts))
        return real_joined(parts, *a)

    monkeypatch.setattr(rounds_module, "_finite_parts", finite_parts)
    monkeypatch.setattr(rounds_module, "_joined_finite", joined_finite)
    return looked_at, joined


@pytest.mark.parametrize("layers", [(1, 1, 1), (1, 2, 1)], ids=["one layer", "over pages"])
def test_a_nan_in_a_shared_round_fails_only_its_caller(monkeypatch, layers) -> None:
    # Three clients' short-path calls: the first goes to the worker alone, the other two
    # gather into one round (over pages of both layers when they are a layer apart, as
    # clients taking turns are). One of those holds a NaN: the worker's device check
    # refuses the round (nothing written), the coordinator then looks part by part, that
    # caller alone gets the full path's error and keeps nothing, and the others' outputs
    # equal dense attention. The coordinator never sums a round's values itself. Each
    # caller names host memory for its output (as a shared-memory client's slot is): the
    # shared round goes to the worker in parts (a round over layers), each part's
    # output written into its caller's memory; the refused caller's memory stays as it was.
    looked_at, joined = watch_finite_checks(monkeypatch)

    async def scenario(coord: Coordinator) -> None:
        worker = coord._clients["w0"]
        pages_checked: list[bool] = []  # check_finite of each round over pages
        parts_given: list[tuple[int, int]] = []  # query parts and output parts of each
        real_round = worker.run_round

        async def pages(rnd: Round) -> Any:
            if round_form(rnd) == "over_layers":
                pages_checked.append(rnd.check_finite)
                out = rnd.out
                parts_given.append((len(rnd.query), 0 if out is None else len(out)))
            return await real_round(rnd)

        worker.run_round = pages  # type: ignore[method-assign]
        models = [Model([(await coord.create_sequence("t")).seq_id for _ in range(B)])
                  for _ in range(3)]  # fmt: skip
        for n, m in enumerate(models):
            m.gen.manual_seed(n)
            items, q = m.items(0, 0)
            res = await coord.append_attend_stacked("t", 0, stacked(items))
            m.check([_Row(res.out[i : i + 1]) for i in range(B)], q)
        batches, queries = [], []
        for m, layer in zip(models, layers, strict=True):
            items, q = m.items(0, layer)
            batches.append(stacked(items))
            queries.append(q)
        batches[2] = spoil(batches[2], "nan query")
        before = {s: coord.block_manager.sequence_info("t", s).written for s in models[2].seqs}
        taken = short_paths(coord)
        outs = [torch.full((B, HQ, D), 7.0) for _ in models]
        results = await asyncio.gather(
            *(
                coord.append_attend_stacked("t", layer, b, out=o)
                for layer, b, o in zip(layers, batches, outs, strict=True)
            ),
            return_exceptions=True,
        )
        assert looked_at == [2]  # the shared round, once the worker refused it
        assert joined == []
        # On one layer or two, the shared round went in parts (two callers' queries and
        # outputs), checked on the device; its rerun without the refused caller is a
        # lone part on one layer.
        assert pages_checked == [True]
        assert parts_given == [(2, 2)]
        assert torch.equal(outs[2], torch.full((B, HQ, D), 7.0))
        for res, o in zip(results[:2], outs[:2], strict=True):
            assert res.out is o
        assert isinstance(results[2], InvalidRequest)
        assert "items[2].query contains NaN or infinite values" in str(results[2])
        assert taken[0] == 2
        for m, res, q in zip(models[:2], results[:2], queries[:2], strict=True):
            m.check([_Row(res.out[i : i + 1]) for i in range(B)], q)
        after = {s: coord.block_manager.sequence_info("t", s).written for s in models[2].seqs}
        assert after == before
        coord.block_manager.check_integrity()

    run(scenario)


def test_other_query_rows_on_a_later_layer_plan_afresh_and_stay_exact() -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        for token in range(4):  # three tokens written on every layer, a fourth on layer 0
            for layer in range(LAYERS if token < 3 else 1):
                items, q = model.items(token, layer)
                res = await coord.append_attend_stacked("t", layer, stacked(items))
                model.check([_Row(res.out[i : i + 1]) for i in range(B)], q)
        # Layer 1 of the same step attends with two query rows per sequence (a verifier's
        # call): the recorded step holds one, so the call takes the full path.
        items, _ = model.items(3, 1)
        gen = torch.Generator().manual_seed(9)
        q2 = torch.randn(B, 2, HQ, D, generator=gen)
        items = [it._replace(query=q2[i]) for i, it in enumerate(items)]
        taken = short_paths(coord)
        res = await coord.append_attend_stacked("t", 1, stacked(items))
        assert taken[0] == 0
        layer, k, v = model._pending
        for i, s in enumerate(seqs):
            hist = model.history.setdefault((s, layer), [])
            ks = torch.cat([x for x, _ in hist] + [k[i]])
            vs = torch.cat([y for _, y in hist] + [v[i]])
            # Query row j of the two sits at position len - 2 + j (causal).
            ref, _ = dense_attention(q2[i], ks, vs)
            assert torch.allclose(res.out[2 * i : 2 * i + 2].double(), ref, atol=1e-5)
        coord.block_manager.check_integrity()

    run(scenario)


def test_a_step_replaced_before_the_locks_are_taken_is_not_repeated() -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        items, _ = model.items(0, 0)
        await coord.append_attend_stacked("t", 0, stacked(items))
        items, _ = model.items(0, 1)
        batch = stacked(items)
        stale = coord._repeats.stacked_step("t", 1, batch)
        assert stale is not None
        # Meanwhile the next step's layer 0 replaces the recorded step.
        for layer in range(1, LAYERS):
            later, _ = model.items(0, layer)
            await coord.append_attend_stacked("t", layer, stacked(later))
        nxt, _ = model.items(1, 0)
        await coord.append_attend_stacked("t", 0, stacked(nxt))
        before = coord.block_manager.to_records()
        assert await coord._repeats.repeat_step("t", 1, stale, batch, False) is None
        assert coord.block_manager.to_records() == before
        coord.block_manager.check_integrity()

    run(scenario)


@pytest.mark.parametrize("restarted", [False, True])
def test_a_worker_lost_between_two_layers_fails_the_stacked_call_and_keeps_the_books(
    restarted: bool,
) -> None:
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        items, _ = model.items(0, 0)
        await coord.append_attend_stacked("t", 0, stacked(items))
        worker = coord._clients["w0"]
        if restarted:  # a new epoch: the coordinator learns it on the next call
            worker.restart()
        else:
            worker.kill()
        items, _ = model.items(0, 1)
        with pytest.raises((WorkerLost, SequenceLost)):
            await coord.append_attend_stacked("t", 1, stacked(items))
        coord.block_manager.check_integrity()
        # The step is not repeated afterwards: its worker is no longer the coordinator's.
        assert coord._repeats.stacked_step("t", 1, stacked(items)) is None

    run(scenario)


def test_a_bad_batch_sharing_a_round_fails_alone_and_the_others_stay_exact() -> None:
    # The short path leaves the finite check to the round: a lone recorded step's worker
    # checks on its device; a round shared by several calls is checked part by part here,
    # so one caller's NaN fails only that caller.
    async def scenario(coord: Coordinator) -> None:
        import asyncio

        groups = [[(await coord.create_sequence("t")).seq_id for _ in range(2)] for _ in range(3)]
        models = [Model(g) for g in groups]
        rounds: list[int] = []  # parts per worker round
        real = coord._rounds.run_parts

        async def counted(key: Any, parts: list[Any]) -> None:
            rounds.append(len(parts))
            await real(key, parts)

        coord._rounds.run_parts = counted  # type: ignore[method-assign]
        for model in models:  # layer 0 records each batch's step
            items, q = model.items(1, 0)
            res = await coord.append_attend_stacked("t", 0, stacked(items))
            model.check([_Row(res.out[i : i + 1]) for i in range(2)], q)
        rounds.clear()
        batches = []
        for model in models:
            items, q = model.items(1, 1)
            batches.append((stacked(items), q))
        bad = spoil(batches[1][0], "inf key")
        before = coord.block_manager.sequence_info("t", groups[1][0]).written
        results = await asyncio.gather(
            coord.append_attend_stacked("t", 1, batches[0][0]),
            coord.append_attend_stacked("t", 1, bad),
            coord.append_attend_stacked("t", 1, batches[2][0]),
            return_exceptions=True,
        )
        assert max(rounds) >= 2, rounds  # the second and third calls shared a round
        assert isinstance(results[1], InvalidRequest)
        assert "items[1].key contains NaN or infinite values" in str(results[1])
        assert coord.block_manager.sequence_info("t", groups[1][0]).written == before
        for i in (0, 2):
            models[i].check([_Row(results[i].out[j : j + 1]) for j in range(2)], batches[i][1])
        coord.block_manager.check_integrity()

    run(scenario)


def test_rounds_coalescing_the_same_steps_plan_once_and_stay_exact() -> None:
    async def scenario(coord: Coordinator) -> None:
        import asyncio

        import cache_service.engine.rounds as rounds_mod

        groups = [[(await coord.create_sequence("t")).seq_id for _ in range(2)] for _ in range(3)]
        models = [Model(g) for g in groups]
        sets: list[frozenset[str]] = []  # the sequences of each coalesced round
        real_run = coord._rounds.run_parts

        async def counted(key: Any, parts: list[Any]) -> None:
            if len(parts) > 1:
                sets.append(frozenset(s for p in parts for s in p.seq_ids))
            await real_run(key, parts)

        coord._rounds.run_parts = counted  # type: ignore[method-assign]
        planned = [0]
        real_plan = rounds_mod.plan_attention

        def counting_plan(*args: Any, **kwargs: Any) -> Any:
            planned[0] += 1
            return real_plan(*args, **kwargs)

        rounds_mod.plan_attention = counting_plan  # type: ignore[assignment]
        reused = 0  # rounds that found their set's plan
        try:
            for token in range(1, 4):
                for model in models:  # layer 0: each batch's step is recorded
                    items, q = model.items(token, 0)
                    res = await coord.append_attend_stacked("t", 0, stacked(items))
                    model.check([_Row(res.out[i : i + 1]) for i in range(2)], q)
                planned[0] = 0
                sets.clear()
                for layer in range(1, DEEP.num_layers):
                    calls = [model.items(token, layer) for model in models]
                    results = await asyncio.gather(
                        *(coord.append_attend_stacked("t", layer, stacked(it)) for it, _ in calls)
                    )
                    for model, (_, q), res in zip(models, calls, results, strict=True):
                        model.check([_Row(res.out[i : i + 1]) for i in range(2)], q)
                # One plan per distinct set of coalesced steps, not one per round.
                assert planned[0] == len(set(sets))
                reused += len(sets) - len(set(sets))
        finally:
            rounds_mod.plan_attention = real_plan  # type: ignore[assignment]
        assert reused > 0, "the same steps never coalesced twice"
        coord.block_manager.check_integrity()

    # More layers than LAYOUT's: the batcher settles after a layer or two.
    run_coordinator(scenario, layout=DEEP)


DEEP = KVLayout(num_layers=6, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype="float32")


def test_commit_repeated_commits_as_commit_writes_does_and_refuses_a_moved_layer() -> None:
    short, full = manager(), manager()
    for m in (short, full):
        for i in range(3):
            m.create_sequence("t", seq_id=f"s{i}")
    seqs = [f"s{i}" for i in range(3)]
    for token in range(6):  # crosses a block boundary
        tokens = [100 + token + i for i in range(3)]
        _, snap = first_layer(short, seqs, tokens)
        first_layer(full, seqs, tokens)
        for layer in range(1, LAYERS):
            assert short.repeatable(snap, layer, tokens)
            short.commit_repeated(snap, layer)
            full.commit_writes("t", layer, [(s, 1) for s in seqs])
            assert short.to_records() == full.to_records()
    # Committed once, a layer has moved past the snapshot: refused, nothing committed.
    before = short.to_records()
    with pytest.raises(InvalidRequest, match="not at the snapshot's"):
        short.commit_repeated(snap, 1)
    assert short.to_records() == before
    short.check_integrity()


def test_a_repeated_commit_is_logged_and_recovered(tmp_path: Any) -> None:
    from cache_service.engine.recovery import DurableBlockManager, recover
    from cache_service.engine.store import MetadataStore, StoreConfig

    config = BlockManagerConfig(block_size=BS, num_layers=LAYERS, layout_fingerprint="fp")
    path = str(tmp_path / "steps.db")
    store = MetadataStore(StoreConfig(path))
    store.begin_generation()
    durable = DurableBlockManager(BlockManager(config), store)
    durable.add_worker("w0", 32, epoch="e")
    seqs = [durable.create_sequence("t").seq_id for _ in range(2)]
    plans = durable.prepare_writes("t", 0, [(s, [7]) for s in seqs])
    for s, plan in zip(seqs, plans, strict=True):
        durable.block_ids("t", s, -(-(plan.start + 1) // BS))
    durable.commit_writes("t", 0, [(s, 1) for s in seqs])
    snap = durable.snapshot_writes("t", seqs, plans)
    for layer in range(1, LAYERS):
        assert durable.repeatable(snap, layer, [7, 7])
        durable.commit_repeated(snap, layer)
    records = durable.to_records()
    store.close()
    store = MetadataStore(StoreConfig(path))
    store.begin_generation()
    assert recover(store, config).manager.to_records() == records
    store.close()


def test_commit_repeated_layers_commits_as_commit_repeated_does_all_or_nothing() -> None:
    # A step lease's end commits the layers it wrote in one call: the state of a
    # commit_repeated per layer; a layer named twice or one that moved commits none.
    one, many = manager(), manager()
    for m in (one, many):
        for i in range(3):
            m.create_sequence("t", seq_id=f"s{i}")
    seqs = [f"s{i}" for i in range(3)]
    for token in range(6):  # crosses a block boundary (published blocks, events)
        tokens = [100 + token + i for i in range(3)]
        _, snap = first_layer(one, seqs, tokens)
        _, many_snap = first_layer(many, seqs, tokens)
        for layer in range(1, LAYERS):
            one.commit_repeated(snap, layer)
        many.commit_repeated_layers(many_snap, range(1, LAYERS))
        assert one.to_records() == many.to_records()
    tokens = [200 + i for i in range(3)]
    _, snap = first_layer(many, seqs, tokens)
    many.commit_repeated(snap, 2)
    before = many.to_records()
    with pytest.raises(InvalidRequest, match="layer 2 of 's0' stands at"):
        many.commit_repeated_layers(snap, [1, 2])
    with pytest.raises(InvalidRequest, match="committed once"):
        many.commit_repeated_layers(snap, [1, 1])
    assert many.to_records() == before
    many.check_integrity()


def test_a_step_planned_for_a_lease_commits_every_layer_at_once_or_none() -> None:
    # A step planned for a lease reserves layer 0's positions without committing them;
    # its end commits every layer in one call: the state per-layer commits leave, the
    # repeatable layers being all of them; a sequence one of whose layers moved meanwhile
    # makes the call refuse, naming it, with nothing committed.
    one, many = manager(), manager()
    for m in (one, many):
        for i in range(3):
            m.create_sequence("t", seq_id=f"s{i}")
    seqs = [f"s{i}" for i in range(3)]
    for token in range(6):  # crosses a block boundary
        snaps = []
        for m in (one, many):
            snaps.append(
                m.snapshot_writes("t", seqs, planned(m, seqs, [300 + token + i for i in range(3)]))
            )
        assert many.repeatable_layers(snaps[1]) == list(range(LAYERS))
        for layer in range(LAYERS):
            one.commit_repeated(snaps[0], layer)
        many.commit_repeated_layers(snaps[1], range(LAYERS))
        assert one.to_records() == many.to_records()
    snap = many.snapshot_writes("t", seqs, planned(many, seqs, [400 + i for i in range(3)]))
    many.commit_repeated(snap, 1)
    assert many.repeatable_layers(snap) == [layer for layer in range(LAYERS) if layer != 1]
    before = many.to_records()
    with pytest.raises(InvalidRequest, match="layer 1 of 's0' stands at"):
        many.commit_repeated_layers(snap, range(LAYERS))
    assert many.to_records() == before
    many.check_integrity()


def test_repeated_layers_are_logged_in_one_commit_and_recovered(tmp_path: Any) -> None:
    from cache_service.engine.recovery import DurableBlockManager, recover
    from cache_service.engine.store import MetadataStore, StoreConfig

    config = BlockManagerConfig(block_size=BS, num_layers=LAYERS, layout_fingerprint="fp")
    path = str(tmp_path / "steps.db")
    store = MetadataStore(StoreConfig(path))
    store.begin_generation()
    durable = DurableBlockManager(BlockManager(config), store)
    durable.add_worker("w0", 32, epoch="e")
    seqs = [durable.create_sequence("t").seq_id for _ in range(2)]
    plans = durable.prepare_writes("t", 0, [(s, [7]) for s in seqs])
    for s, plan in zip(seqs, plans, strict=True):
        durable.block_ids("t", s, -(-(plan.start + 1) // BS))
    durable.commit_writes("t", 0, [(s, 1) for s in seqs])
    snap = durable.snapshot_writes("t", seqs, plans)
    lsn = store.last_lsn()
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    durable.commit_repeated_layers(snap, range(1, LAYERS))
    store._db.set_trace_callback(None)
    assert statements.count("COMMIT") == 1
    logged = list(store.records_after(lsn))
    assert [(r.op, r.args["layer"]) for r in logged] == [
        ("commit_writes", layer) for layer in range(1, LAYERS)
    ]
    assert all(r.args["writes"] == [[s, 1] for s in seqs] for r in logged)
    records = durable.to_records()
    store.close()
    store = MetadataStore(StoreConfig(path))
    store.begin_generation()
    assert recover(store, config).manager.to_records() == records
    store.close()


def test_repeat_now_answers_a_repeated_layer_from_a_callback() -> None:
    # A local session's repeated layer goes without a task: submitted at once, answered by
    # the round's callback, equal to dense attention, committed like the short path.
    # Anything it does not take (a sequence's lock held, another step) changes nothing.
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        items, q = model.items(0, 0)
        await coord.append_attend_stacked("t", 0, stacked(items), True)  # plans the step
        items, q = model.items(0, 1)
        batch = stacked(items)
        order = sorted(seqs)
        assert coord._locks.try_acquire(order[:1])  # another call holds one sequence
        done: list[Any] = []
        assert not coord.repeat_now("t", 1, batch, True, None, None, 7, done.append)
        coord._locks.release(order[:1])
        assert coord.block_manager.sequence_info("t", seqs[0]).written == (1, 0, 0)
        assert coord.repeat_now("t", 1, batch, True, None, None, 7, done.append)
        assert done == []  # answered later, from the round's callback
        while not done:
            await asyncio.sleep(0)
        (res,) = done
        model.check([_Row(res.out[i : i + 1]) for i in range(B)], q)
        assert not any(coord._locks.held(s) for s in seqs)
        for s in seqs:
            assert coord.block_manager.sequence_info("t", s).written == (1, 1, 0)
        # The same layer again is not a repeat (already written): not taken.
        assert not coord.repeat_now("t", 1, batch, True, None, None, 7, done.append)
        coord.block_manager.check_integrity()

    run(scenario)


@pytest.mark.parametrize("path", ["full", "short", "callback"])
def test_a_failure_making_the_answer_keeps_no_write(monkeypatch, path: str) -> None:
    # The answer (the output in the query's dtype) is made before the commit on every
    # path: a failure there (a cast out of memory, here injected) fails the call and
    # keeps none of its writes; the same call then succeeds, equal to dense attention.
    import cache_service.engine.coordinator as coordinator_mod
    import cache_service.engine.step_repeats as step_repeats_mod

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("an injected failure making the answer")

    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        layer = 0 if path == "full" else 1
        if layer:
            items, q = model.items(0, 0)
            res = await coord.append_attend_stacked("t", 0, stacked(items), True)
            model.check([_Row(res.out[i : i + 1]) for i in range(B)], q)
        before = [coord.block_manager.sequence_info("t", s).written for s in seqs]
        items, q = model.items(0, layer)
        batch = stacked(items)
        with monkeypatch.context() as patched:
            if path == "full":
                patched.setattr(coordinator_mod, "stacked_result", fail)
            else:
                patched.setattr(step_repeats_mod, "repeat_answer", fail)
            if path == "callback":
                done: list[Any] = []
                assert coord.repeat_now("t", layer, batch, True, None, None, 7, done.append)
                while not done:
                    await asyncio.sleep(0)
                assert isinstance(done[0], MemoryError)
            else:
                with pytest.raises(MemoryError):
                    await coord.append_attend_stacked("t", layer, batch, True)
        assert [coord.block_manager.sequence_info("t", s).written for s in seqs] == before
        assert not any(coord._locks.held(s) for s in seqs)
        coord.block_manager.check_integrity()
        res = await coord.append_attend_stacked("t", layer, batch, True)
        model.check([_Row(res.out[i : i + 1]) for i in range(B)], q)
        for s, was in zip(seqs, before, strict=True):
            written = list(was)
            written[layer] += 1
            assert coord.block_manager.sequence_info("t", s).written == tuple(written)
        coord.block_manager.check_integrity()

    run(scenario)


def test_a_commit_failing_on_a_later_write_keeps_none_of_the_calls_writes(monkeypatch) -> None:
    # The full path commits a call's writes all or nothing: a failure checking its second
    # write (injected) leaves the first uncommitted too, and the same call then succeeds.
    async def scenario(coord: Coordinator) -> None:
        seqs = [(await coord.create_sequence("t")).seq_id for _ in range(B)]
        model = Model(seqs)
        items, q = model.items(0, 0)
        real = coord.block_manager._committed_length
        seen: list[int] = []

        def second_fails(*args: Any) -> int:
            seen.append(1)
            if len(seen) == 2:
                raise InvalidRequest("an injected failure checking the second write")
            return real(*args)

        with monkeypatch.context() as patched:
            patched.setattr(coord.block_manager, "_committed_length", second_fails)
            with pytest.raises(InvalidRequest, match="injected"):
                await coord.append_attend("t", 0, items, True)
        for s in seqs:
            assert coord.block_manager.sequence_info("t", s).written == (0,) * LAYERS
        assert not any(coord._locks.held(s) for s in seqs)
        coord.block_manager.check_integrity()
        results = await coord.append_attend("t", 0, items, True)
        model.check(results, q)
        for s in seqs:
            assert coord.block_manager.sequence_info("t", s).written == (1, 0, 0)
        coord.block_manager.check_integrity()

    run(scenario)
