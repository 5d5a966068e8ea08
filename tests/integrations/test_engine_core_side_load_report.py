"""The connector's EngineCore half tells the router what a decode request's load moved: a
non-streamed answer's `kv_transfer_params` carries the KV pages and bytes that came from
the prefill instance and the pages the decode instance held already (a prefix-cache hit:
fewer pages travel). The router reads them there (tests/router: the vLLM legs' metrics)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvxfer.integrations.vllm.engine_core_side import EngineCoreSide

LAYERS, PAGE_BYTES = 4, 16384


def block_manager() -> Any:  # what the side reads of vLLM's KVCacheManager: the cache's geometry
    spec = SimpleNamespace(page_size_bytes=PAGE_BYTES)
    group = SimpleNamespace(layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                            kv_cache_spec=spec)
    return SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=[group]))


def decode_request(tokens: int) -> Any:
    return SimpleNamespace(request_id="r1", num_tokens=tokens, num_prompt_tokens=tokens, prompt_token_ids=None,
                           kv_transfer_params={"kvxfer": {"role": "decode", "transfer_id": "t1",
                                                          "peer_engine": "00ff"}})


def idle_step() -> Any:
    return SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={}, scheduled_new_reqs=[],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                           preempted_req_ids=None)


def load(side: EngineCoreSide, request: Any, held_tokens: int, block_ids: list[int], *, failed: bool = False) -> None:
    tokens = request.num_tokens
    assert side.get_num_new_matched_tokens(request, held_tokens) == (tokens - held_tokens, True)
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (block_ids,)), tokens - held_tokens)
    side.build_connector_meta(idle_step())
    side.update_connector_output(SimpleNamespace(finished_recving={request.request_id},
                                                 failed_recving={request.request_id} if failed else None,
                                                 finished_sending=None, kv_connector_worker_meta=None))


def test_a_finished_decode_request_reports_the_pages_and_bytes_it_loaded() -> None:
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0)
    side.bind_kv_cache_manager(block_manager())
    request = decode_request(100)  # 4 blocks of 32 tokens
    load(side, request, 0, [1, 2, 3, 4])
    assert side.request_finished(request, [1, 2, 3, 4]) == (False, {"kvxfer": {
        "role": "decode", "pages_loaded": 4 * LAYERS, "bytes_loaded": 4 * LAYERS * PAGE_BYTES, "pages_held": 0}})


def test_a_prefix_hit_on_the_decode_instance_shows_as_fewer_pages_loaded() -> None:
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0)
    side.bind_kv_cache_manager(block_manager())
    request = decode_request(100)
    load(side, request, 64, [7, 8, 9, 10])  # vLLM's prefix cache held the first 2 blocks
    _, params = side.request_finished(request, [7, 8, 9, 10])
    assert params == {"kvxfer": {"role": "decode", "pages_loaded": 2 * LAYERS, "bytes_loaded": 2 * LAYERS * PAGE_BYTES,
                                 "pages_held": 2 * LAYERS}}


def test_a_failed_load_reports_nothing() -> None:
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0)
    side.bind_kv_cache_manager(block_manager())
    request = decode_request(100)
    load(side, request, 0, [1, 2, 3, 4], failed=True)
    assert side.request_finished(request, [1, 2, 3, 4]) == (False, None)
