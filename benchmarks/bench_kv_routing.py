"""Does routing to the KV pay? The router's pair policies (kv_aware, least_loaded,
round_robin) on three workloads, on the builtin engine and on vLLM, 2 decoders and 1-2
prefillers: TTFT p50 and p99 at the client, KV bytes moved, prompt tokens computed and
goodput (requests per second whose TTFT met a stated bound). Table printed, JSON and PNG
written under benchmarks/results/ (kv_routing_ENGINE.json, .png). The goals (issue 29): on
multi-turn chat kv_aware at least 2x lower p50 TTFT and at least 5x fewer KV bytes than
least_loaded; on the no-reuse workload within 5% of least_loaded's p50 TTFT.

Workloads, in this order for every policy:
  chat      users in conversations on one shared system prompt: each turn re-sends the whole
            conversation plus a new user message, and the answer is appended to it;
  document  users asking about one long document: the document plus a question each;
  random    prompts of random length and content: no reuse at all.
Users run at once up to --users-in-flight; one user's turns run one after another.

Each policy starts cold. Builtin engine: a fresh cluster per policy (etcd, router and
workers restarted, so every prefix cache starts empty). vLLM: the instances start once;
per policy the router is restarted and every instance's prefix cache is emptied with vLLM's
POST /reset_prefix_cache (the benchmark's instances run with VLLM_SERVER_DEV_MODE=1 for it).

Sizes: the builtin "tiny" model has a 1,024-token context and a byte tokenizer, so its
conversations are scaled down (a 512-token system prompt; the last turn is about 900
tokens); the seeded vLLM Llama has 4,096 positions and takes the issue's 1.5K-token
system prompt. KV bytes: the prefill workers' kvxfer_prefill_kv_pushed_bytes_total
(builtin) and the connector's kvxfer_connector_pushed_bytes_total (vLLM). Prompt tokens
computed: vLLM's vllm:prompt_tokens_by_source_total{source="local_compute"} over every
instance; builtin: the prefill workers' looked-up prompt tokens less their prefix-cache hits (a
lower bound: what a decoder computes itself for a request without a prefill leg is not counted).

    .venv/bin/python benchmarks/bench_kv_routing.py --engine builtin          # about 10 min
    .venv/bin/python benchmarks/bench_kv_routing.py --engine vllm --quick     # about 2 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import pyplot, save_figure  # noqa: E402

POLICIES = ("kv_aware", "least_loaded", "round_robin")
WORKLOADS = ("chat", "document", "random")
#: A whole request, admission to last token; one that takes longer is a failed request.
REQUEST_TIMEOUT_S = 300.0
METRICS_TIMEOUT_S = 10.0
#: Words prompts are made of on the builtin engine (one token per byte).
_WORDS = ("the cache holds pages of keys and values for every layer so a prompt that starts like an "
          "earlier one needs only its new tokens computed and moved across the wire to decode").split()

@dataclass(frozen=True)
class Sizes:
    """Token counts of one engine's workloads."""

    system_tokens: int
    user_tokens: int
    answer_tokens: int
    document_tokens: int
    question_tokens: int
    random_min_tokens: int
    random_max_tokens: int


@dataclass(frozen=True)
class Shape:
    """How many requests each workload sends."""

    chat_users: int
    chat_turns: int
    document_users: int
    document_questions: int
    random_requests: int


FULL_SHAPE = Shape(chat_users=16, chat_turns=8, document_users=16, document_questions=2, random_requests=32)
QUICK_SHAPE = Shape(chat_users=4, chat_turns=4, document_users=4, document_questions=2, random_requests=8)


@dataclass
class Session:
    """One user's requests: `turns` messages after a common `prefix`. With `keeps_history`
    each turn's prompt is the conversation so far (answers included) plus the message;
    without, the prefix plus the message alone."""

    prefix: str
    turns: list[str]
    keeps_history: bool


@dataclass
class Outcome:
    """What the client saw of one request."""

    ok: bool
    ttft_s: float = float("nan")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    serving_mode: str = ""
    error: str = ""


@dataclass
class Counters:
    """Cluster-wide totals read from the workers' and the router's metrics."""

    kv_bytes: float = 0.0
    #: Prompt tokens computed on every worker, where the engine counts them (vLLM); None:
    #: derived from the hits instead (builtin, see summarize).
    computed_tokens: float | None = None
    #: Prompt tokens found in a prefix cache: on the prefill side, and on the decode side.
    prefill_hit_tokens: float = 0.0
    decode_hit_tokens: float = 0.0
    #: Prompt tokens the prefill workers looked up in their caches: every prompt they computed.
    prefill_lookup_tokens: float = 0.0
    #: Every reuse-related sample (prefix hits, pages not sent, policy decisions), by name.
    reuse_samples: dict[str, float] = field(default_factory=dict)


def scrape(url: str) -> dict[str, float]:
    """Samples of one /metrics page summed by name and label set ("name{k=v,...}")."""
    out: dict[str, float] = {}
    text = httpx.get(url, timeout=METRICS_TIMEOUT_S).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = [f"{k}={v}" for k, v in labels.items()]
    return sum(v for k, v in samples.items()
               if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


def reuse_samples(samples: dict[str, float]) -> dict[str, float]:
    """The counters that say how much was reused (prefix hits, pages not sent, cached tokens)."""
    words = ("prefix", "skipped", "cached", "not_sent", "pages_moved", "policy_decisions", "by_source")
    return {k: v for k, v in samples.items()
            if any(w in k.split("{")[0] for w in words) and not k.split("{")[0].endswith(("_bucket", "_created"))}


class Engine(Protocol):
    """What the benchmark needs of one engine's cluster."""

    name: str
    sizes: Sizes
    ttft_bound_ms: float
    rounds: int

    def segment(self, rng: random.Random, n: int) -> str: ...
    def prompt_tokens(self, prompt: str) -> int: ...
    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]: ...
    def policy_run(self, policy: str) -> contextlib.AbstractContextManager[str]: ...
    def counters(self) -> Counters: ...


def words_of(rng: random.Random, n: int) -> str:
    """Text of exactly `n` bytes made of words (the builtin tokenizer's n tokens)."""
    out = ""
    while len(out) < n:
        out += rng.choice(_WORDS) + " "
    return out[:n]


class BuiltinEngine:
    """kvxfer's own workers ("tiny" model, byte tokenizer) in a LocalCluster per policy."""

    name = "builtin"
    sizes = Sizes(system_tokens=512, user_tokens=32, answer_tokens=16, document_tokens=768, question_tokens=48,
                  random_min_tokens=200, random_max_tokens=800)
    ttft_bound_ms = 100.0
    rounds = 3

    def __init__(self, prefill: int, work: Path, provider: str, num_pages: int, router_env: dict[str, str]) -> None:
        self.prefill = prefill
        self.work = work
        self.router_env = router_env
        self.provider = provider
        self.num_pages = num_pages
        self.cluster: Any = None

    def segment(self, rng: random.Random, n: int) -> str:
        return words_of(rng, n)

    def prompt_tokens(self, prompt: str) -> int:
        return len(prompt.encode()) + 1  # and BOS

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True}

    @contextlib.contextmanager
    def policy_run(self, policy: str) -> Iterator[str]:
        from kvxfer.cluster.local_cluster import LocalCluster

        log_dir = self.work / f"builtin-{policy}"
        with LocalCluster(prefill=self.prefill, decode=2, provider=self.provider, num_pages=self.num_pages,
                          log_dir=str(log_dir),
                          router_env={**self.router_env, "KVXFER_ROUTER_POLICY": policy}) as cluster:
            self.cluster = cluster
            try:
                yield cluster.router_url
            finally:
                self.cluster = None

    def counters(self) -> Counters:
        listed = httpx.get(f"{self.cluster.admin_url}/workers", timeout=METRICS_TIMEOUT_S).json().get("workers", [])
        merged: dict[str, float] = {}
        for url in [w["http_url"] for w in listed] + [self.cluster.router_url]:
            for k, v in scrape(url + "/metrics").items():
                merged[k] = merged.get(k, 0.0) + v
        return Counters(kv_bytes=total(merged, "kvxfer_prefill_kv_pushed_bytes_total"),
                        prefill_lookup_tokens=total(merged, "kvxfer_prefill_prefix_lookup_tokens_total"),
                        prefill_hit_tokens=total(merged, "kvxfer_prefill_prefix_hit_tokens_total"),
                        decode_hit_tokens=total(merged, "kvxfer_decode_prefix_hit_tokens_total"),
                        reuse_samples=reuse_samples(merged))


class VllmEngine:
    """vLLM instances (the seeded Llama) with the kvxfer connector, started once; the router
    restarted and every prefix cache emptied per policy."""

    name = "vllm"
    sizes = Sizes(system_tokens=1536, user_tokens=48, answer_tokens=16, document_tokens=3000, question_tokens=64,
                  random_min_tokens=500, random_max_tokens=2000)
    ttft_bound_ms = 500.0
    rounds = 1
    served_model = "bench"

    def __init__(self, prefill: int, work: Path, router_env: dict[str, str]) -> None:
        self.prefill = prefill
        self.work = work
        self.router_env = router_env
        self.tokenizer: Any = None
        self.word_tokens: dict[str, int] = {}
        self.stack = contextlib.ExitStack()
        self.fleet: Any = None
        self.metrics_ports: dict[str, int] = {}
        self.router_url = ""

    def __enter__(self) -> "VllmEngine":
        from kvxfer.integrations.vllm.checkpoint import make_checkpoint
        from support.vllm_instances import VllmFleet, free_port

        # POST /reset_prefix_cache, to start each policy cold, is served in dev mode only.
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"
        from tokenizers import Tokenizer

        model = make_checkpoint(self.work / "model")
        self.tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.word_tokens = {" " + w: len(self.tokenizer.encode(" " + w).ids) for w in _WORDS}
        self.fleet = self.stack.enter_context(VllmFleet(
            model, self.work, served_model_name=self.served_model,
            common_extra={"same_host": False, "bind_host": "127.0.0.1"}))
        names = [f"prefill-{i}" for i in range(self.prefill)] + ["decode-0", "decode-1"]
        for i, name in enumerate(names):
            self.metrics_ports[name] = free_port()
            self.fleet.start(name, "kv_producer" if name.startswith("prefill") else "kv_consumer", str(i % 2),
                             extra={"metrics_port": self.metrics_ports[name]})
        self.fleet.wait_ready(*names)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def segment(self, rng: random.Random, n: int) -> str:
        # Words with a leading space: the byte-level BPE splits at spaces, so a segment's
        # tokens are its words' tokens and a prompt's tokens are its segments'.
        out, tokens = "", 0
        while tokens < n:
            word = " " + rng.choice(_WORDS)
            out += word
            tokens += self.word_tokens[word]
        return out

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenizer.encode(prompt).ids)

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        # Text, not token ids: the router's approximate KV index hashes a vLLM prompt's text.
        return {"model": self.served_model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}

    @contextlib.contextmanager
    def policy_run(self, policy: str) -> Iterator[str]:
        from support.vllm_instances import router_process

        for name, inst in self.fleet.instances.items():
            r = httpx.post(inst.url + "/reset_prefix_cache", headers=self.fleet.headers, timeout=60)
            if r.status_code != 200:
                raise RuntimeError(f"{name}: POST /reset_prefix_cache answered {r.status_code}: {r.text[:200]}")
        env = {"KVXFER_ROUTER_MAX_PROMPT_TOKENS": "4096", **self.router_env, "KVXFER_ROUTER_POLICY": policy}
        with router_process(self.fleet, self.work / f"router-{policy}.log", env=env) as url:
            self.router_url = url
            yield url

    def counters(self) -> Counters:
        merged: dict[str, float] = {}
        for name, inst in self.fleet.instances.items():
            for url in (inst.url + "/metrics", f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"):
                for k, v in scrape(url).items():
                    # vLLM's token counts by source, kept apart per side ("decode:" prefix).
                    key = "decode:" + k if name.startswith("decode") and "by_source" in k else k
                    merged[key] = merged.get(key, 0.0) + v
        for k, v in scrape(self.router_url + "/metrics").items():
            merged[k] = merged.get(k, 0.0) + v
        source = "vllm:prompt_tokens_by_source_total"
        return Counters(
            kv_bytes=total(merged, "kvxfer_connector_pushed_bytes_total"),
            computed_tokens=total(merged, source, source="local_compute") + total(
                merged, "decode:" + source, source="local_compute"),
            prefill_hit_tokens=total(merged, source, source="local_cache_hit"),
            decode_hit_tokens=total(merged, "decode:" + source, source="local_cache_hit"),
            reuse_samples=reuse_samples(merged))


def sessions_of(engine: Engine, workload: str, shape: Shape, seed: int) -> list[Session]:
    """The requests of one workload, the same for every policy (seeded)."""
    rng = random.Random(f"{seed}-{workload}")
    s = engine.sizes
    if workload == "chat":
        system = engine.segment(rng, s.system_tokens)
        return [Session(system, [engine.segment(rng, s.user_tokens) for _ in range(shape.chat_turns)], True)
                for _ in range(shape.chat_users)]
    if workload == "document":
        doc = engine.segment(rng, s.document_tokens)
        return [Session(doc, [engine.segment(rng, s.question_tokens) for _ in range(shape.document_questions)], False)
                for _ in range(shape.document_users)]
    return [Session("", [engine.segment(rng, rng.randint(s.random_min_tokens, s.random_max_tokens))], False)
            for _ in range(shape.random_requests)]


async def one_request(client: httpx.AsyncClient, url: str, engine: Engine, prompt: str,
                      max_tokens: int) -> tuple[Outcome, str]:
    """Streams one completion; returns what the client saw and the answer's text."""
    answer = ""
    outcome = Outcome(ok=False, prompt_tokens=engine.prompt_tokens(prompt))
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=engine.body(prompt, max_tokens)) as resp:
            outcome.serving_mode = resp.headers.get("x-kvxfer-serving-mode", "")
            if resp.status_code != 200:
                outcome.error = f"{resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return outcome, answer
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:]).get("choices") or ():
                    answer += choice.get("text") or ""
                    if choice.get("text") is None or choice.get("finish_reason") is not None:
                        continue  # one event per token; the finish event carries no token of its own
                    if outcome.completion_tokens == 0:
                        outcome.ttft_s = time.perf_counter() - start
                    outcome.completion_tokens += 1
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome, answer
    outcome.ok = outcome.completion_tokens > 0
    if not outcome.ok:
        outcome.error = "no token streamed"
    return outcome, answer


async def run_sessions(url: str, engine: Engine, sessions: list[Session], users_in_flight: int,
                       bar: tqdm) -> list[Outcome]:
    """Every session's turns in order; up to `users_in_flight` sessions at once."""
    gate = asyncio.Semaphore(users_in_flight)
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
        async def user(session: Session) -> None:
            async with gate:
                history = session.prefix
                for message in session.turns:
                    prompt = history + message
                    outcome, answer = await one_request(client, url, engine, prompt, engine.sizes.answer_tokens)
                    outcomes.append(outcome)
                    bar.update(1)
                    if session.keeps_history:
                        history = prompt + answer
        await asyncio.gather(*(user(s) for s in sessions))
    return outcomes


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(policy: str, workload: str, outcomes: list[Outcome], wall_s: float, before: Counters,
              after: Counters, bound_ms: float) -> dict[str, Any]:
    """One round of a policy on a workload."""
    ttft_ms = [o.ttft_s * 1e3 for o in outcomes if o.ok]
    prefill_hits = after.prefill_hit_tokens - before.prefill_hit_tokens
    if after.computed_tokens is not None and before.computed_tokens is not None:
        computed = after.computed_tokens - before.computed_tokens
    else:
        # Builtin workers count lookups and hits, not computed tokens: a prefill worker
        # computes what it looked up less its hits. A request served from the decoder's cache
        # alone (prefix_cached) computes only the few tokens the decoder lacked, which no
        # metric tells apart from its hits on disaggregated requests: not counted (a lower bound).
        computed = after.prefill_lookup_tokens - before.prefill_lookup_tokens - prefill_hits
    modes: dict[str, int] = {}
    for o in outcomes:
        modes[o.serving_mode or "none"] = modes.get(o.serving_mode or "none", 0) + 1
    return {
        "policy": policy, "workload": workload, "requests": len(outcomes), "ok": len(ttft_ms), "ttft_ms": ttft_ms,
        "kv_bytes": after.kv_bytes - before.kv_bytes, "prompt_tokens_sent": sum(o.prompt_tokens for o in outcomes),
        "prompt_tokens_computed": computed, "prefill_hit_tokens": prefill_hits,
        "decode_hit_tokens": after.decode_hit_tokens - before.decode_hit_tokens,
        "within_bound": sum(1 for t in ttft_ms if t <= bound_ms), "wall_s": wall_s, "serving_modes": modes,
        "reuse_samples": {k: after.reuse_samples.get(k, 0.0) - before.reuse_samples.get(k, 0.0)
                          for k in after.reuse_samples},
        "errors": [o.error for o in outcomes if not o.ok][:5],
    }


def combine(rounds: list[dict[str, Any]], bound_ms: float) -> dict[str, Any]:
    """A table row from every round of one policy on one workload: TTFT percentiles over
    all requests, counts per round (mean), goodput over the rounds' summed wall time."""
    n = len(rounds)
    ttft = [t for r in rounds for t in r["ttft_ms"]]
    modes: dict[str, int] = {}
    for r in rounds:
        for m, c in r["serving_modes"].items():
            modes[m] = modes.get(m, 0) + c
    wall = sum(r["wall_s"] for r in rounds)
    return {
        "policy": rounds[0]["policy"], "workload": rounds[0]["workload"], "rounds": n,
        "requests": sum(r["requests"] for r in rounds), "ok": sum(r["ok"] for r in rounds),
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
        **{k: sum(r[k] for r in rounds) / n for k in ("kv_bytes", "prompt_tokens_sent", "prompt_tokens_computed",
                                                      "prefill_hit_tokens", "decode_hit_tokens")},
        "goodput_rps": sum(r["within_bound"] for r in rounds) / wall if wall > 0 else 0.0,
        "ttft_bound_ms": bound_ms, "wall_s": wall, "serving_modes": modes,
        "errors": [e for r in rounds for e in r["errors"]][:5],
    }


def run_engine(engine: Engine, policies: list[str], workloads: list[str], shape: Shape, users_in_flight: int,
               seed: int, bound_ms: float, rounds: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every policy on every workload, each policy from cold caches, `rounds` times with the
    policies' order rotated each round (so slow spells of a shared machine spread over all
    of them). Returns the table's rows and every round's."""
    per_round: list[dict[str, Any]] = []
    for k in range(rounds):
        for policy in policies[k % len(policies):] + policies[:k % len(policies)]:
            with engine.policy_run(policy) as url:
                for workload in workloads:
                    sessions = sessions_of(engine, workload, shape, seed)
                    n = sum(len(s.turns) for s in sessions)
                    before = engine.counters()
                    with tqdm(total=n, desc=f"{engine.name} round {k + 1} {policy:>12} {workload:>8}", unit="req",
                              leave=False) as bar:
                        t0 = time.perf_counter()
                        outcomes = asyncio.run(run_sessions(url, engine, sessions, users_in_flight, bar))
                        wall = time.perf_counter() - t0
                    r = summarize(policy, workload, outcomes, wall, before, engine.counters(), bound_ms)
                    per_round.append({**r, "round": k + 1})
                    print(f"  {engine.name} round {k + 1} {policy} {workload}: {r['ok']}/{r['requests']} ok, TTFT p50 "
                          f"{percentile(r['ttft_ms'], 0.5):.1f} ms, KV {r['kv_bytes'] / 1e6:.2f} MB", flush=True)
    rows = [combine([r for r in per_round if r["policy"] == p and r["workload"] == w], bound_ms)
            for w in workloads for p in policies]
    return rows, per_round


def goal_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's goals, each met or not, from the table."""
    def row(policy: str, workload: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["policy"] == policy and r["workload"] == workload), None)

    out = []
    kv, ll = row("kv_aware", "chat"), row("least_loaded", "chat")
    if kv and ll:
        speedup = ll["ttft_p50_ms"] / kv["ttft_p50_ms"] if kv["ttft_p50_ms"] > 0 else float("nan")
        fewer = ll["kv_bytes"] / kv["kv_bytes"] if kv["kv_bytes"] > 0 else float("inf")
        out.append(f"chat: p50 TTFT {speedup:.2f}x lower than least_loaded (goal >= 2x): "
                   f"{'met' if speedup >= 2 else 'NOT met'}")
        out.append(f"chat: {fewer:.1f}x fewer KV bytes than least_loaded (goal >= 5x): "
                   f"{'met' if fewer >= 5 else 'NOT met'}")
    kv, ll = row("kv_aware", "random"), row("least_loaded", "random")
    if kv and ll:
        ratio = kv["ttft_p50_ms"] / ll["ttft_p50_ms"] - 1
        out.append(f"random: p50 TTFT {ratio:+.1%} against least_loaded (goal at most +5%): "
                   f"{'met' if ratio <= 0.05 else 'NOT met'}")
    return out


def print_table(engine: str, rows: list[dict[str, Any]]) -> None:
    """The table as Markdown (benchmarks/README.md takes it as printed): one line per
    workload and policy; KV bytes and prompt tokens per round, requests over all rounds."""
    bound = rows[0]["ttft_bound_ms"] if rows else 0
    print(f"\n{engine}:\n")
    print(f"| workload | policy | TTFT p50 ms | TTFT p99 ms | KV moved MB | prompt tokens computed (sent) "
          f"| no prefill leg | goodput req/s (TTFT <= {bound:g} ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        failed = f", {r['requests'] - r['ok']} failed" if r["ok"] < r["requests"] else ""
        print(f"| {r['workload']} | {r['policy']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} "
              f"| {r['kv_bytes'] / 1e6:.2f} | {r['prompt_tokens_computed']:,.0f} ({r['prompt_tokens_sent']:,.0f}) "
              f"| {r['serving_modes'].get('prefix_cached', 0)} of {r['requests']}{failed} | {r['goodput_rps']:.2f} |")


def plot(engine: str, rows: list[dict[str, Any]], policies: list[str], workloads: list[str], path: Path) -> None:
    """Grouped bars per workload: TTFT p50, KV MB, prompt tokens computed, goodput."""
    plt = pyplot()
    panels = (("ttft_p50_ms", "TTFT p50 (ms)", 1.0), ("kv_bytes", "KV moved (MB)", 1e-6),
              ("prompt_tokens_computed", "prompt tokens computed", 1.0), ("goodput_rps", "goodput (req/s)", 1.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    width = 0.8 / max(1, len(policies))
    for ax, (key, label, scale) in zip(axes, panels):
        for i, policy in enumerate(policies):
            ys = [next((r[key] * scale for r in rows if r["policy"] == policy and r["workload"] == w), 0.0)
                  for w in workloads]
            ax.bar([x + (i - (len(policies) - 1) / 2) * width for x in range(len(workloads))], ys, width,
                   label=policy)
        ax.set_xticks(list(range(len(workloads))), workloads)
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    bound = rows[0]["ttft_bound_ms"] if rows else 0
    fig.suptitle(f"kvxfer router policies, {engine} engine (goodput: TTFT <= {bound:g} ms)", fontsize=11)
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("builtin", "vllm", "both"), default="both",
                        help="which engine's cluster to measure (default both, one after the other)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run of about 2 minutes per engine: {asdict(QUICK_SHAPE)} instead of "
                             f"{asdict(FULL_SHAPE)}, one round")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="router policies to compare, comma-separated (default all three)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="workloads to run, comma-separated, from chat, document, random (default all)")
    parser.add_argument("--prefill", type=int, default=1, choices=(1, 2), help="prefill workers (default 1)")
    parser.add_argument("--users-in-flight", type=int, default=4,
                        help="users whose requests run at once; one user's turns run in order (default 4)")
    parser.add_argument("--ttft-bound-ms", type=float, default=None,
                        help="goodput counts requests whose TTFT is at most this (default: builtin "
                             f"{BuiltinEngine.ttft_bound_ms:g} ms, vLLM {VllmEngine.ttft_bound_ms:g} ms)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="times every policy runs every workload, cold each time, the policies' order rotated "
                             f"per round (default: builtin {BuiltinEngine.rounds}, vLLM {VllmEngine.rounds}; "
                             "--quick 1)")
    parser.add_argument("--num-pages", type=int, default=4096,
                        help="KV pages per builtin worker (default 4096: every conversation fits, no eviction)")
    parser.add_argument("--provider", default="auto", help="libfabric provider of the builtin workers (default auto)")
    parser.add_argument("--router-env", action="append", default=[], metavar="KVXFER_ROUTER_NAME=VALUE",
                        help="a router setting for every policy's router, e.g. KVXFER_ROUTER_LOAD_COST_MS=5 to try "
                             "kv_aware's weights (repeatable; default: the router's own settings)")
    parser.add_argument("--seed", type=int, default=1, help="seed of every prompt (default 1)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the processes' logs (and the vLLM checkpoint) go, kept after the run "
                             "(default: a temporary folder, removed at the end)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results",
                        help="where kv_routing_ENGINE.json and .png go (default benchmarks/results)")
    args = parser.parse_args(argv)
    for name, allowed in (("policies", POLICIES), ("workloads", WORKLOADS)):
        chosen = [x for x in getattr(args, name).split(",") if x]
        if not chosen or any(x not in allowed for x in chosen):
            parser.error(f"--{name} takes a comma-separated subset of {','.join(allowed)}, got {getattr(args, name)!r}")
        setattr(args, name, chosen)
    bad = [e for e in args.router_env if "=" not in e or not e.startswith("KVXFER_ROUTER_")]
    if bad:
        parser.error(f"--router-env takes KVXFER_ROUTER_NAME=VALUE, got {bad[0]!r}")
    args.router_env = dict(e.split("=", 1) for e in args.router_env)
    if args.users_in_flight < 1 or (args.rounds is not None and args.rounds < 1):
        parser.error("--users-in-flight and --rounds must be at least 1")
    return args


def uptime() -> str:
    """The load on this shared machine, for the JSON."""
    return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()


def measure(engine: Engine, args: argparse.Namespace, shape: Shape) -> None:
    """One engine: run, print, write JSON and PNG."""
    bound = args.ttft_bound_ms if args.ttft_bound_ms is not None else engine.ttft_bound_ms
    load_before = uptime()
    t0 = time.perf_counter()
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else engine.rounds
    rows, per_round = run_engine(engine, args.policies, args.workloads, shape, args.users_in_flight, args.seed,
                                 bound, rounds)
    elapsed = time.perf_counter() - t0
    print_table(engine.name, rows)
    verdicts = goal_verdicts(rows)
    for line in verdicts:
        print("  " + line)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"kv_routing_{engine.name}"
    stem.with_suffix(".json").write_text(json.dumps({
        "engine": engine.name, "quick": args.quick, "shape": asdict(shape), "sizes": asdict(engine.sizes),
        "prefill_workers": args.prefill, "decode_workers": 2, "users_in_flight": args.users_in_flight,
        "ttft_bound_ms": bound, "seed": args.seed, "router_env": args.router_env, "uptime_before": load_before,
        "uptime_after": uptime(),
        "elapsed_s": elapsed, "rounds": rounds, "verdicts": verdicts, "rows": rows, "per_round": per_round},
        indent=1))
    plot(engine.name, rows, args.policies, args.workloads, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.json')} and .png ({elapsed:.0f} s)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvxfer-kv-routing-")))
        print(f"logs in {work}", flush=True)
        if args.engine in ("builtin", "both"):
            measure(BuiltinEngine(args.prefill, work / "builtin", args.provider, args.num_pages, args.router_env),
                    args, shape)
        if args.engine in ("vllm", "both"):
            with VllmEngine(args.prefill, work / "vllm", args.router_env) as engine:
                measure(engine, args, shape)


if __name__ == "__main__":
    main()
