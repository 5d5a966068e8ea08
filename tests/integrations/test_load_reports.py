"""A decode instance keeps each landed load's figures for the router to ask after a
streamed answer (`kvxfer.integrations.vllm.load_reports`): the store is bounded and
forgets after `keep_s`; the endpoint on the connector's metrics port answers only the
instance's API key (401 and nothing else without it), serves a report once, and leaves
/metrics as prometheus_client serves it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from support.vllm_instances import free_port

from kvxfer.integrations.vllm.load_reports import (
    LOADS_PATH,
    LoadReport,
    LoadReportStore,
    connector_http_app,
    serve_connector_http,
)

API_KEY = "k" * 64
REPORT = LoadReport(pages_loaded=8, bytes_loaded=131072, pages_held=4)


class Clock:
    """A hand-moved clock for the store's expiry."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_report_is_taken_once_and_an_unknown_id_has_none() -> None:
    store = LoadReportStore(keep_s=60, max_entries=8)
    store.put("kx-a", REPORT)
    assert store.take("kx-unknown") is None
    assert store.take("kx-a") == REPORT
    assert store.take("kx-a") is None


def test_a_report_older_than_keep_s_is_forgotten() -> None:
    clock = Clock()
    store = LoadReportStore(keep_s=10, max_entries=8, clock=clock)
    store.put("kx-old", REPORT)
    clock.now += 5
    store.put("kx-new", REPORT)
    clock.now += 6  # kx-old is 11 s old, kx-new 6 s
    assert store.take("kx-old") is None
    assert store.take("kx-new") == REPORT
    assert len(store) == 0


def test_the_store_holds_at_most_max_entries_dropping_the_oldest() -> None:
    store = LoadReportStore(keep_s=60, max_entries=3)
    for i in range(5):
        store.put(f"kx-{i}", LoadReport(i, i, i))
    assert len(store) == 3
    assert [store.take(f"kx-{i}") for i in range(5)] == [None, None, *(LoadReport(i, i, i) for i in (2, 3, 4))]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, LoadReportStore]]:
    """(base URL, store) of one connector HTTP server with a key, for the module."""
    registry = CollectorRegistry()
    Counter("kvxfer_connector_test_marker", "a series /metrics must still show", registry=registry).inc()
    store = LoadReportStore(keep_s=60, max_entries=64)
    port = free_port()
    server = serve_connector_http(port, connector_http_app(registry, store, API_KEY), host="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{port}", store
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer " + "x" * 64}, {"Authorization": API_KEY}],
                         ids=["no key", "wrong key", "not a bearer"])
def test_a_call_without_the_instances_key_gets_401_and_the_report_stays(
        served: tuple[str, LoadReportStore], headers: dict[str, str]) -> None:
    url, store = served
    store.put("kx-guarded", REPORT)
    r = httpx.get(f"{url}{LOADS_PATH}kx-guarded", headers=headers, trust_env=False)
    assert r.status_code == 401
    assert r.json() == {"error": "unauthorized"}
    assert store.take("kx-guarded") == REPORT  # not served, so still there


def test_the_key_gets_the_report_once_in_kv_transfer_params_shape(served: tuple[str, LoadReportStore]) -> None:
    url, store = served
    store.put("kx-served", REPORT)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(f"{url}{LOADS_PATH}kx-served", headers=headers, trust_env=False)
    assert r.status_code == 200
    assert r.json() == {"kvxfer": {"role": "decode", "pages_loaded": 8, "bytes_loaded": 131072, "pages_held": 4}}
    assert httpx.get(f"{url}{LOADS_PATH}kx-served", headers=headers, trust_env=False).status_code == 404
    assert httpx.get(f"{url}{LOADS_PATH}..%2Fmetrics", headers=headers, trust_env=False).status_code == 404


def test_metrics_are_served_as_before(served: tuple[str, LoadReportStore]) -> None:
    url, _ = served
    r = httpx.get(f"{url}/metrics", trust_env=False)
    assert r.status_code == 200
    assert "kvxfer_connector_test_marker_total 1.0" in r.text
