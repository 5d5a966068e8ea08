"""The requests the vLLM modules send to their own instances: seeded token prompts, a
disaggregated hand-off's two legs at once (as the router sends them), a colocated reference
answer, and the digests the test hooks wrote of a transfer's pages."""

from __future__ import annotations

import concurrent.futures
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
from support.vllm_instances import VllmFleet
from support.waiting import wait_until

#: How long a test waits for the hooks' digest file of a transfer, seconds.
DIGESTS_WAIT_S = 30.0


def prompt_ids(n: int, seed: int) -> list[int]:
    """A seeded prompt of exactly `n` token ids, all above the specials (0-2)."""
    return [3 + (seed * 7919 + i * 104729) % 1900 for i in range(n)]


def kvxfer_params(role: str, tid: str, peer: str) -> dict[str, Any]:
    """The `kv_transfer_params` of one leg of transfer `tid`, naming the other leg's engine."""
    return {"kvxfer": {"role": role, "transfer_id": tid, "peer_engine": peer}}


def disaggregated_legs(fleet: VllmFleet, prefill: str, decode: str, prompt: list[int], tid: str,
                       salt: str | None = None, logprobs: int | None = 5,
                       timeout_s: float = 120.0) -> tuple[httpx.Response, httpx.Response]:
    """Both legs of transfer `tid` at once, as the router sends them, from instance `prefill`
    into instance `decode`: (prefill reply, decode reply). Four greedy tokens, with `logprobs`
    top logprobs (None: none asked) and cache salt `salt` (None: none sent)."""
    p, d = fleet.record(prefill), fleet.record(decode)
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    if logprobs is not None:
        body["logprobs"] = logprobs
    if salt is not None:
        body["cache_salt"] = salt
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        on_d = pool.submit(httpx.post, fleet.instances[decode].url + "/v1/completions", headers=fleet.headers,
                           json={**body, "kv_transfer_params": kvxfer_params("decode", tid, p.engine_address)},
                           timeout=timeout_s)
        on_p = pool.submit(httpx.post, fleet.instances[prefill].url + "/v1/completions", headers=fleet.headers,
                           json={**body, "max_tokens": 1,
                                 "kv_transfer_params": kvxfer_params("prefill", tid, d.engine_address)},
                           timeout=timeout_s)
        return on_p.result(), on_d.result()


def colocated_choice(fleet: VllmFleet, name: str, prompt: list[int], salted: bool = True,
                     timeout_s: float = 120.0) -> dict[str, Any]:
    """Instance `name`'s own answer to `prompt` (four greedy tokens, top-5 logprobs), the
    oracle's reference; `salted`: under a fresh cache salt, so no cached page of a hand-off
    serves it."""
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 5}
    if salted:
        body["cache_salt"] = f"ref-{uuid.uuid4().hex}"
    r = httpx.post(fleet.instances[name].url + "/v1/completions", headers=fleet.headers, json=body,
                   timeout=timeout_s)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def page_digests(digest_dir: Path, role: str, tid: str) -> list[list[Any]]:
    """The [layer, page, digest] rows the hooks wrote for transfer `tid` on side `role`
    ("prefill" or "decode"), once the file is there."""
    path = digest_dir / f"{role}-{tid}.json"
    wait_until(path.exists, timeout_s=DIGESTS_WAIT_S, interval_s=0.1, what=f"{role} digests of {tid}")
    return list(json.loads(path.read_text())["pages"])


def rank_head_digests(digest_dir: Path, role: str, tid: str, ranks: int, timeout_s: float) -> list[dict[str, str]]:
    """Each of `ranks` ranks' {"layer/page/global head": digest} of transfer `tid` on side
    `role`, as the tensor parallel hooks wrote them, once every file is there (`timeout_s`)."""
    files = [digest_dir / f"{role}-{tid}-r{r}.json" for r in range(ranks)]
    wait_until(lambda: all(f.exists() for f in files), timeout_s=timeout_s, interval_s=0.1,
               what=f"{role} digests of {tid}")
    return [json.loads(f.read_text())["heads"] for f in files]
