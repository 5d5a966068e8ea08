"""What prefill and decode workers share: settings, and the engine, model, KV cache and
etcd registration they own (`WorkerCore`). No HTTP here: `http_server` serves it.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvxfer.kv.cache import PagedKVCache
from kvxfer.metrics import EngineMetrics
from kvxfer.model.config import ModelConfig
from kvxfer.model.transformer import Transformer
from kvxfer.transfer.engine import TransferEngine

log = logging.getLogger("kvxfer.worker")

class WorkerSettings(BaseSettings):
    """Settings common to prefill and decode workers (env prefix KVXFER_)."""

    model_config = SettingsConfigDict(env_prefix="KVXFER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = Field(None, description="host in the registered http_url")
    worker_id: str | None = None
    model: str = "tiny"
    provider: str = "auto"
    rails: int = 1
    bind_host: str | None = Field(None, description="engine endpoints bind here")
    same_host: bool = Field(
        True, description="copy KV straight into decode workers on this machine (process_vm_writev)"
    )
    same_host_imm_ring: bool = Field(
        True, description="with same_host, send each write's immediate through the decode worker's shared-memory "
        "ring instead of the fabric (11-18 us and about half the CPU less per small write); false: the fabric"
    )
    tcp_congestion: str | None = Field(
        None, description="TCP congestion control of the engine's fabric connections (tcp, net providers), "
        "names in order of preference; unset: the engine's default, cubic,reno (not the system's because under "
        "BBR without fq TCP paced them to 0.4x); \"system\" keeps the system's"
    )
    num_pages: int = 4096
    transfer_timeout_s: float = 10.0
    lock_kv_pages: bool = Field(
        True, description="lock the KV cache's pages in RAM (mlock) where the process may (CAP_IPC_LOCK or "
        "RLIMIT_MEMLOCK room): never swapped or reclaimed while registered; refused locks are counted "
        "(kvxfer_engine_lock_refused_total) and the cache works unlocked"
    )
    etcd: str | None = Field(None, description="comma-separated etcd endpoints; none: no registry")
    etcd_prefix: str = "/kvxfer"
    etcd_ca_file: Path | None = Field(None, description="CA bundle that verifies etcd (https:// endpoints)")
    etcd_cert_file: Path | None = Field(None, description="client certificate presented to etcd")
    etcd_key_file: Path | None = Field(None, description="private key of etcd_cert_file")
    lease_ttl_s: int = 5
    cluster_key_file: Path | None = Field(
        None, description="file holding the cluster key (>= 32 bytes); signs this worker's registry record "
        "so routers admit it, and keys the control-plane tokens this worker requires on every call but /health, "
        "/ready and /metrics. Unset: unsigned record, open control API, a warning in the log (development only)",
    )
    control_token_max_lifetime_s: float = Field(
        30.0, gt=0, description="control calls are refused when their token expires further ahead than this"
    )
    control_token_clock_skew_s: float = Field(
        5.0, ge=0, description="clock difference tolerated between a caller and this worker on token expiry"
    )
    control_max_body_bytes: int = Field(4 << 20, gt=0, description="largest control request body read (413 beyond)")
    control_body_timeout_s: float = Field(10.0, gt=0, description="time a caller has to send a control body (408)")
    drain_timeout_s: float = 30.0
    retry_after_s: int = Field(1, ge=0, description="Retry-After (seconds) sent with a 429 (no page, slot or queue room)")
    prefill_chunk_tokens: int = 256
    prefix_cache: bool = Field(
        True, description="keep finished requests' full prompt pages, named by their block hashes, and reuse "
        "them for later prompts with the same prefix (a decoder asks its prefiller only for the pages it lacks; "
        "a prefiller computes only the tokens it lacks); idle cached pages are evicted, least recently used "
        "first, when pages run out; reported at POST /prefix_index. false: every prompt is computed and sent whole",
    )


class WorkerCore:
    """The engine, model and KV cache one worker process owns, plus its identity."""

    def __init__(self, settings: WorkerSettings, role: Literal["prefill", "decode"]) -> None:
        self.settings = settings
        self.role = role
        #: Run by close() before the engine closes: threads that call into the engine stop first.
        self.closers: list[Callable[[], None]] = []
        self.worker_id = settings.worker_id or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.config = ModelConfig.preset(settings.model)
        self.model = Transformer(self.config)
        self.cache = PagedKVCache.from_config(self.config, settings.num_pages)
        self.engine = TransferEngine(
            settings.provider,
            rails=settings.rails,
            bind_host=settings.bind_host,
            transfer_timeout_s=settings.transfer_timeout_s,
            same_host=settings.same_host,
            same_host_imm_ring=settings.same_host_imm_ring,
            tcp_congestion=settings.tcp_congestion,
            lock_on_register=settings.lock_kv_pages,
            # Every immediate a worker counts belongs to one of its live reservations
            # (ReservationScope claims it): a sender spraying others cannot fill the table.
            imm_admission="claimed",
        )
        self.cache_region = self.engine.register(self.cache.tensor)
        self.metrics_registry = CollectorRegistry()
        EngineMetrics(self.metrics_registry, self.engine.path_stats, self.engine.engine_stats)
        self.http_url = ""
        self.registration: Any = None
        self.draining = False
        self.started_at = time.time()

    @property
    def kv_layout(self) -> str:
        """The layout string two workers must share to exchange pages."""
        return self.config.kv_layout

    def base_info(self) -> dict[str, Any]:
        """Fields of GET /info shared by both roles."""
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "model": self.config.name,
            "kv_layout": self.kv_layout,
            "engine_address": self.engine.address.hex(),
            "http_url": self.http_url,
            "provider": self.engine.provider,
            "rails": self.engine.rails,
            "max_context": self.config.max_context,
            "draining": self.draining,
            "prefix_cache": self.settings.prefix_cache,
            "block_size": self.config.block_size,
        }

    def register(self, load: dict[str, Any]) -> None:
        """Publishes this worker in etcd (no-op without --etcd).

        Never gives up: a worker started before etcd answers (a pod scheduled ahead of
        the etcd it names, an etcd restarting) serves with /ready 503 and keeps trying,
        as after a lost lease, until its record is in. Returns once it is, or after the
        registry's `connect_timeout_s` with a warning, so the usual start still prints
        "serving on" only once routers can see the worker. Blocks: call it off the event
        loop."""
        if not self.settings.etcd:
            return
        from kvxfer.registry import RegistrySettings, WorkerRecord, WorkerRegistration

        reg_settings = RegistrySettings(
            endpoints=self.settings.etcd.split(","),
            prefix=self.settings.etcd_prefix,
            lease_ttl_s=self.settings.lease_ttl_s,
            cluster_key_path=self.settings.cluster_key_file,
            tls_ca_path=self.settings.etcd_ca_file,
            tls_cert_path=self.settings.etcd_cert_file,
            tls_key_path=self.settings.etcd_key_file,
        )
        if self.settings.cluster_key_file is None:
            log.warning("no cluster key (KVXFER_CLUSTER_KEY_FILE): this worker's registry record is unsigned; "
                        "routers that require signed records will ignore it. Development only.")
        registration = self.registration = WorkerRegistration(reg_settings)
        record = WorkerRecord(
            worker_id=self.worker_id,
            role=self.role,
            http_url=self.http_url,
            engine_address=self.engine.address.hex(),
            model=self.config.name,
            kv_layout=self.kv_layout,
            **load,
        )
        # The local name: a drain during the wait may take self.registration away.
        registration.start(record)
        if not registration.wait_registered(reg_settings.connect_timeout_s):
            log.warning("%s: not registered in etcd %s within connect_timeout_s=%g; serving with /ready 503 "
                        "and still trying", self.worker_id, self.settings.etcd, reg_settings.connect_timeout_s)

    def update_load(self, **fields: Any) -> None:
        """Coalesced load update in etcd (free pages, queue depth...)."""
        if self.registration is not None:
            self.registration.update(**fields)

    def close(self) -> None:
        """Revokes the registration and closes the engine."""
        if self.registration is not None:
            try:
                self.registration.revoke()
            except Exception as exc:  # revoke is best effort: the lease expires anyway
                log.warning("revoke failed: %s", exc)
            self.registration = None
        for closer in self.closers:
            closer()
        self.engine.close()
