"""The router's metric events, mapped onto ``kvxfer.metrics.RouterMetrics``.

The metric objects themselves are declared in ``kvxfer/metrics.py`` (one place for every
name); this module only says *when* they move, so dispatch and admission code call
``telemetry.retry("prefill")`` instead of reaching into Prometheus objects. The wrapped
object is duck-typed (attributes ``requests``, ``time_to_first_token``,
``inter_token_latency``, ``request_duration``, ``requests_in_flight``, ``retries``,
``rejected``, ``set_workers``); with ``None`` every event is a no-op.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterable

from prometheus_client import CollectorRegistry

from kvxfer.metrics import RouterMetrics

from .directory import WorkerView
from .policies import RoutingEstimate

log = logging.getLogger(__name__)


class RouterTelemetry:
    """Records router events on a ``RouterMetrics``-shaped object (or nowhere).

    Outcome labels follow ``kvxfer.metrics.REQUEST_STATUSES`` (ok, error, rejected,
    cancelled, timeout); retry stages ``RETRY_STAGES`` (reserve, prefill, generate);
    rejection codes ``REJECT_CODES`` ("429", "503").
    """

    def __init__(self, metrics: Any | None = None) -> None:
        self.metrics = metrics

    def request_admitted(self) -> None:
        """A request got an in-flight slot."""
        if self.metrics is not None:
            self.metrics.requests_in_flight.inc()

    def request_finished(self, status: str, duration_s: float) -> None:
        """An admitted request ended with ``status`` after ``duration_s`` seconds."""
        if self.metrics is not None:
            self.metrics.requests_in_flight.dec()
            self.metrics.requests.labels(status).inc()
            self.metrics.request_duration.observe(duration_s)

    def colocated_fallback(self, reason: str) -> None:
        """A request that needed prefill went to a decode worker alone (``FALLBACK_REASONS``)."""
        if self.metrics is not None:
            self.metrics.colocated_fallbacks.labels(reason).inc()

    def rejected(self, code: int) -> None:
        """A request was refused at admission with HTTP ``code`` (429 or 503)."""
        if self.metrics is not None:
            self.metrics.rejected.labels(str(code)).inc()
            self.metrics.requests.labels("rejected").inc()

    def rejected_after_admission(self, code: int) -> None:
        """An admitted request was shed with HTTP ``code`` (429: every worker full or too
        slow to reserve); its outcome, ``rejected``, is counted by ``request_finished``."""
        if self.metrics is not None:
            self.metrics.rejected.labels(str(code)).inc()

    def first_token(self, seconds: float) -> None:
        """The first token reached the client ``seconds`` after arrival."""
        if self.metrics is not None:
            self.metrics.time_to_first_token.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        """``seconds`` passed between two consecutive tokens of one stream."""
        if self.metrics is not None:
            self.metrics.inter_token_latency.observe(seconds)

    def loop_lag(self, seconds: float) -> None:
        """The event loop ran a timer ``seconds`` late."""
        if self.metrics is not None and hasattr(self.metrics, "event_loop_lag"):
            self.metrics.event_loop_lag.observe(seconds)

    def retry(self, stage: str) -> None:
        """A request is retried on another pair after failing at ``stage``."""
        if self.metrics is not None:
            self.metrics.retries.labels(stage).inc()

    def registry_rejections(self, totals: dict[str, int]) -> None:
        """Publish the registry watcher's counts of values it did not admit."""
        if self.metrics is not None:
            self.metrics.set_registry_rejections(totals)

    def pair_decision(self, policy: str, estimate: RoutingEstimate) -> None:
        """The policy chose a pair (or a decode worker alone) for a request that needed
        prefill, expecting the prompt blocks ``estimate`` names to be held already."""
        if self.metrics is None or not hasattr(self.metrics, "policy_decisions"):
            return
        self.metrics.policy_decisions.labels(policy, estimate.outcome).inc()
        self.metrics.estimated_prefix_hit_blocks.labels("decode").inc(estimate.decode_hit_blocks)
        self.metrics.estimated_prefix_hit_blocks.labels("prefill").inc(estimate.prefill_hit_blocks)

    def prefill_reply(self, reply: dict[str, Any]) -> None:
        """A prefill worker's ``/prefill`` answer: the KV it pushed and the pages it did not
        push because the decoder held them, for the figures its answer carries."""
        self._kv_moved(reply.get("kv_bytes"), reply.get("pages_pushed"), reply.get("pages_skipped"))

    def decode_load_report(self, report: dict[str, Any]) -> None:
        """A vLLM decode instance's answer said what its load moved (the connector's
        ``kv_transfer_params["kvxfer"]``: ``bytes_loaded``, ``pages_loaded``, ``pages_held``),
        the same figures a builtin prefill worker's ``/prefill`` answer carries."""
        self._kv_moved(report.get("bytes_loaded"), report.get("pages_loaded"), report.get("pages_held"))

    def load_report_fetch_failed(self, reason: str) -> None:
        """No load figures came from a decode instance after a streamed answer
        (``kvxfer.metrics.LOAD_REPORT_FETCH_FAILURES``)."""
        if self.metrics is not None and hasattr(self.metrics, "load_report_fetch_failures"):
            self.metrics.load_report_fetch_failures.labels(reason).inc()

    def _kv_moved(self, kv_bytes: Any, pages_moved: Any, pages_not_sent: Any) -> None:
        """One request's KV moved and pages not sent, each counted where it is a count."""
        if self.metrics is None or not hasattr(self.metrics, "request_kv_moved"):
            return
        if _is_count(kv_bytes):
            self.metrics.request_kv_moved.observe(kv_bytes)
        if _is_count(pages_moved):
            self.metrics.kv_pages_moved.inc(pages_moved)
        if _is_count(pages_not_sent):
            self.metrics.kv_pages_not_sent.inc(pages_not_sent)

    def kv_index(self, sizes: dict[str, tuple[int, float | None]]) -> None:
        """Publish the KV index's blocks and report age per worker."""
        if self.metrics is not None and hasattr(self.metrics, "set_kv_index"):
            self.metrics.set_kv_index(sizes)

    def workers(self, views: Iterable[WorkerView]) -> None:
        """Publish how many workers of each role are ready or draining."""
        if self.metrics is None:
            return
        counts: Counter[tuple[str, str]] = Counter(
            (v.role, "draining" if v.draining else "ready") for v in views
        )
        self.metrics.set_workers(dict(counts))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def default_router_metrics(registry: CollectorRegistry) -> RouterMetrics:
    """The router's ``kvxfer_router_*`` metrics on ``registry``."""
    return RouterMetrics(registry)
