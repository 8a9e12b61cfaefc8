"""Run a real Prometheus server (Debian's `prometheus`) for tests, and PromQL helpers.

The server listens on 127.0.0.1 only, keeps its TSDB in a temporary directory, scrapes the
given targets every `scrape_interval_s`, and is always terminated (then killed) on exit.
Every wait is bounded. `scripts/ensure-prometheus.sh` installs the binaries (`make test`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "PrometheusError",
    "PrometheusServer",
    "dashboard_queries",
    "promtool_check_exprs",
    "substitute_variables",
]


class PrometheusError(RuntimeError):
    """Prometheus did not start, or answered a query with an error."""


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http_json(url: str, timeout_s: float, data: bytes | None = None) -> Any:
    request = urllib.request.Request(url, data=data)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        # Prometheus reports bad queries as 400/422 with a JSON body naming the error.
        body = exc.read().decode(errors="replace")
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            raise PrometheusError(f"{url}: HTTP {exc.code}: {body[:500]}") from exc


@dataclass
class PrometheusServer:
    """One Prometheus process scraping `targets` ("host:port") under job `job`.

    Use as a context manager; `start()` waits (bounded) for /-/ready.
    """

    workdir: Path
    targets: list[str]
    job: str = "kvcache"
    scrape_interval_s: float = 1.0
    start_timeout_s: float = 30.0
    port: int = 0
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def config(self) -> dict[str, Any]:
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {
                    "job_name": self.job,
                    "scrape_interval": interval,
                    "scrape_timeout": interval,
                    "static_configs": [{"targets": list(self.targets)}],
                }
            ],
        }

    def start(self) -> PrometheusServer:
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusError(
                "the `prometheus` binary is not on PATH: run scripts/ensure-prometheus.sh "
                "(make test does)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config()))
        if not self.port:
            self.port = free_loopback_port()
        log = self.log_path.open("wb")
        try:
            self._proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own process group: stop() can signal it without touching pytest.
                start_new_session=True,
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self._proc.returncode}: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise PrometheusError(
            f"prometheus not ready within {self.start_timeout_s}s: {self.log_tail()}"
        )

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate, wait up to `grace_s`, then kill; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP API ---------------------------------------------------------------------------

    def api(self, path: str, params: dict[str, str], timeout_s: float = 10.0) -> Any:
        """POST to /api/v1/<path>; returns `data`, raises PrometheusError on an error status."""
        body = urllib.parse.urlencode(params).encode()
        reply = _http_json(f"{self.base_url}/api/v1/{path}", timeout_s, data=body)
        if reply.get("status") != "success":
            raise PrometheusError(
                f"{path} {params}: {reply.get('errorType')}: {reply.get('error')}"
            )
        return reply["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Evaluate an instant query; returns the result vector (or a one-item list for a
        scalar), each item with "metric" (labels) and "value" ([ts, "string"])."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", params)
        if data["resultType"] == "vector":
            return data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        raise PrometheusError(f"{expr!r} returned a {data['resultType']}, expected a vector")

    def target_health(self) -> list[dict[str, Any]]:
        return self.api_get("targets")["activeTargets"]

    def api_get(self, path: str, timeout_s: float = 10.0) -> Any:
        reply = _http_json(f"{self.base_url}/api/v1/{path}", timeout_s)
        if reply.get("status") != "success":
            raise PrometheusError(f"{path}: {reply.get('error')}")
        return reply["data"]

    def wait_for(
        self, what: str, predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.5
    ) -> None:
        """Poll `predicate` until true; raise PrometheusError naming `what` after timeout_s."""
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except PrometheusError as exc:
                last_error = exc
            time.sleep(poll_s)
        raise PrometheusError(f"timed out after {timeout_s}s waiting for {what} ({last_error})")

    def scrapes_of(self, expr: str) -> int:
        """How many samples `expr` (one series) has in the last 5 minutes."""
        result = self.query(f"count_over_time(({expr})[5m:{self.scrape_interval_s}s])")
        return int(float(result[0]["value"][1])) if result else 0


# -- dashboards --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    """One PromQL target of a dashboard panel."""

    panel: str
    ref_id: str
    expr: str


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard, rows' nested panels included (rows themselves too)."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(dashboard: dict[str, Any]) -> list[PanelQuery]:
    """Every target expression of every non-row panel."""
    queries = []
    for panel in iter_panels(dashboard):
        if panel.get("type") == "row":
            continue
        for target in panel.get("targets", []):
            queries.append(
                PanelQuery(
                    panel.get("title", "?"), target.get("refId", "?"), target.get("expr", "")
                )
            )
    return queries


_VARIABLE_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute_variables(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana variables ($name, ${name}, ${name:fmt}) by `values`; an unknown
    variable raises KeyError so a query can never reach Prometheus half-substituted."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for dashboard variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE_RE.sub(replace, expr)


def promtool_check_exprs(exprs: list[str], workdir: Path, timeout_s: float = 60.0) -> str:
    """Parse every expression with `promtool check rules` (one recording rule each).

    Returns promtool's output; raises PrometheusError with it when any expression fails.
    """
    binary = shutil.which("promtool")
    if binary is None:
        raise PrometheusError("`promtool` is not on PATH: run scripts/ensure-prometheus.sh")
    rules = {
        "groups": [
            {
                "name": "dashboard_queries",
                "rules": [
                    {"record": f"dashboard:query_{i}:check", "expr": expr}
                    for i, expr in enumerate(exprs)
                ],
            }
        ]
    }
    path = workdir / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    proc = subprocess.run(
        [binary, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise PrometheusError(f"promtool rejected the dashboard queries:\n{output}")
    return output


def exported_metric_names() -> set[str]:
    """Every sample name (with _total, _bucket, ...) a ServiceMetrics exports once each of
    its methods ran and a real BlockManager with a sequence on it is bound."""
    from cache_service.control.block_manager import BlockManager, BlockManagerConfig
    from cache_service.obs.metrics import ServiceMetrics

    bm = BlockManager(BlockManagerConfig(4, 1, "layout"))
    bm.add_worker("w0", 4, host_blocks=2)
    seq = bm.create_sequence("t", [1, 2, 3]).seq_id
    bm.prepare_write("t", seq, None, [1, 2, 3])
    metrics = ServiceMetrics()
    metrics.bind_stats(bm.stats, bytes_per_block=1024)
    metrics.set_worker_state("w0", True, "e0")
    metrics.observe_worker_call("w0", 1, 0.001)
    metrics.observe_tier_transfer("restore", 1024, 0.001)
    metrics.add_correctness_mismatch("w0", 0)
    metrics.observe_correctness_check(0.002)
    metrics.add_worker_data_call("w0", "channel")
    metrics.bind_event_loop_thread()
    metrics.observe_event_loop_lag(0.0001)
    metrics.rpc_requests.labels("s", "m", "OK").inc()
    metrics.rpc_duration.labels("s", "m", "OK").observe(0.001)
    return {s.name for f in metrics.registry.collect() for s in f.samples}
