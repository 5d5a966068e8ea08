"""A hybrid model through KvxferConnector, with real vLLM processes: a seeded Gemma-2
checkpoint whose layers alternate between sliding-window (32 tokens) and full attention.

The connector declares `SupportsHMA`, so vLLM runs the model with its hybrid KV cache
manager: a full-attention group and a sliding-window group, each with its own block table
over one allocation, the sliding-window group keeping no block (vLLM's null block) for the
pages before its window. The connector pushes each layer's group's blocks and nothing for
those null pages. The oracle is the same as for the Llama pair: tokens and top-5 logprobs
equal to colocated (the prefill instance, its own cache salt) within one bf16 step, and
the decoder's blocks equal to the prefiller's page by page in every layer (its own
group's blocks), for prompts several windows long.

One prefill and one decode instance of their own (the shared pair serves the Llama model).
Those two start-ups take over a minute on 2 cores, beyond the default suite's budget, so
the tests with instances are opt-in (KVXFER_VLLM_HYBRID_TEST=1); the refusal of KV cache
groups the connector cannot push runs always.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.vllm_faults import HOOKS_SPEC  # noqa: E402
from support.vllm_instances import BLOCK, CONNECTOR_TIMEOUTS, VllmFleet  # noqa: E402
from support.vllm_legs import colocated_choice, disaggregated_legs, page_digests, prompt_ids  # noqa: E402
from support.vllm_oracle import assert_same_as_colocated  # noqa: E402

from kvxfer.integrations.vllm.checkpoint import CheckpointShape, make_sliding_window_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(600)
#: The tests that start the two instances.
with_instances = pytest.mark.skipif(os.environ.get("KVXFER_VLLM_HYBRID_TEST") != "1", reason=(
    "a Gemma-2 prefill and decode instance of their own start in over a minute on 2 cores: "
    "set KVXFER_VLLM_HYBRID_TEST=1 to run them"))

SHAPE = CheckpointShape()


#: vLLM's KV cache managers for the hybrid model: its hybrid manager (the default for a
#: SupportsHMA connector: two groups), and one group (--disable-hybrid-kv-cache-manager:
#: the sliding-window layers unified into full attention, every layer keeping every block).
MANAGERS = {"hybrid_manager": [], "one_group": ["--disable-hybrid-kv-cache-manager"]}


@pytest.fixture(scope="module", params=list(MANAGERS))
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    work = tmp_path_factory.mktemp("vllm-hybrid")
    # A directory kept between runs (as KVXFER_TEST_MODEL_DIR for the Llama) saves making it.
    model_dir = Path(os.environ.get("KVXFER_TEST_HYBRID_MODEL_DIR", work / "model"))
    model = make_sliding_window_checkpoint(model_dir, SHAPE)
    digests = work / "digests"
    digests.mkdir()
    common = {"same_host": False, "bind_host": "127.0.0.1", "hooks": HOOKS_SPEC,
              "hooks_config": {"digest_dir": str(digests)}, **CONNECTOR_TIMEOUTS}
    with VllmFleet(model, work, common_extra=common) as fleet:
        flags = MANAGERS[request.param]
        fleet.start("prefill-h", "kv_producer", "0", user_args=flags)
        fleet.start("decode-h", "kv_consumer", "1", user_args=flags)
        fleet.wait_ready("prefill-h", "decode-h")
        fleet.digests = digests  # type: ignore[attr-defined]
        fleet.manager = request.param  # type: ignore[attr-defined]
        yield fleet
        # Nothing to drain: SIGKILL now rather than wait out vLLM's SIGTERM shutdown.
        for inst in fleet.instances.values():
            inst.kill()
            inst.process.wait(30)


def disaggregated(fleet: VllmFleet, prompt: list[int], tid: str,
                  salt: str | None = None) -> tuple[httpx.Response, httpx.Response]:
    """Both legs at once, as the router sends them: (prefill reply, decode reply); the
    cache salt is the transfer id unless given."""
    return disaggregated_legs(fleet, "prefill-h", "decode-h", prompt, tid, salt=salt or tid)


def colocated(fleet: VllmFleet, prompt: list[int]) -> dict[str, Any]:
    return colocated_choice(fleet, "prefill-h", prompt)


def digests(fleet: VllmFleet, role: str, tid: str) -> list[list[Any]]:
    return page_digests(fleet.digests, role, tid)  # type: ignore[attr-defined]



@with_instances
def test_vllm_runs_the_hybrid_model_with_the_kv_cache_manager_asked_for(fleet: VllmFleet) -> None:
    # The connector is SupportsHMA: vLLM keeps its hybrid manager on unless told otherwise
    # (it would log the first line turning it off for a connector, the second with one group).
    for name in ("prefill-h", "decode-h"):
        text = fleet.instances[name].log_text()
        assert "Turning off hybrid kv cache manager" not in text
        one_group = "Hybrid KV cache manager is disabled for this hybrid model" in text
        assert one_group == (fleet.manager == "one_group")  # type: ignore[attr-defined]


def _group_shape(pages: list[list[Any]]) -> dict[int, int]:
    """Per layer: how many prompt pages it pushed (None digests are pages its group keeps none of)."""
    pushed: dict[int, int] = {}
    for layer, _, digest in pages:
        pushed[layer] = pushed.get(layer, 0) + (digest is not None)
    return pushed


@with_instances
@pytest.mark.parametrize("length", [100, 230])
def test_hybrid_disaggregated_equals_colocated_in_tokens_logprobs_and_kv_bytes(fleet: VllmFleet,
                                                                              length: int) -> None:
    prompt = prompt_ids(length, seed=length)
    tid = f"hyb-{length}-{uuid.uuid4().hex[:8]}"
    on_p, on_d = disaggregated(fleet, prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    assert_same_as_colocated(on_d.json()["choices"][0], colocated(fleet, prompt))
    p_pages, d_pages = digests(fleet, "prefill", tid), digests(fleet, "decode", tid)
    # Every layer of every prompt page, each layer with its own group's blocks.
    pages = -(-length // BLOCK)
    assert sorted({layer for layer, _, _ in d_pages}) == list(range(SHAPE.layers))
    assert len(d_pages) == SHAPE.layers * pages
    assert p_pages == d_pages
    # With the hybrid manager half the layers (full attention) pushed every page and the
    # sliding-window half only the pages of the last 32 tokens' window (its saving, kept
    # across the hand-off); with one group every layer pushed every page.
    hybrid = fleet.manager == "hybrid_manager"  # type: ignore[attr-defined]
    window_pages = pages - (length - 32 + 1) // BLOCK if hybrid else pages
    assert sorted(_group_shape(d_pages).values()) == [window_pages] * (SHAPE.layers // 2) + \
        [pages] * (SHAPE.layers // 2)


@with_instances
def test_a_decoder_prefix_cache_hit_receives_only_the_rest_in_every_group(fleet: VllmFleet) -> None:
    # The same salt on both requests: the decoder holds the first prompt's 8 full blocks
    # (the sliding-window group its last window of them, which is all a hit needs), so the
    # second load starts at page 8 in every group.
    prompt = prompt_ids(130, seed=99)
    salt = f"prefix-{uuid.uuid4().hex}"
    first, second = f"pfx1-{uuid.uuid4().hex[:8]}", f"pfx2-{uuid.uuid4().hex[:8]}"
    on_p, on_d = disaggregated(fleet, prompt, first, salt=salt)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    longer = prompt + prompt_ids(40, seed=5)
    on_p, on_d = disaggregated(fleet, longer, second, salt=salt)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    assert_same_as_colocated(on_d.json()["choices"][0], colocated(fleet, longer))
    p_pages, d_pages = digests(fleet, "prefill", second), digests(fleet, "decode", second)
    assert min(page for _, page, _ in d_pages) == 128 // BLOCK
    assert p_pages == d_pages


@with_instances
def test_a_misplaced_block_of_a_layer_fails_the_byte_oracle(fleet: VllmFleet) -> None:
    # The fault swaps the first two pushed blocks of layer 0 (checksummed swapped, so the
    # decoder admits them); the page comparison must show exactly those two.
    prompt = prompt_ids(100, seed=7)
    tid = f"fault-misplace_page-{uuid.uuid4().hex[:8]}"
    on_p, on_d = disaggregated(fleet, prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    p_pages, d_pages = digests(fleet, "prefill", tid), digests(fleet, "decode", tid)
    pushed = [page for layer, page, digest in p_pages if layer == 0 and digest is not None]
    differing = sorted((layer, page) for (layer, page, a), (_, _, b) in zip(p_pages, d_pages) if a != b)
    assert differing == [(0, pushed[0]), (0, pushed[1])]


def test_kv_cache_groups_the_connector_cannot_push_are_refused_naming_them() -> None:
    # Attention groups (full plus sliding window: the hybrid manager's Gemma-2) are pushed
    # at any tensor parallel size; Mamba state at tensor parallel size 1 without prefix
    # caching only (one state per request; test_vllm_mamba.py pushes it).
    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                            SlidingWindowSpec)

    from kvxfer.integrations.vllm.connector import check_kv_cache_groups
    from kvxfer.integrations.vllm.settings import ConnectorConfigError

    shape = dict(block_size=BLOCK, num_kv_heads=SHAPE.kv_heads, head_size=SHAPE.hidden // SHAPE.heads,
                 dtype=torch.bfloat16)
    full = KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
                            FullAttentionSpec(**shape))
    window = KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"],
                              SlidingWindowSpec(**shape, sliding_window=32))
    mamba = KVCacheGroupSpec(["model.layers.4.mixer"], MambaSpec(block_size=BLOCK, shapes=((4, 8),),
                                                                 dtypes=(torch.bfloat16,)))
    check_kv_cache_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[full]), 2)
    check_kv_cache_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[full, window]), 1)
    check_kv_cache_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[full, window]), 2)
    check_kv_cache_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[full, window, mamba]), 1)
    # State under TP: equal sizes are handed over; different ones refused per request (test_kv_state_groups.py).
    check_kv_cache_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[full, window, mamba]), 2)
    aligned = KVCacheGroupSpec(["model.layers.4.mixer"], MambaSpec(block_size=BLOCK, shapes=((4, 8),),
                                                                   dtypes=(torch.bfloat16,), mamba_cache_mode="align"))
    with pytest.raises(ConnectorConfigError, match=r"mamba_cache_mode 'align'.*--no-enable-prefix-caching"):
        check_kv_cache_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[full, aligned]), 1)
    with pytest.raises(ConnectorConfigError, match=r"no attention layer"):
        check_kv_cache_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[mamba, mamba]), 1)
