"""The router's KV index: which prompt-prefix blocks each worker holds.

A block is named by the chained hash of ``kvxfer.kv.prefix_hash`` (block ``i``'s hash
covers blocks ``0..i``), so "worker W holds the first k blocks of this prompt" is a lookup
of the prompt's hashes in W's set, stopping at the first miss. Two feeds, as llm-d has them
(setting ``kv_index_mode``):

* precise: builtin workers report their prefix cache on ``POST /prefix_index`` (signed like
  every control call); :class:`PrefixIndexPoller` asks every
  ``prefix_index_poll_interval_s``. A report older than ``prefix_index_max_age_s`` is stale
  and ignored (the policy then chooses that worker by load), a new ``epoch`` (the worker
  restarted) drops what it said before.
* approximate: what the router itself routed where. vLLM instances report nothing (their KV
  events need a ZMQ port), so for them this is the only feed, and the router does not
  tokenize their requests: it hashes the prompt's UTF-8 text in fixed-size byte blocks
  (:func:`text_block_hashes`, same chaining) instead. That is an estimate: it says what was
  sent to an instance, not what its cache still holds.

Entries of a worker go when it leaves the directory (its lease ended). Each worker's set is
bounded (the capacity it reports, else ``kv_index_approximate_capacity_blocks``) with LRU
eviction of routed records. Nothing here does I/O except the poller; the index is read on
the event loop and needs no lock.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import httpx

from kvxfer.kv.prefix_hash import BLOCK_HASH_BYTES, block_hashes_hex

from .directory import WorkerDirectory, WorkerView
from .settings import RouterSettings
from .worker_auth import WorkerCallSigner

log = logging.getLogger(__name__)


class KvIndexMode(str, enum.Enum):
    """Which feeds fill the index (setting ``kv_index_mode``)."""

    PRECISE = "precise"          # only the workers' own reports
    APPROXIMATE = "approximate"  # only what the router routed
    BOTH = "both"                # reports, plus routed records until the next report


def text_block_hashes(data: bytes, block_bytes: int, namespace: str = "") -> list[str]:
    """Chained hashes (hex) of the full ``block_bytes``-byte blocks of ``data``: the
    approximate index's names for a prompt the router does not tokenize (vLLM instances).
    Same chaining as ``kvxfer.kv.prefix_hash.block_hashes``, so two prompts share block
    ``i``'s hash exactly when their first ``(i + 1) * block_bytes`` bytes agree."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be at least 1, got {block_bytes}")
    parent = hashlib.blake2b(b"text:" + namespace.encode(), digest_size=BLOCK_HASH_BYTES).digest()
    hashes: list[str] = []
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        parent = hashlib.blake2b(parent + data[start:start + block_bytes], digest_size=BLOCK_HASH_BYTES).digest()
        hashes.append(parent.hex())
    return hashes


def relayed_prompt_text(body: dict[str, Any], kind: str) -> bytes:
    """A canonical rendering of a relayed (vLLM) request's prompt, prefix-stable: a
    conversation one turn longer renders to a longer string that starts with the shorter
    one's rendering. Chat: tools first, then one JSON record per message (role and content
    parts in order); completions: the prompt string, or its token ids."""
    if kind == "chat":
        parts = [json.dumps(["tools", body["tools"]], sort_keys=True) + "\n"] if body.get("tools") else []
        for message in body.get("messages") or ():
            if isinstance(message, dict):
                parts.append(json.dumps([message.get("role"), message.get("content")], sort_keys=True,
                                        ensure_ascii=False) + "\n")
        return "".join(parts).encode("utf-8", errors="replace")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode("utf-8", errors="replace")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "".join(f"{t}," for t in prompt).encode()
    return b""


class PromptBlocks:
    """One request's prompt as the index sees it: its length in units (tokens for kvxfer's
    workers, UTF-8 bytes for vLLM instances) and its block hashes at any block size,
    computed once per size."""

    def __init__(self, namespace: str, *, tokens: Sequence[int] | None = None, text: bytes | None = None) -> None:
        if (tokens is None) == (text is None):
            raise ValueError("a prompt is either tokens or text")
        self.namespace = namespace
        self._tokens = tokens
        self._text = text
        self._hashes: dict[tuple[int, str], list[str]] = {}

    @classmethod
    def for_request(cls, model: str, tokens: Sequence[int], body: dict[str, Any] | None, kind: str) -> PromptBlocks:
        """A request's prompt: its token ids for kvxfer's workers, or, for a body relayed to
        vLLM instances (``body`` set), its canonical text (:func:`relayed_prompt_text`).
        vLLM's ``cache_salt`` goes into the namespace: vLLM folds it into the first block's
        hash, so prompts with different salts never share a cached block there either."""
        if body is not None:
            salt = body.get("cache_salt")
            namespace = f"{model}\x00cache_salt:{salt}" if isinstance(salt, str) and salt else model
            return cls(namespace, text=relayed_prompt_text(body, kind))
        return cls(model, tokens=tokens)

    @property
    def is_text(self) -> bool:
        """Whether the units are bytes of text (vLLM) rather than tokens."""
        return self._text is not None

    @property
    def units(self) -> int:
        """Prompt length in its units (tokens or bytes)."""
        return len(self._tokens) if self._tokens is not None else len(self._text or b"")

    def hashes(self, block_size: int, namespace: str | None = None) -> list[str]:
        """Hex hashes of the prompt's full blocks of ``block_size`` units, in ``namespace``
        (a worker's report names its own; by default the request's model)."""
        namespace = self.namespace if namespace is None else namespace
        cached = self._hashes.get((block_size, namespace))
        if cached is None:
            if self._tokens is not None:
                cached = block_hashes_hex(self._tokens, block_size, namespace)
            else:
                cached = text_block_hashes(self._text or b"", block_size, namespace)
            self._hashes[(block_size, namespace)] = cached
        return cached


@dataclass
class _WorkerBlocks:
    """What the index knows of one worker."""

    block_size: int
    capacity_blocks: int
    #: The hash namespace of the worker's report (None: the request's model).
    namespace: str | None = None
    #: From the last report (precise); replaced whole by the next one.
    reported: frozenset[str] = frozenset()
    #: Routed by this router (approximate): hash -> when recorded (monotonic), LRU order.
    routed: "OrderedDict[str, float]" = field(default_factory=OrderedDict)
    epoch: str | None = None
    version: int = 0
    #: Monotonic time of the last report (None: never reported).
    reported_at: float | None = None


class KvIndex:
    """Per-worker sets of held block hashes, fed by reports and by routing decisions."""

    def __init__(self, settings: RouterSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.mode = KvIndexMode(settings.kv_index_mode)
        self._max_age_s = settings.prefix_index_max_age_s
        self._approx_capacity = settings.kv_index_approximate_capacity_blocks
        self._token_block = settings.approximate_block_tokens
        self._text_block = settings.approximate_text_block_bytes
        self._clock = clock
        self._workers: dict[str, _WorkerBlocks] = {}

    def now(self) -> float:
        """The index's clock (monotonic seconds), for ``apply_report``'s ``asked_at``."""
        return self._clock()

    # --- feeds -------------------------------------------------------------------------

    def since_version(self, worker_id: str) -> int:
        """The version to send with the next ``/prefix_index`` poll of ``worker_id``."""
        entry = self._workers.get(worker_id)
        return entry.version if entry is not None and entry.reported_at is not None else 0

    def apply_report(self, worker_id: str, report: dict[str, Any], *, asked_at: float) -> None:
        """Take a ``/prefix_index`` answer polled at ``asked_at`` (monotonic). Routed
        records older than the poll are dropped: the report is the truth about them (the
        worker may have evicted them). Raises ValueError for a malformed report."""
        epoch, version = report.get("epoch"), report.get("version")
        block_size, capacity = report.get("block_size"), report.get("capacity_pages")
        blocks, namespace = report.get("blocks"), report.get("namespace")
        if not isinstance(epoch, str) or not _is_count(version) or not _is_count(block_size) or block_size < 1 \
                or not _is_count(capacity):
            raise ValueError(f"malformed prefix index report from {worker_id}: "
                             f"epoch={epoch!r} version={version!r} block_size={block_size!r} capacity={capacity!r}")
        if not isinstance(namespace, str):
            raise ValueError(f"malformed prefix index report from {worker_id}: namespace={namespace!r}")
        if blocks is not None and not (isinstance(blocks, list) and all(isinstance(b, str) for b in blocks)):
            raise ValueError(f"malformed prefix index report from {worker_id}: blocks must be a list of hex strings")
        entry = self._workers.get(worker_id)
        if entry is None or entry.epoch != epoch or (entry.block_size, entry.namespace) != (block_size, namespace):
            # A new process (or new block names) makes everything said before meaningless.
            entry = self._workers[worker_id] = _WorkerBlocks(block_size, max(1, capacity), namespace, epoch=epoch)
            if blocks is None:
                # "Unchanged" against a version of another process: ask again from scratch.
                return
        entry.capacity_blocks = max(1, capacity)
        if blocks is not None:
            entry.reported = frozenset(blocks[:entry.capacity_blocks])
        entry.version = version
        entry.reported_at = self._clock()
        for h in [h for h, at in entry.routed.items() if at <= asked_at]:
            del entry.routed[h]

    def record_routed(self, worker: WorkerView, prompt: PromptBlocks) -> None:
        """Note that ``worker`` computed or received ``prompt``'s KV (approximate feed;
        nothing in precise mode)."""
        if self.mode is KvIndexMode.PRECISE:
            return
        entry = self._workers.get(worker.worker_id)
        if entry is None:
            entry = self._workers[worker.worker_id] = _WorkerBlocks(self._default_block(prompt), self._approx_capacity)
        now = self._clock()
        for h in prompt.hashes(entry.block_size, entry.namespace):
            entry.routed[h] = now
            entry.routed.move_to_end(h)
        while len(entry.routed) > entry.capacity_blocks:
            entry.routed.popitem(last=False)

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Forget every worker not in ``worker_ids`` (it left the directory: lease gone)."""
        keep = set(worker_ids)
        for wid in [w for w in self._workers if w not in keep]:
            del self._workers[wid]

    # --- reads -------------------------------------------------------------------------

    def held_units(self, worker: WorkerView, prompt: PromptBlocks) -> int | None:
        """How many leading units (tokens or bytes) of ``prompt`` ``worker`` holds, or
        ``None`` when the index knows nothing usable of it (never heard of, or only a stale
        report): the caller then decides by load."""
        entry = self._workers.get(worker.worker_id)
        if entry is None:
            return None
        fresh = entry.reported_at is not None and self._clock() - entry.reported_at <= self._max_age_s
        use_reported = fresh and self.mode is not KvIndexMode.APPROXIMATE
        use_routed = self.mode is not KvIndexMode.PRECISE
        if not use_reported and not (use_routed and entry.routed):
            return None
        matched = 0
        for h in prompt.hashes(entry.block_size, entry.namespace):
            if not ((use_reported and h in entry.reported) or (use_routed and h in entry.routed)):
                break
            matched += 1
        return matched * entry.block_size

    def block_size(self, worker: WorkerView, prompt: PromptBlocks) -> int:
        """Units per block (per KV page, for kvxfer's workers) the index uses for ``worker``."""
        entry = self._workers.get(worker.worker_id)
        return entry.block_size if entry is not None else self._default_block(prompt)

    def sizes(self) -> dict[str, tuple[int, float | None]]:
        """Per worker: (blocks held as the index counts them, seconds since its last report
        or None if it never reported), for metrics."""
        now = self._clock()
        return {wid: (len(e.reported | e.routed.keys()) if self.mode is KvIndexMode.BOTH
                      else len(e.reported) if self.mode is KvIndexMode.PRECISE else len(e.routed),
                      None if e.reported_at is None else now - e.reported_at)
                for wid, e in self._workers.items()}

    def _default_block(self, prompt: PromptBlocks) -> int:
        return self._text_block if prompt.is_text else self._token_block


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class PrefixIndexPoller:
    """Polls ``POST /prefix_index`` of every worker that ``reports`` (the builtin workers: the
    app asks their leg type) every ``prefix_index_poll_interval_s`` (precise and both modes)
    and prunes the index of workers that left the directory. A worker that does not answer
    keeps its last report, which goes stale on its own; failures are logged at debug level
    only (a worker without a prefix cache answers 404)."""

    def __init__(self, settings: RouterSettings, index: KvIndex, directory: WorkerDirectory,
                 client: Callable[[], httpx.AsyncClient], signer: WorkerCallSigner,
                 reports: Callable[[WorkerView], bool], on_tick: Callable[[], None] = lambda: None) -> None:
        self._settings = settings
        self._reports = reports
        self._index = index
        self._directory = directory
        self._client = client
        self._signer = signer
        self._on_tick = on_tick

    async def run(self) -> None:
        """Poll until cancelled. A round that fails unexpectedly is logged and the next one
        runs: a dead poller would leave every report to go stale."""
        while True:
            try:
                await self.poll_once()
            except Exception:
                log.exception("prefix index poll round failed")
            await asyncio.sleep(self._settings.prefix_index_poll_interval_s)

    async def poll_once(self) -> None:
        """One round: prune, then ask every builtin worker at once."""
        workers = self._directory.workers()
        self._index.retain(w.worker_id for w in workers)
        if self._index.mode is not KvIndexMode.APPROXIMATE:
            await asyncio.gather(*(self._poll(w) for w in workers if self._reports(w)))
        self._on_tick()

    async def _poll(self, worker: WorkerView) -> None:
        s = self._settings
        asked_at = self._index.now()
        body = {"since_version": self._index.since_version(worker.worker_id)}
        try:
            resp = await asyncio.wait_for(self._client().post(
                timeout=httpx.Timeout(s.control_timeout_s, connect=s.connect_timeout_s),
                **self._signer.request(worker, "/prefix_index", body)), s.control_timeout_s)
            if resp.status_code != 200:
                log.debug("prefix index of %s: answered %d", worker.worker_id, resp.status_code)
                return
            report = resp.json()
            if not isinstance(report, dict):
                raise ValueError("not a JSON object")
            self._index.apply_report(worker.worker_id, report, asked_at=asked_at)
        except (httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
            log.debug("prefix index of %s not read: %s", worker.worker_id, exc)
