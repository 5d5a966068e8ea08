"""End to end with Debian's real `prometheus`: it scrapes kvxfer's metrics and answers the
dashboard's queries.

A child process serves the real metric classes over HTTP on 127.0.0.1 (as the router and
workers will), a PrometheusRunner scrapes it every second, and the test polls Prometheus'
HTTP API until the values the child recorded show up exactly.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxfer.cluster.prometheus_runner import PrometheusRunner, find_prometheus_binary

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "k8s" / "grafana" / "kvxfer-dashboard.json"

pytestmark = pytest.mark.skipif(
    find_prometheus_binary() is None,
    reason="no prometheus binary: install Debian's `prometheus` package (scripts/run setup "
           "does) or set KVXFER_PROMETHEUS_BIN")

# What the child records; the assertions below are computed from these.
TTFT_SAMPLES_S = (0.012, 0.3, 2.0)
PUSHED_REQUEST_BYTES = 3 * 2**20
PUSHED_REQUESTS = 2
ENGINE_RAILS = [
    {"bytes_posted": 4096, "bytes_completed": 4096, "ops_posted": 2, "ops_completed": 2,
     "completion_errors": 0},
    {"bytes_posted": 8192, "bytes_completed": 6144, "ops_posted": 4, "ops_completed": 3,
     "completion_errors": 1},
]

SERVER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from prometheus_client import CollectorRegistry
from kvxfer.metrics import (DecodeMetrics, EngineMetrics, PrefillMetrics, RouterMetrics,
                            metrics_response)

spec = json.loads(sys.argv[1])
registry = CollectorRegistry()
router = RouterMetrics(registry)
router.set_kv_index({"decode-0": (12, 0.5)})  # per-worker series need a worker
prefill = PrefillMetrics(registry)
decode = DecodeMetrics(registry)
EngineMetrics(registry, lambda: spec["engine_rails"])
for seconds in spec["ttft_s"]:
    router.time_to_first_token.observe(seconds)
for _ in range(spec["pushed_requests"]):
    prefill.observe_transfer(spec["pushed_request_bytes"], 0.002, 0.001)
decode.set_pages(capacity=1000, free=750)
# The vLLM connector's metrics, as a prefill and a decode instance export them.
from kvxfer.metrics import ConnectorMetrics
connector = ConnectorMetrics("kv_producer", registry)
connector.push_tail.observe(0.004)
connector.admission_wait.observe(0.02)
connector.bytes_pushed.inc(spec["pushed_request_bytes"])

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/metrics":
            self.send_error(404)
            return
        body, content_type = metrics_response(registry, self.headers.get("Accept"))
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@pytest.fixture(scope="module")
def metrics_target() -> Iterator[str]:
    """host:port of a child process serving kvxfer metrics with known values."""
    spec = {"ttft_s": TTFT_SAMPLES_S, "pushed_request_bytes": PUSHED_REQUEST_BYTES,
            "pushed_requests": PUSHED_REQUESTS, "engine_rails": ENGINE_RAILS}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(spec)],
                             stdout=subprocess.PIPE, env=env, text=True)
    try:
        port_line = child.stdout.readline() if child.stdout else ""
        if not port_line.strip().isdigit():
            child.kill()
            pytest.fail(f"metrics server did not start (exit {child.wait()})")
        yield f"127.0.0.1:{port_line.strip()}"
    finally:
        child.terminate()
        child.wait(timeout=10)


@pytest.fixture(scope="module")
def prometheus(metrics_target: str) -> Iterator[PrometheusRunner]:
    with PrometheusRunner({"kvxfer": [metrics_target]}, scrape_interval_s=1.0) as prom:
        prom.wait_for('up{job="kvxfer"}', lambda v: v == 1, timeout_s=20)
        yield prom


def test_prometheus_scrapes_kv_bytes_pushed_total(prometheus: PrometheusRunner) -> None:
    value = prometheus.wait_for("kvxfer_prefill_kv_pushed_bytes_total",
                                lambda v: v > 0, timeout_s=15)
    assert value == PUSHED_REQUEST_BYTES * PUSHED_REQUESTS


def test_prometheus_sees_ttft_histogram_count_sum_and_buckets(
        prometheus: PrometheusRunner) -> None:
    count = prometheus.wait_for("kvxfer_router_time_to_first_token_seconds_count",
                                lambda v: v > 0, timeout_s=15)
    assert count == len(TTFT_SAMPLES_S)
    assert prometheus.query_value("kvxfer_router_time_to_first_token_seconds_sum") == \
        pytest.approx(sum(TTFT_SAMPLES_S))
    below_25ms = prometheus.query_value(
        'kvxfer_router_time_to_first_token_seconds_bucket{le="0.025"}')
    assert below_25ms == sum(1 for s in TTFT_SAMPLES_S if s <= 0.025)
    # The median sample (0.3 s) lies in the (0.25, 0.5] bucket, so Prometheus' interpolated
    # p50 must land there too: this checks the bucket boundaries survived the scrape.
    p50 = prometheus.query_value("histogram_quantile(0.5, sum by (le) "
                                 "(kvxfer_router_time_to_first_token_seconds_bucket))")
    assert p50 is not None and 0.25 < p50 <= 0.5


def test_prometheus_sees_engine_counters_per_rail(prometheus: PrometheusRunner) -> None:
    prometheus.wait_for("count(kvxfer_engine_completed_bytes_total)", lambda v: v == 2,
                        timeout_s=15)
    for rail, stats in enumerate(ENGINE_RAILS):
        assert prometheus.query_value(
            f'kvxfer_engine_completed_bytes_total{{rail="{rail}"}}') == stats["bytes_completed"]
        assert prometheus.query_value(
            f'kvxfer_engine_completion_errors_total{{rail="{rail}"}}') == stats["completion_errors"]


def test_known_label_values_are_exported_before_any_event(
        prometheus: PrometheusRunner) -> None:
    # Zero-initialised series let rate() report 0 instead of nothing.
    assert prometheus.query_value('kvxfer_router_requests_total{status="ok"}') == 0
    assert prometheus.query_value(
        'kvxfer_prefill_kv_transfer_failures_total{reason="timeout"}') == 0


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    # Grafana substitutes these before sending; use what it would send for "All".
    return [e.replace("$__rate_interval", "1m").replace('"$namespace"', '".*"')
            for e in exprs]


def test_every_dashboard_query_is_valid_promql_and_returns_series(
        prometheus: PrometheusRunner) -> None:
    # rate() needs two samples in its window; wait for the third scrape.
    prometheus.wait_for('count_over_time(up{job="kvxfer"}[1m])', lambda v: v >= 3,
                        timeout_s=15)
    empty = []
    for expr in _dashboard_queries():
        result = prometheus.query(expr)  # raises PrometheusError on a PromQL error
        # vLLM's own vllm:* series come from real vLLM instances only: the panels that show
        # them are checked against a `kvxfer up --engine vllm` in tests/integrations/test_vllm_up.py.
        if not result and "vllm:" not in expr:
            empty.append(expr)
    assert not empty, f"dashboard queries with no series: {empty}"


def test_page_utilization_query_computes_the_reserved_share(
        prometheus: PrometheusRunner) -> None:
    expr = next(e for e in _dashboard_queries()
                if re.match(r"sum\(kvxfer_decode_kv_pages_reserved", e))
    value = prometheus.wait_for(expr, lambda v: not math.isnan(v), timeout_s=15)
    assert value == pytest.approx(0.25)
