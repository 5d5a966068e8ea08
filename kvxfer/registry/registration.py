"""Worker side of the registry: a lease, the worker's record under it, keep-alive,
coalesced load updates and revoke, riding out etcd outages and restarts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from types import TracebackType
from typing import Any

import grpc
import pyetcd
from pydantic import ValidationError

from kvxfer.errors import RegistryError, RegistryTimeoutError
from kvxfer.registry.etcd_client import (
    CONNECTION_ERRORS,
    Backoff,
    connect_etcd,
    describe_etcd_error,
    is_not_found,
)
from kvxfer.registry.record import (
    IDENTITY_FIELDS,
    WorkerRecord,
    worker_key,
)
from kvxfer.registry.settings import RegistrySettings
from kvxfer.registry.signing import RecordSigner, load_cluster_key

_log = logging.getLogger(__name__)


class WorkerRegistration:
    """A worker's presence in the registry: its record under a lease, kept alive.

    `register(record)` grants a lease, puts the record and returns once etcd has it
    (or raises `RegistryTimeoutError` after `connect_timeout_s`); `start(record)` does
    the same without waiting and never gives up: the first registration is retried like
    any later one, until it succeeds or `revoke()` (a process that must not die of a
    briefly unreachable etcd). A background thread then refreshes the lease every
    `keepalive_interval_s` (a third of the TTL by default). `update(**fields)` changes
    load fields without blocking; writes are coalesced to at most one per
    `update_interval_s`, last value wins. When etcd is unreachable the thread retries
    with exponential backoff; when it is back it re-puts the record, and if the lease
    expired meanwhile (or etcd lost its data) it grants a new lease. `revoke()` deletes the lease, so the key disappears at once.
    """

    def __init__(self, settings: RegistrySettings) -> None:
        self._settings = settings
        self._signer = RecordSigner(load_cluster_key(settings.cluster_key_path)) if settings.cluster_key_path else None
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
        self.start(record)
        if self.wait_registered(self._settings.connect_timeout_s):
            return
        with self._cond:
            reason = self._last_error or "no answer"
        self.revoke()
        raise RegistryTimeoutError(
            f"could not register {worker_key(self._settings.prefix, record.role, record.worker_id)}"
            f" in etcd {self._settings.endpoints} within {self._settings.connect_timeout_s:g} s"
            f" (last error: {reason})"
        )

    def start(self, record: WorkerRecord) -> None:
        """Publish `record` from the background thread and return at once.

        The thread tries until the record is in etcd, then keeps it alive, with the same
        backoff (`retry_backoff_initial_s` to `retry_backoff_max_s`) and per-RPC deadline
        (`request_timeout_s`) as after a lost lease; it logs one warning when attempts
        start failing and one info when the record got through. `revoke()` ends the
        attempts (within about `request_timeout_s`) and revokes a lease granted
        meanwhile, so no record is left. `update()` works at once: the record written
        is the latest. Raises `RegistryError` if this registration is already active.
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

    def wait_registered(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` seconds for the record started by `start` to reach etcd
        the first time; True once it did (it may have been lost again since: see
        `is_registered`), False on timeout. The attempts go on either way."""
        return self._first_registration.wait(timeout_s)

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
        moved = IDENTITY_FIELDS & set(fields)
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
        backoff = Backoff(self._settings.retry_backoff_initial_s, self._settings.retry_backoff_max_s)
        while True:
            with self._cond:
                while not self._stop_requested:
                    wait_s = self._seconds_until_work_locked(time.monotonic())
                    if wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                if self._stop_requested:
                    break
            written_before = self._first_registration.is_set()
            try:
                self._step()
            except Exception as exc:  # the thread must survive any etcd failure
                self._on_failure(exc)
                delay_s = backoff.next_delay_s(etcd_answered=not isinstance(exc, CONNECTION_ERRORS))
                with self._cond:
                    self._cond.wait_for(lambda: self._stop_requested, delay_s)
                continue
            backoff.reset()
            if not written_before and self._first_registration.is_set():
                # Once per start()/register(), failures or not: a worker that could not
                # reach etcd at start-up is only now in the cluster, and the log says when.
                failed_for = ("" if self._failing_since is None
                              else f" after {time.monotonic() - self._failing_since:.1f} s of failures")
                record = self.record
                _log.info("registry: registered %s (%s)%s", self.key, record.http_url if record else "?", failed_for)
                self._failing_since = None
            elif self._failing_since is not None:
                _log.info(
                    "registry: %s back in etcd after %.1f s of failures",
                    self.key, time.monotonic() - self._failing_since,
                )
                self._failing_since = None
        self._shutdown()

    def _client_or_connect(self) -> pyetcd.MultiEndpointEtcd3Client:
        if self._client is None:
            self._client = connect_etcd(self._settings)
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
        key = worker_key(self._settings.prefix, record.role, record.worker_id)
        value = stamped.model_dump_json()
        if self._signer is not None:
            value = self._signer.seal(key, value)
        try:
            client.put(key, value, lease=lease_id)
        except grpc.RpcError as exc:
            if is_not_found(exc):
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
        description = describe_etcd_error(exc)
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
        if not isinstance(exc, CONNECTION_ERRORS):
            self._drop_client()

    def _shutdown(self) -> None:
        """Revoke the lease (retrying until `revoke_timeout_s`) and release the client."""
        with self._cond:
            lease_id = self._lease_id
        revoked = False
        if lease_id is not None:
            deadline = time.monotonic() + self._settings.revoke_timeout_s
            backoff = Backoff(self._settings.retry_backoff_initial_s, self._settings.retry_backoff_max_s)
            while True:
                try:
                    self._client_or_connect().revoke_lease(lease_id)
                    revoked = True
                    break
                except Exception as exc:
                    if is_not_found(exc):  # already expired: the key is gone either way
                        revoked = True
                        break
                    if not isinstance(exc, CONNECTION_ERRORS):
                        self._drop_client()
                    remaining_s = deadline - time.monotonic()
                    if remaining_s <= 0:
                        _log.warning(
                            "registry: could not revoke lease of %s (%s); the key expires "
                            "after its TTL", self.key, describe_etcd_error(exc),
                        )
                        break
                    time.sleep(min(backoff.next_delay_s(), remaining_s))
        self._drop_client()
        with self._cond:
            self._lease_id = None
            self._registered = False
            self._revoked = revoked


# ---------------------------------------------------------------------------- watcher
