"""Every Prometheus metric kvxfer exports, declared in one place.

Metrics are grouped per component (router, decode worker, prefill worker, transfer engine,
vLLM connector).
Each group is a small class built against a `CollectorRegistry` handed in by its owner, so
tests and several components living in one process (the single-machine demo runs a router
and workers side by side) never collide on the process-global default registry.

Names follow the Prometheus conventions: `kvxfer_<component>_...`, base units in the name
(`_seconds`, `_bytes`, `_bytes_per_second`), `_total` only on counters, and gauges that count
things carry no unit. Label values that are known up front are initialised to zero so that
a rate over them exists before the first event (an absent series is not a zero rate).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Union

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# --- label values known up front -------------------------------------------------------

#: Final outcome of a request at the router (label `status` of
#: `kvxfer_router_requests_total`).
REQUEST_STATUSES: tuple[str, ...] = ("ok", "error", "rejected", "cancelled", "timeout")
#: HTTP codes the router answers when it refuses a request (label `code`).
REJECT_CODES: tuple[str, ...] = ("429", "503")
#: Steps of a request the router may retry on another worker (label `stage`).
RETRY_STAGES: tuple[str, ...] = ("reserve", "prefill", "generate")
#: Why the router served a request that needed prefill colocated on a decode worker
#: (label `reason` of `kvxfer_router_colocated_fallbacks_total`): no compatible prefill
#: worker registered, or the request's prefill leg failed.
FALLBACK_REASONS: tuple[str, ...] = ("no_prefiller", "prefill_failed")
WORKER_ROLES: tuple[str, ...] = ("prefill", "decode")
#: The router's pair policies (label `policy` of `kvxfer_router_policy_decisions_total`).
ROUTING_POLICIES: tuple[str, ...] = ("kv_aware", "least_loaded", "round_robin")
#: How a pair decision for a request that needed prefill came out (label `outcome`; the
#: router's `policies.DECISION_OUTCOMES`): a prefill+decode pair, the decode worker alone
#: because it held nearly all the prompt's KV, or kv_aware choosing by load alone because
#: its KV index knew nothing of the candidates.
DECISION_OUTCOMES: tuple[str, ...] = ("pair", "decoder_only", "fallback")
#: ready: registered and serving; draining: finishing in-flight work after SIGTERM;
#: unhealthy: still registered but failing the router's checks.
WORKER_STATES: tuple[str, ...] = ("ready", "draining", "unhealthy")
#: Why the router's registry watcher did not admit a value under the workers prefix.
REGISTRY_REJECT_REASONS: tuple[str, ...] = (
    "malformed",      # not a worker record, or under the wrong key
    "no_lease",       # written without a lease: it would never expire
    "unsigned",       # no cluster-key signature while the router requires one
    "bad_signature",  # a signature that does not verify with the cluster key
)
#: Why the router got no load figures from a vLLM decode instance after a streamed answer
#: (label `reason` of `kvxfer_router_load_report_fetch_failures_total`).
LOAD_REPORT_FETCH_FAILURES: tuple[str, ...] = (
    "timeout",      # no answer within load_report_timeout_s
    "unreachable",  # no connection, or it broke
    "refused",      # an HTTP status other than 200 (401: the key; 404: no report kept, or expired)
    "malformed",    # a 200 whose body is not a load report
    "busy",         # too many fetches in flight already: this one was not sent
)
#: Why a worker refused a control call before any route ran (label `reason` of
#: `kvxfer_worker_auth_rejected_total`; the token reasons of `kvxfer.registry.control_token`).
AUTH_REJECT_REASONS: tuple[str, ...] = (
    "missing", "malformed", "expired", "too_long_lived", "replayed", "bad_signature", "too_large")
#: Why a KV push failed at the prefill worker (label `reason`).
TRANSFER_FAILURE_REASONS: tuple[str, ...] = (
    "timeout",            # a write did not complete within the transfer deadline
    "cancelled",          # the request was cancelled while its KV was in flight
    "peer_unreachable",   # the decode engine address could not be resolved or connected
    "completion_error",   # the fabric reported an error completion
    "layout_mismatch",    # the decode side's kv_layout did not match ours
)
#: Why the decoder refused a request's landed KV (label `reason`; kvxfer.kv.integrity).
INTEGRITY_FAILURE_REASONS: tuple[str, ...] = (
    "checksum_mismatch",  # a page's CRC-32C differs from the prefiller's
    "checksums_missing",  # integrity is on but the mailbox record carries no (or a short) table
    "write_overcount",    # more writes were counted than the reservation expects
    "mailbox_mismatch",   # the count completed but the mailbox holds another record
)
#: Why a vLLM connector's hand-off failed (label `reason` of
#: `kvxfer_connector_failures_total`), per `side`.
CONNECTOR_FAILURE_REASONS: dict[str, tuple[str, ...]] = {
    "prefill": ("push_failed", "layout_mismatch"),
    "decode": ("load_timeout", "load_stalled", "cancelled", "prefill_aborted", "fence_timeout",
               "no_slot", "reservation_send_failed", "registration_failed",
               "no_landing_room", "landing_failed", "integrity", "prefiller_gone",
               "prefiller_unresponsive", "part_failed", "tp_mismatch")}
#: Why a vLLM connector dropped a control message (label `reason` of
#: `kvxfer_connector_dropped_messages_total`).
CONNECTOR_DROP_REASONS: tuple[str, ...] = (
    "early_reservations_full", "duplicate_reservation", "orphan_reservation", "unknown_cancel",
    "unknown_abort", "malformed_reservation", "not_a_prefiller", "unknown_message", "unknown_table",
    "bad_table", "not_a_decoder")
#: Seconds to check one request's landed KV: a few pages sampled to a full 8B prompt.
KV_VERIFY_BUCKETS_SECONDS: tuple[float, ...] = (
    0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)

# --- histogram buckets -----------------------------------------------------------------
# Buckets are chosen for the ranges we expect to see and to alert on; each bucket is one
# time series per label set per target, so they are kept to about a dozen.

#: Time to first token: a cached short prompt answers in a few ms, a long prompt behind a
#: queue can take tens of seconds; 60 s is the router's default request deadline.
TTFT_BUCKETS_SECONDS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
#: KV moved for one request: a short prompt of the demo model is a few KiB, a 2K-token prompt
#: of an 8B model about 256 MiB.
REQUEST_KV_BUCKETS_BYTES: tuple[float, ...] = tuple(
    float(1 << shift) for shift in (10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30))
#: Event-loop lag: a healthy loop is below a millisecond; a second is an outage of its deadlines.
LOOP_LAG_BUCKETS_SECONDS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
#: Inter-token latency: one decode step of a batch is ms-scale; seconds mean a stall.
ITL_BUCKETS_SECONDS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: End-to-end latency: up to several minutes for long generations.
E2E_BUCKETS_SECONDS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: Prefill compute per request: ms for short prompts, seconds for long ones on CPU.
PREFILL_COMPUTE_BUCKETS_SECONDS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Per-request KV transfer: sub-ms on RDMA for small prompts, seconds when the fabric is
#: congested; past 10 s the request has timed out anyway.
TRANSFER_BUCKETS_SECONDS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Per-request transfer throughput in bytes/s (base unit; dashboards show GB/s): 0.1 GB/s
#: is a slow TCP path, 50 GB/s a multi-rail 400G RDMA path.
TRANSFER_THROUGHPUT_BUCKETS_BYTES_PER_SECOND: tuple[float, ...] = tuple(
    gb * 1e9 for gb in (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 25.0, 35.0, 50.0))
#: Decode-side wait on the ImmCounter for a request's KV: from "already there" to the
#: admission timeout (30 s by default).
IMM_WAIT_BUCKETS_SECONDS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: The vLLM connector's per-request push and admission times: sub-ms for a short prompt on
#: one host, up to its deadlines (tens of seconds).
CONNECTOR_BUCKETS_SECONDS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


def _init_labels(metric: Union[Counter, Gauge], *label_sets: Sequence[str]) -> None:
    """Create the child for every combination of known label values (see module doc)."""
    combos: list[tuple[str, ...]] = [()]
    for values in label_sets:
        combos = [c + (v,) for c in combos for v in values]
    for combo in combos:
        metric.labels(*combo)


class RouterMetrics:
    """Metrics of the router: request outcomes, latencies, admission and the worker view.

    Build one per router against the registry its `/metrics` route serves.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvxfer_router_requests", "Requests finished by the router, by final outcome.",
            ["status"], registry=registry)
        _init_labels(self.requests, REQUEST_STATUSES)
        self.registry_records_rejected = Counter(
            "kvxfer_router_registry_records_rejected",
            "Values under the registry's workers prefix the router ignored, by reason: a fake or "
            "stale worker someone wrote to etcd.", ["reason"], registry=registry)
        _init_labels(self.registry_records_rejected, REGISTRY_REJECT_REASONS)
        self._registry_rejections_seen: dict[str, int] = {}
        self.time_to_first_token = Histogram(
            "kvxfer_router_time_to_first_token_seconds",
            "Time from request arrival at the router to the first token sent to the client.",
            buckets=TTFT_BUCKETS_SECONDS, registry=registry)
        self.inter_token_latency = Histogram(
            "kvxfer_router_inter_token_latency_seconds",
            "Time between consecutive tokens streamed to the client.",
            buckets=ITL_BUCKETS_SECONDS, registry=registry)
        self.request_duration = Histogram(
            "kvxfer_router_request_duration_seconds",
            "End-to-end request latency at the router, arrival to last byte.",
            buckets=E2E_BUCKETS_SECONDS, registry=registry)
        self.requests_in_flight = Gauge(
            "kvxfer_router_requests_in_flight",
            "Requests admitted and not yet finished.", registry=registry)
        self.retries = Counter(
            "kvxfer_router_retries", "Request steps retried on another worker, by step.",
            ["stage"], registry=registry)
        _init_labels(self.retries, RETRY_STAGES)
        self.colocated_fallbacks = Counter(
            "kvxfer_router_colocated_fallbacks",
            "Requests that needed a prefill worker but were served colocated on a decode worker, by reason.",
            ["reason"], registry=registry)
        _init_labels(self.colocated_fallbacks, FALLBACK_REASONS)
        self.rejected = Counter(
            "kvxfer_router_rejected_requests",
            "Requests refused at admission, by HTTP code (429 overloaded, 503 no workers).",
            ["code"], registry=registry)
        _init_labels(self.rejected, REJECT_CODES)
        self.event_loop_lag = Histogram(
            "kvxfer_router_event_loop_lag_seconds",
            "How much later than asked the router's event loop ran a timer (sampled every loop_lag_interval_s): "
            "work on the loop delays every request's deadlines by this much.",
            buckets=LOOP_LAG_BUCKETS_SECONDS, registry=registry)
        self.workers = Gauge(
            "kvxfer_router_workers", "Workers the router knows from the registry.",
            ["role", "state"], registry=registry)
        _init_labels(self.workers, WORKER_ROLES, WORKER_STATES)
        self.policy_decisions = Counter(
            "kvxfer_router_policy_decisions",
            "Pair decisions for requests that needed prefill, by policy and outcome (pair, decoder_only: the "
            "decode worker held nearly all the prompt's KV, fallback: kv_aware chose by load alone).",
            ["policy", "outcome"], registry=registry)
        _init_labels(self.policy_decisions, ROUTING_POLICIES, DECISION_OUTCOMES)
        self.estimated_prefix_hit_blocks = Counter(
            "kvxfer_router_estimated_prefix_hit_blocks",
            "Leading prompt blocks the router's KV index expected the chosen worker to hold already, summed "
            "over requests, by side (prefill, decode).", ["side"], registry=registry)
        _init_labels(self.estimated_prefix_hit_blocks, WORKER_ROLES)
        self.kv_pages_not_sent = Counter(
            "kvxfer_router_kv_pages_not_sent",
            "KV pages prefill workers did not push because the decode worker held them (pages_skipped of their "
            "/prefill answers).", registry=registry)
        self.kv_pages_moved = Counter(
            "kvxfer_router_kv_pages_moved",
            "KV pages prefill workers pushed (pages_pushed of their /prefill answers, when they carry it).",
            registry=registry)
        self.load_report_fetch_failures = Counter(
            "kvxfer_router_load_report_fetch_failures",
            "Streamed requests on vLLM instances whose load figures (kvxfer_router_request_kv_moved_bytes, "
            "kv_pages_*) the router could not get from the decode instance after the stream ended, by reason.",
            ["reason"], registry=registry)
        _init_labels(self.load_report_fetch_failures, LOAD_REPORT_FETCH_FAILURES)
        self.request_kv_moved = Histogram(
            "kvxfer_router_request_kv_moved_bytes",
            "KV bytes pushed for one disaggregated request (kv_bytes of the prefill worker's /prefill answer).",
            buckets=REQUEST_KV_BUCKETS_BYTES, registry=registry)
        self.kv_index_blocks = Gauge(
            "kvxfer_router_kv_index_blocks",
            "Prefix blocks the router's KV index counts as held, per worker (policy kv_aware).",
            ["worker_id"], registry=registry)
        self.kv_index_report_age = Gauge(
            "kvxfer_router_kv_index_report_age_seconds",
            "Seconds since a worker's last prefix index report (policy kv_aware; past prefix_index_max_age_s "
            "the report is ignored). Workers that never reported (vLLM instances) have no sample.",
            ["worker_id"], registry=registry)

    def set_registry_rejections(self, totals: Mapping[str, int]) -> None:
        """Advance the rejected-records counter to the watcher's running totals by reason."""
        for reason, total in totals.items():
            seen = self._registry_rejections_seen.get(reason, 0)
            if total > seen:
                self.registry_records_rejected.labels(reason=reason).inc(total - seen)
                self._registry_rejections_seen[reason] = total

    def set_kv_index(self, sizes: Mapping[str, tuple[int, float | None]]) -> None:
        """Replace the KV index view with `{worker_id: (blocks, seconds since its last report
        or None)}`; workers no longer listed lose their series."""
        self.kv_index_blocks.clear()
        self.kv_index_report_age.clear()
        for worker_id, (blocks, age_s) in sizes.items():
            self.kv_index_blocks.labels(worker_id).set(blocks)
            if age_s is not None:
                self.kv_index_report_age.labels(worker_id).set(age_s)

    def set_workers(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Replace the worker view with `{(role, state): count}`; absent pairs become 0."""
        for role in WORKER_ROLES:
            for state in WORKER_STATES:
                self.workers.labels(role, state).set(counts.get((role, state), 0))


class PrefixCacheMetrics:
    """Metrics of a builtin worker's prefix cache (kv.prefix_cache), `role` "decode" or
    "prefill": prompt tokens looked up and found cached (their ratio is the hit rate, the
    found ones over the requests the tokens per request), pages held, evictions; on a
    prefiller also the blocks it did not send because the decoder held them."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.prompt_tokens = Counter(
            f"kvxfer_{role}_prefix_lookup_tokens",
            "Prompt tokens of the requests looked up in this worker's prefix cache.", registry=registry)
        self.hit_tokens = Counter(
            f"kvxfer_{role}_prefix_hit_tokens",
            "Prompt tokens found in this worker's prefix cache (not computed, not received).", registry=registry)
        self.lookups = Counter(
            f"kvxfer_{role}_prefix_lookups",
            "Requests looked up in this worker's prefix cache.", registry=registry)
        self.cached_pages = Gauge(
            f"kvxfer_{role}_prefix_cache_pages",
            "KV pages held by the prefix cache (referenced by running requests or idle).", registry=registry)
        self.evictions = Counter(
            f"kvxfer_{role}_prefix_cache_evictions",
            "Idle prefix-cache pages evicted to make room for new requests.", registry=registry)
        self.pages_skipped = Counter(
            f"kvxfer_{role}_kv_pages_skipped",
            "Prompt blocks not pushed because the decoder already held them (each is one KV page per layer).",
            registry=registry) if role == "prefill" else None
        self._evictions_seen = 0

    def observe(self, prompt_tokens: int, hit_tokens: int) -> None:
        """One request's lookup: its prompt length and the tokens found cached."""
        self.lookups.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.hit_tokens.inc(hit_tokens)

    def update(self, held_pages: int, evictions: int) -> None:
        """Publishes the cache's pages held now and its evictions since it was made."""
        self.cached_pages.set(held_pages)
        if evictions > self._evictions_seen:
            self.evictions.inc(evictions - self._evictions_seen)
            self._evictions_seen = evictions


class DecodeMetrics:
    """Metrics of a decode worker: KV page pool, admission and the wait for pushed KV."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.pages_capacity = Gauge(
            "kvxfer_decode_kv_pages_capacity", "KV cache pages this worker owns.",
            registry=registry)
        self.pages_free = Gauge(
            "kvxfer_decode_kv_pages_free", "KV cache pages neither reserved nor in use.",
            registry=registry)
        self.pages_reserved = Gauge(
            "kvxfer_decode_kv_pages_reserved",
            "KV cache pages held by requests (waiting for KV or running).", registry=registry)
        self.requests_waiting_for_kv = Gauge(
            "kvxfer_decode_requests_waiting_for_kv",
            "Requests with reserved pages whose KV has not fully arrived.", registry=registry)
        self.requests_running = Gauge(
            "kvxfer_decode_requests_running", "Requests in the running decode batch.",
            registry=registry)
        self.imm_wait = Histogram(
            "kvxfer_decode_imm_wait_seconds",
            "Time a request waited on its ImmCounter until all of its KV had landed.",
            buckets=IMM_WAIT_BUCKETS_SECONDS, registry=registry)
        self.admission_timeouts = Counter(
            "kvxfer_decode_admission_timeouts",
            "Requests whose KV did not arrive before their admission deadline.",
            registry=registry)
        self.pages_fenced = Gauge(
            "kvxfer_decode_kv_pages_fenced",
            "KV cache pages of ended requests waiting until no prefiller write can land.",
            registry=registry)
        self.push_aborts = Counter(
            "kvxfer_decode_push_aborts",
            "Abort messages from prefillers that stopped a push to this worker.",
            registry=registry)
        self.reservations_expired = Counter(
            "kvxfer_decode_reservations_expired",
            "Reservations failed because they were not admitted within reservation_ttl_s.",
            registry=registry)
        self.caller_limit_rejections = Counter(
            "kvxfer_decode_caller_limit_rejections",
            "Reservations refused (429) because their caller already held max_reservations_per_caller.",
            registry=registry)
        self.reservation_registrations = Counter(
            "kvxfer_decode_reservation_registrations",
            "Per-reservation memory registrations made (kv_registration=per_reservation); each is closed when "
            "its reservation stops waiting for KV.", registry=registry)
        self.reservation_registrations_open = Gauge(
            "kvxfer_decode_reservation_registrations_open",
            "Per-reservation registrations whose descriptor can still write (reservations waiting for KV).",
            registry=registry)
        self.stray_immediates = Counter(
            "kvxfer_decode_stray_immediates",
            "Immediates that arrived for a reservation before it existed (or beyond its expected count): "
            "discarded, never credited.", registry=registry)
        self.integrity_failures = Counter(
            "kvxfer_decode_kv_integrity_failures",
            "Requests failed because their landed KV did not pass the end-to-end check, by reason.",
            ["reason"], registry=registry)
        _init_labels(self.integrity_failures, INTEGRITY_FAILURE_REASONS)
        self.pages_verified = Counter(
            "kvxfer_decode_kv_pages_verified",
            "(layer, page) pairs whose CRC-32C the decoder checked before admission.",
            registry=registry)
        self.verify_duration = Histogram(
            "kvxfer_decode_kv_verify_seconds",
            "Time to check one request's landed KV against the prefiller's checksums.",
            buckets=KV_VERIFY_BUCKETS_SECONDS, registry=registry)
        self.prefix = PrefixCacheMetrics(registry, "decode")

    def set_pages(self, capacity: int, free: int) -> None:
        """Publish the page pool; reserved is derived so the three never disagree."""
        self.pages_capacity.set(capacity)
        self.pages_free.set(free)
        self.pages_reserved.set(capacity - free)


class WorkerAuthMetrics:
    """Refusals of a worker's control-plane gate (`kvxfer.workers.control_auth`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rejected = Counter(
            "kvxfer_worker_auth_rejected",
            "Control calls refused before any route ran: no, bad, expired or replayed token.",
            ["reason"], registry=registry)
        _init_labels(self.rejected, AUTH_REJECT_REASONS)


class PrefillMetrics:
    """Metrics of a prefill worker: queue, compute time and the KV push to decoders."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_depth = Gauge(
            "kvxfer_prefill_queue_depth", "Prefill requests accepted and not yet computed.",
            registry=registry)
        self.compute = Histogram(
            "kvxfer_prefill_compute_seconds", "Model compute time of one request's prefill.",
            buckets=PREFILL_COMPUTE_BUCKETS_SECONDS, registry=registry)
        self.kv_bytes_pushed = Counter(
            "kvxfer_prefill_kv_pushed_bytes",
            "KV cache bytes written to decode workers (completed writes).", registry=registry)
        self.transfer_duration = Histogram(
            "kvxfer_prefill_kv_transfer_seconds",
            "Per request: first KV write posted to last write completed.",
            buckets=TRANSFER_BUCKETS_SECONDS, registry=registry)
        self.wire_seconds = Counter(
            "kvxfer_prefill_kv_wire_seconds",
            "Seconds in which at least one KV write of a request was in flight (the push span "
            "without the compute between layers).", registry=registry)
        self.transfer_throughput = Histogram(
            "kvxfer_prefill_kv_transfer_bytes_per_second",
            "Per request: KV bytes divided by the seconds its KV writes were in flight.",
            buckets=TRANSFER_THROUGHPUT_BUCKETS_BYTES_PER_SECOND, registry=registry)
        self.transfer_failures = Counter(
            "kvxfer_prefill_kv_transfer_failures",
            "Requests whose KV push failed, by reason.", ["reason"], registry=registry)
        _init_labels(self.transfer_failures, TRANSFER_FAILURE_REASONS)
        self.peers_connected = Gauge(
            "kvxfer_prefill_peers_connected",
            "Decode engines this worker has an open fabric address for.", registry=registry)
        self.prefix = PrefixCacheMetrics(registry, "prefill")

    def count_transfer_failure(self, reason: str) -> None:
        """One failed push; `reason` must be one of TRANSFER_FAILURE_REASONS, so that the
        dashboard's and alerts' series are the ones that move."""
        if reason not in TRANSFER_FAILURE_REASONS:
            raise ValueError(f"unknown transfer failure reason {reason!r}; known: {TRANSFER_FAILURE_REASONS}")
        self.transfer_failures.labels(reason=reason).inc()

    def observe_transfer(self, kv_bytes: int, seconds: float, wire_seconds: float) -> None:
        """Record one request's completed push: bytes, its span (first write posted to last
        completed) and the part of it with writes in flight, which the rate divides by."""
        self.kv_bytes_pushed.inc(kv_bytes)
        self.transfer_duration.observe(seconds)
        self.wire_seconds.inc(wire_seconds)
        if wire_seconds > 0:  # a zero-length push (empty prompt) has no meaningful rate
            self.transfer_throughput.observe(kv_bytes / wire_seconds)


#: Per-rail engine counters as the engine exposes them: `{rail: {counter: value}}`, or a
#: sequence of per-rail dicts indexed by rail. The same-host path (process-to-process
#: copies on one machine) reports as rail "same_host".
EngineStats = Union[Mapping[Union[int, str], Mapping[str, int]], Sequence[Mapping[str, int]]]

# (metric name, engine stats key, help). The engine keeps these as plain monotonic
# integers on its own thread; we only read them at scrape time.
_ENGINE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("kvxfer_engine_posted_bytes", "bytes_posted", "Bytes submitted to the fabric, per rail."),
    ("kvxfer_engine_completed_bytes", "bytes_completed",
     "Bytes whose write completed successfully, per rail."),
    ("kvxfer_engine_posted_operations", "ops_posted",
     "Fabric operations (writes, immediates) submitted, per rail."),
    ("kvxfer_engine_completed_operations", "ops_completed",
     "Fabric operations completed successfully, per rail."),
    ("kvxfer_engine_completion_errors", "completion_errors",
     "Error completions reported by the fabric, per rail."),
)


#: Engine-wide counters (no rail label): (metric name, engine_stats() key, help). Losses the
#: engine used to take silently, where any increase is worth an alert, the same-host
#: immediate ring's traffic, the congestion-control switches of its connections, and the
#: progress worker's wake-ups.
_ENGINE_WIDE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("kvxfer_engine_imm_foreign_dropped", "imm_foreign_dropped",
     "Immediates from a sender other than the one peer their reservation names (bind_imm_source): dropped, "
     "never credited."),
    ("kvxfer_engine_imm_table_overflows", "imm_table_overflows",
     "Immediate arrivals dropped because the engine's immediate table was full "
     "(imm_table_capacity distinct values); waits on those immediates fail."),
    ("kvxfer_engine_imm_unclaimed_dropped", "imm_unclaimed_dropped",
     "Immediate arrivals for values no live reservation claimed (imm_admission claimed): dropped without "
     "taking a slot of the immediate table. A steady rise is a stray or hostile sender."),
    ("kvxfer_engine_inbox_dropped_messages", "inbox_dropped_messages",
     "Control messages dropped because the unread inbox was at inbox_max_messages or "
     "inbox_max_bytes."),
    ("kvxfer_engine_inbox_dropped_bytes", "inbox_dropped_bytes",
     "Bytes of control messages dropped because the unread inbox was full."),
    ("kvxfer_engine_lock_refused", "lock_refused",
     "Registrations whose pages the kernel would not lock (RLIMIT_MEMLOCK without CAP_IPC_LOCK); they work "
     "unlocked (lock_kv_pages)."),
    ("kvxfer_engine_imm_ring_sent", "imm_ring_sent",
     "Immediates this engine left in a same-host peer's immediate ring instead of sending them over the fabric."),
    ("kvxfer_engine_imm_ring_received", "imm_ring_received",
     "Immediates same-host peers left in this engine's immediate ring."),
    ("kvxfer_engine_imm_ring_fallbacks", "imm_ring_fallbacks",
     "Immediates sent over the fabric because the same-host peer's ring lane was full or its engine closed."),
    ("kvxfer_engine_tcp_congestion_set", "tcp_congestion_set",
     "Sockets of the engine's fabric connections switched to its tcp_congestion algorithm."),
    ("kvxfer_engine_worker_wakeups", "worker_wakeups",
     "Times the engine's progress worker came out of a sleep: what an idle engine costs (about 20 a second "
     "with a wait fd, 1,000 on shm)."),
    ("kvxfer_engine_tcp_congestion_refused", "tcp_congestion_refused",
     "Sockets of the engine's fabric connections whose tcp_congestion switch the kernel refused (an algorithm "
     "outside tcp_allowed_congestion_control for an unprivileged process): they keep the system's."),
)


class EngineMetrics(Collector):
    """Exports the transfer engine's per-rail counters at scrape time.

    A custom collector rather than Counter objects so the engine's hot path does no
    Prometheus work: it keeps its own integers and `stats` is called once per scrape. `stats`
    returns per-rail dicts with keys bytes_posted, bytes_completed, ops_posted, ops_completed
    and completion_errors, or None while no engine exists yet.
    """

    def __init__(self, registry: CollectorRegistry,
                 stats: Callable[[], EngineStats | None],
                 engine_stats: Callable[[], Mapping[str, int] | None] | None = None) -> None:
        self._stats = stats
        # Engine-wide counters (_ENGINE_WIDE_COUNTERS), exported when a source is given.
        self._engine_stats = engine_stats
        registry.register(self)

    def describe(self) -> Iterable[Metric]:
        # With describe() the registry learns our names without calling stats(), which may
        # not work yet while the engine starts.
        wide = _ENGINE_WIDE_COUNTERS if self._engine_stats is not None else ()
        return [CounterMetricFamily(name, doc, labels=["rail"])
                for name, _, doc in _ENGINE_COUNTERS] + [
                    CounterMetricFamily(name, doc) for name, _, doc in wide]

    def collect(self) -> Iterator[Metric]:
        families = {key: CounterMetricFamily(name, doc, labels=["rail"])
                    for name, key, doc in _ENGINE_COUNTERS}
        try:
            stats = self._stats()
        except Exception:  # a broken stats source must not fail the whole scrape
            log.exception("engine stats unavailable for this scrape")
            stats = None
        if stats is not None:
            rails = stats.items() if isinstance(stats, Mapping) else enumerate(stats)
            for rail, counters in rails:
                for key, family in families.items():
                    if key in counters:
                        family.add_metric([str(rail)], counters[key])
        yield from families.values()
        if self._engine_stats is not None:
            yield from self._collect_engine_wide()

    def _collect_engine_wide(self) -> Iterator[Metric]:
        try:
            counters = self._engine_stats() if self._engine_stats is not None else None
        except Exception:  # a broken stats source must not fail the whole scrape
            log.exception("engine-wide stats unavailable for this scrape")
            counters = None
        for name, key, doc in _ENGINE_WIDE_COUNTERS:
            family = CounterMetricFamily(name, doc)
            if counters is not None and key in counters:
                family.add_metric([], counters[key])
            yield family


class ConnectorMetrics:
    """Metrics of one vLLM connector (`kvxfer.integrations.vllm`), both sides: pushed and
    admitted KV, hand-off failures, dropped control messages and the integrity check.

    The connector runs inside vLLM's worker process, whose metrics vLLM does not export, so it
    serves its own registry on its own port (`kvxfer.integrations.vllm.load_reports`). Series
    of the side a connector does not play stay at zero. Declared here without importing vLLM, like every kvxfer metric.
    """

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"role": role}
        self.bytes_pushed = Counter("kvxfer_connector_pushed_bytes", "KV bytes posted to decoders",
                                    registry=self.registry)
        self.pages_pushed = Counter("kvxfer_connector_pushed_pages", "KV pages (blocks of one layer) posted",
                                    registry=self.registry)
        self.push_seconds = Histogram("kvxfer_connector_push_seconds",
                                      "per request: first sight of the request to its last write landed",
                                      buckets=CONNECTOR_BUCKETS_SECONDS, registry=self.registry)
        self.push_tail = Histogram("kvxfer_connector_push_tail_seconds",
                                   "per request: last layer computed to its last write landed",
                                   buckets=CONNECTOR_BUCKETS_SECONDS, registry=self.registry)
        self.admission_wait = Histogram("kvxfer_connector_admission_wait_seconds",
                                        "per request: reservation sent to every expected write landed",
                                        buckets=CONNECTOR_BUCKETS_SECONDS, registry=self.registry)
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
        # The builtin decoder's integrity metrics (DecodeMetrics), for the connector.
        self.integrity_failures = Counter("kvxfer_connector_kv_integrity_failures",
                                          "loads failed because their landed KV did not pass the end-to-end check, "
                                          "by reason", ["reason"], registry=self.registry)
        self.pages_verified = Counter("kvxfer_connector_kv_pages_verified",
                                      "(layer, block) pairs whose CRC-32C the decoder checked before admission",
                                      registry=self.registry)
        self.verify_seconds = Histogram("kvxfer_connector_kv_verify_seconds",
                                        "time to check one load's landed KV against the prefiller's checksums",
                                        buckets=KV_VERIFY_BUCKETS_SECONDS, registry=self.registry)
        _init_labels(self.integrity_failures, INTEGRITY_FAILURE_REASONS)
        for side, reasons in CONNECTOR_FAILURE_REASONS.items():
            _init_labels(self.failures, (side,), reasons)
        _init_labels(self.dropped_messages, CONNECTOR_DROP_REASONS)
        self.info = Gauge("kvxfer_connector_info", "connector identity", list(labels), registry=self.registry)
        self.info.labels(**labels).set(1)


# --- helpers for the /metrics route and for tests --------------------------------------

def metrics_response(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """Render `registry` for a `/metrics` route: returns `(body, content_type)`.

    `accept` is the request's Accept header: Prometheus asking for OpenMetrics gets it,
    everything else gets the classic 0.0.4 text format.
    """
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def exported_sample_names(registry: CollectorRegistry) -> set[str]:
    """Names of every sample `registry` exports now (with `_bucket`, `_total`, ... suffixes)."""
    return {sample.name for family in registry.collect() for sample in family.samples}


def all_metric_names() -> set[str]:
    """Every sample name the router, the builtin workers and the engine export, from all of
    them on a throwaway registry; the vLLM connector's (`ConnectorMetrics`, served from vLLM's
    processes) are not among them.

    The engine collector is fed one fake rail, and the router's KV index one fake worker, so
    their families produce samples.
    """
    registry = CollectorRegistry()
    RouterMetrics(registry).set_kv_index({"worker": (0, 0.0)})
    DecodeMetrics(registry)
    PrefillMetrics(registry)
    WorkerAuthMetrics(registry)
    EngineMetrics(registry, lambda: [{key: 0 for _, key, _ in _ENGINE_COUNTERS}])
    return exported_sample_names(registry)


#: Frozen snapshot of `all_metric_names()` for callers that want a constant.
ALL_METRIC_NAMES: frozenset[str] = frozenset(all_metric_names())
