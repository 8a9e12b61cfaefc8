"""The coordinator's event-loop metrics: the loop thread's CPU seconds read from that
thread's clock at scrape time, the lag probe, and both on a running service."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_support import ServiceHarness, local_workers, service_config

from cache_service.client import KVCacheClient
from cache_service.obs.loop import probe_loop_lag
from cache_service.obs.metrics import ServiceMetrics

CPU = "kvcache_event_loop_cpu_seconds_total"


def _value(metrics: ServiceMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


def _spin(cpu_seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < cpu_seconds:
        pass


def test_the_counter_is_the_bound_threads_cpu_time_not_the_processs() -> None:
    metrics = ServiceMetrics()
    spun, release = threading.Event(), threading.Event()
    used: dict[str, float] = {}

    def busy() -> None:
        _spin(0.3)
        used["bound"] = float(metrics.bind_event_loop_thread())
        used["cpu"] = time.thread_time()
        spun.set()
        release.wait(30)

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        assert spun.wait(30)
        assert used["bound"] == 1.0
        _spin(0.3)  # this thread's CPU must not show in the other's counter
        seen = _value(metrics, CPU)
        assert seen is not None and seen >= 0.3
        assert seen == pytest.approx(used["cpu"], abs=0.05)
    finally:
        release.set()
        thread.join(30)
    # Its thread ended: the series leaves the scrape and every other metric stays.
    assert _value(metrics, CPU) is None
    assert _value(metrics, "kvcache_lost_sequences_total") == 0


def test_binding_again_replaces_the_thread_and_unbinding_removes_the_series() -> None:
    metrics = ServiceMetrics()
    metrics.unbind_event_loop_thread()  # nothing bound: a no-op
    assert metrics.bind_event_loop_thread()
    main_cpu = time.thread_time()  # this thread imported torch: well over a second
    used: dict[str, float] = {}

    def rebind() -> None:
        _spin(0.05)
        metrics.bind_event_loop_thread()
        used["cpu"] = time.thread_time()
        used["seen"] = _value(metrics, CPU) or -1.0
        names = [f.name for f in metrics.registry.collect()]
        used["families"] = names.count(CPU.removesuffix("_total"))

    thread = threading.Thread(target=rebind)
    thread.start()
    thread.join(30)
    # The series followed the new thread (not this one's CPU), and is there once.
    assert used["seen"] == pytest.approx(used["cpu"], abs=0.03) and used["seen"] < main_cpu
    assert used["families"] == 1
    metrics.unbind_event_loop_thread()
    assert _value(metrics, CPU) is None
    metrics.unbind_event_loop_thread()


@pytest.mark.parametrize("seconds", [-0.1, float("nan"), float("inf"), True, "1"])
def test_a_bad_lag_observation_changes_nothing(seconds: Any) -> None:
    metrics = ServiceMetrics()
    with pytest.raises(ValueError, match="seconds"):
        metrics.observe_event_loop_lag(seconds)
    assert _value(metrics, "kvcache_event_loop_lag_seconds_count") == 0


def test_the_probe_reports_a_stalled_loop() -> None:
    lags: list[float] = []

    async def scenario() -> None:
        probe = asyncio.get_running_loop().create_task(probe_loop_lag(lags.append, 0.02))
        await asyncio.sleep(0.1)
        before = len(lags)
        time.sleep(0.25)  # the loop is held: the probe's wake-up is due meanwhile
        await asyncio.sleep(0.1)
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        assert before >= 1 and len(lags) > before
        assert max(lags[before:]) >= 0.2

    asyncio.run(scenario())
    assert min(lags) >= 0 and min(lags) < 0.2


@pytest.mark.parametrize("interval", [0, -1, float("nan"), float("inf"), True, "0.5"])
def test_the_probe_refuses_a_bad_interval(interval: Any) -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="interval_s"):
            await probe_loop_lag(lambda _: None, interval)

    asyncio.run(scenario())


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_running_service_exports_its_loops_cpu_and_lag_and_stops_both() -> None:
    config = service_config(
        **{"metrics.enabled": True, "metrics.port": 0, "metrics.event_loop_lag_interval_s": 0.05}
    )
    harness = ServiceHarness(config, local_workers(1, 64))
    try:
        url = harness.service.metrics_http.url
        first = _scrape(url)
        with KVCacheClient(harness.address, timeout_s=30) as client:
            for _ in range(20):
                client.info()
        time.sleep(0.3)
        later = _scrape(url)
        loop_cpu = harness.call(time.thread_time)  # read on the loop's own thread
        assert 0 < first[CPU] < later[CPU] <= loop_cpu
        # The loop's thread, not the process: this test's thread and the client's are out.
        assert later[CPU] < later["process_cpu_seconds_total"]
        assert later["kvcache_event_loop_lag_seconds_count"] >= 4
        metrics = harness.service.metrics
    finally:
        harness.stop()
    # Stopped: the loop's series is gone and the probe observes no more.
    count = _value(metrics, "kvcache_event_loop_lag_seconds_count")
    time.sleep(0.2)
    assert _value(metrics, CPU) is None
    assert _value(metrics, "kvcache_event_loop_lag_seconds_count") == count
