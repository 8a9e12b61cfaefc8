"""Structure of the Grafana dashboard and its provisioning (deploy/grafana/).

Checks what Grafana and Prometheus would reject or silently mis-render: a hard-coded
data source, fixed rate windows, panels without a query, PromQL that does not parse
(parsed by the real `promtool`), metric names the service does not export.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_harness import (
    dashboard_queries,
    iter_panels,
    promtool_check_exprs,
    substitute_variables,
)

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD_PATH = GRAFANA / "dashboards" / "kvcache.json"
DATASOURCE_REFS = {"${datasource}", "$datasource"}
REQUIRED_ROWS = {"Capacity", "Prefix sharing", "Traffic and latency", "Errors and worker health"}
# What the tests substitute for the dashboard's variables ("All" for the multi-value ones).
TEST_VARIABLES = {
    "__rate_interval": "1m",
    "worker": ".*",
    "tenant": ".*",
    "job": ".*",
}
RANGE_FUNCTIONS = re.compile(r"\b(rate|irate|increase|delta|idelta|deriv|\w+_over_time)\s*\(")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_PATH.read_text())


def _walk(node: Any, path: str = "") -> list[tuple[str, str, Any]]:
    """(path, key, value) for every key of every nested dict."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.append((path, key, value))
            found += _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _walk(value, f"{path}[{i}]")
    return found


def test_datasource_variable_and_no_hard_coded_uids(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables.get("datasource")
    assert ds is not None, "the dashboard needs a `datasource` variable"
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    # Every uid below the top level must be the variable: a fixed uid breaks the dashboard
    # in any Grafana whose Prometheus data source was created with another uid.
    bad = [
        f"{path}.{key}={value!r}"
        for path, key, value in _walk(dashboard)
        if key == "uid" and path != "" and value not in DATASOURCE_REFS
    ]
    assert not bad, f"hard-coded uids: {bad}"
    for panel in iter_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] in DATASOURCE_REFS, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in DATASOURCE_REFS, panel["title"]
    for name in ("worker", "tenant", "job"):
        assert variables[name]["datasource"]["uid"] in DATASOURCE_REFS


def test_rows_panels_and_queries(dashboard: dict[str, Any]) -> None:
    rows = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert rows >= REQUIRED_ROWS, f"missing rows: {REQUIRED_ROWS - rows}"
    panels = [p for p in iter_panels(dashboard) if p["type"] != "row"]
    ids = [p["id"] for p in iter_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), f"panel {panel['title']!r} has an empty query"
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
    titles = " / ".join(p["title"] for p in panels).lower()
    for needed in ("utilization", "fragmentation", "free blocks", "hit", "evictions", "p99"):
        assert needed in titles, f"no panel about {needed!r}"


def test_rates_use_rate_interval(dashboard: dict[str, Any]) -> None:
    for query in dashboard_queries(dashboard):
        windows = re.findall(r"\[([^\]]*)\]", query.expr)
        assert windows or not RANGE_FUNCTIONS.search(query.expr), query
        for window in windows:
            assert window == "$__rate_interval", (
                f"{query.panel} {query.ref_id}: window [{window}] should be [$__rate_interval]"
            )


def test_every_query_parses_with_promtool(dashboard: dict[str, Any], tmp_path: Path) -> None:
    queries = dashboard_queries(dashboard)
    exprs = [substitute_variables(q.expr, TEST_VARIABLES) for q in queries]
    output = promtool_check_exprs(exprs, tmp_path)
    assert f"SUCCESS: {len(exprs)} rules found" in output, output


def test_promtool_check_can_fail(tmp_path: Path) -> None:
    # The parse check above is only worth something if a broken query is rejected.
    from prometheus_harness import PrometheusError

    with pytest.raises(PrometheusError, match="promtool rejected"):
        promtool_check_exprs(["sum(rate(kvcache_rpc_requests_total[1m])"], tmp_path)


def test_substitution_refuses_unknown_variables() -> None:
    assert substitute_variables('x{w=~"${worker}"}[$__rate_interval]', TEST_VARIABLES) == (
        'x{w=~".*"}[1m]'
    )
    with pytest.raises(KeyError, match="nope"):
        substitute_variables("rate(x[$nope])", TEST_VARIABLES)


def test_variable_queries_use_exported_metrics(dashboard: dict[str, Any]) -> None:
    from prometheus_harness import exported_metric_names

    names = exported_metric_names()
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        metric = re.match(r"label_values\((\w+),", variable["query"]["query"]).group(1)
        assert metric in names, f"variable {variable['name']} reads unknown {metric}"


def test_panel_metrics_are_exported_by_the_service(dashboard: dict[str, Any]) -> None:
    from prometheus_harness import exported_metric_names

    names = exported_metric_names()
    used = set()
    for query in dashboard_queries(dashboard):
        used |= set(re.findall(r"\bkvcache_\w+", query.expr))
    unknown = sorted(used - names)
    assert not unknown, f"dashboard queries metrics the service does not export: {unknown}"


def test_provisioning_files() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    assert datasources["apiVersion"] == 1
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["url"].startswith("http")
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/kvcache.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    # The compose file mounts the dashboards folder where the provider looks for it.
    compose = yaml.safe_load((ROOT / "deploy/docker/compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(
        m.split(":")[1] == provider["options"]["path"] and "grafana/dashboards" in m for m in mounts
    ), mounts
