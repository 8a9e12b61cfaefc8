"""ServiceMetrics: event counters, input checks, the gRPC interceptor on a real aio server,
the /metrics HTTP endpoint and scrape-time reads of the control plane's accounting."""

from __future__ import annotations

import asyncio
import threading
import urllib.error
import urllib.request

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from cache_service.obs.metrics import ServiceMetrics


def value(metrics: ServiceMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_names_follow_prometheus_conventions() -> None:
    metrics = ServiceMetrics()
    metrics.set_worker_state("w0", True, "e1")
    metrics.observe_worker_call("w0", 2, 0.01)
    for family in metrics.registry.collect():
        if not family.name.startswith("kvcache"):
            continue  # process_*, python_* collectors
        assert ":" not in family.name
        assert family.name.startswith("kvcache_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith(("_seconds", "_size")), family.name


@pytest.mark.parametrize("prefix", ["kv:cache", "1kv", "", "kv-cache"])
def test_bad_prefix_is_rejected(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        ServiceMetrics(prefix=prefix)


def test_private_registries_do_not_collide() -> None:
    a, b = ServiceMetrics(), ServiceMetrics()
    a.add_tokens_appended(3)
    assert value(a, "kvcache_tokens_appended_total") == 3
    assert value(b, "kvcache_tokens_appended_total") == 0
    shared = CollectorRegistry()
    ServiceMetrics(registry=shared, prefix="other")
    assert shared.get_sample_value("other_lost_sequences_total") == 0
    assert shared.get_sample_value("process_cpu_seconds_total") is None


def test_counters_and_worker_calls() -> None:
    m = ServiceMetrics()
    m.add_tokens_appended(16)
    m.add_tokens_appended(4)
    m.add_attention_tokens(7)
    m.add_lost_sequences(2)
    m.observe_worker_call("w0", 3, 0.004)
    m.observe_worker_call("w0", 5, 0.002)
    m.observe_worker_call("w1", 1, 0.5)
    assert value(m, "kvcache_tokens_appended_total") == 20
    assert value(m, "kvcache_attention_tokens_total") == 7
    assert value(m, "kvcache_lost_sequences_total") == 2
    assert value(m, "kvcache_worker_call_duration_seconds_count", worker="w0") == 2
    assert value(m, "kvcache_worker_call_duration_seconds_sum", worker="w0") == pytest.approx(0.006)
    assert value(m, "kvcache_worker_batch_size_sum", worker="w0") == 8
    # le="4.0" holds the call with 3 requests, not the one with 5.
    assert value(m, "kvcache_worker_batch_size_bucket", worker="w0", le="4.0") == 1
    assert value(m, "kvcache_worker_batch_size_bucket", worker="w1", le="1.0") == 1
    # Client calls per worker call and those over several layers (a round of callers a
    # layer apart); the calls above were lone ones on one layer.
    assert value(m, "kvcache_worker_round_size_sum", worker="w0") == 2
    m.observe_worker_call("w0", 16, 0.003, parts=3, over_layers=True)
    m.observe_worker_call("w0", 8, 0.003, parts=2)
    assert value(m, "kvcache_worker_round_size_sum", worker="w0") == 7
    assert value(m, "kvcache_worker_round_size_bucket", worker="w0", le="2.0") == 3
    assert value(m, "kvcache_worker_calls_over_layers_total", worker="w0") == 1
    assert value(m, "kvcache_worker_calls_over_layers_total", worker="w1") == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("", 1, 0.1), "worker_id"),
        ((7, 1, 0.1), "worker_id"),
        (("w0", 0, 0.1), "layer_batch_size"),
        (("w0", 1.5, 0.1), "layer_batch_size"),
        (("w0", True, 0.1), "layer_batch_size"),
        (("w0", 1, -0.1), "seconds"),
        (("w0", 1, float("nan")), "seconds"),
        (("w0", 1, float("inf")), "seconds"),
        (("w0", 1, "0.1"), "seconds"),
        (("w0", 1, 0.1, 0), "parts"),
        (("w0", 1, 0.1, 2.0), "parts"),
        (("w0", 1, 0.1, 2, 1), "over_layers"),
    ],
)
def test_bad_worker_call_changes_nothing(args: tuple, match: str) -> None:
    m = ServiceMetrics()
    with pytest.raises(ValueError, match=match):
        m.observe_worker_call(*args)
    assert value(m, "kvcache_worker_call_duration_seconds_count", worker="w0") is None
    assert value(m, "kvcache_worker_batch_size_count", worker="w0") is None
    assert value(m, "kvcache_worker_round_size_count", worker="w0") is None
    assert value(m, "kvcache_worker_calls_over_layers_total", worker="w0") is None


@pytest.mark.parametrize("n", [-1, 1.0, True, None])
def test_bad_counts_change_nothing(n: object) -> None:
    m = ServiceMetrics()
    for method, name in [
        (m.add_tokens_appended, "kvcache_tokens_appended_total"),
        (m.add_attention_tokens, "kvcache_attention_tokens_total"),
        (m.add_lost_sequences, "kvcache_lost_sequences_total"),
    ]:
        with pytest.raises(ValueError, match="non-negative int"):
            method(n)
        assert value(m, name) == 0


def test_worker_state_counts_epoch_changes_as_restarts() -> None:
    m = ServiceMetrics()
    m.set_worker_state("w0", True, "epoch-a")
    assert value(m, "kvcache_worker_up", worker="w0") == 1
    assert value(m, "kvcache_worker_restarts_total", worker="w0") == 0
    # Series exist before any incident, so dashboards show 0 rather than nothing.
    assert value(m, "kvcache_correctness_mismatches_total", worker="w0") == 0
    m.set_worker_state("w0", False, "epoch-a")
    assert value(m, "kvcache_worker_up", worker="w0") == 0
    assert value(m, "kvcache_worker_restarts_total", worker="w0") == 0
    m.set_worker_state("w0", True, "epoch-b")
    m.set_worker_state("w0", True, "epoch-b")
    m.set_worker_state("w0", True, "epoch-c")
    assert value(m, "kvcache_worker_restarts_total", worker="w0") == 2
    assert value(m, "kvcache_worker_up", worker="w0") == 1
    m.add_correctness_mismatch("w0", 3)
    assert value(m, "kvcache_correctness_mismatches_total", worker="w0") == 1
    m.remove_worker("w0")
    assert value(m, "kvcache_worker_up", worker="w0") is None
    m.set_worker_state("w0", True, "epoch-d")
    assert value(m, "kvcache_worker_restarts_total", worker="w0") == 0


def test_correctness_checks_are_timed_and_bad_durations_change_nothing() -> None:
    m = ServiceMetrics()
    assert value(m, "kvcache_correctness_check_seconds_count") == 0
    m.observe_correctness_check(0.004)
    m.observe_correctness_check(0.020)
    assert value(m, "kvcache_correctness_check_seconds_count") == 2
    assert value(m, "kvcache_correctness_check_seconds_sum") == pytest.approx(0.024)
    for bad in (-1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="seconds"):
            m.observe_correctness_check(bad)  # type: ignore[arg-type]
    assert value(m, "kvcache_correctness_check_seconds_count") == 2


@pytest.mark.parametrize(
    ("args", "match"),
    [(("", True, "e"), "worker_id"), (("w", 1, "e"), "up"), (("w", True, ""), "epoch")],
)
def test_bad_worker_state_changes_nothing(args: tuple, match: str) -> None:
    m = ServiceMetrics()
    m.set_worker_state("w", True, "e0")
    with pytest.raises(ValueError, match=match):
        m.set_worker_state(*args)
    assert value(m, "kvcache_worker_up", worker="w") == 1
    assert value(m, "kvcache_worker_restarts_total", worker="w") == 0
    with pytest.raises(ValueError, match="layer"):
        m.add_correctness_mismatch("w", -1)
    assert value(m, "kvcache_correctness_mismatches_total", worker="w") == 0


# -- gRPC interceptor on a real server -------------------------------------------------------


async def _stream_numbers(request: bytes, context: grpc.aio.ServicerContext):
    for i in range(int(request.decode())):
        yield str(i).encode()


async def _upload(requests, context: grpc.aio.ServicerContext) -> bytes:
    total = 0
    async for chunk in requests:
        total += len(chunk)
    return str(total).encode()


async def _fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise RuntimeError("servicer bug")


async def _invalid(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad layer")


async def _set_code(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    context.set_code(grpc.StatusCode.DATA_LOSS)
    context.set_details("worker lost")
    return b""


def test_rpc_interceptor_on_a_real_server() -> None:
    metrics = ServiceMetrics()
    test_handlers = grpc.method_handlers_generic_handler(
        "test.v1.Probe",
        {
            "Count": grpc.unary_stream_rpc_method_handler(_stream_numbers),
            "Upload": grpc.stream_unary_rpc_method_handler(_upload),
            "Fail": grpc.unary_unary_rpc_method_handler(_fail),
            "Invalid": grpc.unary_unary_rpc_method_handler(_invalid),
            "Lost": grpc.unary_unary_rpc_method_handler(_set_code),
        },
    )

    async def scenario() -> dict[str, grpc.StatusCode]:
        server = grpc.aio.server(interceptors=[metrics.rpc_interceptor()])
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_generic_rpc_handlers((test_handlers,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen: dict[str, grpc.StatusCode] = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for _ in range(3):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                items = [
                    r async for r in channel.unary_stream("/test.v1.Probe/Count")(b"4", timeout=5)
                ]
                assert items == [b"0", b"1", b"2", b"3"]
                upload = channel.stream_unary("/test.v1.Probe/Upload")
                assert await upload(iter([b"ab", b"cde"]), timeout=5) == b"5"
                calls = {
                    "missing": stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5),
                    "fail": channel.unary_unary("/test.v1.Probe/Fail")(b"", timeout=5),
                    "invalid": channel.unary_unary("/test.v1.Probe/Invalid")(b"", timeout=5),
                    "lost": channel.unary_unary("/test.v1.Probe/Lost")(b"", timeout=5),
                    "unknown": channel.unary_unary("/test.v1.Probe/Nope")(b"", timeout=5),
                }
                for name, call in calls.items():
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    seen[name] = err.value.code()
        finally:
            await server.stop(None)
        return seen

    seen = asyncio.run(scenario())
    assert seen == {
        "missing": grpc.StatusCode.NOT_FOUND,
        "fail": grpc.StatusCode.UNKNOWN,
        "invalid": grpc.StatusCode.INVALID_ARGUMENT,
        "lost": grpc.StatusCode.DATA_LOSS,
        "unknown": grpc.StatusCode.UNIMPLEMENTED,
    }
    health_labels = {"service": "grpc.health.v1.Health", "method": "Check"}
    assert value(metrics, "kvcache_rpc_requests_total", code="OK", **health_labels) == 3
    assert value(metrics, "kvcache_rpc_requests_total", code="NOT_FOUND", **health_labels) == 1
    assert value(metrics, "kvcache_rpc_duration_seconds_count", code="OK", **health_labels) == 3
    assert value(metrics, "kvcache_rpc_duration_seconds_sum", code="OK", **health_labels) > 0
    probe = {"service": "test.v1.Probe"}
    assert value(metrics, "kvcache_rpc_requests_total", method="Count", code="OK", **probe) == 1
    assert value(metrics, "kvcache_rpc_requests_total", method="Upload", code="OK", **probe) == 1
    assert value(metrics, "kvcache_rpc_requests_total", method="Fail", code="UNKNOWN", **probe) == 1
    assert (
        value(
            metrics,
            "kvcache_rpc_requests_total",
            method="Invalid",
            code="INVALID_ARGUMENT",
            **probe,
        )
        == 1
    )
    assert (
        value(metrics, "kvcache_rpc_requests_total", method="Lost", code="DATA_LOSS", **probe) == 1
    )
    # Unknown methods carry client-chosen names: never a label value.
    methods = {
        s.labels["method"]
        for f in metrics.registry.collect()
        if f.name == "kvcache_rpc_requests"
        for s in f.samples
    }
    assert "Nope" not in methods


# -- HTTP endpoint and the stats collector ---------------------------------------------------


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name + str(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_http_server_serves_and_stops() -> None:
    metrics = ServiceMetrics()
    metrics.add_attention_tokens(5)
    server = metrics.start_http_server("127.0.0.1", 0)
    try:
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        samples = _scrape(server.url)
        assert samples["kvcache_attention_tokens_total[]"] == 5
        assert any(k.startswith("process_resident_memory_bytes") for k in samples)
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)
    with pytest.raises(ValueError, match="port"):
        metrics.start_http_server("127.0.0.1", 70000)


def test_stats_read_on_the_owning_loop_and_failures_counted() -> None:
    """bind_stats(loop=...) runs fn on the loop thread, never on the scrape thread."""
    from cache_service.control.accounting import CacheStats, WorkerStats

    metrics = ServiceMetrics(bytes_per_block=2048)
    calls: list[int] = []
    state = {"fail": False}

    def snapshot() -> CacheStats:
        calls.append(threading.get_ident())
        if state["fail"]:
            raise RuntimeError("accounting unavailable")
        worker = WorkerStats(
            total=8, used=3, cached_free=1, free=4, allocated_slots=48, filled_slots=40
        )
        return CacheStats(
            workers={"w0": worker},
            utilization=3 / 8,
            fragmentation=8 / 48,
            prefix_query_tokens={"t": 10},
            prefix_hit_tokens={"t": 4},
            evictions=0,
            cow_copies=0,
            pinned_blocks=0,
            active_sequences=2,
            lost_sequences=0,
        )

    async def scenario() -> tuple[dict[str, float], dict[str, float]]:
        metrics.bind_stats(snapshot, loop=asyncio.get_running_loop())
        server = metrics.start_http_server("127.0.0.1", 0)
        try:
            ok = await asyncio.to_thread(_scrape, server.url)
            state["fail"] = True
            failed = await asyncio.to_thread(_scrape, server.url)
        finally:
            server.stop()
        return ok, failed

    loop_thread = threading.get_ident()
    ok, failed = asyncio.run(scenario())
    assert calls and all(t == loop_thread for t in calls)
    assert ok["kvcache_kv_held_bytes[('worker', 'w0')]"] == 3 * 2048
    assert ok["kvcache_pool_capacity_bytes[('worker', 'w0')]"] == 8 * 2048
    assert ok["kvcache_pool_utilization_ratio[('worker', 'w0')]"] == 3 / 8
    assert ok["kvcache_stats_collect_errors_total[]"] == 0
    # A failing read drops the pool families but keeps every other metric in the scrape.
    assert "kvcache_pool_capacity_blocks[('worker', 'w0')]" not in failed
    assert failed["kvcache_stats_collect_errors_total[]"] == 1
    assert "kvcache_lost_sequences_total[]" in failed


def test_bind_stats_rejects_bad_arguments() -> None:
    metrics = ServiceMetrics()
    with pytest.raises(ValueError, match="callable"):
        metrics.bind_stats(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bytes_per_block"):
        metrics.bind_stats(dict, bytes_per_block=0)
    with pytest.raises(ValueError, match="timeout_s"):
        metrics.bind_stats(dict, timeout_s=0)
    with pytest.raises(ValueError, match="bytes_per_block"):
        ServiceMetrics(bytes_per_block=-1)


def test_worker_data_calls_are_counted_by_path_and_removed_with_the_worker() -> None:
    m = ServiceMetrics()
    for path in ("channel", "channel", "ray", "in_process"):
        m.add_worker_data_call("w0", path)
    assert value(m, "kvcache_worker_data_calls_total", worker="w0", path="channel") == 2
    assert value(m, "kvcache_worker_data_calls_total", worker="w0", path="ray") == 1
    assert value(m, "kvcache_worker_data_calls_total", worker="w0", path="in_process") == 1
    with pytest.raises(ValueError, match="worker_id"):
        m.add_worker_data_call("", "ray")
    with pytest.raises(ValueError, match="path must be one of"):
        m.add_worker_data_call("w0", "carrier pigeon")
    m.remove_worker("w0")
    assert value(m, "kvcache_worker_data_calls_total", worker="w0", path="channel") is None


def test_worker_call_series_removed_with_the_worker_start_afresh_when_it_calls_again() -> None:
    # The labelled children are kept per worker for speed; a removed worker's must go too,
    # or later calls would be observed into series no longer exported.
    m = ServiceMetrics()
    m.observe_worker_call("w0", 4, 0.002)
    m.observe_worker_call("w0", 2, 0.001)
    assert value(m, "kvcache_worker_call_duration_seconds_count", worker="w0") == 2
    assert value(m, "kvcache_worker_batch_size_sum", worker="w0") == 6
    m.remove_worker("w0")
    assert value(m, "kvcache_worker_call_duration_seconds_count", worker="w0") is None
    assert value(m, "kvcache_worker_round_size_count", worker="w0") is None
    m.observe_worker_call("w0", 1, 0.003)
    assert value(m, "kvcache_worker_call_duration_seconds_count", worker="w0") == 1
    assert value(m, "kvcache_worker_batch_size_sum", worker="w0") == 1
    for bad in ("", None):
        with pytest.raises(ValueError, match="worker_id"):
            m.observe_worker_call(bad, 1, 0.001)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer_batch_size"):
        m.observe_worker_call("w0", 0, 0.001)
