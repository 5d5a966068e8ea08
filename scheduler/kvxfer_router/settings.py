"""Router settings: one pydantic-settings object, read from ``KVXFER_ROUTER_*`` variables.

Every timeout is a named setting whose name ends in its unit (``_s``). The defaults suit a
single machine; a deployment overrides them through the environment or ``kvxfer_router``
command-line flags (``python -m kvxfer_router --help`` lists them all).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class RouterSettings(BaseSettings):
    """Configuration of the router process and of every request it dispatches.

    Each field reads from ``KVXFER_ROUTER_<FIELD NAME IN CAPITALS>``;
    ``model_max_prompt_tokens`` takes JSON (``{"kvxfer-tiny": 1024}``).
    """

    model_config = SettingsConfigDict(env_prefix="KVXFER_ROUTER_", extra="ignore")

    # --- process -------------------------------------------------------------------------
    host: str = Field("0.0.0.0", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="Port the HTTP server binds (0: any free port).")
    log_level: str = Field("info", description="Log level: debug, info, warning, error.")
    etcd_endpoints: str = Field(
        "http://127.0.0.1:2379", description="Comma-separated etcd endpoints the registry watcher reads."
    )
    registry_prefix: str = Field("/kvxfer", description="Key prefix of worker records in etcd.")
    etcd_ca_file: Path | None = Field(None, description="CA bundle that verifies etcd (https:// endpoints).")
    etcd_cert_file: Path | None = Field(None, description="Client certificate presented to etcd.")
    etcd_key_file: Path | None = Field(None, description="Private key of etcd_cert_file.")
    cluster_key_file: Path | None = Field(
        None, description="File holding the cluster key (>= 32 bytes): only worker records signed with it are "
        "routed to. Unset: every well-formed record is admitted and a warning is logged (development only).",
    )
    control_issuer: str = Field(
        "router", pattern=r"^[A-Za-z0-9_\-]{1,64}$",
        description="Name this router signs worker calls with; workers scope request ids and limits to it.",
    )
    # Why 25 s and not less: a token is single-use and bound to one method, path and body, so
    # its lifetime only bounds how long an intercepted, undelivered token stays usable and how
    # long workers remember its nonce. The worker checks it when its event loop gets to the
    # request; at 10 s, a starved 2-core machine (a 200-stream burst at load 11-13) refused
    # healthy /generate calls as expired. 25 s stays inside the workers' default 30 s limit.
    control_token_lifetime_s: float = Field(
        25.0, gt=0, description="Lifetime of the token on each worker call, in seconds; workers refuse tokens "
        "that live longer than their control_token_max_lifetime_s (default 30).",
    )
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate (chain) the public port serves HTTPS with, e.g. from a mounted "
        "Kubernetes TLS Secret; needs tls_key_file. Unset: plain HTTP (TLS ends at an ingress, or none).",
    )
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    admin_host: str = Field(
        "127.0.0.1", description="Address the admin HTTP server (GET /workers: worker inventory, engine "
        "addresses) binds; keep it off the public network.",
    )
    admin_port: int = Field(8001, ge=-1, le=65535, description="Port of the admin server (0: any free port; "
                            "-1: no admin server).")

    # --- scheduling ----------------------------------------------------------------------
    policy: str = Field(
        "kv_aware",
        description="Pair-selection policy: kv_aware (the default: lowest estimated time to first token from where "
        "the prompt's KV already is, and the load; see the kv_index_* and *_cost_ms settings), least_loaded (decode "
        "by running batch and free pages, "
        "prefill by queue depth; ties take turns) or round_robin.",
    )
    disaggregation_min_prompt_tokens: int = Field(
        32,
        ge=0,
        description="Prompts with fewer tokens skip disaggregation and run on the decode worker "
        "alone (POST /generate_local): for them a KV transfer costs more than the prefill.",
    )
    max_retries: int = Field(
        1,
        ge=0,
        le=3,
        description="Retries on another pair when an attempt fails before any token was streamed.",
    )
    colocated_fallback: bool = Field(
        True,
        description="When no compatible prefill worker is registered, or the request's prefill failed, serve "
        "it colocated on a decode worker (POST /generate_local: it prefills locally) instead of answering "
        "503; such answers carry X-Kvxfer-Serving-Mode: colocated_fallback. Off: 503 no_worker_pair.",
    )

    # --- KV-aware routing (policy kv_aware) ------------------------------------------------
    kv_index_mode: str = Field(
        "both", pattern=r"^(precise|approximate|both)$", description="What tells the router which prompt prefixes each worker holds: precise (the builtin "
        "workers' own POST /prefix_index reports), approximate (what the router routed where; the only source for "
        "vLLM instances, whose prompts are hashed as text: an estimate), or both.",
    )
    prefix_index_poll_interval_s: float = Field(
        1.0, gt=0, description="Seconds between two polls of every builtin worker's POST /prefix_index."
    )
    prefix_index_max_age_s: float = Field(
        10.0, gt=0, description="A worker's prefix report older than this many seconds is stale and ignored: that "
        "worker is then chosen by load alone.",
    )
    kv_index_approximate_capacity_blocks: int = Field(
        4096, ge=1, description="Blocks the router remembers routing to one worker (least recently routed dropped "
        "first), for workers that do not report their own capacity (vLLM instances).",
    )
    approximate_block_tokens: int = Field(
        16, ge=1, description="Tokens per KV page assumed for a worker that has not reported its own block size "
        "(vLLM instances, builtin workers before their first report): sizes routed records and the pages-to-send "
        "estimate.",
    )
    approximate_text_block_bytes: int = Field(
        64, ge=1, description="Bytes of prompt text per block when the router hashes a vLLM request's prompt as text "
        "(it does not tokenize for vLLM).",
    )
    text_bytes_per_token: float = Field(
        4.0, gt=0, description="Bytes of prompt text counted as one token in kv_aware's cost estimate for vLLM "
        "requests (the router does not tokenize them).",
    )
    prefill_token_cost_ms: float = Field(
        0.1, ge=0, description="kv_aware: estimated milliseconds for a prefill worker to compute one prompt token it "
        "does not hold.",
    )
    transfer_page_cost_ms: float = Field(
        0.05, ge=0, description="kv_aware: estimated milliseconds to move one KV page the decode worker lacks.",
    )
    load_cost_ms: float = Field(
        20.0, ge=0, description="kv_aware: estimated milliseconds one request already running or queued on a worker "
        "adds to a new request's time to first token.",
    )
    skip_prefill_fraction: float = Field(
        0.9, gt=0, le=1, description="kv_aware: when a decode worker holds at least this fraction of the prompt's "
        "blocks it may serve the request alone (no prefill leg): it computes the rest itself.",
    )

    # --- admission -----------------------------------------------------------------------
    max_in_flight: int = Field(
        256, ge=1, description="Requests dispatched at once; beyond it the router answers 429."
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After (seconds) sent with a 429.")
    loop_lag_interval_s: float = Field(
        0.1, gt=0, description="How often the event loop's lag is sampled (kvxfer_router_event_loop_lag_seconds)."
    )
    max_in_flight_per_worker: int = Field(
        128, ge=1, description="Requests of this router one worker may have at once; when every eligible worker "
        "has that many, the router answers 429 with Retry-After (a starved worker would answer late and fail them).",
    )
    admission_max_loop_lag_s: float = Field(
        1.0, gt=0, description="While the event loop's own lag (the part of a timer's lateness the loop spent "
        "running its own work, not time a busy host kept it waiting) is above this, new requests get 429 with "
        "Retry-After: admitted ones would otherwise fail on the router's own deadlines.",
    )
    offload_threads: int = Field(2, ge=1, description="Threads that tokenize and parse big bodies off the event loop.")
    offload_max_queued: int = Field(
        1024, ge=0, description="Jobs that may wait for an offload thread; beyond it the router answers 429."
    )
    offload_min_bytes: int = Field(
        8192, ge=0, description="Prompts of at least this many characters and bodies of this many bytes are tokenized or "
        "parsed off the event loop."
    )
    request_deadline_s: float = Field(
        300.0, gt=0, description="Whole-request deadline, admission to last token; past it: 504."
    )

    # --- validation ----------------------------------------------------------------------
    max_prompt_tokens: int = Field(
        2048, ge=1, description="Longest prompt accepted, in tokens, unless the model has its own limit."
    )
    model_max_prompt_tokens: dict[str, int] = Field(
        default_factory=dict, description="Per-model prompt limit in tokens (JSON object), overriding max_prompt_tokens."
    )
    max_tokens_limit: int = Field(2048, ge=1, description="Largest max_tokens a request may ask for.")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens when a request leaves it out (OpenAI's default).")
    max_request_bytes: int = Field(
        1 << 20, ge=1024,
        description="Largest request body accepted, counted while it streams in (chunked bodies too); beyond it: 413.",
    )
    header_timeout_s: float = Field(
        10.0, gt=0,
        description="Seconds a client has, from opening a connection (or starting its next request on a kept-alive "
        "one), to send the complete request line and headers on the public port; beyond it the connection is "
        "closed after a 408, so slow-header clients cannot hold connections.",
    )
    keep_alive_timeout_s: int = Field(
        75, ge=1,
        description="Seconds the public port keeps an idle kept-alive connection open. Longer than clients' own pool "
        "expiry (httpx: 5 s), so the client closes idle connections first: at equal values a client reusing a "
        "connection the router is just closing gets a connection error for a request the router never saw.",
    )
    request_body_timeout_s: float = Field(
        10.0, gt=0,
        description="Seconds a client has to send the whole request body once the headers are in; a half-sent "
        "request gets 408 and frees its slot instead of being held forever.",
    )

    # --- worker calls (httpx) ------------------------------------------------------------
    connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect timeout to a worker.")
    control_timeout_s: float = Field(
        10.0, gt=0, description="Whole-call timeout of POST /reserve (and other short control calls)."
    )
    prefill_timeout_s: float = Field(
        120.0, gt=0, description="Timeout of POST /prefill: queueing, prefill compute and the KV push."
    )
    kv_wait_timeout_s: float = Field(
        120.0, gt=0, description="timeout_s sent with decode POST /generate: how long decode waits for the KV."
    )
    first_token_timeout_s: float = Field(
        150.0,
        gt=0,
        description="Longest wait for the first line of a decode stream (covers the KV wait and one step).",
    )
    token_idle_timeout_s: float = Field(
        30.0, gt=0, description="Longest gap between two lines of a decode stream after the first."
    )
    cancel_timeout_s: float = Field(5.0, gt=0, description="Timeout of one POST /cancel during clean-up.")
    load_report_timeout_s: float = Field(
        2.0, gt=0, description="Whole-call timeout of the GET that asks a vLLM decode instance, after a streamed "
        "answer ended, for the KV its load moved (the answer never waits for it; no retry).",
    )
    cancel_retries: int = Field(
        3, ge=0, le=10, description="Times a POST /cancel that got no answer is sent again, in the background, "
        "the n-th after n x cancel_timeout_s: until then the worker may hold the request's pages.",
    )
    shutdown_timeout_s: float = Field(
        10.0, gt=0, description="On shutdown, how long in-flight clean-up (cancels) may still run."
    )
    http_max_connections: int = Field(512, ge=1, description="Connection pool size towards all workers together.")

    @model_validator(mode="after")
    def _check_consistency(self) -> "RouterSettings":
        # Fail at start-up with a clear message rather than on the first unlucky request.
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both (HTTPS) or neither (HTTP)")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_limit ({self.max_tokens_limit})"
            )
        if self.first_token_timeout_s < self.kv_wait_timeout_s:
            # Otherwise the router gives up on a stream that decode is still allowed to serve.
            raise ValueError(
                f"first_token_timeout_s ({self.first_token_timeout_s}) is shorter than "
                f"kv_wait_timeout_s ({self.kv_wait_timeout_s})"
            )
        if self.http_max_connections < 2 * self.max_in_flight:
            # An admitted disaggregated request holds two worker connections at once (its
            # prefill and generate legs): a smaller pool makes admitted requests wait for a
            # connection until their own deadlines fire, a failure of the router's making.
            raise ValueError(
                f"http_max_connections ({self.http_max_connections}) is below 2 x max_in_flight "
                f"({self.max_in_flight}): admitted requests would starve for worker connections"
            )
        for model, limit in self.model_max_prompt_tokens.items():
            if limit < 1:
                raise ValueError(f"model_max_prompt_tokens[{model!r}] must be >= 1, got {limit}")
        return self

    def prompt_limit(self, model: str) -> int:
        """Longest prompt, in tokens, accepted for ``model``."""
        return self.model_max_prompt_tokens.get(model, self.max_prompt_tokens)
