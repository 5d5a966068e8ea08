"""A hybrid model through KvxferConnector, with real vLLM processes: a seeded Gemma-2
checkpoint whose layers alternate between sliding-window (32 tokens) and full attention.

vLLM turns its hybrid KV cache manager off for a connector that does not declare
`SupportsHMA`: the model then runs as one KV cache group, every layer keeping every block
(the sliding-window layers still attend to their window only). The connector pushes every
layer of that group; the oracle is the same as for the Llama pair: tokens and top-5
logprobs equal to colocated (the prefill instance, its own cache salt) within one bf16 step,
and the decoder's blocks equal to the prefiller's page by page, for prompts several
windows long.

One prefill and one decode instance of their own (the shared pair serves the Llama model).
Those two start-ups take over a minute on 2 cores, beyond the default suite's budget, so
the tests with instances are opt-in (KVXFER_VLLM_HYBRID_TEST=1); the refusal of a cache of
several groups runs always.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.vllm_faults import HOOKS_SPEC  # noqa: E402
from support.vllm_instances import BLOCK, CONNECTOR_TIMEOUTS, VllmFleet  # noqa: E402
from support.vllm_oracle import assert_same_as_colocated  # noqa: E402
from support.waiting import wait_until  # noqa: E402

from kvxfer.integrations.vllm.checkpoint import CheckpointShape, make_sliding_window_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(600)
#: The tests that start the two instances.
with_instances = pytest.mark.skipif(os.environ.get("KVXFER_VLLM_HYBRID_TEST") != "1", reason=(
    "a Gemma-2 prefill and decode instance of their own start in over a minute on 2 cores: "
    "set KVXFER_VLLM_HYBRID_TEST=1 to run them"))

SHAPE = CheckpointShape()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    work = tmp_path_factory.mktemp("vllm-hybrid")
    # A directory kept between runs (as KVXFER_TEST_MODEL_DIR for the Llama) saves making it.
    model_dir = Path(os.environ.get("KVXFER_TEST_HYBRID_MODEL_DIR", work / "model"))
    model = make_sliding_window_checkpoint(model_dir, SHAPE)
    digests = work / "digests"
    digests.mkdir()
    common = {"same_host": False, "bind_host": "127.0.0.1", "hooks": HOOKS_SPEC,
              "hooks_config": {"digest_dir": str(digests)}, **CONNECTOR_TIMEOUTS}
    with VllmFleet(model, work, common_extra=common) as fleet:
        fleet.start("prefill-h", "kv_producer", "0")
        fleet.start("decode-h", "kv_consumer", "1")
        fleet.wait_ready("prefill-h", "decode-h")
        fleet.digests = digests  # type: ignore[attr-defined]
        yield fleet
        # Nothing to drain: SIGKILL now rather than wait out vLLM's SIGTERM shutdown.
        for inst in fleet.instances.values():
            inst.kill()
            inst.process.wait(30)


def _prompt(n: int, seed: int) -> list[int]:
    # Token ids, so the prompt has exactly n tokens; ids above the specials (0-2).
    return [3 + (seed * 7919 + i * 104729) % 1900 for i in range(n)]


def _params(role: str, tid: str, peer: str) -> dict[str, Any]:
    return {"kvxfer": {"role": role, "transfer_id": tid, "peer_engine": peer}}


def disaggregated(fleet: VllmFleet, prompt: list[int], tid: str) -> tuple[httpx.Response, httpx.Response]:
    """Both legs at once, as the router sends them: (prefill reply, decode reply)."""
    p, d = fleet.record("prefill-h"), fleet.record("decode-h")
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 5,
                            "cache_salt": tid}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        on_d = pool.submit(httpx.post, fleet.instances["decode-h"].url + "/v1/completions", headers=fleet.headers,
                           json={**body, "kv_transfer_params": _params("decode", tid, p.engine_address)}, timeout=120)
        on_p = pool.submit(httpx.post, fleet.instances["prefill-h"].url + "/v1/completions", headers=fleet.headers,
                           json={**body, "max_tokens": 1,
                                 "kv_transfer_params": _params("prefill", tid, d.engine_address)}, timeout=120)
        return on_p.result(), on_d.result()


def colocated(fleet: VllmFleet, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 5,
            "cache_salt": f"ref-{uuid.uuid4().hex}"}
    r = httpx.post(fleet.instances["prefill-h"].url + "/v1/completions", headers=fleet.headers, json=body,
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def digests(fleet: VllmFleet, role: str, tid: str) -> list[list[Any]]:
    path: Path = fleet.digests / f"{role}-{tid}.json"  # type: ignore[attr-defined]
    wait_until(path.exists, timeout_s=30, interval_s=0.1, what=f"{role} digests of {tid}")
    return list(json.loads(path.read_text())["pages"])



@with_instances
def test_vllm_runs_the_hybrid_model_as_one_group_with_the_connector(fleet: VllmFleet) -> None:
    # What the connector relies on: vLLM unified the sliding-window layers into the full
    # attention group because the connector does not declare SupportsHMA.
    text = fleet.instances["prefill-h"].log_text()
    assert "Turning off hybrid kv cache manager" in text
    assert "Hybrid KV cache manager is disabled for this hybrid model" in text


@with_instances
@pytest.mark.parametrize("length", [100, 230])
def test_hybrid_disaggregated_equals_colocated_in_tokens_logprobs_and_kv_bytes(fleet: VllmFleet,
                                                                              length: int) -> None:
    prompt = _prompt(length, seed=length)
    tid = f"hyb-{length}-{uuid.uuid4().hex[:8]}"
    on_p, on_d = disaggregated(fleet, prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    assert_same_as_colocated(on_d.json()["choices"][0], colocated(fleet, prompt))
    p_pages, d_pages = digests(fleet, "prefill", tid), digests(fleet, "decode", tid)
    # Every layer, sliding-window ones included, of every prompt page.
    assert sorted({layer for layer, _, _ in d_pages}) == list(range(SHAPE.layers))
    assert len(d_pages) == SHAPE.layers * -(-length // BLOCK)
    assert p_pages == d_pages



@with_instances
def test_a_misplaced_block_of_a_sliding_window_layer_fails_the_byte_oracle_not_the_output(fleet: VllmFleet) -> None:
    # The fault swaps blocks 0 and 1 of layer 0, a sliding-window layer (checksummed
    # swapped, so the decoder admits them). Tokens 0-63 lie outside the window of every
    # position the decoder computes (from 100 on), so the output cannot tell; the page
    # comparison must.
    prompt = _prompt(100, seed=7)
    tid = f"fault-misplace_page-{uuid.uuid4().hex[:8]}"
    on_p, on_d = disaggregated(fleet, prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    assert_same_as_colocated(on_d.json()["choices"][0], colocated(fleet, prompt))
    p_pages, d_pages = digests(fleet, "prefill", tid), digests(fleet, "decode", tid)
    differing = sorted((layer, page) for (layer, page, a), (_, _, b) in zip(p_pages, d_pages) if a != b)
    assert differing == [(0, 0), (0, 1)]


def test_a_kv_cache_of_several_groups_is_refused_naming_them() -> None:
    # vLLM builds this for the hybrid model when its hybrid manager is forced on.
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kvxfer.integrations.vllm.connector import check_one_kv_cache_group
    from kvxfer.integrations.vllm.settings import ConnectorConfigError

    shape = dict(block_size=BLOCK, num_kv_heads=SHAPE.kv_heads, head_size=SHAPE.hidden // SHAPE.heads,
                 dtype=torch.bfloat16)
    full = KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                            FullAttentionSpec(**shape))
    window = KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"],
                              SlidingWindowSpec(**shape, sliding_window=32))
    check_one_kv_cache_group(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[full]))
    with pytest.raises(ConnectorConfigError, match=r"2 groups \(FullAttentionSpec \(2 layers\), "
                                                   r"SlidingWindowSpec \(2 layers\)\).*hybrid-kv-cache-manager"):
        check_one_kv_cache_group(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[full, window]))
