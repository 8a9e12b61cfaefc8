"""Bounded load through the real server: 64 concurrent clients (threads, one connection
each) mixing create / append / append-and-attend / attend / fork / free on loopback for
20 s (the 60 s run with figures is benchmarks/bench_load.py; this shorter one keeps CI time
reasonable). Zero unexpected errors, every sampled attention output equal to dense
attention, no block in use once every sequence is freed, check_integrity holds, and the
process's resident memory stays flat after warm-up."""

from __future__ import annotations

import os

import pytest
from service_support import ServiceHarness, service_config

from cache_service.cli.load_gen import LoadConfig, run_load
from cache_service.client import KVCacheClient
from cache_service.engine.worker_clients import LocalWorkerClient
from workers.config import PoolConfig
from workers.layout import KVLayout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")
DURATION_S = 20.0


def test_64_clients_for_20_seconds(capsys):
    config = service_config(LAYOUT, **{"coordinator.correctness_check_fraction": 0.05})
    pool = PoolConfig(LAYOUT, num_blocks=1024, fingerprints=True)
    workers = [LocalWorkerClient(f"w{i}", pool) for i in range(2)]
    with ServiceHarness(config, workers) as svc:
        load = LoadConfig(clients=64, duration_s=DURATION_S, max_ops=100_000, seed=3)
        result = run_load(svc.address, LAYOUT, load, rss_pid=os.getpid())

        with KVCacheClient(svc.address) as client:
            stats = client.stats()
        svc.check_integrity()
        svc.checks_finished()  # online checks run after their rounds answered
        checker = svc.coordinator.correctness

    rss = [b for _, b in result.rss]
    warm = rss[len(rss) // 3]
    growth = max(rss[len(rss) // 3 :]) - warm
    with capsys.disabled():
        print(
            f"\nload: {result.total_ops} ops in {result.wall_s:.1f} s "
            f"({result.total_ops / result.wall_s:.0f}/s) {result.ops}; "
            f"{result.checked} outputs checked, max |err| {result.max_abs_err:.2e}; "
            f"prefix hit tokens {result.prefix_hit_tokens}; "
            f"RSS after warm-up {warm / 2**20:.0f} MiB, growth {growth / 2**20:.1f} MiB; "
            f"online checks {checker.checks} ({checker.discarded} discarded: their data "
            "changed under them)"
        )
    assert result.errors == [], result.errors[:10]
    assert all(n > 0 for n in result.ops.values()), result.ops
    assert result.checked > 100 and result.mismatches == 0
    assert result.prefix_hit_tokens > 0  # clients shared prompt prefixes
    assert all(w.used_blocks == 0 for w in stats.workers), stats.workers
    assert stats.active_sequences == 0 and stats.lost_sequences == 0
    # Checks ran (one may be discarded when the load frees its sequences under it); none
    # found a mismatch or failed.
    assert checker.checks + checker.discarded > 0
    assert checker.mismatches == 0 and checker.errors == 0
    # Flat: no more than 32 MiB over the last two thirds (clients and server together).
    assert growth < 32 * 2**20, [r // 2**20 for r in rss]
