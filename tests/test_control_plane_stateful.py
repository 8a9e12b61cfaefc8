"""Random interleavings of every control-plane operation against a simple model.

The model is the client's view (each sequence's tokens and written lengths) plus a
simulated data plane: a dict from (worker, slot, layer) to the K/V "value" written there.
A token's value is the whole prefix up to and including it (real K/V depends on every
earlier token), so reading a sequence back through `attention_view` proves that its table
maps exactly its tokens, that shared and copied blocks hold the right data, and that no
block in use was ever handed to someone else. After every step: check_integrity, the
counts in stats, and that read-back for every sequence and layer.

Lookups never cross tenants: a tenant may only be served a prefix that one of its own
sequences, or a sequence made public, wrote in full on every layer.

Batches (`prepare_writes`) are all or nothing, `cancel_write` gives back exactly the
unwritten reservations, and per-tenant quotas come and go. Every block the manager reports
released (`take_released`, drained after each call) is erased from the simulated memory,
as a debug pool poisons it, before anything else runs: if a block still in use, or still
findable through the prefix index, were reported, a later read-back would catch it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from cache_service.control.block_manager import (
    BlockManager,
    BlockManagerConfig,
    CacheError,
    InvalidRequest,
    LayerNotWritten,
    PoolExhausted,
    QuotaExceeded,
    SeqRef,
    SequenceLost,
    SequenceNotFound,
)

BS = 2
LAYERS = 2
TENANTS = ("a", "b", "c")
WORKER_NAMES = ("w0", "w1", "w2", "w3")
# A tiny vocabulary makes different sequences spell the same blocks often.
tokens_st = st.lists(st.integers(0, 2), max_size=9)
tenant_st = st.sampled_from(TENANTS)
layer_st = st.one_of(st.none(), st.integers(0, LAYERS - 1))

Memory = dict[tuple[str, int, int], tuple[int, ...]]


class ReleaseTracking:
    """The manager, with `take_released` drained after every call into `on_released`."""

    def __init__(
        self, manager: BlockManager, on_released: Callable[[BlockManager, dict], None]
    ) -> None:
        self.manager = manager
        self._on_released = on_released

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.manager, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                self._on_released(self.manager, self.manager.take_released())

        return call


@dataclass
class ModelSeq:
    tenant: str
    tokens: list[int]
    written: list[int]


class ControlPlaneMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = ReleaseTracking(
            BlockManager(
                BlockManagerConfig(
                    block_size=BS,
                    num_layers=LAYERS,
                    layout_fingerprint="fp",
                    tenant_quota_blocks=10,
                    tenant_quota_sequences=5,
                )
            ),
            self.poison,
        )
        self.workers: dict[str, int] = {}
        self.memory: Memory = {}
        self.seqs: dict[str, ModelSeq] = {}
        self.lost: dict[str, str] = {}
        # owner (tenant, or None for public) -> token prefixes it may be served
        self.visible: dict[str | None, set[tuple[int, ...]]] = {}
        self.pins: dict[tuple[str, tuple[int, ...]], int] = {}
        self.pins_maybe_dropped: set[tuple[str, tuple[int, ...]]] = set()

    # ---- helpers ------------------------------------------------------------------------

    def poison(self, manager: BlockManager, released: dict[str, list[int]]) -> None:
        """What a debug pool does with released blocks; none may be findable."""
        if not released:
            return
        event("blocks released")
        records = manager.to_records()
        findable = {(e["worker_id"], e["index"]) for e in records["index"]}
        findable |= {(w["worker_id"], i) for w in records["workers"] for i in w["cached"]}
        for worker_id, blocks in released.items():
            for block in blocks:
                assert (worker_id, block) not in findable, f"{worker_id}:{block} is findable"
                for slot in range(block * BS, (block + 1) * BS):
                    for layer in range(LAYERS):
                        self.memory.pop((worker_id, slot, layer), None)

    def expect_unchanged(self, call, errors: tuple[type[CacheError], ...]) -> CacheError | None:
        """Run call; if it raises one of `errors`, the state must be as before."""
        before = self.m.to_records()
        try:
            call()
        except errors as exc:
            assert self.m.to_records() == before, f"{type(exc).__name__} changed the state"
            return exc
        return None

    def too_long(self, tokens: int) -> bool:
        """Whether one sequence of `tokens` tokens is past every block of every worker
        (refused as InvalidRequest; with no worker, the call's own error decides)."""
        cap = self.m.max_sequence_tokens()
        return cap > 0 and tokens > cap

    def note_written(self, seq: ModelSeq) -> None:
        full = min(seq.written) // BS
        prefixes = self.visible.setdefault(seq.tenant, set())
        for k in range(1, full + 1):
            prefixes.add(tuple(seq.tokens[: k * BS]))

    def check_served(self, tenant: str, prompt: list[int], served: int, cap: bool) -> None:
        limit = (len(prompt) - 1) // BS * BS if cap else len(prompt) // BS * BS
        assert served % BS == 0 and 0 <= served <= max(limit, 0)
        if served:
            prefix = tuple(prompt[:served])
            allowed = self.visible.get(tenant, set()) | self.visible.get(None, set())
            assert prefix in allowed, f"tenant {tenant} served a prefix it never could see"

    def pick(self, data: st.DataObject, pool: dict[str, object]) -> str:
        # Insertion order, not sorted: ids are random, so sorting them would make the drawn
        # choice differ between a failing run and its replay.
        return data.draw(st.sampled_from(list(pool)))

    # ---- workers ------------------------------------------------------------------------

    @initialize(sizes=st.lists(st.integers(3, 12), min_size=1, max_size=2))
    def start_workers(self, sizes: list[int]) -> None:
        for name, size in zip(WORKER_NAMES, sizes, strict=False):
            self.m.add_worker(name, size)
            self.workers[name] = size

    @precondition(lambda self: len(self.workers) < 3)
    @rule(data=st.data(), size=st.integers(1, 12))
    def add_worker(self, data: st.DataObject, size: int) -> None:
        name = data.draw(st.sampled_from([w for w in WORKER_NAMES if w not in self.workers]))
        self.m.add_worker(name, size)
        self.workers[name] = size

    @precondition(lambda self: self.workers)
    @rule(data=st.data())
    def lose_worker(self, data: st.DataObject) -> None:
        name = self.pick(data, self.workers)
        expected = {
            SeqRef(s.tenant, seq_id)
            for seq_id, s in self.seqs.items()
            if name in self.m.sequence_info(s.tenant, seq_id).workers
        }
        affected = self.m.lose_worker(name)
        assert set(affected) == expected and len(affected) == len(expected)
        if affected:
            event("lose_worker failed sequences")
        for ref in affected:
            del self.seqs[ref.seq_id]
            self.lost[ref.seq_id] = ref.tenant
        del self.workers[name]
        self.memory = {k: v for k, v in self.memory.items() if k[0] != name}
        self.pins_maybe_dropped |= set(self.pins)

    # ---- sequences ----------------------------------------------------------------------

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tenant=tenant_st, suffix=tokens_st, compute=st.booleans())
    def create_from_existing(
        self, data: st.DataObject, tenant: str, suffix: list[int], compute: bool
    ) -> None:
        """A prompt that starts like a live sequence: the way prefix hits happen."""
        seq = self.seqs[self.pick(data, self.seqs)]
        if data.draw(st.booleans()):
            tenant = seq.tenant
        prompt = seq.tokens[: data.draw(st.integers(0, len(seq.tokens)))] + suffix
        self.create(tenant, prompt, compute)

    @rule(tenant=tenant_st, prompt=st.one_of(st.none(), tokens_st), compute=st.booleans())
    def create(self, tenant: str, prompt: list[int] | None, compute: bool) -> None:
        """Create; with `compute`, also write the uncached rest of the prompt on every layer,
        as a client does."""
        if prompt and self.too_long(len(prompt)):
            error = self.expect_unchanged(
                lambda: self.m.create_sequence(tenant, prompt), (InvalidRequest,)
            )
            assert error is not None
            event("create refused: too long")
            return
        expected = self.m.lookup(tenant, prompt) if prompt else 0
        created: list = []
        error = self.expect_unchanged(
            lambda: created.append(self.m.create_sequence(tenant, prompt)),
            (PoolExhausted, QuotaExceeded),
        )
        if error is not None:
            event(f"create refused: {type(error).__name__}")
            return
        (result,) = created
        assert result.num_cached_tokens == expected
        if expected:
            event("create adopted a cached prefix")
        if prompt:
            self.check_served(tenant, prompt, expected, cap=True)
        cached = list(prompt or [])[: result.num_cached_tokens]
        self.seqs[result.seq_id] = ModelSeq(tenant, cached, [len(cached)] * LAYERS)
        rest = list(prompt or [])[len(cached) :]
        if compute and rest:
            self.do_write(result.seq_id, None, rest, False, len(rest))

    @precondition(lambda self: self.seqs)
    @rule(
        data=st.data(),
        layer=layer_st,
        new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6),
        corrupt=st.booleans(),
    )
    def write(
        self, data: st.DataObject, layer: int | None, new_tokens: list[int], corrupt: bool
    ) -> None:
        seq_id = self.pick(data, self.seqs)
        committed = data.draw(st.integers(0, len(new_tokens)))
        self.do_write(seq_id, layer, new_tokens, corrupt, committed)

    def do_write(
        self, seq_id: str, layer: int | None, new_tokens: list[int], corrupt: bool, committed: int
    ) -> None:
        """prepare_write, the simulated worker's copies and writes, commit_write."""
        seq = self.seqs[seq_id]
        layers = list(range(LAYERS)) if layer is None else [layer]
        starts = {seq.written[i] for i in layers}
        if len(starts) > 1:
            error = self.expect_unchanged(
                lambda: self.m.prepare_write(seq.tenant, seq_id, None, [0]), (InvalidRequest,)
            )
            assert error is not None
            return
        (start,) = starts
        # Positions already reserved must repeat their tokens; a corrupted one is refused.
        tokens = self.expected_tokens(seq, start, new_tokens)
        reserved_overlap = min(len(seq.tokens), start + len(tokens)) - start
        if corrupt and reserved_overlap > 0:
            bad = list(tokens)
            bad[0] = (bad[0] + 1) % 3
            error = self.expect_unchanged(
                lambda: self.m.prepare_write(seq.tenant, seq_id, layer, bad), (InvalidRequest,)
            )
            assert error is not None
            return
        end = start + len(tokens)
        if end > len(seq.tokens) and self.too_long(end):
            error = self.expect_unchanged(
                lambda: self.m.prepare_write(seq.tenant, seq_id, layer, tokens), (InvalidRequest,)
            )
            assert error is not None
            event("write refused: too long")
            return
        plans: list = []
        error = self.expect_unchanged(
            lambda: plans.append(self.m.prepare_write(seq.tenant, seq_id, layer, tokens)),
            (PoolExhausted, QuotaExceeded),
        )
        if error is not None:
            event(f"write refused: {type(error).__name__}")
            return
        (plan,) = plans
        self.run_copies(plan)
        self.write_and_commit(seq_id, layer, tokens, start, plan, committed)

    def expected_tokens(self, seq: ModelSeq, start: int, new_tokens: list[int]) -> list[int]:
        """The token ids a write at `start` must send: reserved ones repeat themselves."""
        return [
            seq.tokens[p] if p < len(seq.tokens) else new_tokens[p - start]
            for p in range(start, start + len(new_tokens))
        ]

    def run_copies(self, plan) -> None:  # type: ignore[no-untyped-def]
        """The worker runs a plan's copy-on-write copies (every layer)."""
        if plan.copies:
            event("copy-on-write")
        for copy in plan.copies:
            for offset in range(BS):
                for layer_index in range(LAYERS):
                    src = (copy.worker_id, copy.src * BS + offset, layer_index)
                    dst = (copy.worker_id, copy.dst * BS + offset, layer_index)
                    if src in self.memory:
                        self.memory[dst] = self.memory[src]
                    else:
                        self.memory.pop(dst, None)

    def write_and_commit(  # type: ignore[no-untyped-def]
        self, seq_id: str, layer: int | None, tokens: list[int], start: int, plan, committed: int
    ) -> None:
        """The worker writes the new K/V into the plan's slots; commit `committed` of them."""
        seq = self.seqs[seq_id]
        layers = list(range(LAYERS)) if layer is None else [layer]
        if len({w for w, _ in plan.slots}) > 1:
            event("write spans workers")
        assert plan.start == start and len(plan.slots) == len(tokens)
        assert len(set(plan.slots)) == len(plan.slots)
        reserved_overlap = min(len(seq.tokens), start + len(tokens)) - start
        seq.tokens.extend(tokens[max(reserved_overlap, 0) :])
        for i, (worker_id, slot) in enumerate(plan.slots):
            for layer_index in layers:
                self.memory[(worker_id, slot, layer_index)] = tuple(seq.tokens[: start + i + 1])
        self.m.commit_write(seq.tenant, seq_id, layer, committed)
        for layer_index in layers:
            seq.written[layer_index] += committed
        self.note_written(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq_id = self.pick(data, self.seqs)
        seq = self.seqs[seq_id]
        forked: list[str] = []
        error = self.expect_unchanged(
            lambda: forked.append(self.m.fork(seq.tenant, seq_id)), (QuotaExceeded,)
        )
        if error is not None:
            return
        self.seqs[forked[0]] = ModelSeq(seq.tenant, list(seq.tokens), list(seq.written))
        # Forks usually diverge at once (beam search, sampling n > 1).
        if data.draw(st.booleans()) and seq.written.count(seq.written[0]) == LAYERS:
            new_tokens = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3))
            target = forked[0] if data.draw(st.booleans()) else seq_id
            self.do_write(target, None, new_tokens, False, len(new_tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), layer=layer_st, corrupt=st.booleans())
    def write_batch(self, data: st.DataObject, layer: int | None, corrupt: bool) -> None:
        """prepare_writes for several sequences of one tenant: all or nothing. The worker
        runs every copy, then every write (as the coordinator sends them)."""
        tenant = self.seqs[self.pick(data, self.seqs)].tenant
        mine = [seq_id for seq_id, seq in self.seqs.items() if seq.tenant == tenant]
        chosen = data.draw(st.lists(st.sampled_from(mine), min_size=1, max_size=3, unique=True))
        layers = list(range(LAYERS)) if layer is None else [layer]
        batch: list[tuple[str, list[int]]] = []
        starts: list[int] = []
        invalid = False
        for seq_id in chosen:
            seq = self.seqs[seq_id]
            new_tokens = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=5))
            first = {seq.written[i] for i in layers}
            invalid |= len(first) > 1
            start = min(first)
            tokens = self.expected_tokens(seq, start, new_tokens)
            end = start + len(tokens)
            invalid |= end > len(seq.tokens) and self.too_long(end)
            batch.append((seq_id, tokens))
            starts.append(start)
        last_id, last_tokens = batch[-1]
        if corrupt and starts[-1] < len(self.seqs[last_id].tokens):
            batch[-1] = (last_id, [(last_tokens[0] + 1) % 3, *last_tokens[1:]])
            invalid = True
        plans: list = []
        error = self.expect_unchanged(
            lambda: plans.extend(self.m.prepare_writes(tenant, layer, batch)),
            (PoolExhausted, QuotaExceeded, InvalidRequest),
        )
        if invalid:
            assert error is not None  # the first failing item decides which error
            return
        if error is not None:
            assert not isinstance(error, InvalidRequest), error
            event(f"batch refused: {type(error).__name__}")
            return
        event(f"batch of {len(batch)}")
        for plan in plans:
            self.run_copies(plan)
        for (seq_id, tokens), start, plan in zip(batch, starts, plans, strict=True):
            committed = data.draw(st.integers(0, len(tokens)))
            self.write_and_commit(seq_id, layer, tokens, start, plan, committed)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """Give back the positions no layer has written."""
        seq_id = self.pick(data, self.seqs)
        seq = self.seqs[seq_id]
        result = self.m.cancel_write(seq.tenant, seq_id)
        start = max(seq.written)
        if result.start != start:
            # Only positions in the last written block, if a fork shares or published it,
            # may stay.
            event("cancel kept positions of a shared or published block")
            assert start % BS and start < result.start <= -(-start // BS) * BS
        assert result.num_tokens == len(seq.tokens) - result.start
        if result.num_tokens:
            event("cancel released positions")
        del seq.tokens[result.start :]

    @rule(
        tenant=tenant_st,
        max_blocks=st.one_of(st.none(), st.integers(1, 12)),
        max_sequences=st.one_of(st.none(), st.integers(1, 6)),
    )
    def set_quota(self, tenant: str, max_blocks: int | None, max_sequences: int | None) -> None:
        """A tenant's own limits (None: the config's); calls that would pass them are
        refused by the rules above, unchanged."""
        self.m.set_tenant_quota(tenant, max_blocks, max_sequences)

    @precondition(lambda self: self.seqs or self.lost)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        pool = {**{k: v.tenant for k, v in self.seqs.items()}, **self.lost}
        seq_id = self.pick(data, pool)
        self.m.free(pool[seq_id], seq_id)
        self.seqs.pop(seq_id, None)
        self.lost.pop(seq_id, None)

    @precondition(lambda self: self.seqs or self.lost)
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1))
    def wrong_tenant_or_lost(self, data: st.DataObject, layer: int) -> None:
        pool = {**{k: v.tenant for k, v in self.seqs.items()}, **self.lost}
        seq_id = self.pick(data, pool)
        owner = pool[seq_id]
        other = data.draw(st.sampled_from([t for t in TENANTS if t != owner]))
        error = self.expect_unchanged(
            lambda: self.m.attention_view(other, seq_id, layer), (SequenceNotFound,)
        )
        assert error is not None and str(error) == f"no sequence {seq_id!r} for this tenant"
        if seq_id in self.lost:
            error = self.expect_unchanged(
                lambda: self.m.prepare_write(owner, seq_id, None, [1]), (SequenceLost,)
            )
            assert error is not None

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def publish_public(self, data: st.DataObject) -> None:
        seq_id = self.pick(data, self.seqs)
        seq = self.seqs[seq_id]
        self.m.publish_public(seq.tenant, seq_id)
        full = min(seq.written) // BS
        public = self.visible.setdefault(None, set())
        for k in range(1, full + 1):
            public.add(tuple(seq.tokens[: k * BS]))

    # ---- prefix cache ---------------------------------------------------------------------

    @rule(tenant=tenant_st, prompt=tokens_st)
    def lookup(self, tenant: str, prompt: list[int]) -> None:
        if self.too_long(len(prompt)):
            assert self.expect_unchanged(lambda: self.m.lookup(tenant, prompt), (InvalidRequest,))
            return
        before = self.m.to_records()
        served = self.m.lookup(tenant, prompt)
        assert self.m.to_records() == before
        self.check_served(tenant, prompt, served, cap=True)

    @rule(tenant=tenant_st, prompt=tokens_st)
    def pin(self, tenant: str, prompt: list[int]) -> None:
        if self.too_long(len(prompt)):
            assert self.expect_unchanged(lambda: self.m.pin(tenant, prompt), (InvalidRequest,))
            return
        pinned = self.m.pin(tenant, prompt)
        self.check_served(tenant, prompt, pinned, cap=False)
        key = (tenant, tuple(prompt[: len(prompt) // BS * BS]))
        if pinned:
            self.pins[key] = self.pins.get(key, 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)))
        tenant, prefix = key
        error = self.expect_unchanged(lambda: self.m.unpin(tenant, list(prefix)), (InvalidRequest,))
        # Only a lost worker can take a pin away behind the model's back.
        assert error is None or key in self.pins_maybe_dropped
        self.pins[key] -= 1
        if error is not None or self.pins[key] == 0:
            del self.pins[key]
            self.pins_maybe_dropped.discard(key)

    @rule(max_blocks=st.one_of(st.none(), st.integers(0, 4)))
    def evict(self, max_blocks: int | None) -> None:
        before = self.m.stats()
        evicted = self.m.evict(max_blocks=max_blocks)
        if evicted:
            event("explicit eviction")
        after = self.m.stats()
        assert after.evictions - before.evictions == evicted
        cached_before = sum(w.cached_free for w in before.workers.values())
        expected = cached_before if max_blocks is None else min(cached_before, max_blocks)
        assert evicted == expected

    @rule()
    def snapshot_and_restore(self) -> None:
        """Continue on a manager rebuilt from a JSON round trip of the records."""
        records = self.m.to_records()
        restored = BlockManager.from_records(json.loads(json.dumps(records)))
        assert restored.to_records() == records
        self.m = ReleaseTracking(restored, self.poison)

    # ---- invariants ---------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.m.check_integrity()
        stats = self.m.stats()
        assert stats.active_sequences == len(self.seqs)
        assert stats.lost_sequences == len(self.lost)
        assert set(stats.workers) == set(self.workers)
        for worker_id, ws in stats.workers.items():
            assert ws.total == self.workers[worker_id]

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self) -> None:
        for seq_id, seq in self.seqs.items():
            info = self.m.sequence_info(seq.tenant, seq_id)
            assert list(info.token_ids) == seq.tokens
            assert list(info.written) == seq.written
            for layer in range(LAYERS):
                if seq.written[layer] == 0:
                    try:
                        self.m.attention_view(seq.tenant, seq_id, layer)
                    except LayerNotWritten:
                        continue
                    raise AssertionError("attention over an unwritten layer was allowed")
                view = self.m.attention_view(seq.tenant, seq_id, layer)
                assert view.seq_len == seq.written[layer]
                position = 0
                for segment in view.segments:
                    assert segment.start_token == position
                    for block in segment.block_indices:
                        for offset in range(BS):
                            if position < view.seq_len:
                                slot = (segment.worker_id, block * BS + offset, layer)
                                assert self.memory.get(slot) == tuple(seq.tokens[: position + 1]), (
                                    f"{seq_id} position {position} layer {layer} reads {slot}"
                                )
                            position += 1
                assert position >= view.seq_len > position - BS


ControlPlaneMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestControlPlane = ControlPlaneMachine.TestCase
