"""What prefill and decode workers share: settings, the engine and model they own, the
etcd registration, the common HTTP routes and the serve loop with graceful drain.

Drain on SIGTERM: the worker marks itself `draining` in etcd (routers stop picking it),
finishes what is in flight (bounded by `drain_timeout_s`), revokes its lease and exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Literal

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvxfer.engine import TransferEngine
from kvxfer.kv_cache import PagedKVCache
from kvxfer.metrics import EngineMetrics
from kvxfer.model.config import ModelConfig
from kvxfer.model.transformer import Transformer

log = logging.getLogger("kvxfer.worker")

#: Seconds a worker keeps an idle HTTP keep-alive connection open; longer than any client
#: pool's idle expiry (the router's httpx pool: 5 s), so only the client closes idle ones.
KEEP_ALIVE_S = 75


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
    num_pages: int = 4096
    transfer_timeout_s: float = 10.0
    etcd: str | None = Field(None, description="comma-separated etcd endpoints; none: no registry")
    etcd_prefix: str = "/kvxfer"
    etcd_ca_file: Path | None = Field(None, description="CA bundle that verifies etcd (https:// endpoints)")
    etcd_cert_file: Path | None = Field(None, description="client certificate presented to etcd")
    etcd_key_file: Path | None = Field(None, description="private key of etcd_cert_file")
    lease_ttl_s: int = 5
    drain_timeout_s: float = 30.0
    prefill_chunk_tokens: int = 256


class WorkerCore:
    """The engine, model and KV cache one worker process owns, plus its identity."""

    def __init__(self, settings: WorkerSettings, role: Literal["prefill", "decode"]) -> None:
        self.settings = settings
        self.role = role
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
        )
        self.cache_region = self.engine.register(self.cache.tensor)
        self.metrics_registry = CollectorRegistry()
        EngineMetrics(self.metrics_registry, self.engine.path_stats)
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
        }

    def register(self, load: dict[str, Any]) -> None:
        """Publishes this worker in etcd (no-op without --etcd)."""
        if not self.settings.etcd:
            return
        from kvxfer.registry import RegistrySettings, WorkerRecord, WorkerRegistration

        reg_settings = RegistrySettings(
            endpoints=self.settings.etcd.split(","),
            prefix=self.settings.etcd_prefix,
            lease_ttl_s=self.settings.lease_ttl_s,
            tls_ca_path=self.settings.etcd_ca_file,
            tls_cert_path=self.settings.etcd_cert_file,
            tls_key_path=self.settings.etcd_key_file,
        )
        self.registration = WorkerRegistration(reg_settings)
        record = WorkerRecord(
            worker_id=self.worker_id,
            role=self.role,
            http_url=self.http_url,
            engine_address=self.engine.address.hex(),
            model=self.config.name,
            kv_layout=self.kv_layout,
            **load,
        )
        self.registration.register(record)

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
        self.engine.close()


def add_common_routes(app: FastAPI, core: WorkerCore, info: Callable[[], dict[str, Any]]) -> None:
    """GET /health, /ready, /info and /metrics."""

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    def ready(response: Response) -> dict[str, Any]:
        registered = core.registration is None or core.registration.is_registered
        ok = registered and not core.engine.closed and not core.draining
        response.status_code = 200 if ok else 503
        return {"ready": ok, "registered": registered, "draining": core.draining}

    @app.get("/info")
    def get_info() -> dict[str, Any]:
        return info()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(core.metrics_registry), media_type=CONTENT_TYPE_LATEST)


def serve(
    app: FastAPI,
    core: WorkerCore,
    load: Callable[[], dict[str, Any]],
    in_flight: Callable[[], int],
) -> None:
    """Runs the worker's HTTP server until SIGINT/SIGTERM, then drains and exits."""
    settings = core.settings
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    port = sock.getsockname()[1]
    advertise = settings.advertise_host or settings.host
    core.http_url = f"http://{advertise}:{port}"
    # Keep idle connections open well past the router's pool expiry (httpx: 5 s). With
    # uvicorn's default of 5 s both sides expire together, and a router reusing a connection
    # the worker is just closing gets a ReadError (a spurious failure and retry).
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = uvicorn.Server(config)

    async def drain() -> None:
        if core.draining:
            return
        core.draining = True
        log.info("%s draining: %d requests in flight", core.worker_id, in_flight())
        core.update_load(draining=True)
        deadline = time.monotonic() + settings.drain_timeout_s
        while in_flight() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if core.registration is not None:
            core.registration.revoke()
            core.registration = None
        server.should_exit = True

    async def main() -> None:
        loop = asyncio.get_running_loop()
        serve_task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.02)
        # Replace uvicorn's handlers: exit only after the drain.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(drain()))
        core.register(load())
        print(f"kvxfer {core.role} worker {core.worker_id} serving on {core.http_url} "
              f"(engine {core.engine.provider} x{core.engine.rails})", flush=True)
        await serve_task

    try:
        asyncio.run(main())
    finally:
        core.close()
        log.info("%s stopped", core.worker_id)
