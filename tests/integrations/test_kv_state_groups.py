"""Mamba/SSM state through the connector's worker halves, without vLLM processes: an
attention group plus a state group over one allocation, laid out as vLLM's workers lay out
a Mamba hybrid (GraniteMoeHybrid under the hybrid KV cache manager).

vLLM views both groups over the same allocation from byte 0 (`create_kv_cache_views`): a
mixer layer's page for a block is the attention page in the same place, of which its state
(conv window, then SSM state) fills the first `real_page_size_bytes`; block ids come from
one pool. A request holds one state block, which loads and pushes carry as the state
group's block of the last prompt page. The oracle is vLLM's views: every layer's pushed
pages and each mixer's state equal the prefiller's, byte for byte, and nothing else of the
decoder's cache changed (the rest of the state block's page, the attention pages in the
same places, every other block).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

import torch  # noqa: E402
from support.connector_halves import (  # noqa: E402
    decode_half,
    deliver_to_receiver,
    halves_engines,
    prefill_half,
    started_load,
)
from support.vllm_kv_caches import OverlaidGroupsCache, same_bytes  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.handoff.push_state import PushState  # noqa: E402
from kvxfer.integrations.vllm.cache_paths import DirectWrites  # noqa: E402
from kvxfer.integrations.vllm.engine_core_side import EngineCoreSide  # noqa: E402
from kvxfer.integrations.vllm.kv_pusher import KVPusher  # noqa: E402
from kvxfer.integrations.vllm.kv_receiver import KVReceiver  # noqa: E402
from kvxfer.integrations.vllm.kv_region import KVRegion, region_from_kv_caches  # noqa: E402
from kvxfer.integrations.vllm.load_reports import landed_load_report  # noqa: E402
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec, PushSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorConfigError, ConnectorSettings  # noqa: E402
from kvxfer.integrations.vllm.state_groups import StateGroup, check_state_groups, per_prompt_page  # noqa: E402
from kvxfer.integrations.vllm.tensor_parallel import TensorParallelPlace, encode_rank_addresses  # noqa: E402
from kvxfer.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvxfer.kv.protocol import decode_reservation_message  # noqa: E402
from kvxfer.metrics import ConnectorMetrics  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
TOKENS, HEADS, HEAD_SIZE = 4, 2, 8
# vLLM's group order for GraniteMoeHybrid: the mixers' state group first, then attention.
MIXERS = ["model.layers.0.mixer", "model.layers.2.mixer"]
ATTENTION = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
STATE_GROUP, ATTENTION_GROUP = 0, 1
PROMPT_PAGES = 5
# Per group, the block of each prompt page (one pool); the state group's one block at the last page.
SRC = [per_prompt_page([6], PROMPT_PAGES), [1, 2, 3, 4, 5]]
DST = [per_prompt_page([8], PROMPT_PAGES), [9, 3, 11, 5, 2]]
DEADLINE_S = 20.0


class HybridMambaCache(OverlaidGroupsCache):
    """An attention group and a Mamba-2 state group over one seeded allocation, as vLLM's
    `allocate_kv_cache` views them (the state page padded to the attention page)."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.attention = attention = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                                                       dtype=torch.bfloat16)
        # A conv window of 3 x 10 bf16 then an SSM state of 2 x 4 x 4 fp32: 188 of the page's 256 bytes.
        self.mamba = MambaSpec(block_size=TOKENS * PROMPT_PAGES, shapes=((3, 10), (2, 4, 4)),
                               dtypes=(torch.bfloat16, torch.float32), page_size_padded=attention.page_size_bytes)
        super().__init__([(MIXERS, self.mamba), (ATTENTION, attention)], attention, num_blocks, seed)
        self.state = StateGroup(STATE_GROUP, tuple(MIXERS), self.mamba.real_page_size_bytes, "3x10-bf16+2x4x4-f32")
        self.region: KVRegion = region_from_kv_caches(self.views, KVCacheLayout.LBHNC, isa="test",
                                                      groups=[MIXERS, ATTENTION], state_groups=[self.state])

    def conv_and_ssm(self, mixer: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's conv window and SSM state as the mixer reads them (vLLM's views of its page)."""
        page = self.views[mixer][block].flatten()
        conv_bytes = 3 * 10 * 2
        conv = page[:conv_bytes].view(torch.bfloat16).view(3, 10)
        ssm = page[conv_bytes:self.mamba.real_page_size_bytes].view(torch.float32).view(2, 4, 4)
        return conv, ssm


@pytest.fixture(scope="module")
def rank_engines() -> Iterator[list[TransferEngine]]:
    """Each side's second rank, for the tensor parallel cases."""
    with halves_engines(PROVIDER, 2) as pair:
        yield pair


@pytest.fixture(scope="module")
def engines() -> Iterator[list[TransferEngine]]:
    with halves_engines(PROVIDER, 2) as pair:
        yield pair


def test_the_region_places_each_mixers_state_at_the_start_of_its_slots_page_and_tags_the_layout() -> None:
    cache = HybridMambaCache(num_blocks=12, seed=1)
    region = cache.region
    assert region.num_groups == 2 and region.num_layers == 4 and region.geometry.num_layers == 2
    for name in MIXERS:
        layer = region.layer_index(name)
        start, _ = cache.page_range(name, 7)
        assert region.group(layer) == STATE_GROUP
        assert region.layer_runs(layer, 7) == [(start, cache.mamba.real_page_size_bytes)]
        assert region.page_bytes(layer, 7) == cache.views[name][7].numpy().tobytes()
    for name in ATTENTION:
        layer = region.layer_index(name)
        assert region.state_length(layer) == 0 and region.layer_runs(layer, 7) == [cache.page_range(name, 7)]
    assert "-hma2-ssm_" in region.kv_layout
    # Another state shape is another layout: a peer with other mixers is refused as a layout mismatch.
    other = HybridMambaCache(num_blocks=12, seed=1)
    other.state = StateGroup(STATE_GROUP, tuple(MIXERS), other.mamba.real_page_size_bytes, "3x10-bf16+2x4x8-f32")
    assert region_from_kv_caches(other.views, KVCacheLayout.LBHNC, isa="test", groups=[MIXERS, ATTENTION],
                                 state_groups=[other.state]).kv_layout != region.kv_layout


def _config_of(mixers: MambaSpec, attention: FullAttentionSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(MIXERS, mixers),
                                                                             KVCacheGroupSpec(ATTENTION, attention)])


@pytest.mark.parametrize("kind", sorted(MambaAttentionBackendEnum.__members__))
def test_a_mixer_kind_is_pushed_only_where_it_was_shown_equal_to_colocated_and_refused_by_name_else(
        kind: str) -> None:
    cache = HybridMambaCache(num_blocks=4, seed=0)
    config = _config_of(replace(cache.mamba, mamba_type=MambaAttentionBackendEnum[kind]), cache.attention)
    if kind == "MAMBA2":  # GraniteMoeHybrid (tests/integrations/test_vllm_mamba.py)
        check_state_groups(config)
        return
    # The delta-net was run (its own reason); the others never were.
    reason = "one-token delta-rule step" if kind == "GDN_ATTN" else "never shown to hand their state over"
    with pytest.raises(ConnectorConfigError, match=f"holds {kind} mixers: .*{reason}"):
        check_state_groups(config)


def _pump(pusher: KVPusher, receiver_engine: TransferEngine, receiver, request: str) -> tuple[set[str], set[str]]:
    """One round of both halves' messages and polls: (finished, failed) loads."""
    raw = pusher.engine.recv(0.0)
    reservation = decode_reservation_message(bytes(raw)) if raw is not None else None
    if reservation is not None:
        pusher.on_reservation(reservation)
    pusher.poll(set())
    deliver_to_receiver(receiver, receiver_engine.recv(0.0))
    return receiver.poll(set())


def _step(pusher: KVPusher, tid: str, end: int, decode_engines: bytes, tokens: int) -> None:
    """One prefill step computing the prompt up to token `end`: each attention layer saved
    (save_kv_layer), then the step's end (wait_for_save: the mixers' states)."""
    pusher.on_step(KvxferStepMetadata(pushes=[PushSpec(f"prefill-{tid}", tid, decode_engines, tokens,
                                                       list(SRC[ATTENTION_GROUP]), end,
                                                       group_block_ids=[list(g) for g in SRC])]))
    region = pusher.region
    for layer in range(region.num_layers):
        if not region.state_length(layer):
            pusher.save_layer(layer)
    for layer in range(region.num_layers):
        if region.state_length(layer):
            pusher.save_layer(layer)


def _hand_off_state(pusher: KVPusher, receiver: KVReceiver, tid: str, decode_engines: bytes) -> Any:
    """One request from the prefill half into the decode half, the prompt computed in two
    chunks; the prefiller's push (its writes' figures)."""
    tokens, request = PROMPT_PAGES * TOKENS - 1, f"decode-{tid}"
    loaded = [b for g in DST for b in g if b >= 0]
    receiver.start(LoadSpec(request, tid, pusher.engine.address, loaded, 0, group_block_ids=[list(g) for g in DST]))
    _step(pusher, tid, 0, decode_engines, tokens)  # the request reaches the prefiller; nothing computed yet
    (push,) = pusher._by_request[f"prefill-{tid}"]
    end = time.monotonic() + DEADLINE_S
    while pusher.awaiting_reservation:
        _pump(pusher, receiver.engine, receiver, request)
        assert time.monotonic() < end, "no reservation"
    # A first chunk: two pages of each attention layer final, no state (the prompt is not done).
    _step(pusher, tid, 2 * TOKENS, decode_engines, tokens)
    assert push.writes.pages_posted == 2 * len(ATTENTION)
    _step(pusher, tid, tokens, decode_engines, tokens)
    while time.monotonic() < end:
        finished, failed = _pump(pusher, receiver.engine, receiver, request)
        if request in finished:
            assert request not in failed, receiver.failure(request)
            return push
        time.sleep(0.002)
    pytest.fail(f"no outcome within {DEADLINE_S} s ({receiver.failure(request)})")


def _assert_state_landed(prefill: HybridMambaCache, decode: HybridMambaCache, before: np.ndarray) -> None:
    """Each mixer's state and every attention page equal the prefiller's, byte for byte
    (vLLM's views), and nothing else of the decoder's cache changed."""
    moved = np.zeros(before.size, dtype=bool)
    for name in MIXERS:
        src, dst = SRC[STATE_GROUP][-1], DST[STATE_GROUP][-1]
        for mine, theirs in zip(decode.conv_and_ssm(name, dst), prefill.conv_and_ssm(name, src)):
            assert same_bytes(mine, theirs), name  # bytes: random bits hold NaNs
        start, _ = decode.page_range(name, dst)
        moved[start:start + decode.mamba.real_page_size_bytes] = True
    for name in ATTENTION:
        for src, dst in zip(SRC[ATTENTION_GROUP], DST[ATTENTION_GROUP]):
            assert same_bytes(decode.views[name][dst], prefill.views[name][src]), (name, src, dst)
            start, length = decode.page_range(name, dst)
            moved[start:start + length] = True
    after = decode.host_bytes()
    assert (after[~moved] == before[~moved]).all()
    assert not (after[moved] == before[moved]).all()


def test_the_state_lands_in_the_decoders_state_block_after_the_last_step_and_nothing_else_changes(
        engines: list[TransferEngine]) -> None:
    prefill, decode = HybridMambaCache(num_blocks=8, seed=11), HybridMambaCache(num_blocks=16, seed=12)
    before = decode.host_bytes().copy()
    settings = ConnectorSettings(provider=PROVIDER, kv_integrity="full")
    pusher = prefill_half(engines[0], prefill.region, settings, staged=False)
    receiver = decode_half(engines[1], decode.region, settings, staged=False)
    push = _hand_off_state(pusher, receiver, "mamba-bytes", engines[1].address)
    _assert_state_landed(prefill, decode, before)
    # The pushed-bytes metric counts what moved: each mixer's state, not its padded page.
    assert push.writes.bytes_posted == moved_bytes(decode)


def test_under_equal_tensor_parallel_sizes_each_ranks_state_goes_whole_to_the_same_decode_rank(
        engines: list[TransferEngine], rank_engines: list[TransferEngine]) -> None:
    # TP 2 into TP 2: each rank's cache holds its heads (here: its own seeded bytes); the
    # decode ranks' engines travel as one rank list, as WorkerSide hands them to the pusher,
    # and each decode rank reserves at the prefill rank of its own index (WorkerSide, equal sizes).
    settings = ConnectorSettings(provider=PROVIDER, kv_integrity="full")
    prefill_engines, decode_engines = (engines[0], rank_engines[0]), (engines[1], rank_engines[1])
    ranks = encode_rank_addresses([e.address for e in decode_engines])
    for rank in range(2):
        prefill, decode = HybridMambaCache(8, seed=20 + rank), HybridMambaCache(16, seed=30 + rank)
        before = decode.host_bytes().copy()
        engine = prefill_engines[rank]
        pusher = KVPusher(settings, engine, prefill.region, None, ConnectorMetrics("kv_producer"),
                          writes=DirectWrites(engine, engine.register(prefill.region.buffer), prefill.region.geometry),
                          place=TensorParallelPlace(rank, 2, 2 * HEADS))
        receiver = decode_half(decode_engines[rank], decode.region, settings, staged=False)
        _hand_off_state(pusher, receiver, f"mamba-tp2-{rank}", ranks)
        _assert_state_landed(prefill, decode, before)


def test_state_between_different_tensor_parallel_sizes_is_refused_on_both_sides_with_the_reason(
        engines: list[TransferEngine]) -> None:
    settings = ConnectorSettings(provider=PROVIDER, same_host=False, bind_host="127.0.0.1")
    # The prefill rank (TP 1) handed a decoder of two ranks fails the push, naming the sizes.
    prefill = HybridMambaCache(8, seed=40)
    pusher = prefill_half(engines[0], prefill.region, settings, staged=False)
    _step(pusher, "tp-1-into-2", 0, encode_rank_addresses([engines[1].address, engines[1].address]), 9)
    (push,) = pusher._by_request["prefill-tp-1-into-2"]
    assert push.lifecycle.state is PushState.FAILED
    assert "equal tensor parallel sizes only (prefill 1, decode 2)" in push.lifecycle.reason
    # A decode rank (TP 2) handed a single prefill rank refuses the load before reserving.
    decode = HybridMambaCache(16, seed=41)
    worker = WorkerSide(settings, "kv_consumer", "m", place=TensorParallelPlace(1, 2, 2 * HEADS))
    try:
        worker.register_kv_caches(decode.views, KVCacheLayout.LBHNC, groups=[MIXERS, ATTENTION],
                                  state_groups=[decode.state])
        reason, finished, failed = started_load(worker, LoadSpec(
            "r1", "tp-1-into-2", encode_rank_addresses([engines[0].address]), [8, 9], 0, group_block_ids=[[8], [9]]))
    finally:
        worker.shutdown()
    assert finished == failed == {"r1"}
    assert "equal tensor parallel sizes only (prefill 1, decode 2)" in (reason or ""), reason


def moved_bytes(cache: HybridMambaCache) -> int:
    """What a push or load of SRC/DST moves: each mixer's state once, each attention page."""
    return len(MIXERS) * cache.mamba.real_page_size_bytes + \
        len(ATTENTION) * PROMPT_PAGES * cache.region.block_bytes


def test_a_loads_figures_count_each_mixers_state_bytes_alike_in_the_answer_and_the_stream() -> None:
    cache = HybridMambaCache(num_blocks=16, seed=3)
    assert cache.mamba.real_page_size_bytes < cache.region.block_bytes  # padded: the figures must not count it
    spec = LoadSpec("decode-figures", "figures", b"", [b for g in DST for b in g if b >= 0], 0,
                    group_block_ids=[list(g) for g in DST])
    # The worker half's figure (kept for a streamed request's router) ...
    streamed = landed_load_report(cache.region, spec)
    # ... and the engine core's (a non-streamed answer's kv_transfer_params), from vLLM's specs.
    side = _engine_core({})
    side.bind_kv_cache_manager(SimpleNamespace(kv_cache_config=_config_of(cache.mamba, cache.attention)))
    answered = side._load_report([sum(1 for b in g if b >= 0) for g in DST], 0)
    assert answered == streamed.as_params()
    assert streamed.bytes_loaded == moved_bytes(cache)
    assert streamed.pages_loaded == len(MIXERS) + len(ATTENTION) * PROMPT_PAGES


# ---- the EngineCore half (stand-ins for vLLM's request objects, as test_engine_core_side.py) ----

def _leg(rid: str, tokens: int, role: str) -> Any:  # stands in for vllm.v1.request.Request
    ids = list(range(3, 3 + tokens))
    return SimpleNamespace(request_id=rid, num_tokens=tokens, num_prompt_tokens=tokens, prompt_token_ids=ids,
                           _all_token_ids=list(ids), max_tokens=16, kv_transfer_params={
                               "kvxfer": {"role": role, "transfer_id": f"t-{rid}", "peer_engine": "00ff"}})


def _engine_core(blocks: dict[str, tuple[list[int], ...]]) -> EngineCoreSide:
    side = EngineCoreSide(block_size=TOKENS, reservation_wait_s=5.0, state_groups=frozenset({STATE_GROUP}))
    side.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: blocks[rid],
                                               block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=0))))
    return side


def test_a_decode_leg_loads_the_prompt_less_its_last_token_and_names_its_state_block_at_the_last_page() -> None:
    side = _engine_core({})
    req = _leg("d", PROMPT_PAGES * TOKENS, "decode")
    # The decoder computes the last prompt token itself, on the loaded state.
    assert side.get_num_new_matched_tokens(req, 0) == (PROMPT_PAGES * TOKENS - 1, True)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([8], DST[ATTENTION_GROUP])),
                                  PROMPT_PAGES * TOKENS - 1)
    (load,) = side.build_connector_meta(SimpleNamespace(
        total_num_scheduled_tokens=0, num_scheduled_tokens={}, scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]), preempted_req_ids=None)).loads
    assert load.group_block_ids == DST
    assert sorted(load.block_ids) == sorted([8, *DST[ATTENTION_GROUP]])


def test_a_prefill_leg_computes_its_prompt_less_the_last_token_and_pushes_its_state_block_at_the_last_page() -> None:
    side = _engine_core({"p": ([6], SRC[ATTENTION_GROUP])})
    req = _leg("p", PROMPT_PAGES * TOKENS, "prefill")
    side.on_new_request(req)
    tokens = PROMPT_PAGES * TOKENS - 1
    assert (req.num_prompt_tokens, len(req.prompt_token_ids), len(req._all_token_ids), req.max_tokens) == \
        (tokens, tokens, tokens, 1)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    (push,) = side.build_connector_meta(SimpleNamespace(
        total_num_scheduled_tokens=tokens, num_scheduled_tokens={"p": tokens},
        scheduled_new_reqs=[SimpleNamespace(req_id="p", num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]), preempted_req_ids=None)).pushes
    assert (push.prompt_tokens, push.computed_end, push.group_block_ids) == (tokens, tokens, SRC)
    # A one-token prompt has no state to hand over: computed here, never pushed.
    one = _leg("p1", 1, "prefill")
    side.on_new_request(one)
    assert one.num_prompt_tokens == 1 and side.get_num_new_matched_tokens(one, 0) == (0, False)
    assert side.request_finished(one, [])[0] is False
