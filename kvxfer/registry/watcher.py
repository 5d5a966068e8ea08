"""Router side of the registry: a range read plus a watch from the next revision into an
in-memory table, re-listing whenever the watch breaks.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

import pyetcd
from pydantic import ValidationError
from pyetcd import events as etcd_events

from kvxfer.errors import RegistryError, RegistryTimeoutError
from kvxfer.registry.etcd_client import (
    CONNECTION_ERRORS,
    Backoff,
    connect_etcd,
    describe_etcd_error,
)
from kvxfer.registry.record import (
    WORKER_ROLES,
    WorkerRecord,
    WorkerRole,
    worker_key,
    workers_prefix,
)
from kvxfer.registry.settings import RegistrySettings
from kvxfer.registry.signing import RecordRejected, RecordSigner, load_cluster_key

_log = logging.getLogger(__name__)


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
        self._signer = RecordSigner(load_cluster_key(settings.cluster_key_path)) if settings.cluster_key_path else None
        self._on_add = on_add
        self._on_update = on_update
        self._on_remove = on_remove
        self._cond = threading.Condition()
        # Guarded by _cond.
        self._records: dict[str, WorkerRecord] = {}
        # Values under the prefix that were not admitted, by reason (malformed, no_lease,
        # unsigned, bad_signature): a nonzero count is someone writing to the registry.
        self._rejected: Counter[str] = Counter()
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
        backoff = Backoff(self._settings.retry_backoff_initial_s, self._settings.retry_backoff_max_s)
        for session in self._sessions:
            if self._stop.is_set():
                return
            try:
                self._sync_and_watch(session, backoff)
                return  # only returns normally when stopping
            except Exception as exc:  # the thread must survive any etcd failure
                if self._stop.is_set():
                    return
                description = describe_etcd_error(exc)
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
                etcd_answered = not isinstance(exc, (*CONNECTION_ERRORS, _WatchBroken))
                if etcd_answered:
                    self._drop_client()
                if self._stop.wait(backoff.next_delay_s(etcd_answered=etcd_answered)):
                    return

    def _client_or_connect(self) -> pyetcd.MultiEndpointEtcd3Client:
        with self._client_lock:
            if self._stop.is_set():
                raise RegistryError("watcher is closing")
            if self._client is None:
                self._client = connect_etcd(self._settings)
            return self._client

    def _drop_client(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                _log.debug("watcher: error closing etcd client", exc_info=True)

    def _sync_and_watch(self, session: int, backoff: Backoff) -> None:
        """List the prefix, replace the table, then apply watch events until failure."""
        client = self._client_or_connect()
        response = client.get_prefix_response(self._prefix)
        fresh: dict[str, WorkerRecord] = {}
        for kv in response.kvs:
            key, record = self._parse(kv.key, kv.value, kv.lease)
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
                raise _WatchBroken(describe_etcd_error(item)) from item
            if item is None:
                raise _WatchBroken("watch stream ended")
            self._notify(self._apply_watch_response(item))

    def _parse(self, raw_key: bytes, raw_value: bytes, lease: int) -> tuple[str, WorkerRecord | None]:
        """Decode one key/value; one that is not admitted yields None, a warning and a count."""
        key = raw_key.decode("utf-8", errors="replace")
        role, _, worker_id = key[len(self._prefix):].partition("/")
        if role not in WORKER_ROLES or not worker_id or "/" in worker_id:
            return key, self._reject(key, "malformed", f"not {self._prefix}{{role}}/{{worker_id}}")
        if not lease:
            # Workers always write under a lease; a record without one would never expire.
            return key, self._reject(key, "no_lease", "record has no lease, so it would never expire")
        if self._signer is not None:
            try:
                raw_value = self._signer.open(key, raw_value).encode()
            except RecordRejected as exc:
                return key, self._reject(key, exc.reason, str(exc))
        try:
            record = WorkerRecord.model_validate_json(raw_value)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, error['loc'])) or 'value'}: {error['msg']}"
                for error in exc.errors()[:5]
            )
            return key, self._reject(key, "malformed", f"malformed record: {problems}")
        if record.role != role or record.worker_id != worker_id:
            return key, self._reject(key, "malformed", f"it says role={record.role} worker_id={record.worker_id}")
        return key, record

    def _reject(self, key: str, reason: str, detail: str) -> None:
        with self._cond:
            self._rejected[reason] += 1
        _log.warning("watcher: ignoring %s (%s): %s", key, reason, detail)
        return None

    def rejected_records(self) -> dict[str, int]:
        """How many registry values were not admitted since start, by reason."""
        with self._cond:
            return dict(self._rejected)

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
                key, record = self._parse(event.key, event.value, event.lease)
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
