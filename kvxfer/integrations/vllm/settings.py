"""The connector's settings, read from vLLM's `kv_connector_extra_config`.

Tools outside this repository (launch scripts, the router's docs, `kvxfer up --engine
vllm`) use these names, so they are a public contract: renaming one is a breaking change.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvxfer.errors import KvxferError
from kvxfer.handoff.decode_ledger import cancel_confirm_bound_s, cancel_confirm_overrun
from kvxfer.kv.integrity import KVIntegrity


class ConnectorConfigError(KvxferError, ValueError):
    """`kv_connector_extra_config` does not hold valid kvxfer connector settings."""


class ConnectorSettings(BaseModel):
    """Settings of one vLLM instance's kvxfer connector (every time has its unit in its name)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- the transfer engine -------------------------------------------------------------
    provider: str = Field("auto", description="libfabric provider: auto, net, tcp, shm, efa, verbs")
    rails: int = Field(1, ge=1, description="endpoints (NICs) used as one")
    same_host: bool | None = Field(
        None, description="copy straight into a peer process on this host (None: KVXFER_SAME_HOST, else on); "
        "False forces the fabric, as between pods")
    same_host_imm_ring: bool | None = Field(
        None, description="with same_host, each write's immediate goes through the peer's shared-memory ring "
        "instead of the fabric (11-18 us and about half the CPU less per small write; None: "
        "KVXFER_SAME_HOST_IMM_RING, else on); False: the fabric")
    tcp_congestion: str | None = Field(
        None, description="TCP congestion control of the engine's fabric connections (tcp, net providers; "
        "names in order of preference; None: KVXFER_TCP_CONGESTION, else cubic,reno, since under BBR without fq "
        "TCP paced them to 0.4x); "
        "\"system\" keeps the system's")
    bind_host: str | None = Field(None, description="address the engine binds (default KVXFER_BIND_HOST)")
    transfer_timeout_s: float = Field(10.0, gt=0, description="a posted write not complete by then fails")
    lock_kv_pages: bool = Field(
        True, description="lock the registered KV cache's host pages (mlock) where the process may; refused "
        "locks are counted (engine_stats lock_refused) and the cache works unlocked")

    # -- decode side (kv_consumer) -------------------------------------------------------
    load_timeout_s: float = Field(
        600.0, gt=0, description="a reservation whose writes have not all landed by then fails, however steadily "
        "they come (kv_load_failure_policy decides: fail or recompute); it bounds how long a load holds its blocks")
    load_stall_timeout_s: float = Field(
        30.0, gt=0, description="a reservation that sees no new write land for this long (counted from the "
        "reservation, then from each landed write) fails: a dead or stuck prefiller is noticed this soon, while a "
        "long prompt on a slow prefiller, whose layers keep landing, is not cut off. It must exceed the prefiller's "
        "compute of one layer of its largest chunk (max_num_batched_tokens): milliseconds on a GPU, about 30 s for "
        "4K tokens of a 1.1 B model on one CPU core")
    fence_timeout_s: float = Field(
        15.0, gt=0, description="after a failure, how long the decoder keeps the blocks without the "
        "prefiller's word that none of its writes can still land; must exceed transfer_timeout_s")
    cancel_confirm_timeout_s: float = Field(
        10.0, ge=0, description="after the decoder cancels a load (a stall, a deadline, vLLM's abort), how long the "
        "load's registration stays open for the prefiller's word that none of its writes is in flight; revoked "
        "then, or at that word, and the blocks fenced to fence_timeout_s as before. Revoking under a live write is "
        "what this avoids: libfabric's net provider refuses the next op with a revoked key by dropping the whole "
        "connection, so every write queued behind it to this decoder, other loads' too, fails. A live prefiller "
        "answers once its writes of the load drained (within a layer of its compute), and each of those completes "
        "or fails within its transfer_timeout_s (10 s by default), hence 10 s. It leaves dead_prefiller_fence_s of "
        "fence_timeout_s after it, for the rest of an op under way at the revoke: the default is cut to "
        "fence_timeout_s - dead_prefiller_fence_s where that is shorter; a value set above it is an error")
    max_concurrent_loads: int = Field(256, ge=1, le=4096, description="reservations in flight at once")
    prefiller_probe_after_s: float = Field(
        0.5, gt=0, description="a reservation that sees no new write for this long gets its prefiller probed (one "
        "small message per prefiller in flight, again every this long while its loads stay silent): one that fails as "
        "unreachable means the prefiller process is gone, and its loads fail without waiting for load_stall_timeout_s; "
        "one not delivered in time is judged by prefiller_probe_timeout_s. The fallback where the liveness connection "
        "gives no signal (prefiller_liveness.py)")
    prefiller_probe_timeout_s: float = Field(
        2.0, gt=0, description="a probe not delivered by then proves nothing (a starved host delays a live "
        "prefiller's too) and severs nothing: where no write of the prefiller landed since it was sent and its "
        "liveness connection is not held, its silent loads fail with the regular fence (fence_timeout_s; "
        "dead_prefiller_fence_s only where a pinned same-host prefiller is proven exiting). A live process, even a "
        "frozen one, has its kernel take the bytes in well under a millisecond on loopback")
    dead_prefiller_fence_s: float = Field(
        1.0, ge=0, description="with kv_registration per_reservation, how long a load of a gone prefiller keeps its "
        "blocks after its registration was revoked (instead of fence_timeout_s), where severing the prefiller's "
        "connections after the revoke (TransferEngine.sever_peer) proved nothing: a connection the prefiller "
        "opened, a reset one with unread bytes, a same-host peer not proven unable to write (some thread of its process "
        "not exiting yet: see dead_writer_recheck_s), a provider other than net or tcp. Where it "
        "proved that no byte of the prefiller can land, the load is freed at once. The revoke stops every op whose "
        "header arrives after it (the key is checked then, the connection cut), but not the op already under way: "
        "net checks a write's key once, at its header, and copies the rest as it comes, and forgetting the peer "
        "(fi_av_remove) does not stop it either (tests/integrations/test_kv_revoked_write_in_progress.py). A killed "
        "writer's kernel still sends what it held of that op: at most one op (the engine's 4 MiB max_op_bytes and "
        "max_coalesce_bytes; one page where the provider has no weighted immediates), 34 ms at 1 Gbit/s, plus "
        "Linux's retransmission timeouts for a lost segment (200 ms, then 400 ms). 1 s covers that; a slower link "
        "or more losses in a row than that are not covered: raise it there (fence_timeout_s at most)")
    dead_writer_recheck_s: float = Field(
        0.005, gt=0, description="decode side, a gone same-host prefiller (it writes into this cache by memcpy, no "
        "socket to sever): its loads are freed at once once every thread of its process is exiting or gone (a "
        "killed thread runs no more user code and enters no new system call: TransferEngine.same_host_writes_ended). "
        "While some thread is not exiting yet (not scheduled since the kill, in an uninterruptible sleep, or the "
        "process is alive) its threads are looked at again this often, until dead_prefiller_fence_s ends")
    liveness_connect_timeout_s: float = Field(
        1.0, gt=0, description="decode side: a liveness connection to a prefiller (its registry record's "
        "liveness_address) not connected and kept by then gives no signal, and that prefiller is watched by the "
        "probes only; its close or reset, or a refused connect, means the process is gone (in milliseconds)")
    liveness_max_connections: int = Field(
        256, ge=1, le=65536, description="prefill side: liveness connections its port holds at once (one per decode "
        "rank with loads waiting on it); more are closed at once, and their decoders fall back to the probes")
    kv_registration: Literal["per_reservation", "whole_cache"] = Field(
        "per_reservation", description="'per_reservation': each load hands its prefiller a registration of "
        "its own blocks with fresh random keys, revoked (with the immediate's binding to that prefiller) when "
        "the load stops waiting; 'whole_cache': the one descriptor of the whole cache, good for the life of "
        "the instance (cheaper where a registration pins memory: benchmarks/bench_registration.py)")
    idle_wait_ms: float = Field(
        2.0, ge=0, description="on a step with nothing scheduled, how long the worker blocks until any pending "
        "load is complete before it returns to vLLM. It bounds how long a new request waits for that step to end. "
        "It does not make an idle decode instance sleep: vLLM's shared-memory message queues busy-loop for 1 s "
        "after each read (EngineCore and worker, about one core in all, measured), whatever this is")
    kv_integrity: KVIntegrity = Field(
        KVIntegrity.FULL, description="end-to-end check of landed KV before the load is reported finished, as "
        "the builtin decoder's: 'off' (prefillers send no checksums), 'sampled' (kv_integrity_sample_rate of each "
        "layer's blocks), 'full' (every block). A failed check fails the load (kv_load_failure_policy)")
    kv_integrity_sample_rate: float = Field(
        0.05, gt=0, le=1.0, description="share of each layer's blocks checked when kv_integrity is 'sampled' "
        "(at least one block per layer)")

    # -- prefill side (kv_producer) ------------------------------------------------------
    wait_for_reservation: bool = Field(
        False, description="schedule a prefill request only once the decoder's reservation arrived (at most "
        "reservation_wait_s): its compute then never runs ahead of the decoder, at the price of the decoder's "
        "reservation round trip in every TTFT. Off (default): compute at once; the layers computed before the "
        "reservation arrives are posted when it does, the later ones as each is computed")
    reservation_wait_s: float = Field(
        10.0, gt=0, description="how long a prefiller keeps a finished request's blocks waiting for "
        "the decoder's reservation before giving up on the push")
    max_early_reservations: int = Field(
        1024, ge=1, description="reservations held that arrived before their request (bounded; more are "
        "dropped and counted)")

    # -- registry and metrics ------------------------------------------------------------
    etcd: str | None = Field(None, description="comma-separated etcd endpoints; None: do not register")
    etcd_prefix: str = Field("/kvxfer", description="registry key prefix")
    etcd_ca_file: str | None = Field(None, description="CA bundle that verifies etcd (https:// endpoints)")
    etcd_cert_file: str | None = Field(
        None, description="client certificate presented to etcd (`kvxfer up`'s etcd takes no client without one)")
    etcd_key_file: str | None = Field(None, description="private key of etcd_cert_file")
    lease_ttl_s: int = Field(5, ge=1, description="registry lease TTL")
    advertise_url: str | None = Field(None, description="this instance's OpenAI API URL, as the router reaches it")
    registration_wait_s: float = Field(
        900.0, gt=0, description="how long to wait for this instance's API to answer before registering (model "
        "loading and warm-up come first; a record published earlier would send the router to a closed port)")
    warmup_prompt_tokens: int | None = Field(
        None, ge=0, description="prompt tokens of the warm-up completion this instance sends itself before it "
        "registers: a fresh CPU instance's first request with logprobs, or across a chunk boundary, takes seconds, "
        "and a hand-off that meets it misses its load_timeout_s. Default: max_num_batched_tokens + one block (a prompt that crosses "
        "a chunk boundary), capped below max_model_len; 0: no warm-up")
    warmup_timeout_s: float = Field(300.0, gt=0, description="the warm-up completion fails after this long "
                                    "(the instance then registers anyway, with a warning)")
    registry_role: Literal["prefill", "decode"] | None = Field(
        None, description="role published in the registry (default from kv_role; kv_both: decode)")
    worker_id: str | None = Field(None, description="id in the registry (default vllm-ROLE-PID)")
    cluster_key_file: str | None = Field(None, description="cluster key that signs the registry record")
    insecure: bool = Field(False, description="publish an unsigned registry record (local development only)")
    metrics_port: int = Field(0, ge=0, le=65535, description="port of the connector's own /metrics (0: off)")
    load_report_keep_s: float = Field(
        60.0, gt=0, description="how long a decode instance keeps a finished load's figures for the router to "
        "ask (GET /kvxfer/loads/<transfer_id> on metrics_port) after a streamed answer ended")
    load_reports_max: int = Field(
        4096, ge=1, description="the most load figures kept at once (the oldest are dropped first)")

    # -- hooks -----------------------------------------------------------------------------
    hooks: str = Field(
        "", description="'module:callable' or 'path/to/file.py:callable' making the connector_hooks.ConnectorHooks "
        "the pusher and receiver call (tests and failure drills plug in here, docs/architecture.md); empty: none")
    hooks_config: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the hooks' callable")

    @property
    def cancel_confirm_bound_s(self) -> float:
        """How long a cancelled load's registration waits for the prefiller's word:
        cancel_confirm_timeout_s, cut so that dead_prefiller_fence_s of the fence is left after it."""
        return cancel_confirm_bound_s(self.cancel_confirm_timeout_s, self.fence_timeout_s, self.dead_prefiller_fence_s)

    @classmethod
    def from_extra_config(cls, extra: Any) -> ConnectorSettings:
        """Parses `kv_connector_extra_config` (unknown keys are an error, so a typo is not ignored)."""
        data = dict(extra or {})
        try:
            settings = cls(**data)
        except ValidationError as exc:
            raise ConnectorConfigError(f"invalid kv_connector_extra_config for KvxferConnector: {exc}") from None
        if settings.fence_timeout_s <= settings.transfer_timeout_s:
            raise ConnectorConfigError(
                f"fence_timeout_s ({settings.fence_timeout_s}) must exceed transfer_timeout_s "
                f"({settings.transfer_timeout_s}): a write posted before the fence could still land after it")
        overrun = cancel_confirm_overrun(settings.cancel_confirm_timeout_s, settings.fence_timeout_s,
                                         settings.dead_prefiller_fence_s, "dead_prefiller_fence_s")
        if "cancel_confirm_timeout_s" in settings.model_fields_set and overrun:
            raise ConnectorConfigError(overrun)
        return settings
