"""A vLLM instance in kvxfer's registry: role, URL, engine address, model, layout and load,
under an etcd lease, signed with the cluster key like every kvxfer worker's record.

The router then treats the instance as a worker whose `engine` is "vllm": it speaks the
OpenAI API to it and carries the hand-off in `kv_transfer_params`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from kvxfer.registry import RegistrySettings, WorkerRecord, WorkerRegistration
from kvxfer.registry.signing import vllm_api_headers

from .kv_region import KVRegion
from .settings import ConnectorConfigError, ConnectorSettings

log = logging.getLogger(__name__)


class InstanceRegistration:
    """Publishes this instance once its KV cache is registered; withdrawn at shutdown."""

    def __init__(self, settings: ConnectorSettings, kv_role: str, model: str, engine_address_hex: str,
                 region: KVRegion, warmup_prompt_tokens: int = 0, *, tp_size: int = 1, kv_heads: int = 0,
                 liveness_address: str = "") -> None:
        if not settings.advertise_url:
            raise ConnectorConfigError("kv_connector_extra_config: etcd is set but advertise_url (this "
                                       "instance's OpenAI API URL, as the router reaches it) is not")
        role = settings.registry_role or ("prefill" if kv_role == "kv_producer" else "decode")
        if settings.cluster_key_file is None and not settings.insecure:
            raise ConnectorConfigError("kv_connector_extra_config: etcd is set without cluster_key_file; routers "
                                       "ignore unsigned records (set insecure: true for local development)")
        if settings.insecure:
            log.warning("kvxfer connector: insecure: this instance's registry record is unsigned (development only)")
        self._registration = WorkerRegistration(RegistrySettings(
            endpoints=[e for e in settings.etcd.split(",") if e] if settings.etcd else [],
            prefix=settings.etcd_prefix, lease_ttl_s=settings.lease_ttl_s,
            cluster_key_path=Path(settings.cluster_key_file) if settings.cluster_key_file else None,
            tls_ca_path=Path(settings.etcd_ca_file) if settings.etcd_ca_file else None,
            tls_cert_path=Path(settings.etcd_cert_file) if settings.etcd_cert_file else None,
            tls_key_path=Path(settings.etcd_key_file) if settings.etcd_key_file else None,
        ))
        self._record = WorkerRecord(
            worker_id=settings.worker_id or f"vllm-{role}-{socket.gethostname()}-{os.getpid()}",
            role=role, http_url=settings.advertise_url, engine_address=engine_address_hex, model=model,
            kv_layout=region.instance_kv_layout(kv_heads or region.geometry.num_heads), total_pages=region.num_blocks,
            free_pages=region.num_blocks, engine="vllm", tp_size=tp_size, kv_heads=kv_heads,
            metrics_url=_metrics_url(settings.advertise_url, settings.metrics_port),
            liveness_address=liveness_address,
        )
        self._thread: threading.Thread | None = None
        self._last_running = -1
        self._wait_s = settings.registration_wait_s
        self._warmup_tokens = warmup_prompt_tokens
        self._warmup_timeout_s = settings.warmup_timeout_s

    def start(self) -> None:
        """Registers in the background once the instance's own OpenAI API answers and is warm.

        The KV cache is registered before vLLM's API server listens; a record published
        then would send the router to a port that refuses connections. A fresh CPU instance
        also spends seconds on its first request that asks for logprobs (measured: 6.9 s, then
        0.7 s, on the test model), long enough for a hand-off to miss its load_timeout_s; so
        one completion with logprobs that crosses a chunk boundary runs before the record
        goes out.
        """
        def run() -> None:
            deadline = time.monotonic() + self._wait_s
            url = self._record.http_url.rstrip("/") + "/v1/models"
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url, timeout=2.0, trust_env=False, headers=_own_api_headers()).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            else:
                log.error("kvxfer connector: %s did not answer within registration_wait_s=%.0f; not registering",
                          url, self._wait_s)
                return
            self._warm_up()
            try:
                self._registration.register(self._record)
                log.info("kvxfer connector: registered %s as %s worker %s", self._record.http_url,
                         self._record.role, self._record.worker_id)
            except Exception as exc:
                log.error("kvxfer connector: registration in etcd failed: %s", exc)

        self._thread = threading.Thread(target=run, name="kvxfer-registration", daemon=True)
        self._thread.start()

    def _warm_up(self) -> None:
        if self._warmup_tokens <= 0:
            return
        # Token ids, not text: any tokenizer has ids 10..509, and the length is exact. A
        # fresh cache salt keeps the warm-up out of the prefix cache users share.
        prompt = [10 + i % 500 for i in range(self._warmup_tokens)]
        body = {"model": self._record.model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "logprobs": 5,
                "cache_salt": f"kvxfer-warmup-{uuid.uuid4().hex}"}
        started = time.monotonic()
        try:
            r = httpx.post(self._record.http_url.rstrip("/") + "/v1/completions", json=body,
                           timeout=self._warmup_timeout_s, trust_env=False, headers=_own_api_headers())
            r.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("kvxfer connector: warm-up completion failed (%s); registering anyway", exc)
            return
        log.info("kvxfer connector: warm-up completion of %d prompt tokens took %.1f s",
                 self._warmup_tokens, time.monotonic() - started)

    def note_load(self, running: int) -> None:
        """Publishes the number of hand-offs in flight (coalesced by the registration)."""
        if running != self._last_running and self._registration.is_registered:
            self._last_running = running
            self._registration.update(running=running)

    def stop(self) -> None:
        """Revokes the lease so routers drop this instance at once."""
        try:
            self._registration.revoke()
        except Exception as exc:  # the lease expires anyway
            log.warning("kvxfer connector: revoke failed: %s", exc)


def _metrics_url(advertise_url: str, metrics_port: int) -> str:
    """Rank 0's connector HTTP server (worker_side.py), on the host the router reaches the
    instance's API on; "" without one (metrics_port 0)."""
    if not metrics_port:
        return ""
    host = urlsplit(advertise_url).hostname or "127.0.0.1"
    return f"http://[{host}]:{metrics_port}" if ":" in host else f"http://{host}:{metrics_port}"


def _own_api_headers() -> dict[str, str]:
    """The credential this instance's own API asks for (vLLM reads `VLLM_API_KEY` too)."""
    return vllm_api_headers(os.environ.get("VLLM_API_KEY"))
