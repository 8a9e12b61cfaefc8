"""The exported pool and prefix-cache metrics equal the control plane's exact accounting.

A scripted workload runs against a real BlockManager (prefix hits, a fork with a
copy-on-write, a pin, frees, an eviction, a lost worker); the metrics are then scraped from
the real /metrics endpoint and compared with `BlockManager.stats()` and with figures worked
out by hand for this script.
"""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_service.control.block_manager import BlockManager, BlockManagerConfig
from cache_service.obs.metrics import ServiceMetrics
from workers.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
BS = LAYOUT.block_size


def scrape(metrics: ServiceMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape of the real HTTP endpoint, keyed by (name, labels)."""
    server = metrics.start_http_server("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(server.url, timeout=5) as response:
            text = response.read().decode()
    finally:
        server.stop()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def per_worker(samples: dict, name: str, **extra: str) -> dict[str, float]:
    out = {}
    for (sample, labels), v in samples.items():
        labels = dict(labels)
        if sample == name and all(labels.get(k) == x for k, x in extra.items()):
            out[labels["worker"]] = v
    return out


def write_all(bm: BlockManager, tenant: str, seq_id: str, tokens: list[int]) -> None:
    """Reserve and commit `tokens` on every layer (what a worker write would follow)."""
    plan = bm.prepare_write(tenant, seq_id, None, tokens)
    assert len(plan.slots) == len(tokens)
    bm.commit_write(tenant, seq_id, None, len(tokens))


@pytest.fixture
def workload() -> tuple[BlockManager, ServiceMetrics, dict[str, str]]:
    bm = BlockManager(BlockManagerConfig(BS, LAYOUT.num_layers, LAYOUT.fingerprint()))
    bm.add_worker("w0", 6)
    bm.add_worker("w1", 5)
    metrics = ServiceMetrics()
    metrics.bind_stats(bm.stats, bytes_per_block=LAYOUT.bytes_per_block)

    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2 tokens
    s1 = bm.create_sequence("acme", prompt).seq_id
    write_all(bm, "acme", s1, prompt)
    # Same prompt: its 2 full blocks are adopted (8 hit tokens; the last 2 are computed).
    created = bm.create_sequence("acme", prompt)
    assert created.num_cached_tokens == 8
    s2 = created.seq_id
    write_all(bm, "acme", s2, prompt[8:])
    # A fork shares the partial block; its first append copies it (copy-on-write).
    fork = bm.fork("acme", s1)
    plan = bm.prepare_write("acme", fork, None, [99])
    assert len(plan.copies) == 1
    bm.commit_write("acme", fork, None, 1)
    assert bm.pin("acme", prompt[:8]) == 8

    b1 = bm.create_sequence("beta", [501, 502, 503, 504, 505]).seq_id
    write_all(bm, "beta", b1, [501, 502, 503, 504, 505])
    b2 = bm.create_sequence("beta", list(range(601, 609))).seq_id
    write_all(bm, "beta", b2, list(range(601, 609)))
    bm.free("acme", s2)  # its private partial block becomes free
    bm.free("beta", b1)  # one published full block -> cached-free, the partial -> free
    bm.free("beta", b2)  # two published full blocks -> cached-free
    # The least recently released first: b1's block, then b2's last block.
    assert bm.evict(2) == 2
    bm.check_integrity()
    return bm, metrics, {"s1": s1, "fork": fork}


def test_scraped_values_equal_the_accounting(workload) -> None:
    bm, metrics, _ = workload
    stats = bm.stats()
    samples = scrape(metrics)

    capacity = per_worker(samples, "kvcache_pool_capacity_blocks")
    assert capacity == {"w0": 6, "w1": 5}
    for worker_id, w in stats.workers.items():
        for state in ("used", "cached_free", "free"):
            got = per_worker(samples, "kvcache_pool_blocks", state=state)[worker_id]
            assert got == getattr(w, state), (worker_id, state)
        assert per_worker(samples, "kvcache_pool_utilization_ratio")[worker_id] == w.utilization
        assert per_worker(samples, "kvcache_pool_fragmentation_ratio")[worker_id] == w.fragmentation
        assert per_worker(samples, "kvcache_pool_allocated_slots")[worker_id] == w.allocated_slots
        assert per_worker(samples, "kvcache_pool_filled_slots")[worker_id] == w.filled_slots
        assert per_worker(samples, "kvcache_kv_held_bytes")[worker_id] == (
            w.used * LAYOUT.bytes_per_block
        )
        assert per_worker(samples, "kvcache_pool_capacity_bytes")[worker_id] == (
            w.total * LAYOUT.bytes_per_block
        )
    assert samples[("kvcache_cluster_utilization_ratio", ())] == stats.utilization
    assert samples[("kvcache_cluster_fragmentation_ratio", ())] == stats.fragmentation
    for tenant in ("acme", "beta"):
        key = (("tenant", tenant),)
        assert (
            samples[("kvcache_prefix_query_tokens_total", key)]
            == (stats.prefix_query_tokens[tenant])
        )
        assert samples[("kvcache_prefix_hit_tokens_total", key)] == stats.prefix_hit_tokens[tenant]
    assert samples[("kvcache_prefix_evictions_total", ())] == stats.evictions
    assert samples[("kvcache_cow_copies_total", ())] == stats.cow_copies
    assert samples[("kvcache_pinned_blocks", ())] == stats.pinned_blocks
    assert samples[("kvcache_active_sequences", ())] == stats.active_sequences


def test_values_match_the_script_worked_out_by_hand(workload) -> None:
    """Independent of the accounting code: what this script must leave behind.

    Live: s1 = [A, B, C(2 tokens)], fork = [A, B, C'(3 tokens)]; A and B pinned.
    Cached-free: b2's first block (its second and b1's full block were evicted).
    Everything else is free (11 blocks in all).
    """
    _, metrics, _ = workload
    samples = scrape(metrics)
    used = per_worker(samples, "kvcache_pool_blocks", state="used")
    cached = per_worker(samples, "kvcache_pool_blocks", state="cached_free")
    free = per_worker(samples, "kvcache_pool_blocks", state="free")
    assert sum(used.values()) == 4
    assert sum(cached.values()) == 1
    assert sum(free.values()) == 11 - 4 - 1
    for worker_id in used:
        assert (
            used[worker_id] + cached[worker_id] + free[worker_id]
            == (per_worker(samples, "kvcache_pool_capacity_blocks")[worker_id])
        )
    # 4 used blocks = 16 slots; filled 4 + 4 + 2 + 3 = 13.
    assert samples[("kvcache_cluster_fragmentation_ratio", ())] == pytest.approx(3 / 16)
    allocated = sum(per_worker(samples, "kvcache_pool_allocated_slots").values())
    filled = sum(per_worker(samples, "kvcache_pool_filled_slots").values())
    assert (allocated, filled) == (16, 13)
    assert samples[("kvcache_cluster_utilization_ratio", ())] == pytest.approx(4 / 11)
    assert sum(per_worker(samples, "kvcache_kv_held_bytes").values()) == 4 * 512
    # acme: 10 + 10 tokens queried, 8 hit; beta: 5 + 8 queried, none hit.
    assert samples[("kvcache_prefix_query_tokens_total", (("tenant", "acme"),))] == 20
    assert samples[("kvcache_prefix_hit_tokens_total", (("tenant", "acme"),))] == 8
    assert samples[("kvcache_prefix_query_tokens_total", (("tenant", "beta"),))] == 13
    assert samples[("kvcache_prefix_hit_tokens_total", (("tenant", "beta"),))] == 0
    assert samples[("kvcache_prefix_evictions_total", ())] == 2
    assert samples[("kvcache_cow_copies_total", ())] == 1
    assert samples[("kvcache_pinned_blocks", ())] == 2
    assert samples[("kvcache_active_sequences", ())] == 2
    assert samples[("kvcache_lost_sequences_pending", ())] == 0


def test_lost_worker_leaves_the_metrics(workload) -> None:
    bm, metrics, seqs = workload
    home = bm.sequence_info("acme", seqs["s1"]).workers[0]
    lost = bm.lose_worker(home)
    assert {ref.seq_id for ref in lost} >= {seqs["s1"]}
    samples = scrape(metrics)
    assert home not in per_worker(samples, "kvcache_pool_capacity_blocks")
    assert samples[("kvcache_lost_sequences_pending", ())] == len(lost)
    assert samples[("kvcache_active_sequences", ())] == bm.stats().active_sequences
    survivors = bm.stats().workers
    assert per_worker(samples, "kvcache_pool_capacity_blocks") == {
        w: s.total for w, s in survivors.items()
    }
    # The worker returns empty: its capacity is back, all of it free.
    bm.add_worker(home, 6 if home == "w0" else 5)
    samples = scrape(metrics)
    assert (
        per_worker(samples, "kvcache_pool_blocks", state="free")[home]
        == (per_worker(samples, "kvcache_pool_capacity_blocks")[home])
    )
