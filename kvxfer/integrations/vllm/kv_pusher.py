"""Prefill side of the worker half: push each layer's finished pages as it is computed.

For every request of a prefill leg the pusher holds a `PrefillPush`, an adapter over the
push core the builtin prefiller uses too (kvxfer/handoff/): its state is a `PushLifecycle`
(push_state.py; it waits for the reservation, which may come after compute started, and
fails if none came `reservation_wait_s` after vLLM finished the request), its pages and
offsets a `PushPlan` (push_plan.py), its posted writes an `InflightWrites`.

`save_kv_layer(layer)` posts, for each request computed this step, one paged write of the
pages of that layer that became final (every token of the page computed, or the prompt's
last page): one write per (request, layer) per step, chunked prefill included, and no
"done" message; the decoder counts pages on its ImmCounter. A reservation that arrives
late is caught up from the request's blocks, which vLLM keeps for us (`request_finished`
delays their free until this side reports the push finished, with nothing in flight).

Under tensor parallelism each prefill rank runs its own pusher. A decoder of the same size
reserves whole blocks at its same-rank peer: one push per request, as above. A decoder of
another size sends sliced reservations (sliced_reservation.py): this rank holds one push
per decode rank that draws heads from it (`tensor_parallel.head_targets`), each posting
its head slice of every block, and reports the request finished once all of them are.

A push that ends early (FAILED, or STOPPING drained) tells the decoder with the protocol's
abort message, sent only once none of its writes is in flight (the hand-off's
`AbortSender`, push_abort.py): from then on the decoder may reuse its pages. A stopped
push's writes are reaped, without blocking, where the cancel is handled, in every
`save_kv_layer` and in every poll, and the message goes in the first of those that finds
them all completed or failed (`_confirm_if_drained`): a decoder's cancel is confirmed
within a layer of compute, not at the end of the prefill instance's step.

With several KV cache groups (a hybrid model under vLLM's hybrid manager) each layer's
pages are its group's blocks: the step's `PushSpec` carries every group's block ids, the
reservation the decoder's pages per group (`group_pages`), and the plan posts, per layer,
its group's pages the decoder keeps (not a sliding window's pages before the window).
Under tensor parallelism each rank does the same with its heads: whole blocks for a
decoder of the same size, and for one of another size the layer's group's pages, each
block's head slice (the sliced reservation carries `group_pages` like any other); from a
device cache through the staging rows alike (cache_paths.py).

Where the reservation asks for checksums, each block's CRC-32C is taken just before its
write is posted, and the table goes to the decoder once the last write is posted
(kv_checksums.py). Tests and drills slow, stop or corrupt a push through the
`ConnectorHooks` given at construction (connector_hooks.py); production gives none.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from kvxfer.handoff.inflight_writes import InflightWrites
from kvxfer.handoff.push_abort import AbortSender, AbortWords, PushAbort
from kvxfer.handoff.push_plan import LayerGroups, PushPlan, PushPlanError
from kvxfer.handoff.push_state import PushLifecycle, PushState
from kvxfer.kv.protocol import KVReservation
from kvxfer.metrics import ConnectorMetrics
from kvxfer.registry.signing import checksum_table_key_of
from kvxfer.transfer.engine import RegisteredMemory, TransferEngine

from .cache_paths import DirectWrites, StagedWrites
from .connector_hooks import NO_CONNECTOR_HOOKS, ConnectorHooks
from .kv_checksums import block_checksums, encode_table
from .kv_region import KVRegion
from .metadata import KvxferStepMetadata, PushSpec
from .settings import ConnectorSettings
from .sliced_reservation import SliceTarget
from .state_groups import unequal_tensor_parallel_state
from .tensor_parallel import TensorParallelError, TensorParallelPlace, decode_rank_addresses, head_targets

log = logging.getLogger(__name__)

#: The connector's words for its aborts: one line before each send, one for a failed send.
ABORT_WORDS = AbortWords(log, "transfer %s: could not tell the decoder the push stopped: %s", logging.INFO,
                         "transfer %s: no write in flight any more; telling the decoder (%s)")

#: The key of the one push of a request whose decoder has this rank's tensor parallel size
#: (its reservation names no decode rank: whole blocks from the same-rank peer).
WHOLE_BLOCKS = -1


@dataclass
class PrefillPush:
    """One request's push to one decoder (one decode rank of it)."""

    request_id: str
    transfer_id: str
    decode_engine: bytes
    prompt_tokens: int
    block_size: int
    num_layers: int
    #: the decode rank this push serves; WHOLE_BLOCKS where the decoder's TP size is ours.
    decode_rank: int = WHOLE_BLOCKS
    #: the heads of each block it posts, and where they go (None: whole blocks).
    target: SliceTarget | None = None
    block_ids: list[int] = field(default_factory=list)
    #: every KV cache group's block ids (-1: none), where there are several; None: one group.
    group_block_ids: list[list[int]] | None = None
    reservation: KVReservation | None = None
    #: which pages each layer posts and where they land (from the reservation on).
    plan: PushPlan | None = None
    #: tokens whose KV of layer l is in the cache (set as each layer is saved).
    computed_upto: list[int] = field(default_factory=list)
    writes: InflightWrites = field(default_factory=InflightWrites)
    vllm_finished_at: float | None = None
    created_at: float = field(default_factory=time.monotonic)
    layer_saved_at: list[float] = field(default_factory=list)
    layer_posted_at: list[float] = field(default_factory=list)
    abort: PushAbort = field(default_factory=PushAbort)
    #: computed_end of the step being executed (set by on_step, applied per saved layer).
    pending_end: int = 0
    #: pages posted late, from the kept blocks, because the reservation came after their layer.
    caught_up_pages: int = 0
    table_sent: bool = False

    def __post_init__(self) -> None:
        self.lifecycle = PushLifecycle(self.transfer_id)
        self.computed_upto = [0] * self.num_layers
        self.layer_saved_at = [0.0] * self.num_layers
        self.layer_posted_at = [0.0] * self.num_layers

    @property
    def state(self) -> PushState:
        """Where the push is (handoff/push_state.py)."""
        return self.lifecycle.state

    @property
    def total_pages(self) -> int:
        """Pages of the prompt."""
        return math.ceil(self.prompt_tokens / self.block_size)

    def final_pages(self, layer: int) -> int:
        """Prompt pages of `layer` whose every token is computed."""
        upto = self.computed_upto[layer]
        return self.total_pages if upto >= self.prompt_tokens else upto // self.block_size

    def local_blocks(self, group: int) -> list[int]:
        """This side's block ids of KV cache `group`, in prompt page order."""
        return self.group_block_ids[group] if self.group_block_ids is not None else self.block_ids

    @property
    def complete(self) -> bool:
        """Every page of every layer posted."""
        return self.plan is not None and self.plan.complete


class KVPusher:
    """Pushes prefill requests' KV; owned by the worker half, called from vLLM's worker thread only."""

    def __init__(self, settings: ConnectorSettings, engine: TransferEngine, region: KVRegion,
                 memory: RegisteredMemory | None, metrics: ConnectorMetrics,
                 hooks: ConnectorHooks = NO_CONNECTOR_HOOKS, writes: DirectWrites | StagedWrites | None = None,
                 place: TensorParallelPlace | None = None) -> None:
        self.settings = settings
        self.place = place or TensorParallelPlace()
        self.engine = engine
        self.region = region
        self.memory = memory
        self.metrics = metrics
        self._hooks = hooks
        self._table_key = checksum_table_key_of(settings.cluster_key_file)
        self._aborts = AbortSender(engine, ABORT_WORDS)
        self.block_size = region.block_size
        #: Each layer's slot and group where the cache has several groups (None: one).
        self.layer_groups = (LayerGroups(tuple(region.slot(i) for i in range(region.num_layers)),
                                         tuple(region.group(i) for i in range(region.num_layers)),
                                         tuple(region.state_bytes) if region.state_bytes is not None else None)
                             if region.num_groups > 1 else None)
        #: How a layer's blocks leave this cache: read in place (host memory registered as
        #: `memory`), or through pinned staging (a device cache).
        self.writes = writes or (DirectWrites(engine, memory, region.geometry) if memory is not None
                                 else StagedWrites(engine, region))
        self._by_request: dict[str, list[PrefillPush]] = {}  # one per decode rank served
        self._by_transfer: dict[tuple[str, int], PrefillPush] = {}  # (transfer id, decode rank)
        self._early: dict[tuple[str, int], tuple[KVReservation, SliceTarget | None, float]] = {}
        self._this_step: list[PrefillPush] = []
        self._report: set[str] = set()
        self._arrivals: set[str] = set()
        #: Stopped pushes (STOPPING, FAILED with a reservation) whose decoder is not yet told:
        #: each saved layer reaps their writes, so the word goes before the step ends.
        self._unconfirmed: list[PrefillPush] = []

    # ---- from the scheduler's metadata --------------------------------------------------

    def on_step(self, meta: KvxferStepMetadata) -> None:
        """Adopt this step's pushes, finished and preempted requests."""
        self._this_step = []
        for spec in meta.pushes:
            pushes = self._by_request.get(spec.request_id)
            for push in pushes if pushes is not None else self._adopt(spec):
                push.block_ids = spec.block_ids
                push.group_block_ids = spec.group_block_ids
                push.pending_end = spec.computed_end
                self._this_step.append(push)
        for rid in meta.preempted:
            for push in self._by_request.get(rid, ()):
                self._fail(push, "preempted on the prefill instance (its blocks were freed)")
        now = time.monotonic()
        for rid in meta.finished_pushes:
            pushes = self._by_request.get(rid)
            if not pushes:
                self._by_request.pop(rid, None)
                self._report.add(rid)  # never got to the worker, or no decode rank wants our heads
            for push in pushes or ():
                push.vllm_finished_at = now

    def _adopt(self, spec: PushSpec) -> list[PrefillPush]:
        try:
            decode_tp = len(decode_rank_addresses(spec.decode_engine))
            ranks = ([WHOLE_BLOCKS] if decode_tp == self.place.size else
                     head_targets(self.place.total_kv_heads, self.place.size, decode_tp, self.place.rank))
            problem = unequal_tensor_parallel_state(self.region.state_bytes is not None, self.place.size, decode_tp)
            if problem:
                ranks = [WHOLE_BLOCKS]
        except TensorParallelError as exc:
            ranks, problem = [WHOLE_BLOCKS], f"the decoder's KV heads cannot be mapped to this prefill rank ({exc})"
        pushes = [PrefillPush(spec.request_id, spec.transfer_id, spec.decode_engine, spec.prompt_tokens,
                              self.block_size, self.region.num_layers, decode_rank=rank) for rank in ranks]
        self._by_request[spec.request_id] = pushes
        for push in pushes:
            self._by_transfer[(spec.transfer_id, push.decode_rank)] = push
            if problem:
                self._fail(push, problem)
                continue
            early = self._early.pop((spec.transfer_id, push.decode_rank), None)
            if early is not None:
                self._attach(push, early[0], early[1])
        return pushes

    def _pushes(self) -> list[PrefillPush]:
        return [push for pushes in self._by_request.values() for push in pushes]

    # ---- from the decoder ---------------------------------------------------------------

    def on_reservation(self, reservation: KVReservation, target: SliceTarget | None = None) -> None:
        """A decoder's reservation arrived (it may come before its request reaches us);
        `target`: the head slice a decode rank of another TP size asks for."""
        key = (reservation.request_id, target.decode_rank if target is not None else WHOLE_BLOCKS)
        push = self._by_transfer.get(key)
        if push is None:
            if len(self._early) >= self.settings.max_early_reservations:
                self.metrics.dropped_messages.labels(reason="early_reservations_full").inc()
                return
            self._early[key] = (reservation, target, time.monotonic())
            self._arrivals.add(reservation.request_id)
            return
        if push.reservation is not None:
            self.metrics.dropped_messages.labels(reason="duplicate_reservation").inc()
            return
        self._attach(push, reservation, target)
        self._catch_up(push)

    @property
    def awaiting_reservation(self) -> bool:
        """Some push waits for its decoder's reservation (the worker may block on its inbox)."""
        return any(p.state is PushState.WAITING_FOR_RESERVATION for p in self._pushes())

    def take_arrivals(self) -> set[str]:
        """Transfer ids whose reservation arrived before their request (since the last call)."""
        out, self._arrivals = self._arrivals, set()
        return out

    def on_cancel(self, imm: int, nonce: int, reason: str) -> None:
        """The decoder gave up on a reservation: stop posting, confirm once drained."""
        for push in self._pushes():
            res = push.reservation
            if res is not None and res.imm == imm and res.nonce == nonce:
                if push.state in (PushState.PUSHING, PushState.WAITING_FOR_RESERVATION):
                    log.info("transfer %s (request %s): cancelled by the decoder (%s); stopping the push",
                             push.transfer_id, push.request_id, reason)
                    push.lifecycle.move(PushState.STOPPING, f"cancelled by the decoder: {reason}")
                    self._unconfirmed.append(push)
                    self._reap(push)
                    self._confirm_if_drained(push)
                elif push.state is PushState.DONE:
                    # Every write landed already (the decoder refused what landed): confirm
                    # at once rather than let it wait for its fence.
                    self._aborts.abort(push.abort, res, push.state, push.writes.unreaped > 0,
                                       f"cancelled by the decoder after every write landed: {reason}")
                return
        for key, (res, _, _) in list(self._early.items()):
            if res.imm == imm and res.nonce == nonce:
                # Its request never reached us: nothing was posted, confirm at once.
                del self._early[key]
                self._aborts.send(res, f"cancelled by the decoder before the request arrived: {reason}")
                return
        self.metrics.dropped_messages.labels(reason="unknown_cancel").inc()

    def _attach(self, push: PrefillPush, res: KVReservation, target: SliceTarget | None = None) -> None:
        push.reservation = res
        push.target = target
        if push.state is not PushState.WAITING_FOR_RESERVATION:
            # It failed first (preempted, heads it cannot serve): never revived, its blocks
            # may be gone; with the reservation known, the next poll tells the decoder.
            return
        problem = self._check(push, res)
        if problem:
            self._fail(push, problem)
            return
        # A decode rank of another TP size takes the same pages of each layer's group as
        # whole blocks would be, only this slice of each.
        head_slice = target.slice if target is not None else None
        try:
            push.plan = PushPlan(res, self.region.geometry, layer_groups=self.layer_groups,
                                 src_heads=head_slice.src_heads if head_slice else None,
                                 dst_heads=head_slice.dst_heads if head_slice else None,
                                 dst_num_heads=target.dst_num_heads if target is not None else None)
        except PushPlanError as exc:
            self._fail(push, str(exc))
            return
        push.lifecycle.move(PushState.PUSHING)

    def _check(self, push: PrefillPush, res: KVReservation) -> str:
        target = push.target
        # A decode rank of another TP size holds another number of heads per block; every
        # other property of the blocks must be ours.
        ours = self.region.kv_layout if target is None else self.region.kv_layout_with_heads(target.dst_num_heads)
        if res.kv_layout != ours:
            self.metrics.failures.labels(side="prefill", reason="layout_mismatch").inc()
            return (f"KV layout mismatch: the decoder's cache is {res.kv_layout!r}, this prefiller's is "
                    f"{ours!r}; raw blocks cannot be copied between them")
        if target is not None and target.slice.src_heads[1] > self.region.geometry.num_heads:
            return (f"the decoder asks for heads {target.slice.src_heads[0]}..{target.slice.src_heads[1]} of this "
                    f"rank's {self.region.geometry.num_heads} (tensor parallel sizes disagree)")
        if (res.group_pages is None) != (self.layer_groups is None):
            return (f"the decoder's reservation names {len(res.group_pages or [[]])} KV cache groups, this "
                    f"prefiller's cache has {self.region.num_groups}; pages of one group cannot land in another's")
        if self.layer_groups is not None and res.group_pages is not None:
            if len(res.group_pages) != self.region.num_groups:
                return (f"the decoder's reservation names {len(res.group_pages)} KV cache groups, this "
                        f"prefiller's cache has {self.region.num_groups}")
            if res.expected_count != self.layer_groups.expected_writes(res.group_pages):
                return (f"the decoder expects {res.expected_count} writes, its pages per group make "
                        f"{self.layer_groups.expected_writes(res.group_pages)} for this cache's layers")
        if res.first_page + res.prompt_pages != push.total_pages:
            return (f"the reservation covers prompt pages {res.first_page}..{res.first_page + res.prompt_pages}, "
                    f"but this prompt has {push.total_pages} pages (prompts differ between the legs?)")
        if res.fence_timeout_s <= self.settings.transfer_timeout_s:
            return (f"the decoder's fence_timeout_s ({res.fence_timeout_s}) does not exceed this prefiller's "
                    f"transfer_timeout_s ({self.settings.transfer_timeout_s})")
        if res.checksums and res.checksum_tag and self._table_key is None:
            return ("the decoder asks for a tagged checksum table and this prefiller has no cluster key "
                    "(cluster_key_file) to tag it with")
        return ""

    # ---- posting ----------------------------------------------------------------------------

    def save_layer(self, layer: int) -> None:
        """vLLM computed `layer` for this step's requests: post their final pages of it."""
        for push in self._this_step:
            self._hooks.layer_saved(push.transfer_id, layer)
        self._confirm_drained()
        now = time.monotonic()
        for push in self._this_step:
            push.computed_upto[layer] = max(push.computed_upto[layer], push.pending_end)
            push.layer_saved_at[layer] = now
            if push.state is PushState.PUSHING:
                self._post(push, layer)

    def _catch_up(self, push: PrefillPush) -> None:
        before = push.writes.pages_posted
        for layer in range(push.num_layers):
            if push.state is not PushState.PUSHING:
                break
            self._post(push, layer)
        push.caught_up_pages += push.writes.pages_posted - before

    def _post(self, push: PrefillPush, layer: int) -> None:
        if push.state is not PushState.PUSHING:
            return  # stopped (cancelled, failed): nothing more may be posted
        res, plan = push.reservation, push.plan
        assert res is not None and plan is not None
        try:
            group = self.layer_groups.groups[layer] if self.layer_groups is not None else 0
            pages = plan.final(layer, push.final_pages(layer), push.local_blocks(group))
        except PushPlanError as exc:
            self._fail(push, str(exc))
            return
        if pages is None:
            return
        chosen = self._hooks.layer_pages(push.transfer_id, layer, pages.local, pages.remote.tolist())
        if chosen is None:
            return
        src, dst = chosen
        if plan.checksums is not None:
            heads = push.target.slice.src_heads if push.target else None
            plan.record_checksums(pages, block_checksums(self.region, layer, src, heads))
        self._hooks.layer_checksummed(self.region, push.transfer_id, layer, src)
        try:
            posted = self.writes.post(plan.runs(layer), src, res, dst, push.transfer_id, push.writes, push.target)
        except Exception as exc:  # a dead peer, a descriptor the engine refuses, a bad num_pages
            self._fail(push, f"posting layer {layer} failed: {exc}")
            return
        plan.posted(pages)
        push.layer_posted_at[layer] = time.monotonic()
        push.writes.count(len(src), posted)
        if plan.checksums is not None and plan.complete and not push.table_sent:
            self._send_table(push)

    def _send_table(self, push: PrefillPush) -> None:
        """The checksum table, once every write of the push is posted (not yet landed: the
        decoder waits for both)."""
        res = push.reservation
        assert res is not None and push.plan is not None and push.plan.checksums is not None
        push.table_sent = True
        try:
            for message in encode_table(res.imm, res.nonce, push.plan.checksums, self._table_key):
                push.writes.add(self.engine.send(res.descriptor, message))
        except Exception as exc:  # the decoder is gone: this push cannot complete
            self._fail(push, f"sending the checksum table failed: {exc}")

    # ---- completion -------------------------------------------------------------------------

    def poll(self, finished_req_ids: set[str]) -> set[str]:
        """Reap completions and deadlines; the requests whose blocks vLLM may free now."""
        now = time.monotonic()
        for rid in finished_req_ids:
            for push in self._by_request.get(rid, ()):
                if push.vllm_finished_at is None:
                    push.vllm_finished_at = now
        for key, (_, _, at) in list(self._early.items()):
            if now - at > self.settings.reservation_wait_s:
                del self._early[key]  # its request never came: nothing was pushed
                self.metrics.dropped_messages.labels(reason="orphan_reservation").inc()
        for push in self._pushes():
            self._reap(push)
            if push.state is PushState.WAITING_FOR_RESERVATION and push.vllm_finished_at is not None \
                    and now - push.vllm_finished_at > self.settings.reservation_wait_s:
                self._fail(push, f"no reservation from the decoder within reservation_wait_s={self.settings.reservation_wait_s}")
            if push.state is PushState.PUSHING and push.complete and not push.writes.unreaped:
                self._finish(push)
            self._confirm_if_drained(push)
            if push.lifecycle.final and not push.writes.unreaped and push.vllm_finished_at is not None:
                self._forget(push)
        out, self._report = self._report, set()
        return out

    def _confirm_drained(self) -> None:
        """Reaps the stopped pushes' writes without blocking; confirms each one drained."""
        if not self._unconfirmed:
            return
        for push in self._unconfirmed:
            self._reap(push)
            self._confirm_if_drained(push)
        self._unconfirmed = [p for p in self._unconfirmed
                             if p.state in (PushState.STOPPING, PushState.FAILED) and not p.abort.sent]

    def _confirm_if_drained(self, push: PrefillPush) -> None:
        """A stopped push (STOPPING, FAILED) of which no write is unreaped (each completed or
        failed: none can land any more) tells its decoder so, once (`AbortSender.abort`), and a
        STOPPING one is DONE. The one place that does it: a cancel, each saved layer and each
        poll call it."""
        if push.state not in (PushState.STOPPING, PushState.FAILED) or push.writes.unreaped:
            return
        self._aborts.abort(push.abort, push.reservation, push.state, False, push.lifecycle.reason or "stopped")
        if push.state is PushState.STOPPING:
            push.lifecycle.move(PushState.DONE)

    def _reap(self, push: PrefillPush) -> None:
        failure = push.writes.reap().failure
        if failure is not None:
            self._fail(push, f"a write to the decoder failed: {failure}")

    def _finish(self, push: PrefillPush) -> None:
        push.lifecycle.move(PushState.DONE)
        # The tail: from the last layer's compute to its last write landing (the engine
        # stamps completions with CLOCK_MONOTONIC, time.monotonic()'s clock).
        completed = push.writes.last_completed_at or time.monotonic()
        tail = max(0.0, completed - push.layer_saved_at[-1])
        self.metrics.push_tail.observe(tail)
        self.metrics.push_seconds.observe(max(0.0, completed - push.created_at))
        self.metrics.pages_pushed.inc(push.writes.pages_posted)
        self.metrics.bytes_pushed.inc(push.writes.bytes_posted)
        if push.reservation is not None:
            self._hooks.push_finished(self.region, push, tail)

    def _fail(self, push: PrefillPush, reason: str) -> None:
        if push.lifecycle.final:
            return
        log.warning("transfer %s (request %s): push failed: %s", push.transfer_id, push.request_id, reason)
        if "layout mismatch" not in reason:
            self.metrics.failures.labels(side="prefill", reason="push_failed").inc()
        push.lifecycle.move(PushState.FAILED, reason)
        if push.reservation is not None and all(p is not push for p in self._unconfirmed):
            self._unconfirmed.append(push)

    def _forget(self, push: PrefillPush) -> None:
        self._unconfirmed = [p for p in self._unconfirmed if p is not push]
        self._by_transfer.pop((push.transfer_id, push.decode_rank), None)
        pushes = self._by_request.get(push.request_id, [])
        pushes[:] = [p for p in pushes if p is not push]
        if not pushes:  # every decode rank this rank serves is done: vLLM may free the blocks
            self._by_request.pop(push.request_id, None)
            self._report.add(push.request_id)
