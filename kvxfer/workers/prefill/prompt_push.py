"""The compute and KV push of one prefill request: the prefill worker's adapter over the
hand-off's `PushSession` (kvxfer.handoff.push_session) and `PushMonitor`.

The compute thread runs the model over the prompt layer by layer and hands each layer's
final pages to the request's push session, which posts their writes; it never waits for
the decoder (the monitor watches the writes). With the worker's prefix cache, the prompt
blocks this worker holds are not computed again: those the decoder lacks are pushed from
the cache before compute starts, and blocks the decoder holds (the reservation's
`first_page`) are never pushed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.handoff.push_abort import PushAbort
from kvxfer.handoff.push_hooks import PushHooks
from kvxfer.handoff.push_monitor import PushMonitor, WatchedPush
from kvxfer.handoff.push_session import PushSession, PushStats
from kvxfer.kv.protocol import KVReservation, mailbox_slot_bytes, pages_for_tokens
from kvxfer.metrics import PrefillMetrics
from kvxfer.workers.rejection import Rejection, RequestRejected
from kvxfer.workers.worker_core import WorkerCore


@dataclass
class PrefillJob:
    """One /prefill request this worker accepted, from its reservation of local pages until
    none of its writes is in flight: the one place the service keeps a request's state."""

    request_id: str
    caller: str  # the only caller that may cancel it
    prompt: list[int]
    reservation: KVReservation  # the decoder's pages it is pushed into
    local_pages: list[int]
    held_blocks: int  # leading prompt blocks this worker's prefix cache held: not computed again
    block_hashes: list[bytes]  # the prompt's block hashes to publish in the prefix cache; none with it off
    session: PushSession
    abort: PushAbort = field(default_factory=PushAbort)  # sent at most once, by the service's release


class PromptPusher:
    """Computes prompts on the caller's thread (the service's compute thread) and pushes
    each layer's KV through the request's `PushSession`, watched by `monitor`.

    Owns the mailbox staging slots the sessions write their final record from: one per
    request in turn (`mailbox_slots` of them), each wide enough for the record and one
    checksum per (layer, page) of the longest prompt. `emulated_layer_compute_s` is slept
    after each layer of each chunk (the `emulated_layer_compute_ms` setting). Every session
    gets `hooks` (handoff.push_hooks): the no-op in production.
    """

    def __init__(self, core: WorkerCore, monitor: PushMonitor, metrics: PrefillMetrics, *, num_pages: int,
                 mailbox_slots: int, chunk_tokens: int, emulated_layer_compute_s: float, hooks: PushHooks,
                 table_key: bytes | None) -> None:
        self.core = core
        self.monitor = monitor
        self.metrics = metrics
        self.chunk_tokens = chunk_tokens
        self.emulated_layer_compute_s = emulated_layer_compute_s
        self.hooks = hooks
        self.table_key = table_key  # tags checksum tables for decoders that ask (a reservation's checksum_tag)
        cfg = core.config
        max_prompt_pages = min(pages_for_tokens(cfg.max_context, cfg.block_size), num_pages)
        self.mailbox_slot_stride = mailbox_slot_bytes(cfg.num_layers, max_prompt_pages)
        self.mailbox_slots = mailbox_slots
        self.mailbox = np.zeros(mailbox_slots * self.mailbox_slot_stride, dtype=np.uint8)
        self.mailbox_region = core.engine.register(self.mailbox)
        self._next_slot = 0
        self._peers: set[bytes] = set()  # decoders pushed to (the peers_connected gauge)

    def open(self, reservation: KVReservation, local_pages: list[int]) -> PushSession:
        """The push session of a request, in the next mailbox slot; TransferError if the
        reservation does not fit these pages. The caller serialises calls (its lock)."""
        slot = self._next_slot
        self._next_slot = (self._next_slot + 1) % self.mailbox_slots
        engine = self.core.engine
        return PushSession(
            engine, self.core.cache, self.core.cache_region, self.mailbox, self.mailbox_region, slot,
            self.mailbox_slot_stride, reservation, local_pages,
            # A stall longer than this between two writes could outlast the decoder's
            # fence (which outlasts a write's deadline by this much): see PushStalled.
            max_stall_s=reservation.fence_timeout_s - engine.transfer_timeout_s,
            hooks=self.hooks,
            table_key=self.table_key,
        )

    def run(self, job: PrefillJob, push: WatchedPush, on_computed: Callable[[PrefillJob], None]) -> dict[str, Any]:
        """Computes `job` and posts every write (the compute thread); never waits for the decoder.

        `on_computed` is called once the prompt's pages are final (the prefix cache may
        publish them). A push that cannot complete is ended here; the monitor sends the
        abort once none of its writes is in flight (the decoder then fails the request and
        reuses the pages at once).
        """
        try:
            self.monitor.check(push.destination)
            result = self._compute_and_push(job, push, on_computed)
        except BaseException as exc:
            self.monitor.end(push, exc)
            raise
        self.monitor.posted(push)
        return result

    def _compute_and_push(self, job: PrefillJob, push: WatchedPush,
                          on_computed: Callable[[PrefillJob], None]) -> dict[str, Any]:
        """Pushes the cached pages the decoder lacks, computes from the first block this
        worker lacks and pushes each layer's new pages; then reports the prompt computed."""
        session, request_id, prompt, held = job.session, job.request_id, job.prompt, job.held_blocks
        if session.cancelled:
            raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled before compute", request_id)
        t0 = time.perf_counter()
        self._peers.add(job.reservation.descriptor[:64])
        session.mark_progress()
        cfg = self.core.config
        first_page = job.reservation.first_page  # the decoder holds the blocks before it: never pushed
        if held > first_page:
            # Final already (this worker's prefix cache), and the decoder lacks them.
            for layer in range(cfg.num_layers):
                session.on_layer_done(layer, first_page, held)

        def on_layer_done(layer: int, chunk: Any) -> None:
            if push.error is not None:  # its destination is down: stop computing for it
                raise push.error
            if self.emulated_layer_compute_s:
                time.sleep(self.emulated_layer_compute_s)  # the layer "computes" longer, then its pages go out
            session.on_layer_done(layer, chunk.first_block, chunk.end_block)

        result = self.core.model.prefill(prompt, self.core.cache, job.local_pages, chunk_size=self.chunk_tokens,
                                         on_layer_done=on_layer_done, start_pos=held * cfg.block_size)
        session.finish(result.first_token, len(prompt))
        compute_s = time.perf_counter() - t0
        if session.cancelled:
            raise RequestRejected(Rejection.CONFLICT, f"request {request_id} was cancelled", request_id)
        on_computed(job)
        self.metrics.compute.observe(compute_s)
        if job.block_hashes:
            self.metrics.prefix.observe(len(prompt), held * cfg.block_size)
        if self.metrics.prefix.pages_skipped is not None:
            self.metrics.prefix.pages_skipped.inc(first_page)
        # The push is one write per (layer, chunk): per-layer compute is the compute time
        # spread over those steps.
        chunks = math.ceil(len(prompt) / self.chunk_tokens) - (held * cfg.block_size) // self.chunk_tokens
        return {
            "request_id": request_id,
            "first_token": result.first_token,
            "prefill_ms": compute_s * 1e3,
            "chunks": chunks,
            "layer_compute_ms_mean": compute_s * 1e3 / (cfg.num_layers * chunks),
            # Prompt tokens this worker had cached (not computed), blocks the decoder held
            # (not pushed) and blocks pushed (each block is one page per layer).
            "prefix_hit_tokens": held * cfg.block_size,
            "computed_tokens": len(prompt) - held * cfg.block_size,
            "pages_skipped": first_page,
            "pages_pushed": len(job.local_pages) - first_page,
        }

    def answer(self, result: dict[str, Any], stats: PushStats) -> dict[str, Any]:
        """The /prefill answer: the compute's figures and the completed push's."""
        self.metrics.observe_transfer(stats.kv_bytes, max(stats.transfer_s, 1e-9), stats.wire_s)
        self.metrics.peers_connected.set(len(self._peers))
        return {
            **result,
            "transfer_tail_ms": stats.tail_s * 1e3,
            "transfer_ms": stats.transfer_s * 1e3,
            "kv_bytes": stats.kv_bytes,
            "writes": stats.writes,
            "layer_transfer_ms_mean": stats.layer_transfer_s_mean * 1e3,
            "layer_transfer_ms_max": stats.layer_transfer_s_max * 1e3,
            "layer_submit_ms_mean": sum(stats.layer_push_s) * 1e3 / max(1, len(stats.layer_push_s)),
            "mailbox_write_ms": stats.mailbox_write_s * 1e3,
            "transfer_tail_engine_ms": stats.engine_tail_s * 1e3,
        }
