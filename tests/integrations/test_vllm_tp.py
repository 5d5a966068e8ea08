"""Tensor parallelism through the kvxfer connector, with real vLLM instances.

The seeded Llama has 2 KV heads: at TP 2 each rank holds one. Each rank has its own engine;
rank 0 publishes the instance with every rank's engine address; a decode rank reserves at
the prefill rank that holds its heads, and vLLM reports a load finished once every rank
did. The oracle: tokens and top-5 logprobs equal colocated vLLM at the decoder's TP, and
every decode rank's KV heads byte-identical to the prefill ranks' that computed them
(per-head digests from tests/support/vllm_tp_hooks.py, keyed by the head's global index).

Opt-in (KVXFER_VLLM_TP_TEST=1): a TP 2 instance takes about 90 s to start on 2 cores and
two of them run four ranks there, more than the default suite's budget allows.
The pure parts (the head plan, the rank address list, the router's pairing) are
tested in tests/integrations/test_kv_tp_plan.py and test_kv_tp_halves.py, in the default suite.
"""

from __future__ import annotations

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

from support.vllm_instances import (  # noqa: E402
    TP_CONNECTOR_TIMEOUTS,
    VllmFleet,
    assert_memory_for_tp_instances,
    free_port,
)
from support.vllm_legs import colocated_choice, disaggregated_legs, prompt_ids, rank_head_digests  # noqa: E402
from support.vllm_tp_hooks import HOOKS_SPEC  # noqa: E402
from support.vllm_oracle import assert_same_as_colocated  # noqa: E402

pytestmark = [
    pytest.mark.timeout(1200),
    pytest.mark.skipif(os.environ.get("KVXFER_VLLM_TP_TEST") != "1", reason=(
        "four vLLM ranks start in about 3 minutes on 2 cores, beyond the default suite's budget: "
        "set KVXFER_VLLM_TP_TEST=1 to run them")),
]

LAYERS, BLOCK, KV_HEADS = 4, 32, 2
#: How long a stopped instance may take to exit, seconds (SIGTERM, then SIGKILL).
STOP_WAIT_S = 30.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    """Two TP 2 instances (both on cores 0 and 1, one rank each) that serve either leg
    (kv_both): `tp2-a` prefills into `tp2-b`. Four ranks at most run at once: five (a
    third, TP 1 instance beside them) starved etcd on 2 cores, so `tp1` replaces `tp2-a`
    for the pairs of different sizes."""
    from kvxfer.integrations.vllm.checkpoint import make_checkpoint

    assert_memory_for_tp_instances()
    work = tmp_path_factory.mktemp("vllm-tp")
    model = make_checkpoint(Path(os.environ.get("KVXFER_TEST_MODEL_DIR", work / "model")))
    digests = work / "digests"
    digests.mkdir()
    common = {"same_host": False, "bind_host": "127.0.0.1", "hooks": HOOKS_SPEC,
              "hooks_config": {"digest_dir": str(digests)}, **TP_CONNECTOR_TIMEOUTS}
    with VllmFleet(model, work, common_extra=common) as f:
        # Each rank serves its connector metrics on metrics_port + rank (read when a leg fails).
        f.start("tp2-a", "kv_both", "0|1", tensor_parallel_size=2, extra={"metrics_port": free_port()})
        f.start("tp2-b", "kv_both", "0|1", tensor_parallel_size=2, extra={"metrics_port": free_port()})
        f.wait_ready(*f.instances)
        f.digests = digests  # type: ignore[attr-defined]
        yield f


@pytest.fixture(scope="module")
def with_tp1(fleet: VllmFleet) -> VllmFleet:
    """The fleet with `tp2-a` stopped and a TP 1 instance `tp1` (kv_both) in its place."""
    if "tp1" not in fleet.instances:
        stopping = fleet.instances["tp2-a"]
        stopping.kill(signal.SIGTERM)
        try:
            stopping.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            stopping.kill()
            stopping.process.wait(STOP_WAIT_S)
        fleet.start("tp1", "kv_both", "1", extra={"metrics_port": free_port()})
        fleet.wait_ready("tp1")
    return fleet


def _legs(fleet: VllmFleet, prefill: str, decode: str, prompt: list[int],
          tid: str) -> tuple[httpx.Response, httpx.Response]:
    """Both legs at once, as the router sends them: (prefill reply, decode reply)."""
    on_p_reply, on_d_reply = disaggregated_legs(fleet, prefill, decode, prompt, tid, salt=tid, timeout_s=180.0)
    if on_p_reply.status_code != 200 or on_d_reply.status_code != 200:
        # What every rank of both instances dropped or counted, for the failure message.
        print(_connector_counters(fleet, prefill), _connector_counters(fleet, decode))
    return on_p_reply, on_d_reply


def _connector_counters(fleet: VllmFleet, name: str) -> dict[int, list[str]]:
    """The connector's failure and drop counters of each rank of instance `name`."""
    inst = fleet.instances[name]
    port = int(inst.spec.extra_config["metrics_port"])
    out: dict[int, list[str]] = {}
    for rank in range(inst.spec.tensor_parallel_size):
        try:
            text = httpx.get(f"http://127.0.0.1:{port + rank}/metrics", timeout=5).text
        except httpx.HTTPError as exc:
            out[rank] = [f"unreachable: {exc}"]
            continue
        out[rank] = [line for line in text.splitlines() if line.startswith((
                     "kvxfer_connector_dropped_messages_total", "kvxfer_connector_failures_total",
                     "kvxfer_connector_foreign", "kvxfer_connector_loads_in_flight")) and not line.endswith(" 0.0")]
    return out


def _colocated(fleet: VllmFleet, name: str, prompt: list[int]) -> dict[str, Any]:
    return colocated_choice(fleet, name, prompt, timeout_s=180.0)


def _rank_heads(fleet: VllmFleet, role: str, tid: str, ranks: int) -> list[dict[str, str]]:
    """Each rank's {"layer/page/global head": digest} of the transfer."""
    return rank_head_digests(fleet.digests, role, tid, ranks, timeout_s=30)  # type: ignore[attr-defined]


def _expected_keys(pages: int, heads: range) -> set[str]:
    return {f"{layer}/{page}/{h}" for layer in range(LAYERS) for page in range(pages) for h in heads}


def test_tp2_into_tp2_equals_colocated_tp2_and_each_decode_rank_holds_its_heads_exactly(fleet: VllmFleet) -> None:
    prompt = prompt_ids(100, seed=31)
    tid = f"tp22-{uuid.uuid4().hex[:8]}"
    on_p, on_d = _legs(fleet, "tp2-a", "tp2-b", prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    assert_same_as_colocated(on_d.json()["choices"][0], _colocated(fleet, "tp2-a", prompt))
    pushed = _rank_heads(fleet, "prefill", tid, 2)
    landed = _rank_heads(fleet, "decode", tid, 2)
    pages = -(-len(prompt) // BLOCK)
    for rank in range(2):
        assert set(landed[rank]) == _expected_keys(pages, range(rank, rank + 1))
        assert landed[rank] == pushed[rank]  # rank r's one head, from prefill rank r


def test_a_head_slice_on_the_wrong_decode_rank_fails_the_oracle(fleet: VllmFleet) -> None:
    # Each decode rank asks for the next rank's heads (the wrong_rank fault): the loads
    # land and pass the checksums (the bytes are what was sent), but not where vLLM reads
    # that head: the oracle must see it.
    prompt = prompt_ids(100, seed=32)
    tid = f"fault-wrong_rank-{uuid.uuid4().hex[:8]}"
    on_p, on_d = _legs(fleet, "tp2-a", "tp2-b", prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    pushed = _rank_heads(fleet, "prefill", tid, 2)
    landed = _rank_heads(fleet, "decode", tid, 2)
    computed = {**pushed[0], **pushed[1]}
    wrong = [key for rank in range(2) for key, digest in landed[rank].items() if computed[key] != digest]
    assert len(wrong) == LAYERS * -(-len(prompt) // BLOCK) * 2, wrong


def test_tp1_into_tp2_equals_colocated_tp2_and_each_decode_rank_holds_its_head_slice(with_tp1: VllmFleet) -> None:
    fleet = with_tp1
    prompt = prompt_ids(100, seed=33)
    tid = f"tp12-{uuid.uuid4().hex[:8]}"
    on_p, on_d = _legs(fleet, "tp1", "tp2-b", prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    assert_same_as_colocated(on_d.json()["choices"][0], _colocated(fleet, "tp2-b", prompt))
    (pushed,) = _rank_heads(fleet, "prefill", tid, 1)
    landed = _rank_heads(fleet, "decode", tid, 2)
    pages = -(-len(prompt) // BLOCK)
    assert set(pushed) == _expected_keys(pages, range(KV_HEADS))
    for rank in range(2):  # each decode rank: its one head, sliced from the prefiller's two
        assert set(landed[rank]) == _expected_keys(pages, range(rank, rank + 1))
        assert landed[rank] == {key: pushed[key] for key in landed[rank]}


def test_tp2_into_tp1_equals_colocated_tp1_and_the_decoder_holds_both_ranks_heads(with_tp1: VllmFleet) -> None:
    fleet = with_tp1
    prompt = prompt_ids(100, seed=34)
    tid = f"tp21-{uuid.uuid4().hex[:8]}"
    on_p, on_d = _legs(fleet, "tp2-b", "tp1", prompt, tid)
    assert on_p.status_code == 200 and on_d.status_code == 200, (on_p.text, on_d.text)
    assert_same_as_colocated(on_d.json()["choices"][0], _colocated(fleet, "tp1", prompt))
    pushed = _rank_heads(fleet, "prefill", tid, 2)
    (landed,) = _rank_heads(fleet, "decode", tid, 1)
    assert set(landed) == _expected_keys(-(-len(prompt) // BLOCK), range(KV_HEADS))
    assert landed == {**pushed[0], **pushed[1]}  # head 0 from prefill rank 0, head 1 from rank 1
