"""The host tier through a real service (real gRPC port, real in-process PoolWorkers on
CPU): a prefix workload four times the GPU pool keeps its hit rate with the tier and loses
it without; attention through restored blocks equals dense attention; a lost worker's
host entries are never served; the control plane's accounting stays exact."""

from __future__ import annotations

import random
import time

import pytest
import torch
from service_support import HQ, LAYOUT, Mirror, ServiceHarness, service_config

from cache_service.client import AttendItem, DataLossError, KVCacheClient
from cache_service.engine.worker_clients import LocalWorkerClient
from workers.config import PoolConfig
from workers.errors import InvalidWorkerRequest

BS, NL, HKV, D = LAYOUT.block_size, LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
GPU_BLOCKS = 8
PREFIX_BLOCKS = 2
# Distinct shared prefixes whose blocks are 4x the GPU pool (the workload).
NUM_PREFIXES = 4 * GPU_BLOCKS // PREFIX_BLOCKS


def token_kv(layer: int, tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of `tokens` at positions start.. on `layer`, ``[n, Hkv, D]`` float32: a function
    of (layer, token, position) only, as a model's would be for a shared prefix."""
    ids = torch.tensor(tokens, dtype=torch.float64)[:, None, None]
    pos = torch.arange(start, start + len(tokens), dtype=torch.float64)[:, None, None]
    ch = torch.arange(HKV * D, dtype=torch.float64).view(1, HKV, D)
    k = torch.sin(0.37 * ids + 0.11 * pos + 0.013 * ch + layer)
    v = torch.cos(0.23 * ids - 0.07 * pos + 0.017 * ch + 2 * layer)
    return k.float(), v.float()


def all_layers(tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [token_kv(layer, tokens, start) for layer in range(NL)]
    return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])


def prefix(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(PREFIX_BLOCKS * BS)]


def serve_request(client: KVCacheClient, tokens: list[int]) -> tuple[str, int]:
    """Create a sequence for `tokens`, prefill what was not cached; (seq_id, cached)."""
    handle = client.create_sequence(tokens)
    cached = handle.num_cached_tokens
    rest = tokens[cached:]
    k, v = all_layers(rest, cached)
    client.append(handle.seq_id, rest, k, v)
    return handle.seq_id, cached


def hit_rate(gpu_blocks: int, host_blocks: int, requests: int, seed: int) -> float:
    """Prefix hit rate (cached prefix tokens / prefix tokens) of `requests` random
    requests over NUM_PREFIXES prefixes, after each prefix was computed once."""
    config = service_config(
        **{
            "workers.num_workers": 1,
            "workers.blocks_per_worker": gpu_blocks,
            "workers.host_tier_blocks": host_blocks,
        }
    )
    svc = ServiceHarness(config)
    rng = random.Random(seed)
    try:
        with KVCacheClient(svc.address, timeout_s=60) as client:
            for i in range(NUM_PREFIXES):
                seq_id, _ = serve_request(client, [*prefix(i), 7])
                client.free(seq_id)
            hits = 0
            for r in range(requests):
                seq_id, cached = serve_request(client, [*prefix(rng.randrange(NUM_PREFIXES)), r])
                hits += cached
                client.free(seq_id)
        svc.call(svc.coordinator.block_manager.check_integrity)
        stats = svc.call(svc.coordinator.block_manager.stats)
        if host_blocks:
            assert stats.host_hit_tokens > 0
        else:
            assert stats.host_hit_tokens == 0
    finally:
        svc.stop()
    return hits / (requests * PREFIX_BLOCKS * BS)


def test_a_workload_four_times_the_pool_keeps_its_hit_rate_with_the_host_tier() -> None:
    requests, seed = 60, 37
    # Unbounded: every prefix (and each request's own tail block) fits on the GPU.
    unbounded = hit_rate(NUM_PREFIXES * PREFIX_BLOCKS + 2 * GPU_BLOCKS, 0, requests, seed)
    tiered = hit_rate(GPU_BLOCKS, NUM_PREFIXES * PREFIX_BLOCKS, requests, seed)
    gpu_only = hit_rate(GPU_BLOCKS, 0, requests, seed)
    share = GPU_BLOCKS / (NUM_PREFIXES * PREFIX_BLOCKS)  # what fits in the pool
    assert unbounded == 1.0
    assert tiered >= unbounded - 0.05, (tiered, unbounded)
    # Without the tier, about the share that fits (a request's own blocks take room too).
    assert gpu_only <= share + 0.05, (gpu_only, share)


def debug_worker(worker_id: str, gpu_blocks: int, host_blocks: int) -> LocalWorkerClient:
    """A worker whose pool poisons released blocks with NaN: a restore that did not land
    before attention read the block shows up as NaN."""
    pool = PoolConfig(LAYOUT, num_blocks=gpu_blocks, debug=True, host_blocks=host_blocks)
    return LocalWorkerClient(worker_id, pool)


@pytest.fixture
def tiered_service():
    workers = [debug_worker("w0", GPU_BLOCKS, 4 * GPU_BLOCKS)]
    svc = ServiceHarness(service_config(), workers=workers)
    try:
        yield svc
    finally:
        svc.stop()


def test_attention_through_restored_prefix_blocks_equals_dense_attention(tiered_service) -> None:
    svc = tiered_service
    gen = torch.Generator().manual_seed(5)
    with KVCacheClient(svc.address, timeout_s=60) as client:
        # Compute every prefix once: most of them end up in the host tier.
        for i in range(NUM_PREFIXES):
            seq_id, _ = serve_request(client, [*prefix(i), 7])
            client.free(seq_id)
        stats = svc.call(svc.coordinator.block_manager.stats)
        assert stats.host_tiers["w0"].used > 0
        svc.call(svc.coordinator.block_manager.check_integrity)
        for i in (0, 1, NUM_PREFIXES - 1):  # the oldest are in the host tier
            tokens = [*prefix(i), 99]
            seq_id, cached = serve_request(client, tokens)
            assert cached == PREFIX_BLOCKS * BS
            mirror = Mirror(seq_id, NL)
            for layer in range(NL):
                k, v = token_kv(layer, tokens, 0)
                mirror.add(layer, k, v)
                q = torch.randn(2, HQ, D, generator=gen)
                (out,) = client.attend(layer, [AttendItem(seq_id, q)])
                ref, _ = mirror.reference(layer, q)
                assert torch.isfinite(out).all()
                assert torch.allclose(out.double(), ref, atol=2e-5), (
                    (out.double() - ref).abs().max()
                )
            client.free(seq_id)
        stats = svc.call(svc.coordinator.block_manager.stats)
        assert stats.host_hit_tokens >= 2 * PREFIX_BLOCKS * BS
        svc.call(svc.coordinator.block_manager.check_integrity)


def test_a_lost_worker_loses_its_host_entries_and_never_serves_them(tiered_service) -> None:
    svc = tiered_service
    with KVCacheClient(svc.address, timeout_s=60) as client:
        for i in range(NUM_PREFIXES):
            seq_id, _ = serve_request(client, [*prefix(i), 7])
            client.free(seq_id)
        assert client.lookup([*prefix(0), 7]) == PREFIX_BLOCKS * BS  # in the host tier
        holder, _ = serve_request(client, [*prefix(NUM_PREFIXES - 1), 8])
        svc.workers[0].restart()  # a new epoch: empty pool, empty host tier
        with pytest.raises(DataLossError):
            client.attend(0, [AttendItem(holder, torch.randn(1, HQ, D))])
        client.free(holder)
        stats = svc.call(svc.coordinator.block_manager.stats)
        assert stats.host_tiers.get("w0") is None or stats.host_tiers["w0"].used == 0
        svc.call(svc.coordinator.block_manager.check_integrity)
        # Nothing of the lost tier is found: the prompt is computed again, and correctly.
        tokens = [*prefix(0), 7]
        _wait_for_worker(client)
        seq_id, cached = serve_request(client, tokens)
        assert cached == 0
        q = torch.randn(1, HQ, D)
        (out,) = client.attend(1, [AttendItem(seq_id, q)])
        mirror = Mirror(seq_id, NL)
        for layer in range(NL):
            mirror.add(layer, *token_kv(layer, tokens, 0))
        ref, _ = mirror.reference(1, q)
        assert torch.allclose(out.double(), ref, atol=2e-5)


def _wait_for_worker(client: KVCacheClient) -> None:
    """Until every worker is registered again (the coordinator revives a restarted one)."""
    import time

    deadline = time.monotonic() + 20
    while not all(w.up for w in client.info().workers):
        assert time.monotonic() < deadline, "the restarted worker never came back"
        time.sleep(0.1)


def test_host_tier_metrics_reach_a_real_prometheus(tmp_path) -> None:
    from prometheus_harness import PrometheusServer

    workers = [debug_worker("w0", GPU_BLOCKS, 4 * GPU_BLOCKS)]
    config = service_config(**{"metrics.enabled": True, "metrics.port": 0})
    svc = ServiceHarness(config, workers=workers)
    try:
        with KVCacheClient(svc.address, timeout_s=60) as client:
            for i in range(NUM_PREFIXES):
                seq_id, _ = serve_request(client, [*prefix(i), 7])
                client.free(seq_id)
            for i in (0, 1):  # restored from the host tier
                seq_id, cached = serve_request(client, [*prefix(i), 8])
                assert cached == PREFIX_BLOCKS * BS
                client.free(seq_id)
        svc.run(svc.coordinator.checks_finished())
        stats = svc.call(svc.coordinator.block_manager.stats)
        metrics = svc.coordinator.metrics
        moved = {
            d: metrics.tier_transfer_bytes.labels(d)._value.get() for d in ("offload", "restore")
        }
        target = f"127.0.0.1:{svc.service.metrics_http.port}"
        with PrometheusServer(tmp_path / "prometheus", [target], job="kvcache") as prom:

            def value(expr: str) -> float | None:
                result = prom.query(expr)
                return float(result[0]["value"][1]) if result else None

            prom.wait_for(
                "the host tier gauges",
                lambda: value('kvcache_host_tier_blocks{worker="w0",state="used"}') is not None,
                timeout_s=30,
            )
            h = stats.host_tiers["w0"]
            assert value('kvcache_host_tier_blocks{worker="w0",state="used"}') == h.used
            assert value('kvcache_host_tier_blocks{worker="w0",state="free"}') == h.free
            assert value('kvcache_host_tier_utilization_ratio{worker="w0"}') == h.utilization
            bpb = LAYOUT.bytes_per_block
            assert value('kvcache_host_tier_held_bytes{worker="w0"}') == h.used * bpb
            assert value('kvcache_prefix_tier_hit_tokens_total{tier="host"}') == (
                stats.host_hit_tokens
            )
            gpu_hits = sum(stats.prefix_hit_tokens.values()) - stats.host_hit_tokens
            assert value('kvcache_prefix_tier_hit_tokens_total{tier="gpu"}') == gpu_hits
            assert value("kvcache_host_tier_evictions_total") == stats.host_evictions
            for direction, nbytes in moved.items():
                assert nbytes > 0 and nbytes % bpb == 0
                expr = f'kvcache_tier_transfer_bytes_total{{direction="{direction}"}}'
                assert value(expr) == nbytes
                count = value(f'kvcache_tier_transfer_seconds_count{{direction="{direction}"}}')
                assert count is not None and count >= 1
    finally:
        svc.stop()


def test_a_failed_restore_loses_the_worker_instead_of_serving_its_blocks(tiered_service) -> None:
    # A restore that fails on a live worker leaves the adopted blocks without their data:
    # the worker is dropped before any call reads them, and the client is told DATA_LOSS.
    svc = tiered_service
    worker = svc.workers[0].worker

    def refuse(*args, **kwargs):
        raise InvalidWorkerRequest("injected: the host tier copy failed")

    with KVCacheClient(svc.address, timeout_s=60) as client:
        for i in range(NUM_PREFIXES):
            seq_id, _ = serve_request(client, [*prefix(i), 7])
            client.free(seq_id)
        other, _ = serve_request(client, [5000 + t for t in range(BS + 1)])
        worker.restore_blocks = refuse
        handle = client.create_sequence([*prefix(0), 99])  # in the host tier: restored
        assert handle.num_cached_tokens == PREFIX_BLOCKS * BS
        q = torch.randn(1, HQ, D)
        with pytest.raises(DataLossError):
            client.attend(0, [AttendItem(handle.seq_id, q)])
        with pytest.raises(DataLossError):  # every sequence of that worker is lost with it
            client.attend(0, [AttendItem(other, q)])
        del worker.restore_blocks
        client.free(handle.seq_id)
        client.free(other)
        # The worker still answers: it comes back empty, and serves new sequences.
        deadline = time.monotonic() + 30
        while "w0" not in svc.stats().workers:
            assert time.monotonic() < deadline, "the worker did not come back"
            time.sleep(0.1)
        seq_id, cached = serve_request(client, [*prefix(1), 3])
        assert cached == 0  # nothing of before is trusted, host tier included
        (out,) = client.attend(0, [AttendItem(seq_id, q)])
        assert torch.isfinite(out).all()
    svc.call(svc.coordinator.block_manager.check_integrity)


def test_stats_report_the_host_tier_and_its_hits(tiered_service, capsys) -> None:
    from cache_service.cli.main import main as kvcache

    svc = tiered_service
    with KVCacheClient(svc.address, timeout_s=60) as client:
        before = client.stats()
        assert [(w.host_tier_blocks, w.host_tier_used_blocks) for w in before.workers] == [
            (4 * GPU_BLOCKS, 0)
        ]
        for i in range(NUM_PREFIXES):
            seq_id, _ = serve_request(client, [*prefix(i), 7])
            client.free(seq_id)
        seq_id, cached = serve_request(client, [*prefix(0), 8])  # the oldest: on the host
        assert cached == PREFIX_BLOCKS * BS
        after = client.stats()
        inner = svc.stats()
    (worker,) = after.workers
    assert worker.host_tier_used_blocks == inner.host_tiers["w0"].used > 0
    assert after.host_hit_tokens == inner.host_hit_tokens == PREFIX_BLOCKS * BS
    assert after.host_evictions == inner.host_evictions
    assert kvcache(["stats", "--target", svc.address]) == 0
    out = capsys.readouterr().out
    assert f"{worker.host_tier_used_blocks} / {4 * GPU_BLOCKS}" in out  # the workers table
    assert "restored from a host tier" in out
