"""KV-aware routing: the router's KV index and the ``kv_aware`` pair policy, against fake
workers on loopback (the module's shared fake-worker host) that answer the signed
``POST /prefix_index`` of the worker contract; plus ``least_loaded``'s fair ties."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request
from kvxfer_router import RouterSettings, StaticWorkerDirectory, WorkerView, create_app, make_policy
from kvxfer_router.kv_index import PromptBlocks, relayed_prompt_text
from kvxfer_router.openai_api import default_prompt_encoder
from kvxfer_router.policies import LocalLoad, select_pair
from support.fake_workers import LAYOUT_A, MODEL, Fabric, FakeDecodeWorker, FakePrefillWorker, ServerHost, WorkerMux
from support.waiting import wait_until
from support.worker_procs import WorkerProc, WorkerSet

from kvxfer.cluster.control_client import ControlTokenAuth
from kvxfer.kv.prefix_hash import block_hashes_hex
from kvxfer.registry.control_token import TokenRefused, TokenVerifier, WorkerIdentity

BLOCK = 16
CLUSTER_KEY = b"kv-routing-test-cluster-key-0123456789"
SETTINGS: dict[str, Any] = dict(
    policy="kv_aware", kv_index_mode="both", disaggregation_min_prompt_tokens=8, max_prompt_tokens=1024,
    max_tokens_limit=100, request_deadline_s=5.0, connect_timeout_s=1.0, control_timeout_s=2.0,
    prefill_timeout_s=3.0, kv_wait_timeout_s=2.0, first_token_timeout_s=3.0, token_idle_timeout_s=2.0,
    cancel_timeout_s=1.0, shutdown_timeout_s=2.0, prefix_index_poll_interval_s=0.05,
    # Cost weights that make a held prefix and one request of load weigh alike on tiny prompts.
    prefill_token_cost_ms=1.0, transfer_page_cost_ms=1.0, load_cost_ms=100.0,
)


def system_prompt(user: int) -> str:
    """A 'system prompt' per user, several blocks long, that shares no block with another's."""
    return f"{user} system: you are assistant number {user}. " + f"user {user} likes topic {user} very much. " * 3


def tokens(text: str) -> list[int]:
    return default_prompt_encoder()(text)


def in_whole_blocks(text: str) -> str:
    """``text`` padded so that its tokens fill whole blocks (the worker then holds all of them)."""
    return text + "." * (-len(tokens(text)) % BLOCK)


class IndexedDecoder(FakeDecodeWorker):
    """A fake decoder that also reports a prefix index (``hold`` sets its blocks) and checks
    the router's control token on that call, as the workers' middleware does."""

    def __init__(self, worker_id: str, fabric: Fabric) -> None:
        super().__init__(worker_id, fabric)
        self.held: list[str] = []
        self.version = 0
        self.index_status: int | None = None  # answer /prefix_index with this error instead
        self.index_polls = 0
        self.verifier = TokenVerifier(CLUSTER_KEY, WorkerIdentity("decode", worker_id), max_lifetime_s=30,
                                      clock_skew_s=5)
        self.app.post("/prefix_index")(self._prefix_index)

    def hold(self, prompt: str) -> None:
        """Report the full blocks of ``prompt`` (and nothing else) from now on."""
        self.held = block_hashes_hex(tokens(prompt), BLOCK, MODEL)
        self.version += 1

    async def _prefix_index(self, request: Request) -> dict[str, Any]:
        body = await request.body()
        try:
            self.verifier.verify(request.headers.get("authorization"), "POST",
                                 urlparse(self.url).path + "/prefix_index", body)
        except TokenRefused as exc:
            raise HTTPException(401, str(exc)) from None
        self.index_polls += 1
        if self.index_status is not None:
            raise HTTPException(self.index_status, "prefix index unavailable")
        since = (await request.json())["since_version"]
        return {"worker_id": self.worker_id, "epoch": "epoch-1", "version": self.version, "block_size": BLOCK,
                "namespace": MODEL, "capacity_pages": 64, "blocks": None if since == self.version else self.held}


class KvCluster:
    """Two reporting fake decoders, one prefiller and a router on the shared host."""

    def __init__(self, host: ServerHost, mux: WorkerMux, mux_url: str, key_file: Path) -> None:
        self.host, self.mux, self.mux_url, self.key_file = host, mux, mux_url, key_file
        self.fabric = Fabric()
        self.directory = StaticWorkerDirectory()
        self.decoders = {wid: self._add(IndexedDecoder(wid, self.fabric)) for wid in ("d1", "d2")}
        self.prefiller = self._add(FakePrefillWorker("p1", self.fabric))
        self.client = httpx.Client(timeout=10, trust_env=False)
        self.url = ""
        self.app: Any = None

    def _add(self, worker: Any) -> Any:
        worker.url = self.mux_url + self.mux.add(worker.app)
        self.directory.put(worker.record())
        return worker

    def start_router(self, **overrides: Any) -> None:
        settings = RouterSettings(**{**SETTINGS, "cluster_key_file": self.key_file, **overrides})
        self.app = create_app(settings, self.directory)
        self.url = self.host.serve(self.app)

    @property
    def index(self) -> Any:
        return self.app.state.router.policy.kv_index

    def complete(self, prompt: str) -> httpx.Response:
        resp = self.client.post(self.url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                    "max_tokens": 5})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "hello"
        return resp

    def served_by(self, prompt: str) -> tuple[str, str]:
        """(decode worker id, serving mode) of one completion of ``prompt``."""
        before = {wid: len(d.calls) for wid, d in self.decoders.items()}
        resp = self.complete(prompt)
        used = [wid for wid, d in self.decoders.items()
                if any(p in ("/reserve", "/generate_local") for p, _ in d.calls[before[wid]:])]
        assert len(used) == 1, used
        return used[0], resp.headers["x-kvxfer-serving-mode"]

    def wait_reported(self, worker_id: str, prompt: str, held_tokens: int) -> None:
        """Until the router's index has ``worker_id`` holding ``held_tokens`` of ``prompt``."""
        view = next(w for w in self.directory.workers() if w.worker_id == worker_id)
        blocks = PromptBlocks(MODEL, tokens=tokens(prompt))
        wait_until(lambda: self.index.held_units(view, blocks) == held_tokens, timeout_s=5,
                   what=f"{worker_id} reported as holding {held_tokens} tokens")

    def close(self) -> None:
        self.client.close()
        if self.url:
            self.host.stop(self.url)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kv-routing") / "cluster.key"
    path.write_bytes(CLUSTER_KEY)
    return path


@pytest.fixture
def kv_cluster(host: tuple[ServerHost, WorkerMux, str], key_file: Path) -> Iterator[KvCluster]:
    c = KvCluster(*host, key_file)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["approximate", "both"])
def test_each_users_next_turn_goes_to_the_decoder_that_served_the_conversation(
        kv_cluster: KvCluster, mode: str) -> None:
    kv_cluster.start_router(kv_index_mode=mode)
    first = {user: system_prompt(user) + "user: hello\nassistant: " for user in (1, 2)}
    where = {user: kv_cluster.served_by(first[user])[0] for user in (1, 2)}
    assert where[1] != where[2]  # distinct prompts, equal estimates: the decoders take turns
    if mode == "both":
        # Precise reports say the same as the routing records did.
        for user in (1, 2):
            kv_cluster.decoders[where[user]].hold(first[user])
            kv_cluster.wait_reported(where[user], first[user], len(tokens(first[user])) // BLOCK * BLOCK)
    # Second turns in the order a turn-taking choice would send elsewhere.
    for user in (2, 1):
        second = first[user] + "hello there\nuser: tell me more about the topic, at length please\nassistant: "
        assert kv_cluster.served_by(second) == (where[user], "disaggregated")


def test_sequential_distinct_prompts_spread_across_decoders_under_least_loaded(kv_cluster: KvCluster) -> None:
    kv_cluster.start_router(policy="least_loaded")
    chosen = [kv_cluster.served_by(system_prompt(user))[0] for user in range(4)]
    assert chosen == ["d1", "d2", "d1", "d2"]


def test_a_decoder_holding_the_whole_prompt_serves_it_without_a_prefill_leg(kv_cluster: KvCluster) -> None:
    kv_cluster.start_router(kv_index_mode="precise")
    prompt = in_whole_blocks(system_prompt(7) + "user: hello\nassistant:")
    kv_cluster.decoders["d2"].hold(prompt)
    kv_cluster.wait_reported("d2", prompt, len(tokens(prompt)))
    assert kv_cluster.served_by(prompt) == ("d2", "prefix_cached")
    assert kv_cluster.decoders["d2"].paths()[-1] == "/generate_local"
    assert kv_cluster.prefiller.bodies("/prefill") == []


def test_a_holder_that_evicted_went_stale_or_died_does_not_break_the_request(kv_cluster: KvCluster) -> None:
    # d2 is busier by one request (load_cost_ms 100) but holds the prompt's first 9 blocks
    # (computing and moving them would cost more): held, it wins; otherwise the load decides.
    kv_cluster.directory.put(kv_cluster.decoders["d2"].record(running=1))
    kv_cluster.start_router(kv_index_mode="precise", prefix_index_max_age_s=1.5,
                            transfer_page_cost_ms=20.0)
    prompt = system_prompt(9) + "user: hello\nassistant: "
    held = len(tokens(prompt)) // BLOCK * BLOCK
    d2 = kv_cluster.decoders["d2"]
    d2.hold(prompt)
    kv_cluster.wait_reported("d2", prompt, held)
    assert kv_cluster.served_by(prompt)[0] == "d2"

    d2.held, d2.version = [], d2.version + 1  # evicted: its next report no longer lists it
    kv_cluster.wait_reported("d2", prompt, 0)
    assert kv_cluster.served_by(prompt)[0] == "d1"

    d2.hold(prompt)
    kv_cluster.wait_reported("d2", prompt, held)
    d2.index_status = 503  # reports stop: after prefix_index_max_age_s the last one is stale
    view = next(w for w in kv_cluster.directory.workers() if w.worker_id == "d2")
    wait_until(lambda: kv_cluster.index.held_units(view, PromptBlocks(MODEL, tokens=tokens(prompt))) is None,
               timeout_s=5, what="d2's report going stale")
    assert kv_cluster.served_by(prompt)[0] == "d1"

    d2.index_status = None
    kv_cluster.wait_reported("d2", prompt, held)
    kv_cluster.directory.remove("d2")  # its lease ended: the worker is gone
    wait_until(lambda: "d2" not in kv_cluster.index.sizes(), timeout_s=5, what="d2 leaving the index")
    assert kv_cluster.served_by(prompt)[0] == "d1"


def test_the_prefill_worker_that_holds_the_prefix_computes_it_and_load_still_counts() -> None:
    def view(worker_id: str, role: str, **kw: Any) -> WorkerView:
        return WorkerView(worker_id=worker_id, role=role, http_url=f"http://{worker_id}", model=MODEL,  # type: ignore[arg-type]
                          kv_layout=LAYOUT_A, total_pages=64, free_pages=64, **kw)

    directory = StaticWorkerDirectory([view("d1", "decode"), view("p1", "prefill"), view("p2", "prefill")])
    policy = make_policy("kv_aware", RouterSettings(**{**SETTINGS, "kv_index_mode": "approximate"}))
    shared = PromptBlocks(MODEL, tokens=tokens(system_prompt(3)))
    policy.kv_index.record_routed(directory.workers("prefill")[1], shared)
    longer = PromptBlocks(MODEL, tokens=tokens(system_prompt(3) + "user: and now something else entirely"))

    def chosen_prefill() -> str | None:
        pair = select_pair(directory, MODEL, needs_prefill=True, policy=policy, load=LocalLoad(), prompt=longer)
        assert pair is not None and pair.prefill is not None
        return pair.prefill.worker_id

    assert [chosen_prefill() for _ in range(3)] == ["p2"] * 3
    directory.put(view("p2", "prefill", queue_depth=5))  # 5 x 100 ms of queue outweigh 128 tokens x 1 ms held
    assert chosen_prefill() == "p1"


def test_relayed_chat_renders_prefix_stably_so_a_longer_conversation_shares_its_blocks() -> None:
    turn1 = {"model": MODEL, "messages": [{"role": "system", "content": "s" * 200},
                                          {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    turn2 = {**turn1, "messages": turn1["messages"] + [{"role": "assistant", "content": "hello"},
                                                       {"role": "user", "content": "more"}]}
    one, two = (PromptBlocks(MODEL, text=relayed_prompt_text(t, "chat")) for t in (turn1, turn2))
    assert two.hashes(64)[:len(one.hashes(64))] == one.hashes(64)
    other = PromptBlocks("another-model", text=relayed_prompt_text(turn1, "chat"))
    assert set(other.hashes(64)).isdisjoint(one.hashes(64))


def test_metrics_show_decisions_index_size_and_report_age(kv_cluster: KvCluster) -> None:
    kv_cluster.start_router(kv_index_mode="precise")
    prompt = in_whole_blocks(system_prompt(5) + "user: hello\nassistant:")
    kv_cluster.decoders["d1"].hold(prompt)
    kv_cluster.wait_reported("d1", prompt, len(tokens(prompt)))
    kv_cluster.served_by(prompt)
    kv_cluster.served_by(system_prompt(6) + "user: hello\nassistant: ")
    text = kv_cluster.client.get(kv_cluster.url + "/metrics").text
    blocks = len(tokens(prompt)) // BLOCK
    assert 'kvxfer_router_policy_decisions_total{outcome="decoder_only",policy="kv_aware"} 1.0' in text
    assert 'kvxfer_router_policy_decisions_total{outcome="pair",policy="kv_aware"} 1.0' in text
    assert f'kvxfer_router_estimated_prefix_hit_blocks_total{{side="decode"}} {float(blocks)}' in text
    assert f'kvxfer_router_kv_index_blocks{{worker_id="d1"}} {float(blocks)}' in text
    assert 'kvxfer_router_kv_index_report_age_seconds{worker_id="d2"}' in text
    assert "kvxfer_router_request_kv_moved_bytes_count 1.0" in text


class FakeVllmInstance:
    """The OpenAI surface of a vLLM instance running the connector, reduced to what the
    router's vLLM legs read: a non-streamed completion; it records each body."""

    def __init__(self, worker_id: str, role: str) -> None:
        self.worker_id, self.role, self.url = worker_id, role, ""
        self.bodies: list[dict[str, Any]] = []
        self.app = FastAPI()
        self.app.post("/v1/completions")(self._complete)

    async def _complete(self, request: Request) -> dict[str, Any]:
        self.bodies.append(await request.json())
        return {"id": "cmpl-vllm", "object": "text_completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}

    def record(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "role": self.role, "http_url": self.url, "model": MODEL,
                "kv_layout": "vllm-layout", "engine": "vllm", "engine_address": self.worker_id.encode().hex(),
                "total_pages": 64, "free_pages": 64}


def test_a_vllm_decoder_that_was_sent_the_prompt_gets_it_again_alone(
        host: tuple[ServerHost, WorkerMux, str]) -> None:
    server, mux, mux_url = host
    instances = [FakeVllmInstance("vd1", "decode"), FakeVllmInstance("vd2", "decode"),
                 FakeVllmInstance("vp1", "prefill")]
    directory = StaticWorkerDirectory()
    for instance in instances:
        instance.url = mux_url + mux.add(instance.app)
        directory.put(instance.record())
    url = server.serve(create_app(RouterSettings(**{**SETTINGS, "kv_index_mode": "approximate"}), directory))
    prompt = "a long shared document. " * 32  # 768 bytes: whole 64-byte text blocks
    try:
        with httpx.Client(timeout=10, trust_env=False) as client:
            modes = [client.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
                     .headers["x-kvxfer-serving-mode"] for _ in range(2)]
    finally:
        server.stop(url)
    decoder = next(i for i in instances[:2] if i.bodies)
    assert modes == ["disaggregated", "prefix_cached"]
    assert [("kv_transfer_params" in b) for b in decoder.bodies] == [True, False]
    assert len(instances[2].bodies) == 1  # no prefill leg the second time


# --- real builtin workers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_workers(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Iterator[list[WorkerProc]]:
    """Two decode workers and a prefill worker (real processes, prefix caches on, the
    cluster key: every control call, /prefix_index included, must be signed)."""
    workers = WorkerSet(tmp_path_factory.mktemp("kv-routing-workers"),
                        env={"KVXFER_CLUSTER_KEY_FILE": str(key_file), "KVXFER_PREFIX_CACHE": "true"})
    try:
        yield workers.start_many([("decode", {"num_pages": 128, "extra": ["--worker-id", "real-d1"]}),
                                  ("decode", {"num_pages": 128, "extra": ["--worker-id", "real-d2"]}),
                                  ("prefill", {"num_pages": 128, "extra": ["--worker-id", "real-p1"]})])
    except BaseException:
        print(workers.logs())
        raise
    finally:
        workers.close()


def test_real_workers_a_repeated_prompt_goes_back_to_its_decoder_and_answers_the_same(
        host: tuple[ServerHost, WorkerMux, str], key_file: Path, real_workers: list[WorkerProc]) -> None:
    server = host[0]
    auth = ControlTokenAuth(key_file)
    directory = StaticWorkerDirectory(httpx.get(f"{w.url}/info", auth=auth, timeout=5, trust_env=False).json()
                                      for w in real_workers)
    app = create_app(RouterSettings(**{**SETTINGS, "kv_index_mode": "precise", "cluster_key_file": key_file,
                                       "request_deadline_s": 60.0, "prefill_timeout_s": 30.0,
                                       "kv_wait_timeout_s": 30.0, "first_token_timeout_s": 40.0,
                                       "token_idle_timeout_s": 20.0}), directory)
    policy = app.state.router.policy
    decoders: list[str] = []
    served = policy.served
    policy.served = lambda pair, prompt: (decoders.append(pair.decode.worker_id), served(pair, prompt))
    url = server.serve(app)
    prompt = in_whole_blocks("user: summarise the shared document about kv caches, please.\nassistant:" * 2)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8}
    try:
        with httpx.Client(timeout=90, trust_env=False) as client:
            first = client.post(url + "/v1/completions", json=body)
            assert first.status_code == 200, first.text
            holder = decoders[0]
            view = next(w for w in directory.workers() if w.worker_id == holder)
            wait_until(lambda: policy.kv_index.held_units(view, PromptBlocks("tiny", tokens=tokens(prompt)))
                       == len(tokens(prompt)), timeout_s=10, what=f"{holder} reporting the whole prompt")
            second = client.post(url + "/v1/completions", json=body)
            assert second.status_code == 200, second.text
    finally:
        server.stop(url)
    assert (first.headers["x-kvxfer-serving-mode"], second.headers["x-kvxfer-serving-mode"]) == \
        ("disaggregated", "prefix_cached")
    assert decoders == [holder, holder]
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_a_vllm_cache_salt_separates_prompts_as_vllm_separates_them() -> None:
    # vLLM folds cache_salt into a prompt's first block hash: the same text under two salts
    # shares no cached block there, so the router's index must not count one as a hit.
    body = {"prompt": "the same long text " * 40}
    plain = PromptBlocks.for_request(MODEL, [], dict(body), "completions")
    salted = [PromptBlocks.for_request(MODEL, [], {**body, "cache_salt": salt}, "completions") for salt in "ab"]
    a, b, none = salted[0].hashes(64), salted[1].hashes(64), plain.hashes(64)
    assert len(a) == len(b) == len(none) > 1
    assert not set(a) & set(b) and not set(a) & set(none)
    assert PromptBlocks.for_request(MODEL, [], {**body, "cache_salt": "a"}, "completions").hashes(64) == a
