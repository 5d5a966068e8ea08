"""`KvxferConnector`: kvxfer as a vLLM KV connector (KVConnectorBase_V1).

Load it with::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.integrations.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {...ConnectorSettings...}}'

vLLM makes one instance per role: SCHEDULER in its EngineCore process (`EngineCoreSide`)
and WORKER in each worker process (`WorkerSide`). This class only routes vLLM's hooks to
the half that runs in this process; the hand-off itself is in those modules, and the
contract between the two legs is `kvxfer.kv.protocol`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .metadata import KvxferStepMetadata, KvxferWorkerReport
from .engine_core_side import EngineCoreSide
from .settings import ConnectorConfigError, ConnectorSettings
from .state_groups import check_state_groups, state_groups
from .tensor_parallel import TensorParallelPlace
from .worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: The KV cache layout the connector asks vLLM for (see `get_required_kvcache_layout`).
PREFERRED_KV_CACHE_LAYOUT = "LBHNC"


def _log_through_vllm() -> None:
    # vLLM configures handlers for its own logger tree only; kvxfer's modules log under
    # "kvxfer", which would otherwise be silent inside vLLM's processes.
    ours, theirs = logging.getLogger("kvxfer"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


_log_through_vllm()


def _tensor_parallel_place(vllm_config: VllmConfig) -> TensorParallelPlace:
    """This worker's rank in vLLM's tensor parallel group and the model's KV heads."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConnectorConfigError("KvxferConnector: pipeline parallelism is not supported (tensor parallelism is)")
    size = int(parallel.tensor_parallel_size)
    rank = 0
    if size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    model = vllm_config.model_config
    heads = 1 if model.use_mla else int(model.get_total_num_kv_heads())
    return TensorParallelPlace(rank=rank, size=size, total_kv_heads=heads)


def _gather_over_tp_group(address: bytes) -> list[bytes]:
    """Every rank's engine address, in rank order, over vLLM's tensor parallel CPU group
    (gloo; a collective every rank calls from register_kv_caches)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size, get_tp_group

    size = int(get_tensor_model_parallel_world_size())
    if size == 1:
        return [address]
    import torch.distributed

    out: list[object] = [None] * size
    torch.distributed.all_gather_object(out, address, group=get_tp_group().cpu_group)
    return [bytes(a) for a in out]  # type: ignore[arg-type]


def kv_cache_group_layers(kv_cache_config: KVCacheConfig | None) -> list[list[str]] | None:
    """The layer names of each KV cache group; None for one group (or no config)."""
    groups = [] if kv_cache_config is None else list(kv_cache_config.kv_cache_groups)
    return [list(g.layer_names) for g in groups] if len(groups) > 1 else None


def check_kv_cache_groups(kv_cache_config: KVCacheConfig | None, tensor_parallel_size: int = 1) -> None:
    """Refuses a KV cache of several groups the connector cannot push (ConnectorConfigError
    naming the groups and why).

    The connector declares `SupportsHMA`, so vLLM runs a hybrid model (full plus
    sliding-window attention) with its hybrid KV cache manager: one group per attention
    kind, each with its own block table, overlaying one allocation. It pushes each layer's
    group's blocks, at any tensor parallel size (`tensor_parallel_size`: each rank its
    heads, head-sliced between sizes). Mamba/SSM state groups (a request's one state
    block, pushed after the prompt) it pushes under the conditions `check_state_groups`
    names (a mixer kind shown, no prefix caching; equal TP sizes per request); other groups
    it refuses.
    `--disable-hybrid-kv-cache-manager` runs an attention-only hybrid model as one group
    (every layer keeps every block)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    groups = [] if kv_cache_config is None else list(kv_cache_config.kv_cache_groups)
    if len(groups) <= 1:
        return
    kinds = ", ".join(f"{type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers)" for g in groups)
    if not all(isinstance(g.kv_cache_spec, (AttentionSpec, MambaSpec)) for g in groups):
        raise ConnectorConfigError(
            f"KvxferConnector: the KV cache has {len(groups)} groups ({kinds}); the connector pushes attention "
            "KV and Mamba/SSM state only")
    check_state_groups(kv_cache_config)  # type: ignore[arg-type]


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    """Pushes prefill KV layer by layer with one-sided writes; admits decode requests on
    kvxfer's ImmCounter. Settings: `ConnectorSettings` (kv_connector_extra_config)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_kv_cache_groups(kv_cache_config, int(vllm_config.parallel_config.tensor_parallel_size))
        config = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(config.kv_connector_extra_config)
        self.kv_role = str(config.kv_role)
        block_size = int(vllm_config.cache_config.block_size)
        self._engine_core: EngineCoreSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._engine_core = EngineCoreSide(block_size, self.settings.reservation_wait_s,
                                               wait_for_reservation=self.settings.wait_for_reservation,
                                               state_groups=frozenset(g.group for g in state_groups(kv_cache_config)))
            self._engine_core.watch_sigterm()
        else:
            model = vllm_config.model_config
            name = model.served_model_name
            name = name[0] if isinstance(name, (list, tuple)) else name
            self._worker = WorkerSide(self.settings, self.kv_role, str(name or model.model),
                                      warmup_prompt_tokens=self._warmup_prompt_tokens(vllm_config, block_size),
                                      place=_tensor_parallel_place(vllm_config), gather=_gather_over_tp_group)

    def _warmup_prompt_tokens(self, vllm_config: VllmConfig, block_size: int) -> int:
        if self.settings.warmup_prompt_tokens is not None:
            return self.settings.warmup_prompt_tokens
        chunk = int(vllm_config.scheduler_config.max_num_batched_tokens)
        return max(0, min(chunk + block_size, int(vllm_config.model_config.max_model_len) - 2))

    # ---- worker side -----------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # LBHNC: a (layer, block) is one run, so a request's blocks of one layer are one
        # paged write; a head slice of a block is one run too (tensor parallel peers of
        # different sizes exchange contiguous slices); and it is kvxfer's own cache order.
        # vLLM uses it where every attention backend supports it (the CPU backend only does).
        return PREFERRED_KV_CACHE_LAYOUT

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        cache, model = self._vllm_config.cache_config, self._vllm_config.model_config
        layout = cache.get_resolved_kv_cache_layout() if cache.kv_cache_layout is not None else None
        self._worker.register_kv_caches(kv_caches, layout, latent=bool(model.use_mla),
                                        groups=kv_cache_group_layers(self._kv_cache_config),
                                        state_groups=state_groups(self._kv_cache_config))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvxferStepMetadata):
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are admitted whole (every layer landed) before vLLM schedules the request.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        # Writes stay in flight past the step; vLLM keeps the blocks until get_finished says so.
        # Mamba/SSM states are final only now (their mixers call no save_kv_layer).
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def build_connector_worker_meta(self) -> KvxferWorkerReport | None:
        assert self._worker is not None
        return self._worker.report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- EngineCore side (vLLM's SCHEDULER role) -------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._engine_core is not None:
            self._engine_core.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        assert self._engine_core is not None
        self._engine_core.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._engine_core is not None
        return self._engine_core.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._engine_core is not None
        self._engine_core.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._engine_core is not None
        return self._engine_core.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._engine_core is not None:
            self._engine_core.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._engine_core is not None
        return self._engine_core.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self._engine_core is not None
        return self._engine_core.request_finished_all_groups(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._engine_core is not None and self._engine_core.has_pending_push_work()

    @property
    def requires_kv_delivery(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")
