"""A hybrid model under tensor parallelism through KvxferConnector, with real vLLM: the
seeded Gemma-2 checkpoint (layers alternating between a 32-token sliding window and full
attention, 2 KV heads) prefilled at TP 1 and decoded at TP 2, vLLM's hybrid KV cache
manager on (two groups).

Each decode rank holds one KV head and sends the prefill rank a sliced reservation naming
its blocks of both groups; the prefill rank posts each layer's group's kept pages, head
sliced. The oracle: tokens and top-5 logprobs equal to colocated vLLM at the decoder's TP
(within one bf16 step), and every decode rank's head of every layer's group pages
byte-identical to the prefiller's head of the same global index (per-head digests from
tests/support/vllm_tp_hooks.py), the sliding-window layers holding only their window's
pages.

Opt-in (KVXFER_VLLM_HYBRID_TP_TEST=1): a TP 1 and a TP 2 instance (three ranks) start in
minutes on 2 cores. Its own module, so that its instances never run beside those of
test_vllm_hybrid.py (module-scoped, held to that module's end). Without vLLM the same path
runs in the default suite: tests/integrations/test_kv_tp_groups.py.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.vllm_instances import BLOCK, TP_CONNECTOR_TIMEOUTS, VllmFleet, assert_memory_for_tp_instances  # noqa: E402
from support.vllm_legs import colocated_choice, disaggregated_legs, prompt_ids, rank_head_digests  # noqa: E402
from support.vllm_oracle import assert_same_as_colocated  # noqa: E402
from support.vllm_tp_hooks import HOOKS_SPEC  # noqa: E402

from kvxfer.integrations.vllm.checkpoint import CheckpointShape, make_sliding_window_checkpoint  # noqa: E402

pytestmark = [
    pytest.mark.timeout(1200),
    pytest.mark.skipif(os.environ.get("KVXFER_VLLM_HYBRID_TP_TEST") != "1", reason=(
        "a Gemma-2 TP 1 and TP 2 instance (three ranks) start in minutes on 2 cores: "
        "set KVXFER_VLLM_HYBRID_TP_TEST=1 to run them")),
]

SHAPE = CheckpointShape()
WINDOW_TOKENS = 32


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    """`tp1` prefills (core 1), `tp2` decodes (ranks on cores 0 and 1; kv_both, so it also
    answers colocated at TP 2)."""
    assert_memory_for_tp_instances()
    work = tmp_path_factory.mktemp("vllm-hybrid-tp")
    model = make_sliding_window_checkpoint(Path(os.environ.get("KVXFER_TEST_HYBRID_MODEL_DIR", work / "model")),
                                           SHAPE)
    digests = work / "digests"
    digests.mkdir()
    common = {"same_host": False, "bind_host": "127.0.0.1", "hooks": HOOKS_SPEC,
              "hooks_config": {"digest_dir": str(digests)}, **TP_CONNECTOR_TIMEOUTS}
    with VllmFleet(model, work, common_extra=common) as f:
        f.start("tp1", "kv_producer", "1")
        f.start("tp2", "kv_both", "0|1", tensor_parallel_size=2)
        f.wait_ready("tp1", "tp2")
        f.digests = digests  # type: ignore[attr-defined]
        yield f
        for inst in f.instances.values():  # nothing to drain: SIGKILL rather than wait out SIGTERM
            inst.kill()
            inst.process.wait(30)


def _legs(fleet: VllmFleet, prompt: list[int], tid: str) -> tuple[httpx.Response, httpx.Response]:
    """Both legs at once, as the router sends them: (prefill reply, decode reply)."""
    return disaggregated_legs(fleet, "tp1", "tp2", prompt, tid, salt=tid, timeout_s=300.0)


def _colocated_tp2(fleet: VllmFleet, prompt: list[int]) -> dict[str, Any]:
    return colocated_choice(fleet, "tp2", prompt, timeout_s=300.0)


def _rank_heads(fleet: VllmFleet, role: str, tid: str, ranks: int) -> list[dict[str, str]]:
    """Each rank's {"layer/page/global head": digest} of the transfer."""
    return rank_head_digests(fleet.digests, role, tid, ranks, timeout_s=60)  # type: ignore[attr-defined]


def test_hybrid_tp1_into_tp2_equals_colocated_tp2_and_each_rank_holds_its_head_of_each_groups_pages(
        fleet: VllmFleet) -> None:
    for name in ("tp1", "tp2"):  # the hybrid manager on: two groups on both sides
        assert "Turning off hybrid kv cache manager" not in fleet.instances[name].log_text()
    length = 100
    prompt = prompt_ids(length, seed=41)
    tid = f"hybtp12-{uuid.uuid4().hex[:8]}"
    on_p, on_d = _legs(fleet, prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    assert_same_as_colocated(on_d.json()["choices"][0], _colocated_tp2(fleet, prompt))
    (pushed,) = _rank_heads(fleet, "prefill", tid, 1)
    landed = _rank_heads(fleet, "decode", tid, 2)
    pages = -(-length // BLOCK)
    window_pages = pages - (length - WINDOW_TOKENS + 1) // BLOCK
    for rank in range(2):
        assert landed[rank] == {key: pushed[key] for key in landed[rank]}  # head `rank`, from the TP 1 rank
        assert {int(key.split("/")[2]) for key in landed[rank]} == {rank}
        per_layer: dict[int, int] = {}
        for key in landed[rank]:
            layer = int(key.split("/")[0])
            per_layer[layer] = per_layer.get(layer, 0) + 1
        # Half the layers (full attention) every prompt page, the sliding-window half its window's.
        assert sorted(per_layer.values()) == [window_pages] * (SHAPE.layers // 2) + [pages] * (SHAPE.layers // 2)
