"""Where the router learns which workers exist: a small protocol plus two implementations.

The router never talks to etcd itself. It asks a ``WorkerDirectory`` for the live workers
of a role and gets back immutable ``WorkerView`` snapshots with the fields of the registry's
``WorkerRecord`` (docs/architecture.md, "Registry"). ``EtcdWorkerDirectory`` adapts the
registry watcher (``kvxfer.registry.RegistryWatcher`` or anything shaped like it);
``StaticWorkerDirectory`` is a fixed, mutable-by-hand list for tests and single-machine runs
without etcd.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass
from typing import (
    Any,
    Iterable,
    Literal,
    Mapping,
    Protocol,
    Sequence,
    runtime_checkable,
)

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")

_REQUIRED_FIELDS = ("worker_id", "role", "http_url", "model", "kv_layout")


def layout_key(kv_layout: Any) -> str:
    """Canonical string for a ``kv_layout`` value, for equality between workers.

    The contract does not fix whether ``kv_layout`` is a string or a JSON object, so two
    layouts are compared by their canonical JSON (sorted keys); that way a dict that went
    through etcd and one that came from ``/info`` compare equal when they mean the same.
    """
    if isinstance(kv_layout, str):
        return kv_layout
    return json.dumps(kv_layout, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class WorkerView:
    """One worker as the router sees it: an immutable snapshot of its registry record.

    Field names and meanings follow ``WorkerRecord`` in docs/architecture.md. Load fields
    (``free_pages``, ``queue_depth``, ``running``) are as fresh as the worker's last
    registry update, i.e. up to a few seconds old.
    """

    worker_id: str
    role: Role
    http_url: str
    model: str
    kv_layout: Any
    engine_address: str = ""
    total_pages: int = 0
    free_pages: int = 0
    queue_depth: int = 0
    running: int = 0
    draining: bool = False
    updated_at: float = 0.0
    #: "kvxfer" (kvxfer's own worker API) or "vllm" (an OpenAI server with the kvxfer connector).
    engine: str = "kvxfer"
    #: A vLLM instance's tensor parallel size and KV heads over every rank (0: not said).
    tp_size: int = 1
    kv_heads: int = 0
    #: A vLLM instance's connector HTTP server (its load figures for streamed requests); "" if none.
    metrics_url: str = ""
    #: A vLLM prefill instance's liveness "host:port" (copied into the decode leg); "" if none.
    liveness_address: str = ""

    @property
    def layout_key(self) -> str:
        """Canonical form of ``kv_layout`` (see :func:`layout_key`)."""
        return layout_key(self.kv_layout)

    def url(self, path: str) -> str:
        """Absolute URL of ``path`` on this worker's HTTP API."""
        return self.http_url.rstrip("/") + path

    def as_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (what ``GET /workers`` shows)."""
        return asdict(self)

    @classmethod
    def from_record(cls, record: Any) -> "WorkerView":
        """Build a view from a registry record: a mapping, a dataclass, a pydantic model or
        any object with the ``WorkerRecord`` attributes (duck-typed on purpose, so the
        router does not import the registry module).

        Raises ``ValueError`` naming the missing field when a required one is absent.
        """
        if isinstance(record, WorkerView):
            return record
        if hasattr(record, "model_dump"):
            record = record.model_dump()
        get = record.get if isinstance(record, Mapping) else (lambda k, d=None: getattr(record, k, d))
        for name in _REQUIRED_FIELDS:
            if get(name) is None:
                raise ValueError(f"worker record lacks {name!r}: {record!r}")
        role = str(get("role"))
        if role not in ROLES:
            raise ValueError(f"worker record {get('worker_id')!r} has unknown role {role!r}")
        engine_address = get("engine_address", "") or ""
        if isinstance(engine_address, (bytes, bytearray)):
            # Addresses print as hex everywhere else; keep one spelling.
            engine_address = bytes(engine_address).hex()
        return cls(
            worker_id=str(get("worker_id")),
            role=role,  # type: ignore[arg-type]
            http_url=str(get("http_url")),
            model=str(get("model")),
            kv_layout=get("kv_layout"),
            engine_address=str(engine_address),
            total_pages=int(get("total_pages", 0) or 0),
            free_pages=int(get("free_pages", 0) or 0),
            queue_depth=int(get("queue_depth", 0) or 0),
            running=int(get("running", 0) or 0),
            draining=bool(get("draining", False)),
            updated_at=float(get("updated_at", 0.0) or 0.0),
            engine=str(get("engine", "kvxfer") or "kvxfer"),
            tp_size=int(get("tp_size", 1) or 1),
            kv_heads=int(get("kv_heads", 0) or 0),
            metrics_url=str(get("metrics_url", "") or ""),
            liveness_address=str(get("liveness_address", "") or ""),
        )


@runtime_checkable
class WorkerDirectory(Protocol):
    """Source of live workers for the router.

    ``workers(role)`` returns the currently known workers of that role (``"prefill"`` or
    ``"decode"``), or of every role when ``role`` is ``None``. It is called on every
    request, so it must be cheap and must not block (no network I/O): implementations
    answer from a cache that a watcher keeps current.
    """

    def workers(self, role: Role | None = None) -> list[WorkerView]:
        """Live workers of ``role`` (all roles when ``None``)."""
        ...

    def rejected_records(self) -> dict[str, int]:
        """Registry values not admitted so far, by reason (metrics); {} without a registry."""
        ...


class StaticWorkerDirectory:
    """A directory holding a hand-managed list of workers (tests, runs without etcd).

    ``put`` adds or replaces a worker by ``worker_id``; ``remove`` drops one. Thread-safe,
    because tests mutate it from the test thread while the router reads it from its loop.
    """

    def __init__(self, workers: Iterable[WorkerView | Mapping[str, Any]] = ()) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, WorkerView] = {}
        for w in workers:
            self.put(w)

    def put(self, worker: WorkerView | Mapping[str, Any]) -> WorkerView:
        """Add ``worker`` or replace the one with the same ``worker_id``; returns the view."""
        view = WorkerView.from_record(worker)
        with self._lock:
            self._workers[view.worker_id] = view
        return view

    def remove(self, worker_id: str) -> None:
        """Forget ``worker_id`` (no error when unknown)."""
        with self._lock:
            self._workers.pop(worker_id, None)

    def workers(self, role: Role | None = None) -> list[WorkerView]:
        """Known workers of ``role``, in insertion order."""
        with self._lock:
            views = list(self._workers.values())
        return [w for w in views if role is None or w.role == role]

    def rejected_records(self) -> dict[str, int]:
        """A hand-managed list rejects nothing."""
        return {}


class _RecordSource(Protocol):
    def workers(self, role: str | None = None) -> Sequence[Any]: ...


class EtcdWorkerDirectory:
    """Adapter from the etcd registry watcher to :class:`WorkerDirectory`.

    ``watcher`` is a ``kvxfer.registry.RegistryWatcher`` or anything with
    ``workers(role=None)`` returning ``WorkerRecord``-shaped records (see
    :meth:`WorkerView.from_record`). Records that cannot be read are skipped and logged once
    per worker, so one malformed registration cannot take the router down.
    """

    def __init__(self, watcher: _RecordSource) -> None:
        self._watcher = watcher
        self._warned: set[tuple[str, str]] = set()
        # The directory is read on every request; the watcher replaces a record object on
        # each update, so a view is rebuilt only when its record object changed.
        self._views: dict[tuple[str, str], tuple[Any, WorkerView]] = {}

    def rejected_records(self) -> dict[str, int]:
        """The watcher's counts of registry values it did not admit, by reason."""
        counts = getattr(self._watcher, "rejected_records", None)  # record sources in tests have none
        return counts() if counts is not None else {}

    @property
    def watcher(self) -> _RecordSource:
        """The wrapped registry watcher."""
        return self._watcher

    def workers(self, role: Role | None = None) -> list[WorkerView]:
        """Live workers of ``role`` from the watcher's cache, as views."""
        views: list[WorkerView] = []
        seen: set[tuple[str, str]] = set()
        for record in self._watcher.workers(role):
            key = (str(_field(record, "role")), str(_field(record, "worker_id")))
            seen.add(key)
            cached = self._views.get(key)
            if cached is not None and cached[0] is record:
                views.append(cached[1])
                continue
            try:
                view = WorkerView.from_record(record)
            except (ValueError, TypeError) as exc:
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("skipping unreadable worker record: %s", exc)
                continue
            self._views[key] = (record, view)
            views.append(view)
        # Forget views of workers that left, so churn (pods coming and going) does not grow
        # the cache.
        for key in [k for k in self._views if (role is None or k[0] == role) and k not in seen]:
            del self._views[key]
        return [v for v in views if role is None or v.role == role]


def _field(record: Any, name: str) -> Any:
    if isinstance(record, Mapping):
        return record.get(name)
    return getattr(record, name, None)
