"""The connector's worker half (vLLM's worker process): one transfer engine over vLLM's KV
cache, the pusher (prefill legs), the receiver (decode legs), and the control messages
between them.

vLLM calls every method here from its one worker thread, so the pusher and receiver need
no locks; the engine's own progress thread moves the bytes meanwhile.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from urllib.parse import urlsplit
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvxfer.kv.protocol import (
    KVReservation,
    ReservationError,
    decode_abort,
    decode_cancel,
    decode_reservation_message,
    is_probe,
)
from kvxfer.handoff.push_hooks import load_hooks
from kvxfer.metrics import ConnectorMetrics
from kvxfer.transfer.engine import TransferEngine

from .connector_hooks import NO_CONNECTOR_HOOKS, ConnectorHooks
from .instance_registration import InstanceRegistration
from .kv_checksums import decode_table
from .kv_pusher import KVPusher
from .kv_receiver import KVReceiver
from .kv_region import KVRegion, region_from_kv_caches
from .load_reports import LoadReportStore, connector_http_app, landed_load_report, serve_connector_http
from .metadata import KvxferStepMetadata, KvxferWorkerReport, LoadSpec
from .prefiller_liveness import LivenessListener
from .settings import ConnectorSettings
from .sliced_reservation import SliceTarget, decode_sliced_reservation
from .state_groups import StateGroup, unequal_tensor_parallel_state
from .tensor_parallel import (
    TensorParallelError,
    TensorParallelPlace,
    decode_rank_addresses,
    encode_rank_addresses,
    head_sources,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_layout import KVCacheLayout

log = logging.getLogger(__name__)

# Control messages read per poll: enough for a burst, bounded so one step never drains a flood.
_MAX_MESSAGES_PER_POLL = 256


#: Every rank's engine address, gathered from each rank's own (rank order), across the
#: instance's tensor parallel group.
GatherAddresses = Callable[[bytes], list[bytes]]


def _alone(address: bytes) -> list[bytes]:
    return [address]


class WorkerSide:
    """Engine, pusher and receiver of one vLLM worker: one tensor parallel rank.

    Each rank has its own engine and registers its own part of the KV cache (its heads);
    rank 0 publishes the instance's registry record, listing every rank's engine address
    (`gather`). A decode rank reserves its blocks at the prefill rank that holds its heads;
    vLLM reports a load finished only once every rank did (its `KVOutputAggregator`)."""

    def __init__(self, settings: ConnectorSettings, kv_role: str, model_name: str,
                 warmup_prompt_tokens: int = 0, place: TensorParallelPlace | None = None,
                 gather: GatherAddresses = _alone) -> None:
        self.settings = settings
        self.place = place or TensorParallelPlace()
        self._gather = gather
        self.rank_addresses: list[bytes] = []
        self.warmup_prompt_tokens = warmup_prompt_tokens
        self.kv_role = kv_role
        self.model_name = model_name
        self.metrics = ConnectorMetrics(kv_role)
        self.engine: TransferEngine | None = None
        self.region: KVRegion | None = None
        self.pusher: KVPusher | None = None
        self.receiver: KVReceiver | None = None
        self.registration: InstanceRegistration | None = None
        self.liveness: LivenessListener | None = None  # prefill rank 0 with a registry record
        self._meta: KvxferStepMetadata | None = None
        # Each landed load's figures, for the router to ask after a streamed answer
        # (load_reports.py); the loads in flight, by request, to make them from.
        self.load_reports = LoadReportStore(settings.load_report_keep_s, settings.load_reports_max)
        self._loading: dict[str, LoadSpec] = {}
        # Tests and drills plug in here (connector_hooks.py); production runs the no-op.
        self.hooks: ConnectorHooks = (load_hooks(settings.hooks, ConnectorHooks, **settings.hooks_config)
                                      if settings.hooks else NO_CONNECTOR_HOOKS)

    def register_kv_caches(self, kv_caches: dict[str, Any], layout: KVCacheLayout | None = None, *,
                           latent: bool = False, groups: list[list[str]] | None = None,
                           state_groups: list[StateGroup] | None = None) -> None:
        """Register vLLM's whole KV allocation once; start serving transfers and publish.
        `layout` is vLLM's resolved KV cache layout (None: read from the strides);
        `latent` marks MLA content; `groups` the layer names of each KV cache group where
        there are several, `state_groups` those holding Mamba/SSM state (host caches only)."""
        self._request_amx_permission()
        self.hooks.placed(self.place)
        self.region = region_from_kv_caches(kv_caches, layout, latent=latent, groups=groups,
                                            state_groups=state_groups or ())
        s = self.settings
        self.engine = TransferEngine(s.provider, s.rails, bind_host=s.bind_host, transfer_timeout_s=s.transfer_timeout_s,
                                     same_host=s.same_host, same_host_imm_ring=s.same_host_imm_ring,
                                     tcp_congestion=s.tcp_congestion, lock_on_register=s.lock_kv_pages,
                                     # Only live loads' immediates count (ReservationScope claims
                                     # them): a sender spraying others cannot fill the table.
                                     imm_admission="claimed")
        # A device cache is not registered: it moves through pinned staging (cache_paths.py).
        memory = self.engine.register(self.region.buffer) if self.region.on_host else None
        if self.kv_role in ("kv_producer", "kv_both"):
            self.pusher = KVPusher(s, self.engine, self.region, memory, self.metrics, self.hooks, place=self.place)
        if self.kv_role in ("kv_consumer", "kv_both"):
            self.receiver = KVReceiver(s, self.engine, self.region, memory, self.metrics, hooks=self.hooks)
        log.info("kvxfer connector: %s rank %d of %d, %d layers x %d blocks of %d bytes registered, layout %s, "
                 "engine %s (%s)", self.kv_role, self.place.rank, self.place.size, self.region.num_layers,
                 self.region.num_blocks, self.region.block_bytes, self.region.kv_layout, self.engine.address.hex(),
                 self.engine.provider)
        # Every rank calls this at once (vLLM initializes the KV caches collectively).
        self.rank_addresses = self._gather(self.engine.address)
        # One /metrics per rank: rank r serves on metrics_port + r; the router asks rank 0's
        # for a streamed request's load figures (it has the record's metrics_url).
        if s.metrics_port:
            serve_connector_http(s.metrics_port + self.place.rank, connector_http_app(
                self.metrics.registry, self.load_reports, os.environ.get("VLLM_API_KEY")))
        if s.etcd and self.place.rank == 0:
            # Decoders hold a connection to this port while loads wait on this instance:
            # its close tells them in milliseconds that the process died (prefiller_liveness.py).
            liveness = self.liveness = (LivenessListener(s.bind_host or os.environ.get("KVXFER_BIND_HOST", ""),
                                         s.liveness_max_connections, urlsplit(s.advertise_url or "").hostname)
                        if self.pusher is not None else None)
            self.registration = InstanceRegistration(
                s, self.kv_role, self.model_name, encode_rank_addresses(self.rank_addresses).hex(), self.region,
                self.warmup_prompt_tokens, tp_size=self.place.size, kv_heads=self.place.total_kv_heads,
                liveness_address=liveness.address if liveness is not None else "")
            self.registration.start()

    @staticmethod
    def _request_amx_permission() -> None:
        # Linux grants AMX state only on request; vLLM's CPU attention uses AMX where the
        # CPU has it, and a decode instance whose first forward runs on transferred KV
        # would otherwise die of SIGILL (it never ran the warm-up path that asks).
        try:
            import torch

            init = getattr(torch.cpu, "_init_amx", None)
            if init is not None:
                init()
        except Exception as exc:  # no AMX on this CPU: nothing to ask for
            log.debug("AMX permission not requested: %s", exc)

    # ---- per step ---------------------------------------------------------------------------

    def bind(self, meta: KvxferStepMetadata) -> None:
        """The scheduler's instructions for this step."""
        self._meta = meta
        if meta.draining and self.registration is not None:
            log.info("kvxfer connector: the engine drains its requests (SIGTERM); withdrawing from the registry")
            self.registration.stop()
            self.registration = None
        if self.pusher is not None:
            self.pusher.on_step(meta)

    def start_load_kv(self) -> None:
        """Reserve and announce this step's new loads."""
        if self._meta is None or self.receiver is None:
            return
        for spec in self._meta.loads:
            self._loading[spec.request_id] = spec
            self._start_load(spec)

    def _start_load(self, spec: LoadSpec) -> None:
        """Reserve at the prefill rank that holds this rank's heads."""
        assert self.receiver is not None
        place = self.place
        try:
            prefill_ranks = decode_rank_addresses(spec.prefill_engine)
            sources = head_sources(place.total_kv_heads, len(prefill_ranks), place.size, place.rank)
        except TensorParallelError as exc:
            self.receiver.refuse(spec, "tp_mismatch", f"the prefiller's KV heads cannot be mapped to this decode "
                                 f"rank ({exc})")
            return
        unequal = unequal_tensor_parallel_state(self.region is not None and self.region.state_bytes is not None,
                                                len(prefill_ranks), place.size)
        if unequal:
            self.receiver.refuse(spec, "tp_mismatch", unequal)
            return
        sources = self.hooks.head_sources(spec.transfer_id, len(prefill_ranks), sources)
        # Every part keeps the instance's liveness address (rank 0's port), also a part drawn
        # from rank s>0: it means "the prefill instance is alive". An instance cannot serve
        # once any rank died (its engine core shuts every worker down), and rank 0's keeper
        # closes when rank 0 does; on that EOF the receiver revokes and severs every part
        # drawn from the instance, so no byte of rank s lands whether or not it is dead yet.
        if len(prefill_ranks) == place.size:
            # Equal sizes: this rank's blocks are one prefill rank's, head for head.
            (source,) = sources
            self.receiver.start(replace(spec, prefill_engine=prefill_ranks[source.src_rank]))
            return
        assert self.region is not None
        heads = self.region.geometry.num_heads
        self.receiver.start(spec, [(prefill_ranks[s.src_rank], SliceTarget(place.rank, place.size, s, heads))
                                   for s in sources])

    def save_kv_layer(self, layer_name: str) -> None:
        """Layer `layer_name` is computed for this step: push what became final."""
        if self.pusher is None or self.region is None:
            return
        self._drain_messages()
        self.pusher.save_layer(self.region.layer_index(layer_name))

    def wait_for_save(self) -> None:
        """The step's forward is done: push the Mamba/SSM states that became final (a
        mixer layer never calls save_kv_layer, and its state is final only once the whole
        step ran: the pusher posts it with the prompt's last step only)."""
        if self.pusher is None or self.region is None or self.region.state_bytes is None:
            return
        for layer in range(self.region.num_layers):
            if self.region.state_length(layer):
                self.pusher.save_layer(layer)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this step."""
        if self.receiver is not None and self._meta is not None and self._meta.idle:
            self.receiver.wait_briefly()
        meta = self._meta
        # Idle first: the pusher's scan runs only on steps that compute nothing.
        if meta is not None and meta.idle and self.engine and (
                meta.awaiting_reservations or (self.pusher is not None and self.pusher.awaiting_reservation)):
            # Nothing to compute until a reservation comes: wait for it instead of spinning.
            raw = self.engine.recv(self.settings.idle_wait_ms / 1000.0)
            if raw is not None:
                self._dispatch(bytes(raw))
        self._drain_messages()
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self.pusher is not None:
            sending = self.pusher.poll(finished_req_ids)
        if self.receiver is not None:
            for rid in finished_req_ids:
                self._loading.pop(rid, None)  # aborted while loading: no landed load to report
            recving, failed = self.receiver.poll(finished_req_ids)
            self._keep_load_reports(recving, failed)
        if self.registration is not None:
            self.registration.note_load(running=self.receiver.pending if self.receiver else 0)
        return sending, recving, failed

    def _keep_load_reports(self, finished: set[str], failed: set[str]) -> None:
        """Keep the figures of each load that landed, as the engine core's `_load_report`
        makes them for a non-streamed answer (this rank's page bytes, as its KV cache spec)."""
        assert self.region is not None
        for rid in finished:
            spec = self._loading.pop(rid, None)
            if spec is None or rid in failed:
                continue
            self.load_reports.put(spec.transfer_id, landed_load_report(self.region, spec))

    def report(self) -> KvxferWorkerReport | None:
        """Transfers whose reservation arrived since the last report (for the scheduler's gate)."""
        arrived = self.pusher.take_arrivals() if self.pusher is not None else set()
        return KvxferWorkerReport(arrived) if arrived else None

    def _drain_messages(self) -> None:
        if self.engine is None:
            return
        for _ in range(_MAX_MESSAGES_PER_POLL):
            raw = self.engine.recv(0.0)
            if raw is None:
                return
            self._dispatch(bytes(raw))

    def _dispatch(self, raw: bytes) -> None:
        try:
            sliced = decode_sliced_reservation(raw, self.place.rank)
            if sliced is not None:
                self._on_reservation(*reversed(sliced))
                return
            reservation = decode_reservation_message(raw)
        except ReservationError as exc:
            log.warning("dropped a malformed reservation message: %s", exc)
            self.metrics.dropped_messages.labels(reason="malformed_reservation").inc()
            return
        if reservation is not None:
            self._on_reservation(reservation, None)
            return
        cancel = decode_cancel(raw)
        if cancel is not None:
            if self.pusher is not None:
                self.pusher.on_cancel(*cancel)
            return
        part = decode_table(raw)
        if part is not None:
            if self.receiver is not None:
                self.receiver.on_checksum_table(part)
            else:
                self.metrics.dropped_messages.labels(reason="not_a_decoder").inc()
            return
        stopped = decode_abort(raw)
        if stopped is not None:
            if self.receiver is not None:
                self.receiver.on_prefill_stopped(*stopped)
            return
        if is_probe(raw):
            return  # a decoder asking whether this process is alive: its delivery is the answer
        self.metrics.dropped_messages.labels(reason="unknown_message").inc()

    def _on_reservation(self, reservation: KVReservation, target: SliceTarget | None) -> None:
        if self.pusher is None:
            self.metrics.dropped_messages.labels(reason="not_a_prefiller").inc()
        else:
            self.pusher.on_reservation(reservation, target)

    def shutdown(self) -> None:
        """Withdraw the registration and close the engine."""
        if self.registration is not None:
            self.registration.stop()
        if self.engine is not None:
            self.engine.close()
