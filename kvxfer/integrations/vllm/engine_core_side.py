"""The connector's EngineCore half (vLLM's SCHEDULER role, in its EngineCore process).

Decode instance: a request whose `kv_transfer_params` name a kvxfer decode leg is parked
by vLLM in WAITING_FOR_REMOTE_KVS with blocks for the part of the prompt this instance
does not hold (prefix-cache hits count); the worker half reserves them and admits the
request on its ImmCounter. Until the worker reports the load finished (admitted, failed,
or fenced after a cancel), `request_finished` keeps the blocks: no block is freed while a
write for it can still land.

Prefill instance: the request computes as usual; each step tells the worker half which
blocks hold how many computed tokens, and the worker pushes every layer's finished pages
from `save_kv_layer`. `request_finished` keeps the blocks until the worker reports the
push finished (no write in flight), and `has_pending_push_work` keeps vLLM stepping
meanwhile.

Several KV cache groups (vLLM's hybrid manager, the connector being `SupportsHMA`): a block
id names a page of one group only, so loads and pushes carry every group's block ids
(`group_block_ids`, vLLM's null block as -1: a sliding window's pages before its window,
which neither side pushes nor keeps). vLLM's prefix-cache hit is one token count for every
group, so `first_page` is common to the groups.

Mamba/SSM state groups (`state_groups.py`): a request holds one block of each, which the
loads and pushes carry as that group's block of the last prompt page (-1 before it). The
decoder recomputes the last prompt token on top of a loaded state, so a decode leg loads
the prompt less that token, and a prefill leg computes only that much (its prompt is
truncated when it arrives, `on_new_request`).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .metadata import KvxferStepMetadata, KvxferWorkerReport, LoadSpec, PushSpec, TransferParams, TransferParamsError
from .state_groups import RECOMPUTED_TOKENS, per_prompt_page, truncate_prefill_prompt

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: How long (seconds) a transfer id whose load ended is remembered, so that a sibling of
#: the request that loaded it (vLLM forks one child per choice for `n` > 1, all with the
#: same kv_transfer_params) asked only after that request finished computes locally
#: instead of reserving a second time for KV that nobody will push.
SIBLING_MEMORY_S = 120.0


@dataclass
class _PendingLoad:
    params: TransferParams
    num_computed: int
    spec_sent: bool = False


@dataclass
class _ActivePush:
    params: TransferParams
    prompt_tokens: int
    pushed_to: int = 0  # computed_end already announced to the worker


@dataclass
class _TransferLoad:
    """The one load of a transfer id: the request that loads it, its prompt (siblings have
    the same), and when the load ended (None while it runs)."""

    loader: str
    prompt: int
    ended_at: float | None = None


def _prompt_key(request: Request) -> int:
    """A request's prompt, as a key: siblings of one `n` > 1 request have equal keys."""
    ids = getattr(request, "prompt_token_ids", None)
    return hash((request.num_prompt_tokens, tuple(ids) if ids is not None else ()))


class EngineCoreSide:
    """Bookkeeping of kvxfer legs in vLLM's scheduler; builds each step's metadata."""

    def __init__(self, block_size: int, reservation_wait_s: float, *, wait_for_reservation: bool = False,
                 state_groups: frozenset[int] = frozenset()) -> None:
        self.block_size = block_size
        #: The KV cache groups that hold Mamba/SSM state (one block per request).
        self.state_groups = state_groups
        # Prefill legs whose prompt could not be truncated for a state push: computed, not pushed.
        self._unpushable: set[str] = set()
        self.reservation_wait_s = reservation_wait_s
        self.wait_for_reservation = wait_for_reservation
        self._arrived: set[str] = set()  # transfer ids whose reservation the worker holds
        self._gated_since: dict[str, float] = {}  # prefill requests held until their reservation
        self._kv_cache_manager: Any = None
        self._pending_loads: dict[str, _PendingLoad] = {}
        self._loads_in_flight: set[str] = set()  # sent to the worker, not reported finished
        # One load per transfer: the request that loads it, by transfer id, and the transfer of
        # each loading request. vLLM's children of one `n` > 1 request share the transfer id;
        # the first child loads, its siblings wait (None: asked again next step) and then hit
        # the blocks the load cached, computing only the last partial block themselves.
        # A request with another prompt under the same transfer id (a batch of prompts sent
        # with one kv_transfer_params) is no sibling: it computes here, it never shares a load.
        # An ended load is remembered for SIBLING_MEMORY_S.
        self._transfer_loads: dict[str, _TransferLoad] = {}
        self._load_transfer: dict[str, str] = {}  # loading request -> its transfer id
        # Loads the worker reported failed: with kv_load_failure_policy=recompute vLLM asks
        # again for the same request, which must then be computed here, not loaded again.
        self._failed_loads: set[str] = set()
        # Per loading request: (blocks it loads per KV cache group, leading prompt blocks it
        # held already), for the figures its answer's kv_transfer_params carry to the router.
        self._load_blocks: dict[str, tuple[list[int], int]] = {}
        self._loads_to_send: list[LoadSpec] = []
        self._pushes: dict[str, _ActivePush] = {}
        self._finished_pushes: list[str] = []
        self._awaiting_send: set[str] = set()  # finished on vLLM's side, blocks held for the push
        self._draining = False

    def watch_sigterm(self) -> None:
        """Learn of vLLM's drain (call once, in the EngineCore process)."""
        # vLLM's API server answers SIGTERM by asking the engine core to drain (with
        # --shutdown-timeout), which arrives here as SIGTERM too. Wrap vLLM's handler, so the
        # worker learns of the drain on the next step and withdraws the registry record
        # while the requests in flight finish.
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (tests build us elsewhere)
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            self._draining = True
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.raise_signal(signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)

    def bind_kv_cache_manager(self, manager: Any) -> None:
        """vLLM's block manager, to read a request's block table."""
        self._kv_cache_manager = manager

    def _params(self, request: Request) -> TransferParams | None:
        try:
            return TransferParams.parse(request.kv_transfer_params)
        except TransferParamsError as exc:
            # The router validates before it sends; a client reaching the instance directly
            # with bad params gets its request computed here, and the refusal is logged.
            log.warning("request %s: ignoring kv_transfer_params: %s", request.request_id, exc)
            request.kv_transfer_params = None
            return None

    def on_new_request(self, request: Request) -> None:
        """A prefill leg of a model with Mamba/SSM state computes its prompt less the token
        the decoder recomputes (state_groups.py)."""
        if not self.state_groups:
            return
        params = self._params(request)
        if params is not None and params.role == "prefill" and not truncate_prefill_prompt(request):
            self._unpushable.add(request.request_id)

    # ---- decode ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode leg: all prompt tokens beyond the local prefix hit load asynchronously."""
        rid = request.request_id
        if rid in self._loads_in_flight or rid in self._pending_loads:
            return 0, False
        params = self._params(request)
        if params is not None and params.role == "prefill":
            return self._gate_prefill(request, params)
        if params is None or rid in self._failed_loads:
            return 0, False
        prompt = _prompt_key(request)
        sibling = self._sibling_answer(rid, params.transfer_id, prompt)
        if sibling is not None:
            return sibling
        # With state groups the decoder's last prompt token is computed here, on the loaded state.
        n = request.num_tokens - num_computed_tokens - (RECOMPUTED_TOKENS if self.state_groups else 0)
        if n <= 0:
            return 0, False
        self._pending_loads[rid] = _PendingLoad(params, num_computed_tokens)
        self._transfer_loads[params.transfer_id] = _TransferLoad(rid, prompt)
        self._load_transfer[rid] = params.transfer_id
        return n, True

    def _sibling_answer(self, rid: str, transfer_id: str, prompt: int) -> tuple[int | None, bool] | None:
        """For a request whose transfer another request loads or loaded (a sibling choice of
        the same `n` > 1 request): None to ask again while that load runs, then (0, False)
        (compute here; the loaded blocks are prefix-cache hits). (0, False) at once for a
        request with another prompt. None for the first asker."""
        load = self._transfer_loads.get(transfer_id)
        if load is None:
            return None
        if load.ended_at is not None:
            return 0, False
        if load.loader == rid:
            return None
        if load.prompt != prompt:
            return 0, False
        running = load.loader in self._pending_loads or load.loader in self._loads_in_flight
        return (None, False) if running else (0, False)

    def _gate_prefill(self, request: Request, params: TransferParams) -> tuple[int | None, bool]:
        # With wait_for_reservation, compute only once the decoder's reservation is here, so
        # that every layer's pages leave as soon as the layer is computed; past
        # reservation_wait_s compute anyway. Without it (the default), compute at once: the
        # layers done before the reservation comes are pushed from the kept blocks when it
        # does, which costs less than the decoder's reservation round trip before compute
        # (one vLLM step on each side: about 30 ms of a 64-token TTFT on this machine).
        rid = request.request_id
        if rid in self._pushes or rid in self._unpushable:
            return 0, False
        if any(push.params.transfer_id == params.transfer_id for push in self._pushes.values()):
            # Another request of this instance pushes for that transfer (a batch of prompts
            # under one kv_transfer_params): one reservation takes one prompt's KV.
            log.warning("request %s: transfer %s is pushed by another request; computing without a push",
                        rid, params.transfer_id)
            return 0, False
        if self.wait_for_reservation and self._still_gated(rid, params.transfer_id):
            return None, False
        self._pushes[rid] = _ActivePush(params, request.num_prompt_tokens)
        return 0, False

    def _still_gated(self, rid: str, transfer_id: str) -> bool:
        """With wait_for_reservation: True until the reservation arrived or reservation_wait_s
        passed since the request was first asked about."""
        now = time.monotonic()
        since = self._gated_since.setdefault(rid, now)
        if transfer_id not in self._arrived and now - since < self.reservation_wait_s:
            return True
        self._gated_since.pop(rid, None)
        self._arrived.discard(transfer_id)
        return False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The blocks of a decode leg are known: queue its load for the worker."""
        pending = self._pending_loads.get(request.request_id)
        if pending is None or pending.spec_sent or num_external_tokens <= 0:
            return
        first_page = pending.num_computed // self.block_size
        last_page = math.ceil((pending.num_computed + num_external_tokens) / self.block_size)
        per_group = self._group_blocks(blocks.get_block_ids(), last_page)
        groups = [ids[first_page:last_page] for ids in per_group]
        loaded = [b for ids in groups for b in ids if b >= 0]
        self._load_blocks[request.request_id] = ([sum(1 for b in ids if b >= 0) for ids in groups], first_page)
        self._loads_to_send.append(LoadSpec(
            request_id=request.request_id, transfer_id=pending.params.transfer_id,
            prefill_engine=pending.params.peer_engine, block_ids=loaded,
            first_page=first_page, prefill_liveness=pending.params.peer_liveness,
            group_block_ids=groups if len(groups) > 1 else None,
        ))
        pending.spec_sent = True

    def _group_blocks(self, block_ids: Any, pages: int = 0) -> list[list[int]]:
        """vLLM's block ids per KV cache group; with several groups its null block (a
        sliding window's page outside the window) as -1, and a state group's block as its
        block of the last of `pages` prompt pages."""
        groups = [list(ids) for ids in block_ids]
        if len(groups) == 1:
            return groups
        pool = getattr(self._kv_cache_manager, "block_pool", None)
        null = pool.null_block.block_id if pool is not None else 0  # vLLM's null block is block 0
        return [per_prompt_page(ids, pages) if g in self.state_groups else [-1 if b == null else int(b) for b in ids]
                for g, ids in enumerate(groups)]

    # ---- every step ----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvxferStepMetadata:
        """This step's loads to start, pushes to make, finished and preempted pushes."""
        meta = KvxferStepMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0,
                                  awaiting_reservations=bool(self._gated_since), draining=self._draining)
        for spec in self._loads_to_send:
            self._pending_loads.pop(spec.request_id, None)
            self._loads_in_flight.add(spec.request_id)
            meta.loads.append(spec)
        self._loads_to_send = []
        scheduled = scheduler_output.num_scheduled_tokens
        computed: dict[str, int] = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, push in self._pushes.items():
            if rid not in scheduled or push.pushed_to >= push.prompt_tokens:
                continue
            end = min(computed.get(rid, 0) + scheduled[rid], push.prompt_tokens)
            groups = (self._group_blocks(self._kv_cache_manager.get_block_ids(rid),
                                         math.ceil(push.prompt_tokens / self.block_size))
                      if self._kv_cache_manager else [[]])
            meta.pushes.append(PushSpec(
                request_id=rid, transfer_id=push.params.transfer_id, decode_engine=push.params.peer_engine,
                prompt_tokens=push.prompt_tokens, block_ids=groups[0], computed_end=end,
                group_block_ids=groups if len(groups) > 1 else None,
            ))
            push.pushed_to = end
        meta.finished_pushes, self._finished_pushes = self._finished_pushes, []
        meta.preempted = [rid for rid in (scheduler_output.preempted_req_ids or ()) if rid in self._pushes]
        for rid in meta.preempted:
            # Its blocks are gone; a rescheduled attempt would push stale pages.
            self._pushes[rid].pushed_to = self._pushes[rid].prompt_tokens
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Loads and pushes the worker reported finished."""
        for rid in output.finished_recving or ():
            self._loads_in_flight.discard(rid)
            self._load_ended(rid)
        for rid in output.failed_recving or ():
            self._loads_in_flight.discard(rid)
            self._failed_loads.add(rid)
            self._load_ended(rid)
        for rid in output.finished_sending or ():
            self._awaiting_send.discard(rid)
        report = output.kv_connector_worker_meta
        if isinstance(report, KvxferWorkerReport) and self.wait_for_reservation:
            # Only the gate reads arrivals; kept without it, nothing would ever discard them.
            self._arrived |= report.reservations_arrived

    def _load_ended(self, rid: str) -> None:
        """The load of `rid` ended (landed, failed or fenced): its siblings compute locally now."""
        now = time.monotonic()
        load = self._transfer_loads.get(self._load_transfer.pop(rid, ""))
        if load is not None and load.loader == rid and load.ended_at is None:
            load.ended_at = now
        expired = [t for t, ld in self._transfer_loads.items()
                   if ld.ended_at is not None and now - ld.ended_at > SIBLING_MEMORY_S]
        for t in expired:
            del self._transfer_loads[t]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while a load or push may still write them or read from them."""
        rid = request.request_id
        if self._pending_loads.pop(rid, None) is not None:
            self._load_ended(rid)  # never sent to the worker: nothing in flight for its siblings to wait on
        self._gated_since.pop(rid, None)
        self._unpushable.discard(rid)
        load_failed = rid in self._failed_loads
        self._failed_loads.discard(rid)
        loaded = self._load_blocks.pop(rid, None)
        if rid in self._loads_in_flight:
            return True, None  # the worker cancels, fences, then reports finished_recving
        push = self._pushes.pop(rid, None)
        if push is None:
            return False, (self._load_report(*loaded) if loaded is not None and not load_failed else None)
        if push.pushed_to == 0:
            return False, None  # never reached the worker: nothing to push, nothing in flight
        self._awaiting_send.add(rid)
        self._finished_pushes.append(rid)
        return True, {"kvxfer": {"transfer_id": push.params.transfer_id, "role": "prefill"}}

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` for vLLM's hybrid manager (every group's blocks are kept or
        freed together)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def _load_report(self, blocks: list[int], held_blocks: int) -> dict[str, Any] | None:
        """What a decode request's answer tells the router about its load: KV pages (blocks
        of one layer) and bytes that came from the prefill instance, and the pages it held
        already (a prefix-cache hit: they did not travel); None without vLLM's block manager
        (nothing to count pages with). vLLM puts it in a non-streamed answer's
        `kv_transfer_params`; the router reads it there and gives the client null. A stream
        carries none: the worker half keeps the same figures for the router to ask
        (`load_reports.py`), so the two must be made alike."""
        geometry = self._block_geometry()
        if not geometry or len(geometry) != len(blocks):
            return None
        layers = sum(n for n, _ in geometry)
        # Held pages count every layer of the prompt blocks before first_page (a
        # sliding-window layer's null blocks among them).
        return {"kvxfer": {"role": "decode", "pages_loaded": sum(b * n for b, (n, _) in zip(blocks, geometry)),
                           "bytes_loaded": sum(b * size for b, (_, size) in zip(blocks, geometry)),
                           "pages_held": held_blocks * layers}}

    def _block_geometry(self) -> list[tuple[int, int]]:
        """Per KV cache group, (layers, bytes) behind one of its block ids: a block id names
        one page in every layer of its group, of which a Mamba/SSM layer moves its state only
        (`real_page_size_bytes`: the padding to the attention page never travels)."""
        config = getattr(self._kv_cache_manager, "kv_cache_config", None)
        if config is None:
            return []
        return [(len(g.layer_names), len(g.layer_names) * int(
            g.kv_cache_spec.real_page_size_bytes if i in self.state_groups else g.kv_cache_spec.page_size_bytes))
            for i, g in enumerate(config.kv_cache_groups)]

    def has_pending_push_work(self) -> bool:
        """True while a finished prefill request's blocks wait for its push to end."""
        return bool(self._awaiting_send)
