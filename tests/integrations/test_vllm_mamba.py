"""State-bearing hybrids through KvxferConnector, with real vLLM processes: seeded
checkpoints whose layers alternate between a state mixer and full attention, one prefill
and decode pair per model shown (`MODELS`, a module fixture per model, started one model at
a time): a GraniteMoeHybrid with Mamba-2 mixers (`make_mamba_hybrid_checkpoint`). A
Qwen3-Next with gated delta-net mixers (`make_linear_attention_hybrid_checkpoint`) is
refused at start-up, naming its mixer kind (`state_groups.REFUSED_MIXER_KINDS`).

vLLM runs it under its hybrid KV cache manager with two groups over one allocation: the
mixers' state group (one block per request: conv window and SSM state) and the attention
group. Prefix caching is off (`--no-enable-prefix-caching`: vLLM's one-state-per-request
mode, the one the connector pushes). The prefill leg computes the prompt less its last
token and pushes the attention pages layer by layer and each mixer's state after the last
chunk; the decoder loads them and computes the last prompt token on the loaded state. The
prefill instance prefills in 64-token chunks, so the state is pushed only after several
steps. The oracle: tokens and top-5 logprobs equal to colocated (the prefill instance
computing the whole prompt itself) within one bf16 step, the decoder's attention pages
equal to the prefiller's page by page, and each mixer's state bytes equal to the
prefiller's.

One prefill and one decode instance of their own per model start in over a minute on 2
cores, beyond the default suite's budget: opt-in (KVXFER_VLLM_MAMBA_TEST=1). A model's
checkpoint is kept where KVXFER_TEST_MAMBA_MODEL_DIR names a folder (one subfolder per
model).
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.vllm_faults import HOOKS_SPEC  # noqa: E402
from support.vllm_instances import CONNECTOR_TIMEOUTS, VllmFleet  # noqa: E402
from support.vllm_legs import colocated_choice, disaggregated_legs, page_digests, prompt_ids  # noqa: E402
from support.vllm_oracle import assert_same_as_colocated  # noqa: E402

from kvxfer.integrations.vllm.checkpoint import (  # noqa: E402
    CheckpointShape,
    make_linear_attention_hybrid_checkpoint,
    make_mamba_hybrid_checkpoint,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(
    os.environ.get("KVXFER_VLLM_MAMBA_TEST") != "1", reason=(
        "a Mamba hybrid prefill and decode instance of their own start in over a minute on 2 cores: "
        "set KVXFER_VLLM_MAMBA_TEST=1 to run them"))]

SHAPE = CheckpointShape()
CHUNK = 64  # the prefill instance's max_num_batched_tokens: prompts over it prefill in chunks
FLAGS = ["--no-enable-prefix-caching", "--max-model-len", "1024"]
#: The hybrids shown, by name: the maker of its checkpoint (in the folder it is given) and
#: the attention block vLLM picks, whose page must hold a mixer's state (vLLM's CPU block,
#: 128 tokens, for the Mamba-2 mixers).
MODELS: dict[str, tuple[Callable[[Path, CheckpointShape], Path], int]] = {
    "mamba2-granitemoehybrid": (make_mamba_hybrid_checkpoint, 128),
}


def _model_dir(name: str, work: Path) -> Path:
    model_root = os.environ.get("KVXFER_TEST_MAMBA_MODEL_DIR")
    return Path(model_root) / name if model_root else work / "model"


def test_a_gated_deltanet_hybrid_is_refused_at_start_up_naming_its_mixer_kind(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Run through the connector, a Qwen3-Next's state arrived byte-equal but its decoder's
    # text differed from colocated (state_groups.REFUSED_MIXER_KINDS): vLLM refuses to start.
    work = tmp_path_factory.mktemp("vllm-gated-deltanet")
    model = make_linear_attention_hybrid_checkpoint(_model_dir("gated-deltanet-qwen3next", work), SHAPE)
    with VllmFleet(model, work, common_extra={"bind_host": "127.0.0.1"}) as fleet:
        fleet.start("decode-g", "kv_consumer", "1", block_size=None, user_args=FLAGS)
        with pytest.raises(RuntimeError, match="exited"):
            fleet.wait_ready("decode-g")
        assert "holds GDN_ATTN mixers: run through the connector" in fleet.instances["decode-g"].log_text()


@pytest.fixture(scope="module", params=sorted(MODELS))
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    work = tmp_path_factory.mktemp(f"vllm-{request.param}")
    make, block = MODELS[request.param]
    model = make(_model_dir(request.param, work), SHAPE)
    digests = work / "digests"
    digests.mkdir()
    common = {"same_host": False, "bind_host": "127.0.0.1", "hooks": HOOKS_SPEC, "kv_integrity": "full",
              "hooks_config": {"digest_dir": str(digests)}, **CONNECTOR_TIMEOUTS}
    with VllmFleet(model, work, common_extra=common) as fleet:
        fleet.start("prefill-m", "kv_producer", "0", block_size=None, max_num_batched_tokens=CHUNK, user_args=FLAGS)
        fleet.start("decode-m", "kv_consumer", "1", block_size=None, user_args=FLAGS)
        fleet.wait_ready("prefill-m", "decode-m")
        fleet.digests = digests  # type: ignore[attr-defined]
        fleet.block = block  # type: ignore[attr-defined]
        yield fleet
        # Nothing to drain: SIGKILL now rather than wait out vLLM's SIGTERM shutdown.
        for inst in fleet.instances.values():
            inst.kill()
            inst.process.wait(30)


def disaggregated(fleet: VllmFleet, prompt: list[int], tid: str) -> tuple[httpx.Response, httpx.Response]:
    """Both legs at once, as the router sends them: (prefill reply, decode reply)."""
    return disaggregated_legs(fleet, "prefill-m", "decode-m", prompt, tid)


def colocated(fleet: VllmFleet, prompt: list[int]) -> dict[str, Any]:
    return colocated_choice(fleet, "prefill-m", prompt, salted=False)


def digests(fleet: VllmFleet, role: str, tid: str) -> list[list[Any]]:
    return page_digests(fleet.digests, role, tid)  # type: ignore[attr-defined]


@pytest.mark.parametrize("length", [100, 300])
def test_mamba_disaggregated_equals_colocated_in_tokens_logprobs_kv_and_state_bytes(fleet: VllmFleet,
                                                                                 length: int) -> None:
    prompt = prompt_ids(length, seed=length)
    tid = f"mamba-{length}-{uuid.uuid4().hex[:8]}"
    on_p, on_d = disaggregated(fleet, prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    assert_same_as_colocated(on_d.json()["choices"][0], colocated(fleet, prompt))
    p_pages, d_pages = digests(fleet, "prefill", tid), digests(fleet, "decode", tid)
    # The region's layers: per slot the mixer (state group 0), then the attention layer.
    # The decoder computes the last prompt token itself.
    pages = math.ceil((length - 1) / fleet.block)  # type: ignore[attr-defined]
    assert len(d_pages) == SHAPE.layers * pages
    assert p_pages == d_pages
    for layer in range(SHAPE.layers):
        pushed = [page for lay, page, digest in d_pages if lay == layer and digest is not None]
        # A mixer pushed its state once (as the last prompt page's block); attention every page.
        assert pushed == ([pages - 1] if layer % 2 == 0 else list(range(pages))), layer


