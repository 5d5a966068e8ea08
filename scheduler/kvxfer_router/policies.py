"""Pair selection: which decode worker and which prefill worker serve one request.

Filtering is common to every policy and lives in :func:`select_pair`: only workers serving
the request's model, not ``draining``, not excluded by an earlier failed attempt, and - for a
pair - a prefill worker whose ``kv_layout`` equals the decode worker's (an incompatible pair
would write KV the decoder cannot read). A policy only ranks the survivors, and may be told
the request's prompt (its block hashes, :class:`~kvxfer_router.kv_index.PromptBlocks`):
``kv_aware`` (:mod:`kvxfer_router.kv_aware`) uses it, the load-based ones ignore it. Policies
are pluggable by name through :mod:`kvxfer_router.policy_registry`.
"""

from __future__ import annotations

import abc
import itertools
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Collection, Sequence

from kvxfer.metrics import DECISION_OUTCOMES

from .directory import WorkerDirectory, WorkerView

if TYPE_CHECKING:
    from .kv_index import KvIndex, PromptBlocks



@dataclass(frozen=True)
class RoutingEstimate:
    """What the policy expected of its choice: the outcome (one of ``DECISION_OUTCOMES``) and
    how many leading prompt blocks it believed each chosen worker held."""

    outcome: str
    decode_hit_blocks: int = 0
    prefill_hit_blocks: int = 0


@dataclass(frozen=True)
class WorkerPair:
    """The workers chosen for one attempt. ``prefill`` is ``None`` when the prompt is short
    enough to run on the decode worker alone (``POST /generate_local``), or when ``kv_aware``
    found the decode worker already holding nearly all of it. ``estimate`` is the policy's
    expectation, when it had one (not part of equality)."""

    decode: WorkerView
    prefill: WorkerView | None
    estimate: RoutingEstimate | None = field(default=None, compare=False)

    @property
    def worker_ids(self) -> tuple[str, ...]:
        """Ids of the workers in the pair, decode first."""
        return (self.decode.worker_id,) + ((self.prefill.worker_id,) if self.prefill else ())


def compatible(decode: WorkerView, prefill: WorkerView) -> bool:
    """Whether ``prefill`` may push KV to ``decode``: same model and same KV layout, and
    tensor parallel sizes whose KV heads map onto each other (both split the same heads
    as vLLM does: one of heads and size divides the other; unknown heads: equal sizes)."""
    return (decode.model == prefill.model and decode.layout_key == prefill.layout_key
            and decode.engine == prefill.engine and _heads_map(decode, prefill))


def _heads_map(decode: WorkerView, prefill: WorkerView) -> bool:
    if decode.tp_size == prefill.tp_size:
        return True
    heads = decode.kv_heads
    return heads > 0 and heads == prefill.kv_heads and all(
        heads % tp == 0 or tp % heads == 0 for tp in (decode.tp_size, prefill.tp_size))


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
    :meth:`choose_prefill`; both receive a non-empty list that is already filtered. A policy
    that weighs whole pairs against the request's prompt overrides :meth:`choose_pair` (and
    :meth:`served`, to learn where prompts went); ``kv_index`` is the KV index it reads, if
    any (the app then keeps it fed)."""

    name: ClassVar[str]
    kv_index: "KvIndex | None" = None

    def choose_pair(self, decodes: Sequence[WorkerView], prefills: Sequence[WorkerView], load: LocalLoad, *,
                    needs_prefill: bool, prompt: "PromptBlocks | None") -> WorkerPair:
        """Pick the pair among ``decodes`` (non-empty; with ``needs_prefill`` each has a
        compatible worker in ``prefills``). The default: :meth:`choose_decode`, then
        :meth:`choose_prefill` among the prefill workers compatible with it."""
        decode = self.choose_decode(decodes, load)
        if not needs_prefill:
            return WorkerPair(decode, None)
        return WorkerPair(decode, self.choose_prefill([p for p in prefills if compatible(decode, p)], load),
                          RoutingEstimate("pair"))

    def served(self, pair: WorkerPair, prompt: "PromptBlocks | None") -> None:
        """``pair`` served a request for ``prompt`` (its workers now hold its KV); no-op here."""

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


class FairTies:
    """Picks the best candidate by a key; candidates tied on it take turns (per role), in
    ``worker_id`` order. The registry's load figures are seconds old, so sequential requests
    see every idle worker tied: always taking the lowest id sent them all to one worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._turns: dict[str, itertools.count[int]] = {}

    def pick(self, role: str, candidates: Sequence[Any], key: Callable[[Any], Any],
             worker_id: Callable[[Any], str] = lambda w: w.worker_id) -> Any:
        """The candidate with the smallest ``key``; among equal keys, the next in turn."""
        keys = [key(c) for c in candidates]
        best = min(keys)
        tied = sorted((c for c, k in zip(candidates, keys) if k == best), key=worker_id)
        with self._lock:
            # Advanced on every pick, tied or not, so that the rotation is reproducible.
            turn = next(self._turns.setdefault(role, itertools.count()))
        return tied[turn % len(tied)]


class LeastLoadedPolicy(PairPolicy):
    """Decode: fewest running requests (registry ``running`` plus this router's own), then
    most free pages; a worker with no free page at all goes last because its ``/reserve``
    would fail. Prefill: shortest queue (``queue_depth`` plus this router's own).
    Tied workers take turns (:class:`FairTies`)."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._ties = FairTies()

    def choose_decode(self, candidates: Sequence[WorkerView], load: LocalLoad) -> WorkerView:
        """Least busy decode worker."""
        return self._ties.pick("decode", candidates,
                               lambda w: (w.free_pages <= 0, w.running + load.get(w.worker_id), -w.free_pages))

    def choose_prefill(self, candidates: Sequence[WorkerView], load: LocalLoad) -> WorkerView:
        """Prefill worker with the shortest queue."""
        return self._ties.pick("prefill", candidates, lambda w: w.queue_depth + load.get(w.worker_id))


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
    prompt: "PromptBlocks | None" = None,
) -> WorkerPair | None:
    """Choose the workers for one attempt, or ``None`` when no eligible combination exists.

    With ``max_per_worker``, a worker that already has that many of this router's requests
    is not eligible (backpressure: past it, a starved worker answers every call late).

    The decode worker is chosen first among those that have at least one compatible prefill
    worker (so a decode worker whose layout no prefiller shares is never picked for a
    disaggregated request), then the prefill worker among the compatible ones; a policy
    given the ``prompt`` may weigh whole pairs instead, and may answer a pair without a
    prefill worker even when ``needs_prefill`` (the decode worker holds the prompt's KV).
    """
    if max_per_worker is not None:
        busy = {w.worker_id for w in directory.workers() if load.get(w.worker_id) >= max_per_worker}
        exclude = set(exclude) | busy
    decodes = eligible(directory.workers("decode"), model, exclude)
    if not needs_prefill:
        return policy.choose_pair(decodes, [], load, needs_prefill=False, prompt=prompt) if decodes else None
    prefills = eligible(directory.workers("prefill"), model, exclude)
    layouts = {p.layout_key for p in prefills}
    decodes = [d for d in decodes if d.layout_key in layouts]
    if not decodes:
        return None
    return policy.choose_pair(decodes, prefills, load, needs_prefill=True, prompt=prompt)


def has_pair(directory: WorkerDirectory, model: str | None = None, *, needs_prefill: bool = True) -> bool:
    """Whether some eligible decode worker (with a compatible prefill worker when
    ``needs_prefill``) exists for ``model``, or for any model when ``model`` is ``None``."""
    decodes = [d for d in directory.workers("decode") if not d.draining and (model is None or d.model == model)]
    if not needs_prefill:
        return bool(decodes)
    prefill_keys = {(p.model, p.layout_key) for p in directory.workers("prefill") if not p.draining}
    return any((d.model, d.layout_key) in prefill_keys for d in decodes)
