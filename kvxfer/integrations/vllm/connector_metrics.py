"""The connector's `kvxfer_connector_*` metrics, served on its own port (`metrics_port`).

The connector runs inside vLLM's worker process, whose metrics vLLM does not export; a
small HTTP server of prometheus_client's serves this process's registry instead.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvxfer.metrics import INTEGRITY_FAILURE_REASONS, KV_VERIFY_BUCKETS_SECONDS

_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)

#: Values of the `reason` label of kvxfer_connector_failures_total, per `side`.
FAILURE_REASONS = {"prefill": ("push_failed", "layout_mismatch"),
                   "decode": ("load_timeout", "load_stalled", "cancelled", "prefill_aborted", "fence_timeout",
                              "no_slot", "reservation_send_failed", "registration_failed",
                              "no_landing_room", "landing_failed", "integrity")}
#: Values of the `reason` label of kvxfer_connector_dropped_messages_total.
DROP_REASONS = ("early_reservations_full", "duplicate_reservation", "orphan_reservation", "unknown_cancel",
                "unknown_abort", "malformed_reservation", "not_a_prefiller", "unknown_message", "unknown_table",
                "bad_table", "not_a_decoder")


class ConnectorMetrics:
    """Counters and histograms of one connector (both sides; unused ones stay at zero)."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"role": role}
        self.bytes_pushed = Counter("kvxfer_connector_pushed_bytes", "KV bytes posted to decoders",
                                    registry=self.registry)
        self.pages_pushed = Counter("kvxfer_connector_pushed_pages", "KV pages (blocks of one layer) posted",
                                    registry=self.registry)
        self.push_seconds = Histogram("kvxfer_connector_push_seconds",
                                      "per request: first sight of the request to its last write landed",
                                      buckets=_SECONDS, registry=self.registry)
        self.push_tail = Histogram("kvxfer_connector_push_tail_seconds",
                                   "per request: last layer computed to its last write landed",
                                   buckets=_SECONDS, registry=self.registry)
        self.admission_wait = Histogram("kvxfer_connector_admission_wait_seconds",
                                        "per request: reservation sent to every expected write landed",
                                        buckets=_SECONDS, registry=self.registry)
        self.pages_received = Counter("kvxfer_connector_received_pages", "KV pages admitted on this decoder",
                                      registry=self.registry)
        self.failures = Counter("kvxfer_connector_failures", "hand-offs that failed, by side and reason",
                                ["side", "reason"], registry=self.registry)
        self.dropped_messages = Counter("kvxfer_connector_dropped_messages",
                                        "control messages dropped, by reason", ["reason"], registry=self.registry)
        self.loads_in_flight = Gauge("kvxfer_connector_loads_in_flight", "reservations awaiting their writes",
                                     registry=self.registry)
        self.registrations = Counter("kvxfer_connector_reservation_registrations",
                                     "per-load registrations of a reservation's blocks (kv_registration="
                                     "per_reservation)", registry=self.registry)
        self.registrations_open = Gauge("kvxfer_connector_reservation_registrations_open",
                                        "per-load registrations not yet revoked", registry=self.registry)
        self.foreign_immediates = Gauge("kvxfer_connector_foreign_immediates_dropped",
                                        "immediates dropped because their sender was not the prefiller the "
                                        "load names (the engine's count)", registry=self.registry)
        # The builtin decoder's integrity metrics (kvxfer.metrics.DecodeMetrics), for the connector.
        self.integrity_failures = Counter("kvxfer_connector_kv_integrity_failures",
                                          "loads failed because their landed KV did not pass the end-to-end check, "
                                          "by reason", ["reason"], registry=self.registry)
        self.pages_verified = Counter("kvxfer_connector_kv_pages_verified",
                                      "(layer, block) pairs whose CRC-32C the decoder checked before admission",
                                      registry=self.registry)
        self.verify_seconds = Histogram("kvxfer_connector_kv_verify_seconds",
                                        "time to check one load's landed KV against the prefiller's checksums",
                                        buckets=KV_VERIFY_BUCKETS_SECONDS, registry=self.registry)
        for reason in INTEGRITY_FAILURE_REASONS:
            self.integrity_failures.labels(reason=reason)
        # Every label value exported from the start, so dashboards see zeros, not gaps.
        for side, reasons in FAILURE_REASONS.items():
            for reason in reasons:
                self.failures.labels(side=side, reason=reason)
        for reason in DROP_REASONS:
            self.dropped_messages.labels(reason=reason)
        self.info = Gauge("kvxfer_connector_info", "connector identity", list(labels), registry=self.registry)
        self.info.labels(**labels).set(1)

    def serve(self, port: int) -> None:
        """Serves /metrics on `port` (0: nowhere)."""
        if port:
            start_http_server(port, registry=self.registry)
