"""The connector's EngineCore half, driven with stand-ins for vLLM's request objects (no
engine: what it answers vLLM, step by step). The hand-off itself is tested with real vLLM
processes in test_vllm_connector.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from kvxfer.integrations.vllm.engine_core_side import EngineCoreSide  # noqa: E402


def leg_request(rid: str, tokens: int, role: str) -> Any:  # stands in for vllm.v1.request.Request
    return SimpleNamespace(request_id=rid, num_tokens=tokens, num_prompt_tokens=tokens, kv_transfer_params={
        "kvxfer": {"role": role, "transfer_id": f"t-{rid}", "peer_engine": "00ff"}})


def decode_request(rid: str, tokens: int) -> Any:
    return leg_request(rid, tokens, "decode")


def prefill_request(rid: str, tokens: int) -> Any:
    return leg_request(rid, tokens, "prefill")


def idle_step() -> Any:  # a SchedulerOutput that scheduled nothing
    return SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={}, scheduled_new_reqs=[],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                           preempted_req_ids=None)


def test_a_failed_load_is_computed_locally_when_vllm_asks_again() -> None:
    # kv_load_failure_policy=recompute: vLLM resets the request and asks the connector again.
    # Answering "load it" again would reserve, time out and fail forever (seen with real
    # instances: a new failed load every 9 s); the request must be computed here instead.
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0)
    req = decode_request("r1", 100)
    assert side.get_num_new_matched_tokens(req, 0) == (100, True)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 100)
    meta = side.build_connector_meta(idle_step())
    assert [spec.request_id for spec in meta.loads] == ["r1"]
    side.update_connector_output(SimpleNamespace(finished_recving={"r1"}, failed_recving={"r1"},
                                                 finished_sending=None, kv_connector_worker_meta=None))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    # Another request with kvxfer params still loads.
    assert side.get_num_new_matched_tokens(decode_request("r2", 40), 0) == (40, True)


def arrivals(*transfer_ids: str) -> Any:  # a KVConnectorOutput with only arrivals
    from kvxfer.integrations.vllm.metadata import KvxferWorkerReport

    return SimpleNamespace(finished_recving=None, failed_recving=None, finished_sending=None,
                           kv_connector_worker_meta=KvxferWorkerReport(set(transfer_ids)))


def test_a_prefill_leg_computes_at_once_by_default() -> None:
    # The decoder's reservation round trip is not on the TTFT path: the layers computed
    # before it comes are pushed from the kept blocks when it does (kv_pusher's catch-up).
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0)
    assert side.get_num_new_matched_tokens(prefill_request("p1", 100), 0) == (0, False)
    assert not side.build_connector_meta(idle_step()).awaiting_reservations
    # Arrivals are not kept when nothing gates on them (they would never be discarded).
    side.update_connector_output(arrivals("t-p2"))
    assert not side._arrived


def test_wait_for_reservation_holds_a_prefill_leg_until_its_reservation_arrived() -> None:
    side = EngineCoreSide(block_size=32, reservation_wait_s=5.0, wait_for_reservation=True)
    req = prefill_request("p1", 100)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # not schedulable yet
    assert side.build_connector_meta(idle_step()).awaiting_reservations  # the worker may block on its inbox
    side.update_connector_output(arrivals("t-p1"))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not side.build_connector_meta(idle_step()).awaiting_reservations
    assert not side._arrived
