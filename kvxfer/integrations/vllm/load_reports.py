"""What each finished KV load moved, kept for the router to ask after a streamed answer.

vLLM 0.32's OpenAI server puts the connector's `kv_transfer_params` only in a non-streamed
answer (`engine_core_side._load_report` writes the decode instance's figures there), so a
streamed request's figures never reach the router with its answer. The decode instance
therefore also keeps each landed load's figures (pages loaded, bytes loaded, pages held,
the same ones) under the router's `transfer_id`, for `load_report_keep_s` and at most
`load_reports_max` entries, and serves them once at ``GET /kvxfer/loads/<transfer_id>``
on the connector's existing metrics port (no new port to open or discover).

The figures are made on the worker side, not in the engine core: the engine core's
process has no HTTP server (at tensor parallel size above 1 the workers are other
processes), and it learns of a finished request only when vLLM finishes it, with no step
afterwards that could carry the figures to a worker. The worker's receiver knows the load
landed (`get_finished`), and the load's spec gives its blocks and the prompt blocks held
already; the bytes use this rank's page size, as the engine core's figure uses vLLM's
per-rank KV cache spec, and a Mamba/SSM layer's block counts its state bytes, not its
padded page (what moved; `EngineCoreSide._block_geometry` on the engine core's side). The
router asks rank 0 (the registry record's `metrics_url`).

The endpoint checks the instance's own API key (`VLLM_API_KEY`, which the router derives
from the cluster key): a call without it, or with another, gets 401 and nothing else. An
instance without a key serves its OpenAI API openly and this endpoint too. A report is
removed when it is served: the router asks once.
"""

from __future__ import annotations

import hmac
import json
import re
import socketserver
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

#: Where a load's report is served: the path, then the router's transfer id.
LOADS_PATH = "/kvxfer/loads/"
# Transfer ids are the router's (`kx-` and hex); anything else is no id of ours.
_TRANSFER_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

if TYPE_CHECKING:
    from .kv_region import KVRegion
    from .metadata import LoadSpec

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


@dataclass(frozen=True)
class LoadReport:
    """What one decode request's load moved: KV pages (blocks of one layer) and bytes that
    came from the prefill instance, and the pages this instance held already."""

    pages_loaded: int
    bytes_loaded: int
    pages_held: int

    def as_params(self) -> dict[str, Any]:
        """The report in the shape of the connector's `kv_transfer_params` in a non-streamed answer."""
        return {"kvxfer": {"role": "decode", "pages_loaded": self.pages_loaded, "bytes_loaded": self.bytes_loaded,
                           "pages_held": self.pages_held}}


def landed_load_report(region: KVRegion, spec: LoadSpec) -> LoadReport:
    """The figures of load `spec`, landed in `region`, as the engine core's `_load_report`
    makes them: per layer, its group's blocks (null ones, -1, never travel), each moving a
    state layer's state or an attention layer's page; the held pages are every layer's
    prompt blocks before `first_page`."""
    groups = spec.group_block_ids or [spec.block_ids]
    pages = bytes_loaded = 0
    for layer in range(region.num_layers):
        blocks = sum(1 for b in groups[region.group(layer)] if b >= 0)
        pages += blocks
        bytes_loaded += blocks * (region.state_length(layer) or region.block_bytes)
    return LoadReport(pages_loaded=pages, bytes_loaded=bytes_loaded, pages_held=spec.first_page * region.num_layers)


class LoadReportStore:
    """Reports of finished loads by transfer id, each kept `keep_s` seconds, at most
    `max_entries` (the oldest go first); thread-safe (vLLM's worker thread puts, the HTTP
    server's threads take)."""

    def __init__(self, keep_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        self._clock = clock
        self._reports: OrderedDict[str, tuple[float, LoadReport]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, transfer_id: str, report: LoadReport) -> None:
        """Keep `report` for `transfer_id` (a second report for it replaces the first)."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._reports.pop(transfer_id, None)
            self._reports[transfer_id] = (now, report)
            while len(self._reports) > self.max_entries:
                self._reports.popitem(last=False)

    def take(self, transfer_id: str) -> LoadReport | None:
        """The report of `transfer_id`, removed; None when unknown or expired."""
        with self._lock:
            self._expire(self._clock())
            entry = self._reports.pop(transfer_id, None)
        return entry[1] if entry is not None else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._reports)

    def _expire(self, now: float) -> None:
        while self._reports:
            stored_at, _ = next(iter(self._reports.values()))
            if now - stored_at <= self.keep_s:
                return
            self._reports.popitem(last=False)


def _json(start_response: StartResponse, status: str, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]


def connector_http_app(registry: CollectorRegistry, store: LoadReportStore, api_key: str | None) -> WsgiApp:
    """The connector's HTTP app: ``/metrics`` (and every other path) as prometheus_client
    serves `registry`, and ``GET /kvxfer/loads/<transfer_id>`` from `store`, for callers
    that present `api_key` as ``Authorization: Bearer`` (anyone when `api_key` is None)."""
    metrics_app = make_wsgi_app(registry)
    expected = f"Bearer {api_key}".encode() if api_key else None

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if not path.startswith(LOADS_PATH):
            return metrics_app(environ, start_response)
        presented = environ.get("HTTP_AUTHORIZATION", "").encode()
        if expected is not None and not hmac.compare_digest(presented, expected):
            return _json(start_response, "401 Unauthorized", {"error": "unauthorized"})
        if environ.get("REQUEST_METHOD") != "GET":
            return _json(start_response, "405 Method Not Allowed", {"error": "GET only"})
        transfer_id = path[len(LOADS_PATH):]
        report = store.take(transfer_id) if _TRANSFER_ID.match(transfer_id) else None
        if report is None:
            return _json(start_response, "404 Not Found", {"error": "no report for this transfer id"})
        return _json(start_response, "200 OK", report.as_params())

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        # Prometheus scrapes every few seconds: a line each would drown vLLM's own log.
        pass


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


def serve_connector_http(port: int, app: WsgiApp, host: str = "0.0.0.0") -> WSGIServer:
    """Serve `app` on `host`:`port` from a daemon thread (as prometheus_client's own
    `start_http_server` does); returns the server (its `shutdown()` stops it)."""
    server = make_server(host, port, app, _ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="kvxfer-connector-http", daemon=True).start()
    return server


__all__ = ["LOADS_PATH", "LoadReport", "LoadReportStore", "connector_http_app", "landed_load_report",
           "serve_connector_http"]
