"""The gRPC server: health, reflection, draining shutdown, authentication and tenants,
metrics wiring, large payloads, and coalescing of concurrent calls."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_support import (
    HQ,
    LAYOUT,
    Mirror,
    Recording,
    ServiceHarness,
    local_workers,
    service_config,
)

from cache_service.client import (
    AppendAttendItem,
    AttendItem,
    KVCacheClient,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
)
from cache_service.obs.metrics import ServiceMetrics
from workers.layout import KVLayout

D, HKV = LAYOUT.head_dim, LAYOUT.num_kv_heads


def decode_token(client: KVCacheClient, m: Mirror, layer: int, gen: torch.Generator) -> None:
    k = torch.randn(1, HKV, D, generator=gen)
    q = torch.randn(1, HQ, D, generator=gen)
    (out,) = client.append_attend(layer, [AppendAttendItem(m.seq_id, [1], k, k, q)])
    m.add(layer, k, k)
    ref, _ = m.reference(layer, q)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_health_reflection_and_metrics_are_wired() -> None:
    metrics = ServiceMetrics(bytes_per_block=LAYOUT.bytes_per_block)
    with ServiceHarness(service_config(), local_workers(2, 16), metrics=metrics) as svc:
        channel = grpc.insecure_channel(svc.address)
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "kvcache.v1.KVCache"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        (answer,) = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for s in answer.list_services_response.service}
        assert {"kvcache.v1.KVCache", "grpc.health.v1.Health"} <= names

        gen = torch.Generator().manual_seed(0)
        with KVCacheClient(svc.address) as client:
            h = client.create_sequence()
            m = Mirror(h.seq_id, LAYOUT.num_layers)
            for layer in range(LAYOUT.num_layers):
                decode_token(client, m, layer, gen)
            with pytest.raises(NotFoundError):
                client.free("unknown")
        value = metrics.registry.get_sample_value
        # The interceptor records a call once its status is sent: give it a moment.
        labels = {"service": "kvcache.v1.KVCache", "method": "FreeSequence", "code": "NOT_FOUND"}
        deadline = time.monotonic() + 5
        while value("kvcache_rpc_requests_total", labels) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert value("kvcache_rpc_requests_total",
                     {"service": "kvcache.v1.KVCache", "method": "AppendAttend", "code": "OK"}) == 2  # fmt: skip
        assert value("kvcache_rpc_requests_total",
                     {"service": "kvcache.v1.KVCache", "method": "FreeSequence", "code": "NOT_FOUND"}) == 1  # fmt: skip
        assert value("kvcache_tokens_appended_total") == 2
        assert value("kvcache_attention_tokens_total") == 2
        worker = svc.workers_of(h.seq_id)[0]
        assert value("kvcache_worker_call_duration_seconds_count", {"worker": worker}) == 2
        assert value("kvcache_worker_up", {"worker": "w0"}) == 1
        # The pool gauges come from the block manager's own accounting.
        used = svc.stats().workers[worker].used
        assert used == 1
        text = svc.call(lambda: __import__("prometheus_client").generate_latest(metrics.registry))
        assert b"kvcache_" in text


def test_shutdown_drains_calls_in_flight_and_refuses_new_ones() -> None:
    slow = [Recording(w, delay_s=0.6) for w in local_workers(1, 16)]
    svc = ServiceHarness(service_config(), slow)
    client = KVCacheClient(svc.address, timeout_s=10)
    h = client.create_sequence()
    m = Mirror(h.seq_id, LAYOUT.num_layers)
    outcome: dict[str, Any] = {}

    def in_flight() -> None:
        try:
            decode_token(client, m, 0, torch.Generator().manual_seed(1))
            outcome["ok"] = True
        except Exception as exc:  # reported below
            outcome["error"] = exc

    t = threading.Thread(target=in_flight)
    t.start()
    while not slow[0].calls["one_layer"]:
        time.sleep(0.01)
    svc.stop()  # drains: the call in flight completes
    t.join(10)
    assert outcome == {"ok": True}
    with pytest.raises(UnavailableError):
        KVCacheClient(svc.address, timeout_s=2, max_attempts=1).info()
    client.close()


def test_concurrent_calls_for_one_worker_and_layer_share_one_worker_call() -> None:
    workers = [Recording(w) for w in local_workers(1, 64)]
    config = service_config(**{"coordinator.batch_window_ms": 200.0})
    with ServiceHarness(config, workers) as svc:
        clients = [KVCacheClient(svc.address, timeout_s=20) for _ in range(6)]
        mirrors = []
        for c in clients:
            h = c.create_sequence()
            mirrors.append(Mirror(h.seq_id, LAYOUT.num_layers))
        barrier = threading.Barrier(len(clients))
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                barrier.wait()
                decode_token(clients[i], mirrors[i], 0, torch.Generator().manual_seed(i))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        # Six calls inside one window: far fewer worker calls, each carrying several (a
        # round of several callers goes in parts, over layers).
        calls = workers[0].calls
        assert calls["one_layer"] + calls["over_layers"] < len(clients)
        assert max(workers[0].batch_sizes) > 1
        assert sum(workers[0].batch_sizes) == len(clients)
        for c in clients:
            c.close()


def test_a_full_batch_goes_at_once_without_waiting_for_the_window() -> None:
    hold = threading.Event()
    workers = [Recording(w, hold_first=hold) for w in local_workers(1, 64)]
    # A window longer than the clients' deadline: only the size limit can send the batch.
    config = service_config(
        **{"coordinator.batch_window_ms": 60_000.0, "coordinator.max_batch_items": 2}
    )
    with ServiceHarness(config, workers) as svc:
        clients = [KVCacheClient(svc.address, timeout_s=10) for _ in range(3)]
        mirrors = [Mirror(c.create_sequence().seq_id, LAYOUT.num_layers) for c in clients]
        threads = [
            threading.Thread(target=decode_token, args=(c, m, 0, torch.Generator().manual_seed(3)))
            for c, m in zip(clients, mirrors, strict=True)
        ]
        # The first call is alone: it goes at once (no window) and is held on the worker.
        threads[0].start()
        wait_until(lambda: workers[0].calls["one_layer"] == 1)
        # The other two arrive while it is in flight: together they fill a batch, which
        # leaves at once although the first is still on the worker and the window is long
        # (a round of two callers: in parts, over layers).
        for t in threads[1:]:
            t.start()
        wait_until(lambda: workers[0].calls["over_layers"] == 1)
        hold.set()
        for t in threads:
            t.join(20)
        assert workers[0].batch_sizes == [1, 2]
        for c in clients:
            c.close()


def wait_until(predicate: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the service did not get there"
        time.sleep(0.01)


def write_tokens_file(path: Path) -> dict[str, str]:
    tokens = {"acme": "a" * 32, "globex": "g" * 32}
    path.write_text(
        yaml.safe_dump(
            {
                "tokens": {tokens["acme"]: "acme", tokens["globex"]: "globex"},
                "tenants": {"acme": {"publish_public": True}},
            }
        )
    )
    return tokens


def test_tokens_tenants_and_permissions(tmp_path: Path) -> None:
    tokens = write_tokens_file(tmp_path / "tokens.yaml")
    config = service_config(auth_file=str(tmp_path / "tokens.yaml"))
    with ServiceHarness(config, local_workers(1, 32)) as svc:
        with pytest.raises(UnauthenticatedError):
            KVCacheClient(svc.address).info()
        with pytest.raises(UnauthenticatedError):
            KVCacheClient(svc.address, token="x" * 32).info()
        # Health stays open for probes.
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(svc.address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        acme = KVCacheClient(svc.address, token=tokens["acme"])
        globex = KVCacheClient(svc.address, token=tokens["globex"])
        prompt = list(range(1, 10))
        h = acme.create_sequence(prompt)
        kv = torch.randn(LAYOUT.num_layers, 9, HKV, D)
        acme.append(h.seq_id, prompt, kv, kv)
        assert acme.lookup(prompt) == 8
        # Another tenant neither sees the sequence nor shares its prefix.
        assert globex.lookup(prompt) == 0
        with pytest.raises(NotFoundError):
            globex.attend(0, [AttendItem(h.seq_id, torch.randn(1, HQ, D))])
        with pytest.raises(NotFoundError):
            globex.free(h.seq_id)
        with pytest.raises(PermissionDeniedError, match="publish_public"):
            globex.publish_public(h.seq_id)
        acme.publish_public(h.seq_id)
        assert globex.lookup(prompt) == 8
        assert set(acme.stats().prefix) == {"acme"}
        acme.free(h.seq_id)
        svc.check_integrity()
        acme.close()
        globex.close()


def test_payloads_larger_than_4_mib_go_through() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32")
    config = service_config(layout, **{"server.stream_chunk_bytes": 1 << 20})
    workers = local_workers(1, 300, layout)
    n = 2048
    with (
        ServiceHarness(config, workers) as svc,
        KVCacheClient(svc.address, timeout_s=120) as client,
    ):
        gen = torch.Generator().manual_seed(5)
        # Unary append_attend: K + V 4 MiB, query 8 MiB in; 8 MiB out.
        h = client.create_sequence()
        k = torch.randn(n, 4, 64, generator=gen)
        q = torch.randn(n, 16, 64, generator=gen)
        (out,) = client.append_attend(0, [AppendAttendItem(h.seq_id, list(range(n)), k, k, q)])
        assert out.shape == (n, 16, 64) and out.numel() * 4 > 4 << 20
        m = Mirror(h.seq_id, 2)
        m.add(0, k, k)
        ref, _ = m.reference(0, q[-4:])
        assert torch.allclose(out[-4:].double(), ref, atol=1e-5)
        # Streamed: an all-layer append of 8 MiB (K + V), its 8 MiB export and import.
        kv = torch.randn(2, n, 4, 64, generator=gen)
        big = client.create_sequence()
        client.append(big.seq_id, list(range(n)), kv, -kv)
        exported = client.export_blocks(big.seq_id)
        assert len(exported.data) == 8 << 20
        copy = client.import_blocks(exported)
        a, b = client.attend(1, [AttendItem(big.seq_id, q[:3]), AttendItem(copy.seq_id, q[:3])])
        assert torch.equal(a, b)
        for seq in (h, big, copy):
            client.free(seq.seq_id)
        svc.check_integrity()


def test_a_sequence_larger_than_one_pool_spans_workers_and_still_equals_dense() -> None:
    gen = torch.Generator().manual_seed(11)
    workers = [Recording(w) for w in local_workers(2, 8)]  # 8 blocks of 4 tokens each
    with ServiceHarness(service_config(), workers) as svc, KVCacheClient(svc.address) as client:
        big = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
        small = Mirror(client.create_sequence().seq_id, LAYOUT.num_layers)
        # 40 tokens = 10 blocks: more than one pool holds.
        for m, n in ((big, 40), (small, 3)):
            for layer in range(LAYOUT.num_layers):
                k = torch.randn(n, HKV, D, generator=gen)
                q = torch.randn(n, HQ, D, generator=gen)
                (out,) = client.append_attend(
                    layer, [AppendAttendItem(m.seq_id, [1] * n, k, -k, q)]
                )
                m.add(layer, k, -k)
                ref, _ = m.reference(layer, q)
                assert torch.allclose(out.double(), ref, atol=1e-5)
        assert set(svc.workers_of(big.seq_id)) == {"w0", "w1"}
        # One call mixing the spanning sequence (partials merged by LSE) with a single-worker
        # one; rows of several queries each, with LSE.
        for layer in range(LAYOUT.num_layers):
            items, qs = [], []
            for m in (big, small):
                k = torch.randn(1, HKV, D, generator=gen)
                q = torch.randn(2, HQ, D, generator=gen)
                items.append(AppendAttendItem(m.seq_id, [2], k, k, q))
                qs.append(q)
                m.add(layer, k, k)
            outs = client.append_attend(layer, items, return_lse=True)
            for m, q, (o, lse) in zip((big, small), qs, outs, strict=True):
                ref, ref_lse = m.reference(layer, q)
                assert torch.allclose(o.double(), ref, atol=1e-5)
                assert torch.allclose(lse.double(), ref_lse, atol=1e-4)
        assert workers[0].calls["one_layer"] + workers[0].calls["attend"] > 0
        assert workers[1].calls["one_layer"] + workers[1].calls["attend"] > 0
        client.free(big.seq_id)
        client.free(small.seq_id)
        svc.check_integrity()
