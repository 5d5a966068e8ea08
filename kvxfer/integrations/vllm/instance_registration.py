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
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx

from kvxfer.registry import RegistrySettings, WorkerRecord, WorkerRegistration
from kvxfer.registry.signing import vllm_api_headers

from .settings import ConnectorConfigError, ConnectorSettings

if TYPE_CHECKING:
    # Only a type here: kv_region imports torch and vLLM (seconds), and the registration
    # and its tests (tests/registry) need neither.
    from .kv_region import KVRegion

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
        registry_settings = RegistrySettings(
            endpoints=[e for e in settings.etcd.split(",") if e] if settings.etcd else [],
            prefix=settings.etcd_prefix, lease_ttl_s=settings.lease_ttl_s,
            cluster_key_path=Path(settings.cluster_key_file) if settings.cluster_key_file else None,
            tls_ca_path=Path(settings.etcd_ca_file) if settings.etcd_ca_file else None,
            tls_cert_path=Path(settings.etcd_cert_file) if settings.etcd_cert_file else None,
            tls_key_path=Path(settings.etcd_key_file) if settings.etcd_key_file else None,
        )
        self._registration = WorkerRegistration(registry_settings)
        self._record = WorkerRecord(
            worker_id=settings.worker_id or f"vllm-{role}-{socket.gethostname()}-{os.getpid()}",
            role=role, http_url=settings.advertise_url, engine_address=engine_address_hex, model=model,
            kv_layout=region.instance_kv_layout(kv_heads or region.geometry.num_heads), total_pages=region.num_blocks,
            free_pages=region.num_blocks, engine="vllm", tp_size=tp_size, kv_heads=kv_heads,
            metrics_url=_metrics_url(settings.advertise_url, settings.metrics_port),
            liveness_address=liveness_address,
        )
        self._thread: threading.Thread | None = None
        # Guards _record, _last_running, _published and _stopped between the engine's
        # thread (note_load, stop) and the registration thread (start's run), so a stop()
        # racing the registration either comes first (nothing is published) or revokes it.
        # _last_running is written by the engine's thread only, so it reads it without.
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._published = False
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

        etcd is then tried until the record is in or stop() is called (the registry's
        own retry: backoff up to retry_backoff_max_s, each call bounded by
        request_timeout_s), not once: an etcd that is restarting or starved at that
        moment must not leave a healthy instance out of the cluster for good. The
        registry logs one warning when attempts fail and one info when the record is in.
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
                if self._stopped.wait(0.5):  # stopped while loading: nothing to publish
                    return
            else:
                log.error("kvxfer connector: %s did not answer within registration_wait_s=%.0f; not registering",
                          url, self._wait_s)
                return
            self._warm_up()
            with self._lock:
                if self._stopped.is_set():
                    return
                # The registry logs "registered" once the record is in (and one warning
                # before that if etcd does not answer at first).
                log.info("kvxfer connector: registering %s as %s worker %s", self._record.http_url,
                         self._record.role, self._record.worker_id)
                try:
                    self._registration.start(self._record)
                except Exception as exc:  # RegistryError: only a second start, which run() never makes
                    log.error("kvxfer connector: registration in etcd failed: %s", exc)
                    return
                self._published = True

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

    @property
    def is_registered(self) -> bool:
        """True while the last contact with etcd confirmed the record is in place."""
        return self._registration.is_registered

    def note_load(self, running: int) -> None:
        """Publishes the number of hand-offs in flight (coalesced by the registration).

        Kept also while not registered (before start, while etcd is away or the lease is
        being replaced): the record written when registering again is the latest one, so
        a change during the gap is not lost until the next change.
        """
        if running == self._last_running:  # most steps: no change, and no lock (only this thread writes it)
            return
        with self._lock:
            if self._stopped.is_set():
                return
            self._last_running = running
            self._record = self._record.model_copy(update={"running": running})
            if self._published:
                self._registration.update(running=running)

    def stop(self) -> None:
        """Ends the registration attempts and revokes the lease, so routers drop this
        instance at once and no record is left behind."""
        with self._lock:
            self._stopped.set()
            published = self._published
        if not published:
            return
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
