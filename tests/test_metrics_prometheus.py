"""The real service scraped by a real Prometheus; every dashboard panel query evaluated.

The service (coordinator, gRPC server with authentication, /metrics endpoint, in-process
worker pools) runs on 127.0.0.1 on its own event loop; Debian's `prometheus` scrapes it
every second from a temporary directory. After a scripted workload from two tenants
(prefix hits, a fork with copy-on-write, a pin, an export stream, bad requests, a worker
restart that loses sequences), every query of deploy/grafana/dashboards/kvcache.json is
evaluated through Prometheus' HTTP API: each must return series, and the capacity, prefix
and traffic figures must equal the service's own GetStats and the calls made.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_harness import (
    PrometheusServer,
    dashboard_queries,
    iter_panels,
    substitute_variables,
)

from cache_service.api.server import start_service
from cache_service.client import (
    AppendAttendItem,
    AttendItem,
    DataLossError,
    InvalidArgumentError,
    KVCacheClient,
    KVCacheError,
    NotFoundError,
    UnauthenticatedError,
)
from cache_service.config import (
    CoordinatorConfig,
    LayoutConfig,
    MetricsConfig,
    ServerConfig,
    ServiceConfig,
    WorkersConfig,
)
from cache_service.engine.worker_clients import LocalWorkerClient
from workers.config import PoolConfig

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = json.loads((ROOT / "deploy/grafana/dashboards/kvcache.json").read_text())
# The rate window spans the whole test, so every rate sees the traffic.
VARIABLES = {"__rate_interval": "5m", "worker": ".*", "tenant": ".*", "job": ".*"}
TOKENS = {"acme": "acme-token-0123456789abcdef", "globex": "globex-token-0123456789abcdef"}
NUM_Q_HEADS = 4
LAYOUT = LayoutConfig(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
BLOCKS_PER_WORKER = 24


class ServiceThread:
    """start_service() on an event loop of its own thread; stop() always tears it down."""

    def __init__(self, config: ServiceConfig, workers: list[LocalWorkerClient]) -> None:
        self.config = config
        self.workers = workers
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.running: Any = None

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def call(self, fn: Any, timeout_s: float = 30.0) -> Any:
        async def wrapped() -> Any:
            return fn()

        return self.run(wrapped(), timeout_s)

    def start(self) -> ServiceThread:
        self.thread.start()
        self.running = self.run(start_service(self.config, workers=self.workers))
        return self

    def stop(self) -> None:
        try:
            if self.running is not None:
                self.run(self.running.stop(grace_s=1.0), timeout_s=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            for worker in self.workers:
                worker.close()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceThread]:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {v: k for k, v in TOKENS.items()}}))
    config = ServiceConfig(
        layout=LAYOUT,
        workers=WorkersConfig(num_workers=2, blocks_per_worker=BLOCKS_PER_WORKER, in_process=True),
        server=ServerConfig(host="127.0.0.1", port=0),
        coordinator=CoordinatorConfig(health_check_interval_s=0.5),
        metrics=MetricsConfig(enabled=True, host="127.0.0.1", port=0),
        auth_file=str(tokens),
    )
    # With a host tier, so its panels have series (host_tier tests fill it).
    pool = PoolConfig(layout=LAYOUT.kv_layout(), num_blocks=BLOCKS_PER_WORKER, host_blocks=8)
    workers = [LocalWorkerClient(f"w{i}", pool, "cpu") for i in range(2)]
    svc = ServiceThread(config, workers)
    try:
        yield svc.start()
    finally:
        svc.stop()


def kv(n: int, *, layers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    if layers is not None:
        shape = (layers, *shape)
    return torch.randn(shape), torch.randn(shape)


def query(n: int = 1) -> torch.Tensor:
    return torch.randn(n, NUM_Q_HEADS, LAYOUT.head_dim)


def drive_tenant(client: KVCacheClient, prompt: list[int], calls: Counter) -> dict[str, str]:
    """Prefill one sequence, reuse its prefix from a second, fork and decode. Returns ids."""
    first = client.create_sequence(prompt)
    calls["CreateSequence"] += 1
    k, v = kv(len(prompt), layers=LAYOUT.num_layers)
    client.append(first.seq_id, prompt, k, v)
    calls["Append"] += 1
    for layer in range(LAYOUT.num_layers):
        (out,) = client.attend(layer, [AttendItem(first.seq_id, query())])
        calls["Attend"] += 1
        assert out.shape == (1, NUM_Q_HEADS, LAYOUT.head_dim)

    second = client.create_sequence(prompt)
    calls["CreateSequence"] += 1
    cached = second.num_cached_tokens
    assert cached == (len(prompt) - 1) // LAYOUT.block_size * LAYOUT.block_size
    rest = prompt[cached:]
    k, v = kv(len(rest), layers=LAYOUT.num_layers)
    client.append(second.seq_id, rest, k, v)
    calls["Append"] += 1

    fork = client.fork(second.seq_id)
    calls["ForkSequence"] += 1
    for step in range(3):
        for layer in range(LAYOUT.num_layers):
            items = []
            for seq_id in (second.seq_id, fork.seq_id):
                k, v = kv(1)
                items.append(AppendAttendItem(seq_id, [1000 + step], k, v, query()))
            outs = client.append_attend(layer, items)
            calls["AppendAttend"] += 1
            assert len(outs) == 2
    client.pin(prompt[: 2 * LAYOUT.block_size])
    calls["Pin"] += 1
    assert client.lookup(prompt) == cached
    calls["Lookup"] += 1
    return {"first": first.seq_id, "second": second.seq_id, "fork": fork.seq_id}


def panel(title: str) -> dict[str, Any]:
    (found,) = [p for p in iter_panels(DASHBOARD) if p.get("title") == title]
    return found


def panel_values(prom: PrometheusServer, title: str, ref: str = "A") -> list[dict[str, Any]]:
    (target,) = [t for t in panel(title)["targets"] if t["refId"] == ref]
    return prom.query(substitute_variables(target["expr"], VARIABLES))


def by_label(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


def test_every_dashboard_query_against_real_prometheus(
    service: ServiceThread, tmp_path: Path
) -> None:
    metrics_target = f"127.0.0.1:{service.running.metrics_http.port}"
    calls: Counter = Counter()
    errors: Counter = Counter()
    with PrometheusServer(tmp_path / "prometheus", [metrics_target], job="kvcache") as prom:
        prom.wait_for(
            "the first scrape of the service",
            lambda: by_label(prom.query('up{job="kvcache"}'), "job").get("kvcache") == 1,
            timeout_s=30,
        )
        address = service.running.address
        acme = KVCacheClient(address, token=TOKENS["acme"], timeout_s=30)
        globex = KVCacheClient(address, token=TOKENS["globex"], timeout_s=30)
        anonymous = KVCacheClient(address, timeout_s=30)
        try:
            acme_ids = drive_tenant(acme, list(range(1, 15)), calls)
            globex_ids = drive_tenant(globex, list(range(101, 111)), calls)
            export = acme.export_blocks(acme_ids["first"])
            calls["ExportBlocks"] += 1
            assert export.num_tokens == 14

            # Client mistakes: each must come back with its status, and be counted.
            for method, call, error, code in [
                (
                    "Attend",
                    lambda: acme.attend(0, [AttendItem("no-such-seq", query())]),
                    NotFoundError,
                    "NOT_FOUND",
                ),
                (
                    "Attend",
                    lambda: acme.attend(7, [AttendItem(acme_ids["first"], query())]),
                    InvalidArgumentError,
                    "INVALID_ARGUMENT",
                ),
                (
                    "CreateSequence",
                    lambda: anonymous.create_sequence([1, 2, 3]),
                    UnauthenticatedError,
                    "UNAUTHENTICATED",
                ),
            ]:
                with pytest.raises(error):
                    call()
                calls[method] += 1
                errors[code] += 1

            # A worker restarts with an empty pool: the sequences with blocks on it fail
            # with DATA_LOSS, the others keep working.
            home = service.call(
                lambda: service.running.coordinator.block_manager.sequence_info(
                    "globex", globex_ids["first"]
                ).workers[0]
            )
            restarted = next(w for w in service.workers if w.worker_id == home)
            restarted.restart()
            lost = 0
            for tenant_client, ids in ((acme, acme_ids), (globex, globex_ids)):
                for seq_id in ids.values():
                    try:
                        tenant_client.attend(0, [AttendItem(seq_id, query())])
                    except DataLossError:
                        lost += 1
                        tenant_client.free(seq_id)
                        calls["FreeSequence"] += 1
                    except KVCacheError as exc:  # pragma: no cover - reported by the assert
                        pytest.fail(f"unexpected {exc}")
                    calls["Attend"] += 1
            assert lost >= 1
            info = acme.info()
            calls["GetInfo"] += 1
            deadline = time.monotonic() + 20
            while not all(w.up for w in info.workers):  # the worker comes back empty
                assert time.monotonic() < deadline, "the restarted worker never came back"
                time.sleep(0.2)
                info = acme.info()
                calls["GetInfo"] += 1
            # GetStats reports the caller's own prefix figures: ask as each tenant.
            globex_stats = globex.stats()
            stats = acme.stats()
            calls["GetStats"] += 2
            prefix = {**globex_stats.prefix, **stats.prefix}
        finally:
            for client in (acme, globex, anonymous):
                client.close()

        # The service is idle now: wait (bounded) until Prometheus holds its final state.
        expected_util = {w.worker_id: w.used_blocks / w.total_blocks for w in stats.workers}
        prom.wait_for(
            "a scrape of the final pool state",
            lambda: (
                by_label(prom.query("kvcache_pool_utilization_ratio"), "worker") == expected_util
                and by_label(
                    prom.query("sum by (method) (kvcache_rpc_requests_total)"), "method"
                ).get("GetStats")
                == calls["GetStats"]
            ),
            timeout_s=30,
        )
        # Rates need two samples of a series: wait for one more scrape of the last call's.
        prom.wait_for(
            "a second scrape after the traffic",
            lambda: (
                by_label(
                    prom.query(
                        'count_over_time(kvcache_rpc_requests_total{method="GetStats"}[5m])'
                    ),
                    "method",
                ).get("GetStats", 0)
                >= 2
            ),
            timeout_s=30,
        )

        # 1. Every panel query returns series.
        queries = dashboard_queries(DASHBOARD)
        assert len(queries) == sum(
            len(p.get("targets", [])) for p in iter_panels(DASHBOARD) if p["type"] != "row"
        )
        empty = []
        for q in queries:
            if not prom.query(substitute_variables(q.expr, VARIABLES)):
                empty.append(f"{q.panel} [{q.ref_id}]: {q.expr}")
        assert not empty, "panel queries without series:\n" + "\n".join(empty)

        # 2. Capacity panels equal the service's own accounting (GetStats).
        workers = {w.worker_id: w for w in stats.workers}
        assert set(workers) == {"w0", "w1"}
        assert by_label(panel_values(prom, "Pool utilization per worker"), "worker") == (
            expected_util
        )
        assert by_label(panel_values(prom, "Free blocks per worker", "A"), "worker") == {
            w: s.free_blocks for w, s in workers.items()
        }
        assert by_label(panel_values(prom, "Free blocks per worker", "B"), "worker") == {
            w: s.cached_free_blocks for w, s in workers.items()
        }
        frag = {
            w: (s.allocated_slots - s.filled_slots) / s.allocated_slots if s.allocated_slots else 0
            for w, s in workers.items()
        }
        assert by_label(panel_values(prom, "Fragmentation per worker"), "worker") == (
            pytest.approx(frag)
        )
        bytes_per_block = LAYOUT.kv_layout().bytes_per_block
        assert by_label(panel_values(prom, "KV bytes held per worker", "A"), "worker") == {
            w: s.used_blocks * bytes_per_block for w, s in workers.items()
        }
        (util,) = panel_values(prom, "Cluster pool utilization")
        assert float(util["value"][1]) == pytest.approx(stats.utilization)
        (cluster_frag,) = panel_values(prom, "Cluster fragmentation")
        assert float(cluster_frag["value"][1]) == pytest.approx(stats.fragmentation)
        (active,) = panel_values(prom, "Active sequences")
        assert float(active["value"][1]) == stats.active_sequences

        # 3. Prefix sharing.
        assert prefix == {"acme": (28, 12), "globex": (20, 8)}  # 2 prompts each, 1 reused
        (hit_ratio,) = panel_values(prom, "Prefix hit ratio (since start)")
        assert float(hit_ratio["value"][1]) == pytest.approx(
            sum(h for _, h in prefix.values()) / sum(q for q, _ in prefix.values())
        )
        # (Rates of a series whose first scrape already holds its final value are 0: only
        # the series' presence is checked there.)
        looked_up = by_label(panel_values(prom, "Prefix tokens looked up and hit", "A"), "tenant")
        assert set(looked_up) == {"acme", "globex"}
        assert set(by_label(panel_values(prom, "Prefix hit rate per tenant"), "tenant")) == {
            "acme",
            "globex",
        }
        for tenant, (queried, hit) in prefix.items():
            label = f'{{tenant="{tenant}"}}'
            (q,) = prom.query(f"kvcache_prefix_query_tokens_total{label}")
            (h,) = prom.query(f"kvcache_prefix_hit_tokens_total{label}")
            assert (float(q["value"][1]), float(h["value"][1])) == (queried, hit)
        pinned = by_label(panel_values(prom, "Pinned and cached-free blocks", "A"), "")
        assert pinned == {"": stats.pinned_blocks}
        assert stats.cow_copies >= 2  # one per tenant's fork
        cow = prom.query("kvcache_cow_copies_total")
        assert float(cow[0]["value"][1]) == stats.cow_copies

        # 4. Traffic: every call made is counted under its method, errors under their code.
        counted = by_label(
            prom.query(
                'sum by (method) (kvcache_rpc_requests_total{service="kvcache.v1.KVCache"})'
            ),
            "method",
        )
        for method, n in calls.items():
            assert counted.get(method) == n, (method, counted.get(method), n)
        rpc_methods = set(by_label(panel_values(prom, "RPC rate per method"), "method"))
        assert set(calls) <= rpc_methods
        p99 = by_label(panel_values(prom, "RPC latency p50 / p99 per method", "B"), "method")
        assert set(calls) - {"GetStats"} <= set(p99)
        error_codes = {
            r["metric"]["code"] for r in panel_values(prom, "RPC errors by method and code")
        }
        assert set(errors) | {"DATA_LOSS"} <= error_codes

        # 5. Errors and worker health.
        (lost_total,) = prom.query("kvcache_lost_sequences_total")
        assert float(lost_total["value"][1]) == lost
        restarts = by_label(prom.query("kvcache_worker_restarts_total"), "worker")
        assert restarts == {w: (1.0 if w == home else 0.0) for w in ("w0", "w1")}
        assert by_label(panel_values(prom, "Worker up"), "worker") == {"w0": 1.0, "w1": 1.0}
        (targets_up,) = panel_values(prom, "Metrics scrape health", "A")
        assert float(targets_up["value"][1]) == 1
