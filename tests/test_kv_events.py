"""KV events (SubscribeKvEvents) on a real server over a real port: what the prefix index
gains and loses, numbered, resumable (also across a coordinator restart on its write-ahead
log), tenant-scoped, and refused with a clear status when a request cannot be served.

The workers are in-process pools owned by the test, standing in for the detached Ray
actors that outlive a coordinator.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from service_support import LAYOUT, ServiceHarness, local_workers, service_config

from cache_service.client import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    InvalidArgumentError,
    KVCacheClient,
    KvEvent,
    block_hashes,
)
from cache_service.control.block_manager import BlockManager, BlockManagerConfig, CacheError
from cache_service.control.prefix_index import ROOT_KEY, chain_keys, encode_tokens, make_salt
from cache_service.engine.recovery import DurableBlockManager, recover
from cache_service.engine.store import MetadataStore, StoreConfig

pytestmark = pytest.mark.timeout(60)

BS = LAYOUT.block_size
TOKEN_A = "token-of-acme-0123456789"
TOKEN_B = "token-of-globex-abcdefgh"
TOKEN_OPS = "token-of-operators-1111"


# ---------------------------------------------------------------------------- helpers


def _prefill(c: KVCacheClient, tokens: list[int], seed: int = 0) -> str:
    """A sequence holding `tokens` on every layer (its full blocks get published)."""
    seq = c.create_sequence(tokens)
    n = seq.num_cached_tokens
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, len(tokens) - n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    c.append(
        seq.seq_id, tokens[n:], torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    )
    return seq.seq_id


def _newest(h: ServiceHarness) -> int:
    return h.call(lambda: h.coordinator.block_manager.events.last_released)


def _read(
    h: ServiceHarness, c: KVCacheClient, after: int = 0, **kw: Any
) -> tuple[list[KvEvent], int]:
    """The events a subscription from `after` sees up to the newest released one, and the
    subscription's position then."""
    newest = _newest(h)
    events: list[KvEvent] = []
    if newest <= after:
        return events, after
    with c.kv_events(after, timeout_s=20, **kw) as sub:
        for batch in sub.batches():
            events += batch
            if sub.position >= newest:
                break
        return events, sub.position


def _stored_hashes(events: list[KvEvent]) -> list[bytes]:
    return [h for e in events if isinstance(e.body, BlockStored) for h in e.body.hashes]


def _removed_hashes(events: list[KvEvent]) -> set[bytes]:
    return {h for e in events if isinstance(e.body, BlockRemoved) for h in e.body.hashes}


def _content(e: KvEvent) -> tuple[Any, ...]:
    """An event without its timestamp (replay stamps rebuilt events anew)."""
    return (e.sequence, e.tenant, e.public, e.namespace, e.body)


# ---------------------------------------------------------------------------- one service


def test_stored_removed_and_cleared_events_follow_the_prefix_index() -> None:
    workers = local_workers(2, 6)
    with (
        ServiceHarness(service_config(), workers=workers) as h,
        KVCacheClient(h.address, max_attempts=1) as c,
    ):
        info = c.info()
        prompt = list(range(100, 113))  # three full blocks and one token more
        seq = _prefill(c, prompt)
        events, position = _read(h, c)
        keys = block_hashes(prompt, BS, info.fingerprint, tenant="default")
        assert len(keys) == 3
        assert _stored_hashes(events) == keys
        first = next(e for e in events if isinstance(e.body, BlockStored))
        assert first.body.parent == bytes(32) and first.body.block_size == BS
        assert first.body.medium == "gpu" and first.tenant == "default" and not first.public
        assert first.body.worker_id in {"w0", "w1"}
        assert [e.sequence for e in events] == list(range(1, len(events) + 1))

        # Freed, its blocks stay cached; other prompts filling the pool evict them.
        c.free(seq)
        home = first.body.worker_id
        fillers = []
        for i in range(4):
            fillers.append(_prefill(c, list(range(1000 + 100 * i, 1000 + 100 * i + 24)), i))
            if h.stats().workers[home].cached_free == 0:
                break
        assert h.stats().workers[home].cached_free == 0, "nothing evicted the freed prompt"
        events, position = _read(h, c, position)
        assert set(keys) <= _removed_hashes(events)
        for e in events:
            if isinstance(e.body, BlockRemoved) and set(e.body.hashes) & set(keys):
                assert e.body.worker_id == home and e.tenant == "default"

        # A worker lost: one AllCleared for it.
        workers[1].kill()
        h.run(h.coordinator.check_workers())
        events, position = _read(h, c, position)
        assert [e.body for e in events if isinstance(e.body, AllCleared)] == [AllCleared("w1")]
        assert position == _newest(h)
        h.check_integrity()


def test_resuming_from_n_gets_exactly_the_events_after_n() -> None:
    with (
        ServiceHarness(service_config(), workers=local_workers(1, 32)) as h,
        KVCacheClient(h.address, max_attempts=1) as c,
    ):
        for i in range(5):
            _prefill(c, list(range(10 * i, 10 * i + 9)), i)
        everything, last = _read(h, c)
        assert [e.sequence for e in everything] == list(range(1, last + 1))
        for n in (0, 1, last // 2, last - 1):
            again, _ = _read(h, c, n)
            assert again == everything[n:], f"resuming from {n}"
        assert _read(h, c, last) == ([], last)

        # A subscription that stops mid-batch resumes from the event it stopped after.
        with c.kv_events(0, timeout_s=20) as sub:
            seen = [e for _, e in zip(range(2), sub, strict=False)]
        assert sub.position == seen[-1].sequence == 2
        again, _ = _read(h, c, sub.position)
        assert again == everything[2:]

        # only_new starts after the newest event: its first batch, at once, is empty.
        with c.kv_events(only_new=True, timeout_s=20) as sub:
            batches = sub.batches()
            assert next(batches) == [] and sub.caught_up and sub.newest_sequence == last
            _prefill(c, list(range(900, 909)), 9)
            batch = next(batches)
        assert batch and batch[0].sequence == last + 1


def test_subscriptions_are_tenant_scoped(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "tokens": {TOKEN_A: "acme", TOKEN_B: "globex", TOKEN_OPS: "ops"},
                "tenants": {"acme": {"publish_public": True}, "ops": {"admin": True}},
            }
        )
    )
    config = service_config(auth_file=str(tokens))
    with ServiceHarness(config, workers=local_workers(1, 32)) as h:
        a = KVCacheClient(h.address, token=TOKEN_A, max_attempts=1)
        b = KVCacheClient(h.address, token=TOKEN_B, max_attempts=1)
        ops = KVCacheClient(h.address, token=TOKEN_OPS, max_attempts=1)
        fingerprint = a.info().fingerprint
        prompt_a, prompt_b = list(range(9)), list(range(50, 59))
        seq_a = _prefill(a, prompt_a)
        _prefill(b, prompt_b)
        keys_a = block_hashes(prompt_a, BS, fingerprint, tenant="acme")
        keys_b = block_hashes(prompt_b, BS, fingerprint, tenant="globex")

        seen_a, pos_a = _read(h, a)
        seen_b, pos_b = _read(h, b)
        seen_ops, _ = _read(h, ops)
        assert pos_a == pos_b == _newest(h)  # both read past the other's events
        assert _stored_hashes(seen_a) == keys_a and {e.tenant for e in seen_a} == {"acme"}
        assert _stored_hashes(seen_b) == keys_b and {e.tenant for e in seen_b} == {"globex"}
        assert set(_stored_hashes(seen_ops)) == set(keys_a) | set(keys_b)

        # Public keys are everyone's.
        a.publish_public(seq_a)
        public = block_hashes(prompt_a, BS, fingerprint, tenant=None)
        more_b, _ = _read(h, b, pos_b)
        assert _stored_hashes(more_b) == public and all(e.public for e in more_b)
        for client in (a, b, ops):
            client.close()


def test_bad_requests_are_refused_with_what_was_wrong() -> None:
    config = service_config(**{"coordinator.kv_event_ring": 2})
    with (
        ServiceHarness(config, workers=local_workers(1, 32)) as h,
        KVCacheClient(h.address, max_attempts=1) as c,
    ):
        for i in range(4):
            _prefill(c, list(range(10 * i, 10 * i + 9)), i)
        newest = _newest(h)
        assert newest >= 4

        def refused(code: grpc.StatusCode, words: str, after: int = 0, **kw: Any) -> None:
            with pytest.raises(InvalidArgumentError) as caught:
                list(c.kv_events(after, timeout_s=20, **kw))
            assert caught.value.code == code, caught.value
            assert words in str(caught.value), caught.value

        refused(grpc.StatusCode.OUT_OF_RANGE, "newest event of stream", newest + 1)
        refused(grpc.StatusCode.OUT_OF_RANGE, f"the oldest kept is {newest - 1}", 1)
        refused(grpc.StatusCode.INVALID_ARGUMENT, "from_sequence must be 0", 1, only_new=True)
        refused(grpc.StatusCode.INVALID_ARGUMENT, "unknown worker_id 'w9'", worker_id="w9")
        refused(grpc.StatusCode.INVALID_ARGUMENT, "max_batch_events", max_batch_events=5000)
        with pytest.raises(ValueError, match="from_sequence"):
            c.kv_events(-1)
        # From 0 the kept events come (the ring keeps 2), and the service still serves.
        events, position = _read(h, c)
        assert [e.sequence for e in events] == [newest - 1, newest] and position == newest
        h.check_integrity()


# ---------------------------------------------------------------------------- restarts


def test_a_restarted_coordinator_continues_the_stream_without_gap_or_duplicate(
    tmp_path: Path,
) -> None:
    path = tmp_path / "meta.db"
    workers = local_workers(2, 24)
    h = ServiceHarness(service_config(store_path=str(path)), workers=workers)
    try:
        with KVCacheClient(h.address, max_attempts=1) as c:
            for i in range(4):
                _prefill(c, [100 + i] * 9, i)
            before, last = _read(h, c)
            stream = h.call(lambda: h.coordinator.block_manager.events.stream_id)
            assert {e.body.worker_id for e in before if isinstance(e.body, BlockStored)} == {
                "w0",
                "w1",
            }
    finally:
        h.workers = None  # the pools outlive the coordinator, like detached actors
        h.stop()

    workers[1].restart()  # new epoch, empty pool, while no coordinator runs
    h = ServiceHarness(service_config(store_path=str(path)), workers=workers)
    try:
        with KVCacheClient(h.address, max_attempts=1) as c:
            middle = last // 2
            with c.kv_events(middle, timeout_s=20) as sub:
                resumed: list[KvEvent] = []
                for batch in sub.batches():
                    resumed += batch
                    if sub.position >= last:
                        break
            assert sub.stream_id == stream
            assert [_content(e) for e in resumed[: last - middle]] == [
                _content(e) for e in before[middle:]
            ]
            # Recovery's own change (the restarted worker's blocks are gone) comes next.
            after, position = _read(h, c, last)
            assert [e.sequence for e in after] == list(range(last + 1, position + 1))
            assert after[0].body == AllCleared("w1")
            _prefill(c, [7] * 9, 9)
            new, newest = _read(h, c, position)
            assert [e.sequence for e in new] == list(range(position + 1, newest + 1)) and new
        h.check_integrity()
    finally:
        h.workers = workers
        h.stop()


def test_replay_after_a_checkpoint_rebuilds_the_same_numbered_events(tmp_path: Path) -> None:
    config = BlockManagerConfig(block_size=4, num_layers=1, layout_fingerprint="fp")
    store = MetadataStore(StoreConfig(str(tmp_path / "m.db"), checkpoint_every=3))
    store.begin_generation()
    durable = DurableBlockManager(BlockManager(config), store)
    durable.add_worker("w0", 8, "e0")
    for i in range(6):
        tokens = [i * 10 + t for t in range(9)]
        seq = durable.create_sequence("t", tokens).seq_id
        durable.prepare_write("t", seq, None, tokens)
        durable.commit_write("t", seq, None, len(tokens))
        durable.free("t", seq)  # cached: later prompts evict it
    events = durable.events
    assert store.latest_checkpoint() is not None and store.log_length() > 0
    assert events.last_released == events.last_sequence > 0
    kept = events.read(0, 10_000)
    assert {e.type for e in kept} == {"stored", "removed"}
    store.close()

    store = MetadataStore(StoreConfig(str(tmp_path / "m.db")))
    store.begin_generation()
    again = DurableBlockManager.from_recovery(recover(store, config), store).events
    assert again.stream_id == events.stream_id and again.last_released == events.last_released
    assert [(e.sequence, e.owner, e.body) for e in again.read(0, 10_000)] == [
        (e.sequence, e.owner, e.body) for e in kept
    ]
    store.close()


# ---------------------------------------------------------------------------- hashes


@pytest.mark.parametrize("tenant", ["default", "acme", None])
@pytest.mark.parametrize("namespace", ["", "llama-3-8b"])
def test_the_client_block_hashes_equal_the_prefix_index_keys(
    tenant: str | None, namespace: str
) -> None:
    tokens = [0, 1, 2**64 - 1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    salt = make_salt(tenant, "fp-xyz", namespace).salt
    full = len(tokens) // 4 * 4
    expected = [key for _, key, _ in chain_keys(ROOT_KEY, salt, encode_tokens(tokens[:full]), 4)]
    assert block_hashes(tokens, 4, "fp-xyz", tenant=tenant, namespace=namespace) == expected
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([-1, 0, 0, 0], 4, "fp-xyz")


# ---------------------------------------------------------------------------- the CLI


def test_kvcache_events_prints_the_kept_events_and_resumes(capsys) -> None:
    from cache_service.cli.main import main

    with (
        ServiceHarness(service_config(), workers=local_workers(1, 32)) as h,
        KVCacheClient(h.address, max_attempts=1) as c,
    ):
        prompt = list(range(300, 309))
        _prefill(c, prompt)
        key = block_hashes(prompt, BS, c.info().fingerprint)[0].hex()[:16]
        assert main(["events", "--target", h.address]) == 0
        out, err = capsys.readouterr()
        assert out.splitlines()[0].startswith(f"1 stored default w0 gpu [{key} ")
        assert "resume with --from 1" in err
        assert main(["events", "--target", h.address, "--from", "1"]) == 0
        assert capsys.readouterr().out == ""
        assert main(["events", "--target", h.address, "--from", "7"]) == 1
        assert "in the future" in capsys.readouterr().err


def test_metrics_count_published_events_and_subscribers_and_shutdown_ends_streams() -> None:
    from cache_service.client import UnavailableError

    h = ServiceHarness(service_config(), workers=local_workers(2, 32))
    try:
        registry = h.coordinator.metrics.registry

        def value(name: str, **labels: str) -> float:
            return h.call(lambda: registry.get_sample_value(name, labels)) or 0.0

        c = KVCacheClient(h.address, max_attempts=1)
        _prefill(c, list(range(9)))
        _prefill(c, list(range(40, 53)))
        events, _ = _read(h, c)
        stored = sum(e.type == "stored" for e in events)
        assert value("kvcache_kv_events_total", type="stored") == stored > 0
        assert value("kvcache_kv_events_total", type="cleared") == 0

        sub = c.kv_events(only_new=True)
        batches = sub.batches()
        assert next(batches) == []  # the stream is open
        assert value("kvcache_kv_event_subscribers") == 1
        h.run(h.service.stop(2.0))  # shutdown ends the open stream
        with pytest.raises(UnavailableError, match="shutting down"):
            next(batches)
        c.close()
    finally:
        h.loop.call_soon_threadsafe(h.loop.stop)
        h._thread.join(10)
        h.loop.close()
        for w in h.workers or []:
            w.close()


# ---------------------------------------------------------------------------- the log


@pytest.mark.parametrize("seed", range(5))
def test_replaying_the_events_rebuilds_the_prefix_index_exactly(seed: int) -> None:
    """Whatever the calls, a subscriber applying every event holds exactly the index's
    keys, each on the right worker."""
    import random

    from cache_service.control import kv_events as log

    rng = random.Random(seed)
    m = BlockManager(BlockManagerConfig(block_size=4, num_layers=1, layout_fingerprint="fp"))
    m.add_worker("w0", 12)
    m.add_worker("w1", 12)
    live: list[tuple[str, str]] = []
    for _ in range(300):
        op = rng.random()
        try:
            if op < 0.45 or not live:
                tenant = rng.choice(["t1", "t2"])
                # Few distinct prefixes, so prompts share blocks and hit the cache.
                tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
                created = m.create_sequence(tenant, tokens)
                seq = created.seq_id
                live.append((tenant, seq))
                m.prepare_write(tenant, seq, None, tokens[created.num_cached_tokens :])
                m.commit_write(tenant, seq, None, len(tokens))
            elif op < 0.75:
                m.free(*live.pop(rng.randrange(len(live))))
            elif op < 0.85:
                m.publish_public(*rng.choice(live))
            elif op < 0.95:
                m.evict(rng.randrange(4))
            else:
                worker = rng.choice(list(m.workers()))
                lost = {ref.seq_id for ref in m.lose_worker(worker)}
                for tenant, seq in [x for x in live if x[1] in lost]:
                    m.free(tenant, seq)
                live = [x for x in live if x[1] not in lost]
                m.add_worker(worker, 12)
        except CacheError:
            pass  # a full pool or quota: the call changed nothing
    view: dict[bytes, str] = {}
    events = m.events.read(0, 1_000_000)
    assert {e.type for e in events} == {"stored", "removed", "cleared"}
    for event in events:
        body = event.body
        if isinstance(body, log.BlockStored):
            for key in body.hashes:
                assert key not in view
                view[key] = body.worker_id
        elif isinstance(body, log.BlockRemoved):
            for key in body.hashes:
                assert view.pop(key) == body.worker_id
        else:
            view = {k: w for k, w in view.items() if w != body.worker_id}
    assert view == {key: e.block.worker_id for key, e in m._index.entries()}
