"""The Grafana dashboard only queries metrics kvxfer actually exports.

Sample names come from the real metric classes on a fresh registry (histograms export
_bucket/_sum/_count, counters _total), so a renamed metric fails here instead of leaving an
empty panel in production.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvxfer.metrics import (ALL_METRIC_NAMES, ConnectorMetrics, DecodeMetrics, EngineMetrics, PrefillMetrics,
                            RouterMetrics, WorkerAuthMetrics, all_metric_names, exported_sample_names)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = REPO / "k8s" / "grafana" / "kvxfer-dashboard.json"
METRIC_NAME = re.compile(r"\bkvxfer_[a-zA-Z0-9_:]*")
#: Labels Prometheus attaches to every target (static configs and the operator's monitors;
#: `worker` and `role` come with `kvxfer up`'s prometheus-targets.json); `le` is the histogram
#: bucket label.
TARGET_LABELS = {"namespace", "pod", "job", "instance", "container", "service", "endpoint",
                 "worker", "role", "le"}
ENGINE_STATS = [{"bytes_posted": 1, "bytes_completed": 1, "ops_posted": 1,
                 "ops_completed": 1, "completion_errors": 0}]

#: Panels the dashboard must have (title pattern -> a metric its queries must use).
REQUIRED_PANELS = {
    r"time to first token": "kvxfer_router_time_to_first_token_seconds_bucket",
    r"inter-token latency": "kvxfer_router_inter_token_latency_seconds_bucket",
    r"end-to-end latency": "kvxfer_router_request_duration_seconds_bucket",
    r"request rate by status": "kvxfer_router_requests_total",
    r"transfer throughput": "kvxfer_prefill_kv_transfer_bytes_per_second_bucket",
    r"kv bytes pushed": "kvxfer_prefill_kv_pushed_bytes_total",
    r"page utilization": "kvxfer_decode_kv_pages_reserved",
    r"queue depth": "kvxfer_prefill_queue_depth",
    r"waiting for kv / running": "kvxfer_decode_requests_waiting_for_kv",
    r"transfer failures by reason": "kvxfer_prefill_kv_transfer_failures_total",
    r"admission timeouts": "kvxfer_decode_admission_timeouts_total",
    r"rejected": "kvxfer_router_rejected_requests_total",
    r"workers by role and state": "kvxfer_router_workers",
    r"engine bytes per rail": "kvxfer_engine_completed_bytes_total",
    r"kv bytes moved per request": "kvxfer_router_request_kv_moved_bytes_bucket",
    r"kv pages moved / held by the decoder": "kvxfer_router_kv_pages_not_sent_total",
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_PATH.read_text())


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every exported sample name -> the label names its samples carry."""
    registry = CollectorRegistry()
    RouterMetrics(registry).set_kv_index({"worker": (0, 0.0)})  # per-worker series need a worker
    DecodeMetrics(registry)
    PrefillMetrics(registry)
    WorkerAuthMetrics(registry)
    EngineMetrics(registry, lambda: ENGINE_STATS)
    ConnectorMetrics("kv_producer", registry)
    labels: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows nest their panels
    return panels


def _queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if variable.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def _labels_used(expr: str) -> set[str]:
    used = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        used.update(label.strip() for label in group.split(",") if label.strip())
    for selector in re.findall(r"\{([^}]*)\}", expr):
        used.update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector))
    return used


def test_every_metric_the_dashboard_queries_is_exported(
        dashboard: dict[str, Any], exported: dict[str, set[str]]) -> None:
    referenced = {name for expr in _queries(dashboard) for name in METRIC_NAME.findall(expr)}
    assert referenced, "no kvxfer metric found in the dashboard's queries"
    assert referenced - exported.keys() == set()


def test_every_label_the_dashboard_groups_or_filters_by_exists(
        dashboard: dict[str, Any], exported: dict[str, set[str]]) -> None:
    for expr in _queries(dashboard):
        metric_labels = set().union(*(exported.get(n, set()) for n in METRIC_NAME.findall(expr)))
        unknown = _labels_used(expr) - metric_labels - TARGET_LABELS
        assert not unknown, f"{expr}: labels {unknown} are on none of its metrics"


@pytest.mark.parametrize("title_pattern", sorted(REQUIRED_PANELS))
def test_dashboard_has_required_panel(dashboard: dict[str, Any], title_pattern: str) -> None:
    panels = [p for p in _panels(dashboard)
              if re.search(title_pattern, p.get("title", ""), re.IGNORECASE)]
    assert panels, f"no panel titled like '{title_pattern}'"
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    assert REQUIRED_PANELS[title_pattern] in exprs


def test_latency_panels_show_p50_p95_p99(dashboard: dict[str, Any]) -> None:
    for title in ("time to first token", "inter-token latency", "end-to-end latency"):
        panel = next(p for p in _panels(dashboard) if title in p.get("title", "").lower())
        quantiles = {re.match(r"histogram_quantile\(([0-9.]+)", t["expr"]).group(1)
                     for t in panel["targets"]}
        assert quantiles == {"0.5", "0.95", "0.99"}


def test_panels_have_unique_ids_a_datasource_and_fit_the_grid(
        dashboard: dict[str, Any]) -> None:
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]


def test_all_metric_names_constant_matches_what_the_classes_export(
        exported: dict[str, set[str]]) -> None:
    # The vLLM connector's metrics live with it (kvxfer.integrations), outside kvxfer.metrics.
    assert ALL_METRIC_NAMES == all_metric_names() == {n for n in exported if not n.startswith("kvxfer_connector_")}


def test_exported_names_follow_prometheus_conventions(exported: dict[str, set[str]]) -> None:
    # Dashboards and alerts rely on these: one prefix, and units in histogram names.
    registry = CollectorRegistry()
    RouterMetrics(registry).set_kv_index({"worker": (0, 0.0)})  # per-worker series need a worker
    DecodeMetrics(registry)
    PrefillMetrics(registry)
    WorkerAuthMetrics(registry)
    EngineMetrics(registry, lambda: ENGINE_STATS)
    ConnectorMetrics("kv_producer", registry)
    for family in registry.collect():
        assert family.name.startswith("kvxfer_"), family.name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", family.name), family.name
        if family.type == "histogram":
            assert re.search(r"_(seconds|bytes|bytes_per_second)$", family.name), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        if family.type == "gauge":
            assert not family.name.endswith("_total"), family.name
    assert exported_sample_names(registry) == set(exported)
