"""The connector's EngineCore half with vLLM's `n` > 1 children: vLLM forks one child request
per choice, all carrying the same kv_transfer_params. One transfer of the prompt's KV serves
them all: the first child loads, its siblings wait for that load and then compute here (the
loaded blocks are prefix-cache hits). Before, every child reserved for the same transfer and
all but one waited for KV that never came (a 504 after 30 s through the router)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from kvxfer.integrations.vllm.engine_core_side import EngineCoreSide  # noqa: E402


def child(index: int, tokens: int, transfer_id: str = "t-parent") -> Any:  # vLLM's child of an n > 1 request
    return SimpleNamespace(request_id=f"{index}_parent", num_tokens=tokens, num_prompt_tokens=tokens,
                           kv_transfer_params={"kvxfer": {"role": "decode", "transfer_id": transfer_id,
                                                          "peer_engine": "00ff"}})


def idle_step() -> Any:
    return SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={}, scheduled_new_reqs=[],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                           preempted_req_ids=None)


def loads_ended(*rids: str, failed: bool = False) -> Any:
    return SimpleNamespace(finished_recving=set(rids), failed_recving=set(rids) if failed else None,
                           finished_sending=None, kv_connector_worker_meta=None)


def test_siblings_wait_for_the_first_childs_load_then_compute_on_its_cached_blocks() -> None:
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0)
    first, second, third = child(0, 100), child(1, 100), child(2, 100)
    assert side.get_num_new_matched_tokens(first, 0) == (100, True)
    assert side.get_num_new_matched_tokens(second, 0) == (None, False)  # asked again next step
    side.update_state_after_alloc(first, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 100)
    meta = side.build_connector_meta(idle_step())
    assert [spec.request_id for spec in meta.loads] == ["0_parent"]  # one reservation for the transfer
    assert side.get_num_new_matched_tokens(third, 0) == (None, False)  # still loading
    side.update_connector_output(loads_ended("0_parent"))
    # The load landed and vLLM cached its full blocks: the siblings compute the rest here.
    assert side.get_num_new_matched_tokens(second, 96) == (0, False)
    assert side.get_num_new_matched_tokens(third, 96) == (0, False)
    assert not side.build_connector_meta(idle_step()).loads


def test_a_sibling_asked_only_after_the_first_child_finished_does_not_reserve_again() -> None:
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0)
    first = child(0, 70)
    assert side.get_num_new_matched_tokens(first, 0) == (70, True)
    side.update_state_after_alloc(first, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],)), 70)
    side.build_connector_meta(idle_step())
    side.update_connector_output(loads_ended("0_parent"))
    assert side.request_finished(first, [5, 6, 7]) == (False, None)
    assert side.get_num_new_matched_tokens(child(1, 70), 64) == (0, False)
    # A different transfer still loads.
    assert side.get_num_new_matched_tokens(child(0, 70, "t-other"), 0) == (70, True)


def test_siblings_of_a_failed_load_compute_locally_rather_than_wait() -> None:
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0)
    first = child(0, 50)
    assert side.get_num_new_matched_tokens(first, 0) == (50, True)
    side.update_state_after_alloc(first, SimpleNamespace(get_block_ids=lambda: ([1, 2],)), 50)
    side.build_connector_meta(idle_step())
    side.update_connector_output(loads_ended("0_parent", failed=True))
    assert side.get_num_new_matched_tokens(child(1, 50), 0) == (0, False)


def test_a_request_with_another_prompt_under_the_same_transfer_never_shares_its_load() -> None:
    # A batch of prompts sent with one kv_transfer_params: each prompt is its own request.
    # Only one reservation exists, for one prompt's KV: the others compute here, at once.
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0)
    first, other = child(0, 100), child(1, 60)
    first.prompt_token_ids, other.prompt_token_ids = list(range(100)), list(range(60))
    assert side.get_num_new_matched_tokens(first, 0) == (100, True)
    assert side.get_num_new_matched_tokens(other, 0) == (0, False)


def test_a_prefill_instance_pushes_one_request_per_transfer() -> None:
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0)
    one, two = child(0, 100), child(1, 60)
    for req in (one, two):
        req.kv_transfer_params["kvxfer"]["role"] = "prefill"
    assert side.get_num_new_matched_tokens(one, 0) == (0, False)
    assert side.get_num_new_matched_tokens(two, 0) == (0, False)
    assert list(side._pushes) == ["0_parent"]
