"""etcd peer registry: workers announce themselves under a lease, routers watch the prefix.

Contract (docs/architecture.md, "Registry (etcd)"): key
``{prefix}/workers/{role}/{worker_id}``, value a JSON `WorkerRecord`, attached to the
worker's lease (TTL 5 s by default). A worker that dies stops refreshing its lease and its
key disappears after the TTL; a worker that drains revokes the lease and its key
disappears at once.

Two halves, each owning one etcd client (``etcd-sdk-python``, import name ``pyetcd``) that
only its own background thread uses, because that client keeps per-connection state
(current endpoint, cached stubs) that is not safe to share between threads:

- `WorkerRegistration` (worker side): lease grant, put, keep-alive, coalesced load
  updates, revoke; it rides out etcd outages and restarts.
- `RegistryWatcher` (router side): range read + watch from the next revision into an
  in-memory table, re-listing whenever the watch breaks.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit

import grpc
import pyetcd
from pyetcd import events as etcd_events
from pyetcd import exceptions as etcd_exceptions
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "RegistryError",
    "RegistryTimeoutError",
    "RegistrySettings",
    "RegistryWatcher",
    "WorkerRecord",
    "WorkerRegistration",
    "WorkerRole",
    "worker_key",
    "workers_prefix",
]

_log = logging.getLogger(__name__)

WorkerRole = Literal["prefill", "decode"]
_ROLES: tuple[str, ...] = ("prefill", "decode")
_DEFAULT_ETCD_PORT = 2379

# ----------------------------------------------------------------------------- errors


class RegistryError(Exception):
    """A registry operation failed; the message names the key or endpoints involved.

    Raised for configuration mistakes (bad update fields, calling `update` before
    `register`) and when etcd cannot be reached within the configured timeout.
    Background threads never raise it: they log, back off and retry.
    """


class RegistryTimeoutError(RegistryError):
    """A wait on the registry (first registration, first sync, `wait_for`) ran out of time."""


# --------------------------------------------------------------------------- settings


def _split_endpoint(url: str) -> tuple[str, int, bool]:
    """Parse ``http(s)://host[:port]`` into (host, port, secure)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"etcd endpoint {url!r} must look like http://HOST:PORT or https://HOST:PORT"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"etcd endpoint {url!r} must not have a path, query or fragment")
    try:
        port = parts.port or _DEFAULT_ETCD_PORT
    except ValueError as exc:
        raise ValueError(f"etcd endpoint {url!r} has an invalid port") from exc
    return parts.hostname, port, parts.scheme == "https"


class RegistrySettings(BaseModel):
    """How to reach etcd and how the registry behaves; every timeout carries its unit.

    `endpoints` lists the etcd members to use (a comma-separated string is accepted too);
    requests go to one member and fail over to the others when it stops answering. TLS
    is used for ``https://`` endpoints, with `tls_ca_path` (system roots when unset) and
    an optional client certificate (`tls_cert_path` + `tls_key_path`); `username` and
    `password` enable etcd authentication. Timeouts bound every blocking call: no etcd
    RPC waits longer than `request_timeout_s`, and `register` / `RegistryWatcher.start`
    give up after `connect_timeout_s`.
    """

    model_config = ConfigDict(extra="forbid")

    endpoints: list[str] = Field(default_factory=lambda: [f"http://127.0.0.1:{_DEFAULT_ETCD_PORT}"])
    prefix: str = "/kvxfer"
    # Integer because etcd leases are granted in whole seconds; etcd may raise very small
    # TTLs to its minimum (about 2 s for default election settings).
    lease_ttl_s: int = Field(default=5, ge=1)
    # None: a third of the granted TTL, so two keep-alives can be lost before expiry.
    keepalive_interval_s: float | None = Field(default=None, gt=0)
    # Load updates (free pages, queue depth) are written at most this often, last value
    # wins: a per-request write would turn etcd into the hot path.
    update_interval_s: float = Field(default=0.2, ge=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=2.0, gt=0)
    # Total time `revoke()` spends trying to delete the lease before leaving it to expire.
    revoke_timeout_s: float = Field(default=2.0, gt=0)
    retry_backoff_initial_s: float = Field(default=0.1, gt=0)
    retry_backoff_max_s: float = Field(default=2.0, gt=0)
    # After an endpoint fails, other endpoints are preferred for this long.
    endpoint_retry_after_s: float = Field(default=1.0, ge=0)
    # gRPC's default reconnect backoff grows to 120 s; capping it makes a restarted etcd
    # usable again within about this long.
    grpc_reconnect_backoff_max_s: float = Field(default=1.0, gt=0)
    # HTTP/2 pings detect a silently dead connection (partition) under a long-lived watch.
    # etcd rejects pings more often than every 5 s (--grpc-keepalive-min-time).
    grpc_keepalive_time_s: float = Field(default=10.0, ge=5.0)
    grpc_keepalive_timeout_s: float = Field(default=5.0, gt=0)
    tls_ca_path: Path | None = None
    tls_cert_path: Path | None = None
    tls_key_path: Path | None = None
    username: str | None = None
    password: SecretStr | None = None

    @field_validator("endpoints", mode="before")
    @classmethod
    def _split_comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("endpoints")
    @classmethod
    def _check_endpoints(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one etcd endpoint is required")
        for url in value:
            _split_endpoint(url)
        return value

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not value.startswith("/") or value.endswith("/") or len(value) < 2:
            raise ValueError(f"prefix {value!r} must start with '/' and not end with '/'")
        return value

    @model_validator(mode="after")
    def _check_tls_and_auth(self) -> "RegistrySettings":
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("tls_cert_path and tls_key_path must be given together")
        secure = {_split_endpoint(url)[2] for url in self.endpoints}
        if len(secure) > 1:
            raise ValueError("etcd endpoints mix http:// and https://; use one scheme")
        uses_tls_files = any(
            p is not None for p in (self.tls_ca_path, self.tls_cert_path, self.tls_key_path)
        )
        if uses_tls_files and secure == {False}:
            raise ValueError("TLS files are set but the etcd endpoints are http://; use https://")
        for path in (self.tls_ca_path, self.tls_cert_path, self.tls_key_path):
            if path is not None and not path.is_file():
                raise ValueError(f"TLS file {path} does not exist")
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password must be given together")
        if self.grpc_reconnect_backoff_max_s < 0.1:
            raise ValueError("grpc_reconnect_backoff_max_s must be at least 0.1")
        return self


# ----------------------------------------------------------------------------- record


class WorkerRecord(BaseModel):
    """What a worker publishes about itself in etcd (docs/architecture.md).

    Identity and addressing (`worker_id`, `role`, `http_url`, `engine_address` as hex,
    `model`, `kv_layout`) are fixed for the registration; load fields (`free_pages`,
    `queue_depth`, `running`, `draining`) change through `WorkerRegistration.update`.
    `updated_at` is Unix time in seconds, stamped by the registration at each write.
    Unknown fields are ignored when reading, so a router keeps working while workers
    of a newer version add fields.
    """

    model_config = ConfigDict(extra="ignore")

    # No '/' so the id is exactly one key segment.
    worker_id: str = Field(min_length=1, pattern=r"^[^/\s]+$")
    role: WorkerRole
    http_url: str = Field(min_length=1)
    engine_address: str = Field(pattern=r"^(?:[0-9a-fA-F]{2})*$")
    model: str
    # Workers publish the string of kvxfer.kv_cache.format_kv_layout
    # ("L32-H8-D128-float32-bs16"); a prefiller pushes only into decoders whose layout
    # equals its own.
    kv_layout: str
    total_pages: int = Field(ge=0)
    free_pages: int = Field(default=0, ge=0)
    queue_depth: int = Field(default=0, ge=0)
    running: int = Field(default=0, ge=0)
    draining: bool = False
    # The contract names it updated_at; the unit is seconds since the Unix epoch.
    updated_at: float = 0.0


# Fields that place the record under its key; changing them would be a new registration.
_IDENTITY_FIELDS = frozenset({"worker_id", "role"})


def workers_prefix(prefix: str) -> str:
    """Return the key prefix under which all worker records live (ends with '/')."""
    return f"{prefix}/workers/"


def worker_key(prefix: str, role: WorkerRole, worker_id: str) -> str:
    """Return the etcd key of one worker: ``{prefix}/workers/{role}/{worker_id}``."""
    return f"{workers_prefix(prefix)}{role}/{worker_id}"


# ---------------------------------------------------------------------- etcd plumbing

# Failures that mean "etcd did not answer": the client and its endpoint bookkeeping stay
# useful. Anything else (auth token rejected after an etcd restart, unexpected errors)
# gets a fresh client, which also re-authenticates.
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    etcd_exceptions.ConnectionFailedError,
    etcd_exceptions.ConnectionTimeoutError,
    etcd_exceptions.NoServerAvailableError,
    etcd_exceptions.WatchTimedOut,
)


def _connect(settings: RegistrySettings) -> pyetcd.MultiEndpointEtcd3Client:
    """Build an etcd client over all endpoints, with bounded timeouts and failover.

    Raises whatever the client raises (authentication happens here when configured);
    callers treat that as one failed attempt.
    """
    credentials: grpc.ChannelCredentials | None = None
    secure = _split_endpoint(settings.endpoints[0])[2]
    if secure:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=settings.tls_ca_path.read_bytes() if settings.tls_ca_path else None,
            private_key=settings.tls_key_path.read_bytes() if settings.tls_key_path else None,
            certificate_chain=settings.tls_cert_path.read_bytes() if settings.tls_cert_path else None,
        )
    options = [
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", int(settings.grpc_reconnect_backoff_max_s * 1000)),
        ("grpc.keepalive_time_ms", int(settings.grpc_keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.grpc_keepalive_timeout_s * 1000)),
        # Otherwise gRPC stops pinging an idle watch stream after two pings.
        ("grpc.http2.max_pings_without_data", 0),
    ]
    endpoints = []
    for url in settings.endpoints:
        host, port, _ = _split_endpoint(url)
        endpoints.append(
            pyetcd.Endpoint(
                f"[{host}]" if ":" in host else host,
                port,
                secure=secure,
                creds=credentials,
                time_retry=settings.endpoint_retry_after_s,
                opts=options,
            )
        )
    try:
        client = pyetcd.MultiEndpointEtcd3Client(
            endpoints=endpoints,
            timeout=settings.request_timeout_s,
            user=settings.username,
            password=settings.password.get_secret_value() if settings.password else None,
            failover=True,
        )
    except BaseException:
        for endpoint in endpoints:
            endpoint.close()
        raise
    if not secure:
        # The client sends the auth token twice: as plain metadata and as gRPC call
        # credentials; gRPC refuses call credentials on a plaintext channel (every call
        # fails UNAUTHENTICATED), while the metadata alone is what etcd reads.
        client.call_credentials = None
    return client


def _describe(exc: BaseException) -> str:
    """One-line description of an etcd/gRPC failure for logs and error messages."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        details = exc.details() if hasattr(exc, "details") else ""
        return f"{exc.code().name}: {details}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _is_not_found(exc: BaseException) -> bool:
    """True for etcd's 'requested lease not found' (a put on an expired lease)."""
    return (
        isinstance(exc, grpc.RpcError)
        and hasattr(exc, "code")
        and exc.code() == grpc.StatusCode.NOT_FOUND
    )


class _Backoff:
    """Exponential retry delay between `initial_s` and `max_s`; `reset()` after a success."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial_s = initial_s
        self._max_s = max(max_s, initial_s)
        self._next_s = initial_s
        self._etcd_answered = False

    def next_delay_s(self, etcd_answered: bool = False) -> float:
        """Delay before the next attempt; `etcd_answered` says the failure was an answer.

        An answer after a run of "no answer" failures means etcd is back (typically an
        auth token from before a restart was rejected), so the delay grown during the
        outage is dropped; repeated answers (a wrong password) still back off.
        """
        if etcd_answered and not self._etcd_answered:
            self._next_s = self._initial_s
        self._etcd_answered = etcd_answered
        delay = self._next_s
        self._next_s = min(self._next_s * 2, self._max_s)
        return delay

    def reset(self) -> None:
        self._next_s = self._initial_s
        self._etcd_answered = False


# ----------------------------------------------------------------------- registration


class WorkerRegistration:
    """A worker's presence in the registry: its record under a lease, kept alive.

    `register(record)` grants a lease, puts the record and returns once etcd has it
    (or raises `RegistryTimeoutError` after `connect_timeout_s`); a background thread
    then refreshes the lease every `keepalive_interval_s` (a third of the TTL by
    default). `update(**fields)` changes load fields without blocking; writes are
    coalesced to at most one per `update_interval_s`, last value wins. When etcd is
    unreachable the thread retries with exponential backoff; when it is back it re-puts
    the record, and if the lease expired meanwhile (or etcd lost its data) it grants a
    new lease. `revoke()` deletes the lease, so the key disappears at once.
    """

    def __init__(self, settings: RegistrySettings) -> None:
        self._settings = settings
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        # Guarded by _cond: state shared with callers.
        self._record: WorkerRecord | None = None
        self._record_version = 0
        self._stop_requested = False
        self._registered = False
        self._lease_id: int | None = None
        self._last_error: str | None = None
        self._first_registration = threading.Event()
        self._revoked = False
        # Owned by the background thread only.
        self._client: pyetcd.MultiEndpointEtcd3Client | None = None
        self._written_version = -1
        self._needs_put = True
        self._granted_ttl_s = float(settings.lease_ttl_s)
        self._next_keepalive_at = 0.0
        self._last_write_at = -math.inf
        self._failing_since: float | None = None

    # ------------------------------------------------------------------ public API

    @property
    def key(self) -> str | None:
        """The etcd key of the registered record, or None before `register`."""
        with self._cond:
            record = self._record
        return None if record is None else worker_key(self._settings.prefix, record.role, record.worker_id)

    @property
    def record(self) -> WorkerRecord | None:
        """The latest record (including updates not yet written), or None."""
        with self._cond:
            return self._record

    @property
    def lease_id(self) -> int | None:
        """The etcd lease currently holding the key, or None when there is none."""
        with self._cond:
            return self._lease_id

    @property
    def is_registered(self) -> bool:
        """True when the last contact with etcd confirmed the key is in place.

        False before `register`, after `revoke`, and while etcd is unreachable or the
        record is being re-created; a worker's ``/ready`` can report it directly.
        """
        with self._cond:
            return self._registered

    def register(self, record: WorkerRecord) -> None:
        """Publish `record` under a new lease and keep it alive from a background thread.

        Blocks until the first put succeeded, at most `connect_timeout_s`; on timeout
        nothing is left running and `RegistryTimeoutError` says which endpoints failed
        and why. Raises `RegistryError` if this registration is already active.
        """
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                raise RegistryError(
                    f"worker {self._record.worker_id if self._record else '?'} is "
                    + ("still revoking its previous registration" if self._stop_requested
                       else "already registered; revoke() before registering again")
                )
            self._record = record
            self._record_version += 1
            self._stop_requested = False
            self._registered = False
            self._revoked = False
            self._lease_id = None
            self._last_error = None
            self._first_registration.clear()
            self._needs_put = True
            self._written_version = -1
            self._last_write_at = -math.inf
            self._failing_since = None
            thread = threading.Thread(
                target=self._run,
                name=f"kvxfer-registry-{record.role}-{record.worker_id}",
                daemon=True,  # never keeps the interpreter alive; the lease then expires
            )
            self._thread = thread
        thread.start()
        if self._first_registration.wait(self._settings.connect_timeout_s):
            return
        with self._cond:
            reason = self._last_error or "no answer"
        self.revoke()
        raise RegistryTimeoutError(
            f"could not register {worker_key(self._settings.prefix, record.role, record.worker_id)}"
            f" in etcd {self._settings.endpoints} within {self._settings.connect_timeout_s:g} s"
            f" (last error: {reason})"
        )

    def update(self, **fields: Any) -> None:
        """Change fields of the published record; the write happens in the background.

        Never blocks on etcd: the new record is validated, stored as the latest value
        and written within about `update_interval_s` (sooner if no write happened
        recently). Raises `RegistryError` for unknown or invalid fields, for `worker_id`
        or `role` (which would move the key), and when not registered.
        """
        unknown = set(fields) - set(WorkerRecord.model_fields)
        if unknown:
            raise RegistryError(f"unknown WorkerRecord fields: {sorted(unknown)}")
        moved = _IDENTITY_FIELDS & set(fields)
        if moved:
            raise RegistryError(
                f"update() cannot change {sorted(moved)}: it would move the key; revoke() and "
                "register() a new record instead"
            )
        with self._cond:
            if self._record is None or self._thread is None or self._stop_requested:
                raise RegistryError("update() needs an active registration; call register() first")
            try:
                updated = WorkerRecord.model_validate({**self._record.model_dump(), **fields})
            except ValidationError as exc:
                raise RegistryError(
                    f"invalid update for worker {self._record.worker_id}: {exc}"
                ) from exc
            self._record = updated
            self._record_version += 1
            self._cond.notify_all()

    def revoke(self) -> bool:
        """Stop keeping the record alive and delete its lease, so the key goes at once.

        Returns True when etcd confirmed the revoke, False when etcd could not be
        reached within `revoke_timeout_s` (the key then expires after its TTL) or
        nothing was registered. Idempotent; `register` may be called again afterwards.
        """
        with self._cond:
            thread = self._thread
            if thread is None:
                return False
            self._stop_requested = True
            self._cond.notify_all()
        # The thread may be inside one RPC (bounded by request_timeout_s) before it sees
        # the request, then spends at most revoke_timeout_s revoking.
        thread.join(self._settings.request_timeout_s + self._settings.revoke_timeout_s + 1.0)
        with self._cond:
            if thread.is_alive():
                # Kept in _thread so register() refuses to start a second one meanwhile.
                _log.warning("registry thread %s did not stop in time", thread.name)
                return False
            self._thread = None
            return self._revoked

    def __enter__(self) -> "WorkerRegistration":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.revoke()

    # ---------------------------------------------------------- background thread

    def _keepalive_interval_s(self) -> float:
        if self._settings.keepalive_interval_s is not None:
            return min(self._settings.keepalive_interval_s, self._granted_ttl_s / 2)
        return self._granted_ttl_s / 3

    def _seconds_until_work_locked(self, now: float) -> float:
        if self._lease_id is None or self._needs_put:
            return 0.0
        wake_at = self._next_keepalive_at
        if self._record_version != self._written_version:
            wake_at = min(wake_at, self._last_write_at + self._settings.update_interval_s)
        return wake_at - now

    def _run(self) -> None:
        backoff = _Backoff(self._settings.retry_backoff_initial_s, self._settings.retry_backoff_max_s)
        while True:
            with self._cond:
                while not self._stop_requested:
                    wait_s = self._seconds_until_work_locked(time.monotonic())
                    if wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                if self._stop_requested:
                    break
            try:
                self._step()
            except Exception as exc:  # the thread must survive any etcd failure
                self._on_failure(exc)
                delay_s = backoff.next_delay_s(etcd_answered=not isinstance(exc, _CONNECTION_ERRORS))
                with self._cond:
                    self._cond.wait_for(lambda: self._stop_requested, delay_s)
                continue
            backoff.reset()
            if self._failing_since is not None:
                _log.info(
                    "registry: %s back in etcd after %.1f s of failures",
                    self.key, time.monotonic() - self._failing_since,
                )
                self._failing_since = None
        self._shutdown()

    def _client_or_connect(self) -> pyetcd.MultiEndpointEtcd3Client:
        if self._client is None:
            self._client = _connect(self._settings)
        return self._client

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken client must not mask the real failure
                _log.debug("registry: error closing etcd client", exc_info=True)

    def _step(self) -> None:
        """Do whatever is due now: grant a lease, refresh it, or write the record."""
        client = self._client_or_connect()
        now = time.monotonic()
        if self._lease_id is None:
            lease = client.lease(self._settings.lease_ttl_s)
            self._granted_ttl_s = float(lease.ttl)
            with self._cond:
                self._lease_id = int(lease.id)
            self._next_keepalive_at = now + self._keepalive_interval_s()
            self._needs_put = True
        elif now >= self._next_keepalive_at:
            responses = list(client.refresh_lease(self._lease_id))
            if not responses:
                raise RegistryError("etcd closed the keep-alive stream without answering")
            if responses[0].TTL <= 0:
                # The lease expired while we could not reach etcd, or etcd lost its data:
                # the key is gone; start over with a new lease right away.
                self._lease_lost("lease expired or unknown to etcd")
                return
            self._next_keepalive_at = now + self._keepalive_interval_s()

        with self._cond:
            record, version = self._record, self._record_version
            lease_id = self._lease_id
        assert record is not None and lease_id is not None
        update_due = (
            version != self._written_version
            and now >= self._last_write_at + self._settings.update_interval_s
        )
        if not (self._needs_put or update_due):
            return
        stamped = record.model_copy(update={"updated_at": time.time()})
        try:
            client.put(
                worker_key(self._settings.prefix, record.role, record.worker_id),
                stamped.model_dump_json(),
                lease=lease_id,
            )
        except grpc.RpcError as exc:
            if _is_not_found(exc):
                self._lease_lost("put rejected: lease not found")
                return
            raise
        self._written_version = version
        self._last_write_at = now
        self._needs_put = False
        with self._cond:
            self._registered = True
            self._last_error = None
        self._first_registration.set()

    def _lease_lost(self, why: str) -> None:
        _log.warning("registry: %s: %s; re-registering with a new lease", self.key, why)
        with self._cond:
            self._lease_id = None
            self._registered = False
        self._needs_put = True

    def _on_failure(self, exc: Exception) -> None:
        description = _describe(exc)
        with self._cond:
            self._registered = False
            self._last_error = description
        # The key may have been lost while etcd was away (restart without data, someone
        # deleted it): re-put it on the first successful contact.
        self._needs_put = True
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            _log.warning(
                "registry: etcd %s unreachable for %s (%s); retrying with backoff",
                self._settings.endpoints, self.key, description,
            )
        else:
            _log.debug("registry: still failing for %s: %s", self.key, description)
        if not isinstance(exc, _CONNECTION_ERRORS):
            self._drop_client()

    def _shutdown(self) -> None:
        """Revoke the lease (retrying until `revoke_timeout_s`) and release the client."""
        with self._cond:
            lease_id = self._lease_id
        revoked = False
        if lease_id is not None:
            deadline = time.monotonic() + self._settings.revoke_timeout_s
            backoff = _Backoff(self._settings.retry_backoff_initial_s, self._settings.retry_backoff_max_s)
            while True:
                try:
                    self._client_or_connect().revoke_lease(lease_id)
                    revoked = True
                    break
                except Exception as exc:
                    if _is_not_found(exc):  # already expired: the key is gone either way
                        revoked = True
                        break
                    if not isinstance(exc, _CONNECTION_ERRORS):
                        self._drop_client()
                    remaining_s = deadline - time.monotonic()
                    if remaining_s <= 0:
                        _log.warning(
                            "registry: could not revoke lease of %s (%s); the key expires "
                            "after its TTL", self.key, _describe(exc),
                        )
                        break
                    time.sleep(min(backoff.next_delay_s(), remaining_s))
        self._drop_client()
        with self._cond:
            self._lease_id = None
            self._registered = False
            self._revoked = revoked


# ---------------------------------------------------------------------------- watcher

RecordCallback = Callable[[WorkerRecord], None]

# Marks the end of the watcher's event queue (close()).
_STOP = object()


class RegistryWatcher:
    """The router's live view of registered workers, fed by etcd.

    `start()` reads every record under ``{prefix}/workers/`` and watches the prefix from
    the revision after that read, so no change is missed or applied twice; it blocks
    until that first sync (at most `connect_timeout_s`). When the watch breaks (etcd
    restart, outage, compaction) the table is kept as last known, `is_synced` turns
    False, and the watcher re-lists and re-watches with backoff; the diff against the
    table is reported as adds, updates and removes. Records that do not parse are
    skipped with a warning. Callbacks run on the watcher thread, in etcd order, and must
    not block for long.
    """

    def __init__(
        self,
        settings: RegistrySettings,
        *,
        on_add: RecordCallback | None = None,
        on_update: RecordCallback | None = None,
        on_remove: RecordCallback | None = None,
    ) -> None:
        self._settings = settings
        self._prefix = workers_prefix(settings.prefix)
        self._on_add = on_add
        self._on_update = on_update
        self._on_remove = on_remove
        self._cond = threading.Condition()
        # Guarded by _cond.
        self._records: dict[str, WorkerRecord] = {}
        self._change_count = 0
        self._synced = False
        self._last_error: str | None = None
        self._revision = 0
        self._first_sync = threading.Event()
        self._stop = threading.Event()
        self._events: queue.Queue[tuple[int, object]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._client: pyetcd.MultiEndpointEtcd3Client | None = None
        self._client_lock = threading.Lock()
        # Session numbers tag queued watch responses; unique across start()/close() cycles.
        self._sessions = itertools.count(1)

    # ------------------------------------------------------------------ public API

    @property
    def is_synced(self) -> bool:
        """True while the table follows a live watch; False before the first sync and
        while re-listing after a failure (the table then holds the last known state)."""
        with self._cond:
            return self._synced and not self._stop.is_set()

    @property
    def revision(self) -> int:
        """The etcd revision the table reflects (0 before the first sync)."""
        with self._cond:
            return self._revision

    def start(self) -> "RegistryWatcher":
        """Start the watcher thread and block until the first sync.

        Raises `RegistryTimeoutError` (and stops the thread) when etcd does not answer
        within `connect_timeout_s`. Returns self so it chains with construction.
        """
        if self._thread is not None:
            return self
        self._stop.clear()
        self._first_sync.clear()
        # A fresh queue: the old one may still hold the stop marker of a previous close().
        self._events = queue.Queue()
        thread = threading.Thread(target=self._run, name="kvxfer-registry-watcher", daemon=True)
        self._thread = thread
        thread.start()
        if self._first_sync.wait(self._settings.connect_timeout_s):
            return self
        with self._cond:
            reason = self._last_error or "no answer"
        self.close()
        raise RegistryTimeoutError(
            f"could not read {self._prefix} from etcd {self._settings.endpoints} within "
            f"{self._settings.connect_timeout_s:g} s (last error: {reason})"
        )

    def close(self) -> None:
        """Stop watching and release the etcd client; the table stays readable."""
        self._stop.set()
        self._events.put((0, _STOP))
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()  # also ends an RPC the thread may be blocked in
            except Exception:
                _log.debug("watcher: error closing etcd client", exc_info=True)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self._settings.request_timeout_s + 1.0)
        with self._cond:
            self._synced = False

    def workers(self, role: WorkerRole | None = None) -> list[WorkerRecord]:
        """Snapshot of live workers, optionally of one role, ordered by role then id."""
        with self._cond:
            records = list(self._records.values())
        return sorted(
            (r for r in records if role is None or r.role == role),
            key=lambda r: (r.role, r.worker_id),
        )

    def get(self, role: WorkerRole, worker_id: str) -> WorkerRecord | None:
        """The live record of one worker, or None if it is not registered."""
        with self._cond:
            return self._records.get(worker_key(self._settings.prefix, role, worker_id))

    def wait_for(
        self, predicate: Callable[[list[WorkerRecord]], bool], timeout_s: float
    ) -> list[WorkerRecord]:
        """Block until `predicate(workers())` is true and return that snapshot.

        The predicate is re-evaluated after every change to the table. Raises
        `RegistryTimeoutError` listing the workers seen when `timeout_s` runs out.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                seen_changes = self._change_count
            snapshot = self.workers()
            # Evaluated without the lock so the predicate may call back into the watcher.
            if predicate(snapshot):
                return snapshot
            with self._cond:
                while self._change_count == seen_changes:
                    remaining_s = deadline - time.monotonic()
                    if remaining_s <= 0:
                        ids = [f"{r.role}/{r.worker_id}" for r in snapshot]
                        raise RegistryTimeoutError(
                            f"registry condition not met within {timeout_s:g} s; "
                            f"workers: {ids}, synced: {self._synced}"
                        )
                    self._cond.wait(remaining_s)

    def __enter__(self) -> "RegistryWatcher":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---------------------------------------------------------- background thread

    def _run(self) -> None:
        backoff = _Backoff(self._settings.retry_backoff_initial_s, self._settings.retry_backoff_max_s)
        for session in self._sessions:
            if self._stop.is_set():
                return
            try:
                self._sync_and_watch(session, backoff)
                return  # only returns normally when stopping
            except Exception as exc:  # the thread must survive any etcd failure
                if self._stop.is_set():
                    return
                description = _describe(exc)
                with self._cond:
                    # Warn once per outage: when a live watch broke or nothing worked yet.
                    first_failure = self._synced or self._last_error is None
                    self._synced = False
                    self._last_error = description
                if first_failure:
                    _log.warning(
                        "watcher: etcd %s: %s; re-listing with backoff",
                        self._settings.endpoints, description,
                    )
                else:
                    _log.debug("watcher: still failing: %s", description)
                etcd_answered = not isinstance(exc, (*_CONNECTION_ERRORS, _WatchBroken))
                if etcd_answered:
                    self._drop_client()
                if self._stop.wait(backoff.next_delay_s(etcd_answered=etcd_answered)):
                    return

    def _client_or_connect(self) -> pyetcd.MultiEndpointEtcd3Client:
        with self._client_lock:
            if self._stop.is_set():
                raise RegistryError("watcher is closing")
            if self._client is None:
                self._client = _connect(self._settings)
            return self._client

    def _drop_client(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                _log.debug("watcher: error closing etcd client", exc_info=True)

    def _sync_and_watch(self, session: int, backoff: _Backoff) -> None:
        """List the prefix, replace the table, then apply watch events until failure."""
        client = self._client_or_connect()
        response = client.get_prefix_response(self._prefix)
        fresh: dict[str, WorkerRecord] = {}
        for kv in response.kvs:
            key, record = self._parse(kv.key, kv.value)
            if record is not None:
                fresh[key] = record
        revision = int(response.header.revision)
        changes = self._replace_all(fresh, revision)
        self._notify(changes)
        # Watch from the revision after the read: every later change arrives exactly once.
        client.add_watch_prefix_callback(
            self._prefix,
            lambda item, s=session: self._events.put((s, item)),
            start_revision=revision + 1,
        )
        with self._cond:
            was_synced_before = self._first_sync.is_set()
            self._synced = True
            self._last_error = None
            self._change_count += 1
            self._cond.notify_all()
        self._first_sync.set()
        backoff.reset()
        if was_synced_before:
            _log.info("watcher: re-synced %d workers at revision %d", len(fresh), revision)
        while True:
            item_session, item = self._events.get()
            if item is _STOP:
                return
            if item_session != session:
                continue  # leftovers of a watch that already broke
            if isinstance(item, BaseException):
                raise _WatchBroken(_describe(item)) from item
            if item is None:
                raise _WatchBroken("watch stream ended")
            self._notify(self._apply_watch_response(item))

    def _parse(self, raw_key: bytes, raw_value: bytes) -> tuple[str, WorkerRecord | None]:
        """Decode one key/value; a malformed one yields None and a warning."""
        key = raw_key.decode("utf-8", errors="replace")
        role, _, worker_id = key[len(self._prefix):].partition("/")
        if role not in _ROLES or not worker_id or "/" in worker_id:
            _log.warning("watcher: skipping key %s: not %s{role}/{worker_id}", key, self._prefix)
            return key, None
        try:
            record = WorkerRecord.model_validate_json(raw_value)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, error['loc'])) or 'value'}: {error['msg']}"
                for error in exc.errors()[:5]
            )
            _log.warning("watcher: skipping malformed record at %s: %s", key, problems)
            return key, None
        if record.role != role or record.worker_id != worker_id:
            _log.warning(
                "watcher: skipping record at %s: it says role=%s worker_id=%s",
                key, record.role, record.worker_id,
            )
            return key, None
        return key, record

    def _replace_all(self, fresh: dict[str, WorkerRecord], revision: int) -> list[tuple[str, WorkerRecord]]:
        with self._cond:
            changes: list[tuple[str, WorkerRecord]] = []
            for key, old in self._records.items():
                if key not in fresh:
                    changes.append(("remove", old))
            for key, new in fresh.items():
                old_record = self._records.get(key)
                if old_record is None:
                    changes.append(("add", new))
                elif old_record != new:
                    changes.append(("update", new))
            self._records = fresh
            self._revision = revision
            if changes:
                self._change_count += 1
                self._cond.notify_all()
            return changes

    def _apply_watch_response(self, response: Any) -> list[tuple[str, WorkerRecord]]:
        changes: list[tuple[str, WorkerRecord]] = []
        with self._cond:
            for event in response.events:
                if isinstance(event, etcd_events.DeleteEvent):
                    key = event.key.decode("utf-8", errors="replace")
                    old = self._records.pop(key, None)
                    if old is not None:
                        changes.append(("remove", old))
                    continue
                key, record = self._parse(event.key, event.value)
                old = self._records.get(key)
                if record is None:
                    # A key we can no longer trust is treated as gone.
                    if old is not None:
                        del self._records[key]
                        changes.append(("remove", old))
                elif old is None:
                    self._records[key] = record
                    changes.append(("add", record))
                elif old != record:
                    self._records[key] = record
                    changes.append(("update", record))
            self._revision = max(self._revision, int(response.header.revision))
            if changes:
                self._change_count += 1
                self._cond.notify_all()
        return changes

    def _notify(self, changes: list[tuple[str, WorkerRecord]]) -> None:
        callbacks = {"add": self._on_add, "update": self._on_update, "remove": self._on_remove}
        for kind, record in changes:
            callback = callbacks[kind]
            if callback is None:
                continue
            try:
                callback(record)
            except Exception:  # a faulty callback must not stop the registry view
                _log.exception("watcher: %s callback failed for %s", kind, record.worker_id)


class _WatchBroken(Exception):
    """The watch stream failed or ended; the watcher re-lists and re-watches."""

