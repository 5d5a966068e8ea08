"""A Mamba hybrid under tensor parallelism through KvxferConnector, with real vLLM: the
seeded GraniteMoeHybrid (`make_mamba_hybrid_checkpoint`: 4 layers alternating a Mamba-2
mixer and attention; 8 mixer heads, 2 KV heads) at TP 2 on both sides, and refused between
TP 1 and TP 2.

At TP 2 each rank holds one KV head and half of every mixer (4 of its SSM heads, its share
of the conv channels; the one B/C group is replicated): its state block is its slice alone.
At equal sizes decode rank r reserves at prefill rank r, which pushes its attention pages
and, after the prompt's last chunk, its mixers' state blocks whole. The oracle: tokens and
top-5 logprobs equal to colocated vLLM at TP 2 (within one bf16 step), and each decode
rank's attention head of every page and each mixer's state bytes equal to the same prefill
rank's (digests from tests/support/vllm_tp_hooks.py). A state slice cannot be cut
between sizes: TP 1 into TP 2 and TP 2 into TP 1 are refused on both sides, naming the
sizes (`state_groups.unequal_tensor_parallel_state`), and leave no block taken.

Opt-in (KVXFER_VLLM_MAMBA_TP_TEST=1): two TP 2 instances (four ranks) start in minutes on 2
cores, beyond the default suite's budget. Four ranks at most run at once (five starved etcd
on 2 cores, tests/integrations/test_vllm_tp.py): the TP 1 instance replaces one TP 2 instance
for the refusals. The checkpoint is kept where KVXFER_TEST_MAMBA_MODEL_DIR names a folder
(its subfolder `mamba2-granitemoehybrid`, shared with test_vllm_mamba.py).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from support.vllm_instances import (  # noqa: E402
    TP_CONNECTOR_TIMEOUTS,
    VllmFleet,
    assert_memory_for_tp_instances,
    free_port,
)
from support.vllm_legs import colocated_choice, disaggregated_legs, prompt_ids, rank_head_digests  # noqa: E402
from support.vllm_oracle import assert_same_as_colocated  # noqa: E402
from support.vllm_tp_hooks import HOOKS_SPEC, STATE_KEY  # noqa: E402
from support.waiting import wait_until  # noqa: E402

from kvxfer.integrations.vllm.checkpoint import CheckpointShape, make_mamba_hybrid_checkpoint  # noqa: E402

pytestmark = [
    pytest.mark.timeout(1200),
    pytest.mark.skipif(os.environ.get("KVXFER_VLLM_MAMBA_TP_TEST") != "1", reason=(
        "two TP 2 Mamba hybrid instances (four ranks) start in minutes on 2 cores, beyond the default suite's "
        "budget: set KVXFER_VLLM_MAMBA_TP_TEST=1 to run them")),
]

SHAPE = CheckpointShape()
#: vLLM's attention block for this model on CPU, at TP 1 and 2 alike: 128 tokens, the CPU
#: backend's alignment, whose page already holds a rank's mixer state.
BLOCK = 128
CHUNK = 64  # max_num_batched_tokens: prompts over it prefill in chunks, the state pushed after the last
FLAGS = ["--no-enable-prefix-caching", "--max-model-len", "1024"]
#: How long a stopped instance may take to exit, seconds (SIGTERM, then SIGKILL).
STOP_WAIT_S = 30.0
#: How long a refused hand-off may take to show in logs, counters and vLLM's cache usage, seconds.
REFUSAL_SETTLE_S = 30.0
LEG_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    """Two TP 2 instances (both on cores 0 and 1, one rank each) that serve either leg
    (kv_both): `tp2-a` prefills into `tp2-b` and answers colocated at TP 2."""
    assert_memory_for_tp_instances()
    work = tmp_path_factory.mktemp("vllm-mamba-tp")
    model_root = os.environ.get("KVXFER_TEST_MAMBA_MODEL_DIR")
    model = make_mamba_hybrid_checkpoint(
        Path(model_root) / "mamba2-granitemoehybrid" if model_root else work / "model", SHAPE)
    digests = work / "digests"
    digests.mkdir()
    common = {"same_host": False, "bind_host": "127.0.0.1", "hooks": HOOKS_SPEC, "kv_integrity": "full",
              "hooks_config": {"digest_dir": str(digests)}, **TP_CONNECTOR_TIMEOUTS}
    with VllmFleet(model, work, common_extra=common) as f:
        for name in ("tp2-a", "tp2-b"):
            # Each rank serves its connector metrics on metrics_port + rank.
            f.start(name, "kv_both", "0|1", tensor_parallel_size=2, block_size=None, max_num_batched_tokens=CHUNK,
                    user_args=FLAGS, extra={"metrics_port": free_port()})
        f.wait_ready(*f.instances)
        f.digests = digests  # type: ignore[attr-defined]
        yield f
        for inst in f.instances.values():  # nothing to drain: SIGKILL rather than wait out SIGTERM
            inst.kill()
            inst.process.wait(STOP_WAIT_S)


@pytest.fixture(scope="module")
def with_tp1(fleet: VllmFleet) -> VllmFleet:
    """The fleet with `tp2-a` stopped and a TP 1 instance `tp1` (kv_both, core 1) in its place."""
    if "tp1" not in fleet.instances:
        stopping = fleet.instances["tp2-a"]
        stopping.kill(signal.SIGTERM)
        try:
            stopping.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            stopping.kill()
            stopping.process.wait(STOP_WAIT_S)
        fleet.start("tp1", "kv_both", "1", block_size=None, max_num_batched_tokens=CHUNK, user_args=FLAGS,
                    extra={"metrics_port": free_port()})
        fleet.wait_ready("tp1")
    return fleet


def _legs(fleet: VllmFleet, prefill: str, decode: str, prompt: list[int],
          tid: str) -> tuple[httpx.Response, httpx.Response]:
    """Both legs at once, as the router sends them: (prefill reply, decode reply)."""
    return disaggregated_legs(fleet, prefill, decode, prompt, tid, timeout_s=LEG_TIMEOUT_S)


def _rank_digests(fleet: VllmFleet, role: str, tid: str, ranks: int) -> list[dict[str, str]]:
    """Each rank's {"layer/page/global head or state": digest} of the transfer."""
    return rank_head_digests(fleet.digests, role, tid, ranks, timeout_s=60)  # type: ignore[attr-defined]


def _expected_keys(prompt_len: int, rank: int) -> set[str]:
    """What rank `rank` of TP 2 moves of a `prompt_len`-token prompt (the decoder computes its
    last token): each mixer (even layers) its state once, as the last page's block; each
    attention layer its one KV head (global index `rank`) of every page."""
    pages = math.ceil((prompt_len - 1) / BLOCK)
    mixers = {f"{layer}/{pages - 1}/{STATE_KEY}" for layer in range(0, SHAPE.layers, 2)}
    return mixers | {f"{layer}/{page}/{rank}" for layer in range(1, SHAPE.layers, 2) for page in range(pages)}


def _metric_samples(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, frozenset[tuple[str, str]]],
                                                                             float]:
    """{(sample name, labels): value} of a Prometheus /metrics page."""
    text = httpx.get(url + "/metrics", headers=headers or {}, timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _connector_samples(fleet: VllmFleet, name: str) -> list[dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    """Each rank's connector metrics of instance `name` (served on metrics_port + rank)."""
    inst = fleet.instances[name]
    assert inst.metrics_port is not None
    return [_metric_samples(f"http://127.0.0.1:{inst.metrics_port + rank}") for rank in range(_ranks(fleet, name))]


def _ranks(fleet: VllmFleet, name: str) -> int:
    spec = fleet.instances[name].spec
    assert spec is not None
    return spec.tensor_parallel_size


def _failures(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], side: str, reason: str) -> float:
    return samples.get(("kvxfer_connector_failures_total", frozenset({("side", side), ("reason", reason)})), 0.0)


def _gauge(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    """The sum of every series of `name` (vLLM labels its gauges with the engine and model);
    a name the page lacks fails (a misspelt gauge must not read as idle)."""
    values = [value for (sample, _), value in samples.items() if sample == name]
    assert values, f"no {name} on the metrics page"
    return sum(values)


def _idle(fleet: VllmFleet, name: str) -> bool:
    """Instance `name` holds no KV block and runs or waits for no request (vLLM's own
    metrics), and no rank of its connector awaits a load."""
    vllm = _metric_samples(fleet.instances[name].url, fleet.headers)
    ranks = _connector_samples(fleet, name)
    return (_gauge(vllm, "vllm:kv_cache_usage_perc") == 0.0 and _gauge(vllm, "vllm:num_requests_running") == 0.0
            and _gauge(vllm, "vllm:num_requests_waiting") == 0.0
            and all(_gauge(r, "kvxfer_connector_loads_in_flight") == 0.0 for r in ranks))


def _log_lines(fleet: VllmFleet, name: str, tid: str, what: str) -> list[str]:
    """Instance `name`'s log lines about transfer `tid` that say `what`."""
    return [line for line in fleet.instances[name].log_text().splitlines() if f"transfer {tid} " in line
            and what in line]


def _colocated_tp2(fleet: VllmFleet, prompt: list[int]) -> dict[str, Any]:
    return colocated_choice(fleet, "tp2-a", prompt, salted=False, timeout_s=LEG_TIMEOUT_S)


def test_mamba_tp2_into_tp2_equals_colocated_tp2_and_each_decode_rank_holds_its_prefill_ranks_state_and_head(
        fleet: VllmFleet) -> None:
    length = 300  # three pages, prefilled in five chunks
    prompt = prompt_ids(length, seed=51)
    tid = f"mambatp22-{uuid.uuid4().hex[:8]}"
    on_p, on_d = _legs(fleet, "tp2-a", "tp2-b", prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    assert_same_as_colocated(on_d.json()["choices"][0], _colocated_tp2(fleet, prompt))
    pushed = _rank_digests(fleet, "prefill", tid, 2)
    landed = _rank_digests(fleet, "decode", tid, 2)
    for rank in range(2):
        assert set(landed[rank]) == _expected_keys(length, rank), rank
        assert landed[rank] == pushed[rank], rank  # rank r's state slices and head, from prefill rank r
    # The two ranks' state blocks are different slices: one sent to the other rank would show.
    states = [{key: digest for key, digest in pushed[rank].items() if key.endswith(STATE_KEY)} for rank in range(2)]
    assert all(states[0][key] != states[1][key] for key in states[0])


def test_a_state_block_on_the_wrong_decode_rank_fails_the_oracle(fleet: VllmFleet) -> None:
    # Each decode rank reserves at the next prefill rank (the wrong_rank fault): the loads
    # land and pass the checksums (the bytes are what was sent), but each rank's mixers now
    # hold the other rank's slice of their state: the oracle must see every one.
    length = 100
    prompt = prompt_ids(length, seed=52)
    tid = f"fault-wrong_rank-{uuid.uuid4().hex[:8]}"
    on_p, on_d = _legs(fleet, "tp2-a", "tp2-b", prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    pushed = _rank_digests(fleet, "prefill", tid, 2)
    landed = _rank_digests(fleet, "decode", tid, 2)
    for rank in range(2):
        other = 1 - rank
        states = [key for key in landed[rank] if key.endswith(STATE_KEY)]
        assert len(states) == SHAPE.layers // 2
        # Each mixer's state: not the one prefill rank `rank` computed, the other rank's.
        assert all(landed[rank][key] != pushed[rank][key] and landed[rank][key] == pushed[other][key]
                   for key in states), rank


@pytest.mark.parametrize(("prefill", "decode", "sizes"), [("tp1", "tp2-b", "prefill 1, decode 2"),
                                                          ("tp2-b", "tp1", "prefill 2, decode 1")])
def test_mamba_state_between_tp1_and_tp2_is_refused_on_both_sides_naming_the_sizes_and_no_block_stays_taken(
        with_tp1: VllmFleet, prefill: str, decode: str, sizes: str) -> None:
    fleet = with_tp1
    before = {name: _connector_samples(fleet, name) for name in (prefill, decode)}
    tid = f"mambatp-refused-{uuid.uuid4().hex[:8]}"
    on_p, on_d = _legs(fleet, prefill, decode, prompt_ids(100, seed=53), tid)
    # The decoder fails the request (kv_load_failure_policy fail: vLLM answers 500); the
    # prefiller computed its leg and answers it, only its push failed.
    assert on_p.status_code == 200, on_p.text
    assert on_d.status_code == 500, on_d.text
    why = f"Mamba/SSM state is handed over between equal tensor parallel sizes only ({sizes})"
    ranks = {name: _ranks(fleet, name) for name in (prefill, decode)}
    # Every rank of each side refuses by itself, in its log and its failure counter.
    wait_until(lambda: len(_log_lines(fleet, decode, tid, f"load failed: {why}")) == ranks[decode],
               timeout_s=REFUSAL_SETTLE_S, interval_s=0.2, what=f"{decode}'s ranks refusing the load")
    wait_until(lambda: len(_log_lines(fleet, prefill, tid, f"push failed: {why}")) == ranks[prefill],
               timeout_s=REFUSAL_SETTLE_S, interval_s=0.2, what=f"{prefill}'s ranks refusing the push")
    after = {name: _connector_samples(fleet, name) for name in (prefill, decode)}
    for rank in range(ranks[decode]):
        assert _failures(after[decode][rank], "decode", "tp_mismatch") - \
            _failures(before[decode][rank], "decode", "tp_mismatch") == 1.0, rank
    for rank in range(ranks[prefill]):
        assert _failures(after[prefill][rank], "prefill", "push_failed") - \
            _failures(before[prefill][rank], "prefill", "push_failed") == 1.0, rank
    # Nothing was admitted, and both instances are back to idle: no block, request or load held.
    assert not list(fleet.digests.glob(f"decode-{tid}-r*.json"))  # type: ignore[attr-defined]
    for name in (prefill, decode):
        wait_until(lambda: _idle(fleet, name), timeout_s=REFUSAL_SETTLE_S, interval_s=0.5,
                   what=f"{name} back to idle")
