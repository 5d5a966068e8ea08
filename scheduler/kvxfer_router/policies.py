"""Pair selection: which decode worker and which prefill worker serve one request.

Filtering is common to every policy and lives in :func:`select_pair`: only workers serving
the request's model, not ``draining``, not excluded by an earlier failed attempt, and - for a
pair - a prefill worker whose ``kv_layout`` equals the decode worker's (an incompatible pair
would write KV the decoder cannot read). A policy only ranks the survivors. Policies are
pluggable by name through :func:`register_policy` / :func:`make_policy`.
"""

from __future__ import annotations

import abc
import itertools
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, ClassVar, Collection, Sequence

from .directory import WorkerDirectory, WorkerView


@dataclass(frozen=True)
class WorkerPair:
    """The workers chosen for one attempt. ``prefill`` is ``None`` when the prompt is short
    enough to run on the decode worker alone (``POST /generate_local``)."""

    decode: WorkerView
    prefill: WorkerView | None

    @property
    def worker_ids(self) -> tuple[str, ...]:
        """Ids of the workers in the pair, decode first."""
        return (self.decode.worker_id,) + ((self.prefill.worker_id,) if self.prefill else ())


def compatible(decode: WorkerView, prefill: WorkerView) -> bool:
    """Whether ``prefill`` may push KV to ``decode``: same model and same KV layout."""
    return (decode.model == prefill.model and decode.layout_key == prefill.layout_key
            and decode.engine == prefill.engine)


class LocalLoad:
    """Requests this router currently has on each worker.

    Registry load figures refresh only every few seconds, so a burst of requests would all
    see the same "least loaded" worker; adding the router's own in-flight count spreads the
    burst. The count is per router process, which is the best it can know without a round
    trip.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def acquire(self, pair: WorkerPair) -> None:
        """Count one more request on each worker of ``pair``."""
        with self._lock:
            for wid in pair.worker_ids:
                self._counts[wid] += 1

    def release(self, pair: WorkerPair) -> None:
        """Undo one :meth:`acquire` of ``pair``."""
        with self._lock:
            for wid in pair.worker_ids:
                self._counts[wid] -= 1
                if self._counts[wid] <= 0:
                    del self._counts[wid]

    def get(self, worker_id: str) -> int:
        """Requests this router has on ``worker_id`` now."""
        with self._lock:
            return self._counts.get(worker_id, 0)


class PairPolicy(abc.ABC):
    """Ranks eligible workers. Subclasses implement :meth:`choose_decode` and
    :meth:`choose_prefill`; both receive a non-empty list that is already filtered."""

    name: ClassVar[str]

    @abc.abstractmethod
    def choose_decode(self, candidates: Sequence[WorkerView], load: LocalLoad) -> WorkerView:
        """Pick one decode worker among ``candidates`` (non-empty)."""

    @abc.abstractmethod
    def choose_prefill(self, candidates: Sequence[WorkerView], load: LocalLoad) -> WorkerView:
        """Pick one prefill worker among ``candidates`` (non-empty, all compatible with the
        decode worker already chosen)."""


class RoundRobinPolicy(PairPolicy):
    """Cycles through the eligible workers of each role, ignoring load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = {"decode": itertools.count(), "prefill": itertools.count()}

    def _pick(self, role: str, candidates: Sequence[WorkerView]) -> WorkerView:
        # Sorted so that the rotation order does not depend on registry iteration order.
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        with self._lock:
            i = next(self._next[role])
        return ordered[i % len(ordered)]

    def choose_decode(self, candidates: Sequence[WorkerView], load: LocalLoad) -> WorkerView:
        """Next decode worker in rotation."""
        return self._pick("decode", candidates)

    def choose_prefill(self, candidates: Sequence[WorkerView], load: LocalLoad) -> WorkerView:
        """Next prefill worker in rotation."""
        return self._pick("prefill", candidates)


class LeastLoadedPolicy(PairPolicy):
    """Decode: fewest running requests (registry ``running`` plus this router's own), then
    most free pages; a worker with no free page at all goes last because its ``/reserve``
    would fail. Prefill: shortest queue (``queue_depth`` plus this router's own).
    Ties go to the lowest ``worker_id`` so the choice is reproducible."""

    name = "least_loaded"

    def choose_decode(self, candidates: Sequence[WorkerView], load: LocalLoad) -> WorkerView:
        """Least busy decode worker."""
        return min(
            candidates,
            key=lambda w: (w.free_pages <= 0, w.running + load.get(w.worker_id), -w.free_pages, w.worker_id),
        )

    def choose_prefill(self, candidates: Sequence[WorkerView], load: LocalLoad) -> WorkerView:
        """Prefill worker with the shortest queue."""
        return min(candidates, key=lambda w: (w.queue_depth + load.get(w.worker_id), w.worker_id))


_POLICIES: dict[str, Callable[[], PairPolicy]] = {
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadedPolicy.name: LeastLoadedPolicy,
}


def register_policy(name: str, factory: Callable[[], PairPolicy]) -> None:
    """Make a policy selectable by ``name`` (setting ``policy``); replaces an existing one."""
    _POLICIES[name] = factory


def policy_names() -> list[str]:
    """Names accepted by :func:`make_policy`."""
    return sorted(_POLICIES)


def make_policy(name: str) -> PairPolicy:
    """A fresh policy instance for ``name``; ``ValueError`` listing the known names if unknown."""
    try:
        factory = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(policy_names())}") from None
    return factory()


def eligible(workers: Sequence[WorkerView], model: str, exclude: Collection[str] = ()) -> list[WorkerView]:
    """Workers that may take a new request for ``model``: right model, not draining, not
    excluded."""
    return [w for w in workers if w.model == model and not w.draining and w.worker_id not in exclude]


def select_pair(
    directory: WorkerDirectory,
    model: str,
    *,
    needs_prefill: bool,
    policy: PairPolicy,
    load: LocalLoad,
    exclude: Collection[str] = (),
    max_per_worker: int | None = None,
) -> WorkerPair | None:
    """Choose the workers for one attempt, or ``None`` when no eligible combination exists.

    With ``max_per_worker``, a worker that already has that many of this router's requests
    is not eligible (backpressure: past it, a starved worker answers every call late).

    The decode worker is chosen first among those that have at least one compatible prefill
    worker (so a decode worker whose layout no prefiller shares is never picked for a
    disaggregated request), then the prefill worker among the compatible ones.
    """
    if max_per_worker is not None:
        busy = {w.worker_id for w in directory.workers() if load.get(w.worker_id) >= max_per_worker}
        exclude = set(exclude) | busy
    decodes = eligible(directory.workers("decode"), model, exclude)
    if not needs_prefill:
        return WorkerPair(policy.choose_decode(decodes, load), None) if decodes else None
    prefills = eligible(directory.workers("prefill"), model, exclude)
    layouts = {p.layout_key for p in prefills}
    decodes = [d for d in decodes if d.layout_key in layouts]
    if not decodes:
        return None
    decode = policy.choose_decode(decodes, load)
    prefill = policy.choose_prefill([p for p in prefills if compatible(decode, p)], load)
    return WorkerPair(decode, prefill)


def has_pair(directory: WorkerDirectory, model: str | None = None, *, needs_prefill: bool = True) -> bool:
    """Whether some eligible decode worker (with a compatible prefill worker when
    ``needs_prefill``) exists for ``model``, or for any model when ``model`` is ``None``."""
    decodes = [d for d in directory.workers("decode") if not d.draining and (model is None or d.model == model)]
    if not needs_prefill:
        return bool(decodes)
    prefill_keys = {(p.model, p.layout_key) for p in directory.workers("prefill") if not p.draining}
    return any((d.model, d.layout_key) in prefill_keys for d in decodes)
