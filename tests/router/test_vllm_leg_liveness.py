"""A vLLM prefill instance's liveness address travels from its registry record to the
decoder: the router copies it into the decode leg's kv_transfer_params, and the decode
side parses it into its load (prefiller_liveness.py watches it there)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from kvxfer.integrations.vllm.metadata import TransferParams, TransferParamsError  # noqa: E402
from kvxfer.registry import WorkerRecord  # noqa: E402
from scheduler.kvxfer_router.directory import WorkerView  # noqa: E402
from scheduler.kvxfer_router.vllm_legs import leg_bodies  # noqa: E402

LIVENESS = "127.0.0.1:40123"


def _view(role: str, **fields: str) -> WorkerView:
    record = WorkerRecord(worker_id=f"vllm-{role}", role=role, http_url=f"http://{role}", engine_address="aa" if
                          role == "prefill" else "bb", model="m", kv_layout="L2-H2-D8-float32-bs16", total_pages=8,
                          engine="vllm", **fields)
    return WorkerView.from_record(record)


def test_the_decode_leg_carries_the_prefillers_liveness_address() -> None:
    _, decode_body = leg_bodies({"prompt": "x"}, "t-1", _view("decode"), _view("prefill", liveness_address=LIVENESS))
    params = TransferParams.parse(decode_body["kv_transfer_params"])
    assert params is not None and params.peer_liveness == LIVENESS and params.peer_engine == bytes.fromhex("aa")


def test_a_prefiller_without_a_liveness_address_sends_none() -> None:
    _, decode_body = leg_bodies({"prompt": "x"}, "t-2", _view("decode"), _view("prefill"))
    assert "peer_liveness" not in decode_body["kv_transfer_params"]["kvxfer"]
    params = TransferParams.parse(decode_body["kv_transfer_params"])
    assert params is not None and params.peer_liveness == ""


def test_a_liveness_address_that_is_not_a_short_string_is_refused() -> None:
    for bad in (42, "x" * 81):
        with pytest.raises(TransferParamsError, match="peer_liveness"):
            TransferParams.parse({"kvxfer": {"role": "decode", "transfer_id": "t", "peer_engine": "aa",
                                             "peer_liveness": bad}})
