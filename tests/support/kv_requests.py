"""Driving real prefill and decode worker processes the way the router does, and the
colocated reference to compare with: prompts, reservations, /prefill and /generate calls,
page accounting. Shared by tests/workers/ (the KV path and the hand-off's failure paths).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import httpx
import pytest
import torch

from kvxfer.model.config import ModelConfig
from kvxfer.model.tokenizer import ByteTokenizer
from kvxfer.model.transformer import Generation, Transformer
from support.waiting import wait_until
from support.worker_procs import WorkerProc

CONFIG = ModelConfig.preset("tiny")
TOKENIZER = ByteTokenizer()
MAX_TOKENS = 16
NUM_PAGES = 512
FENCE_S = 3.0
#: Decoders of the KV-path tests put the landed prompt KV's digest in their receipt: the
#: oracle compares it with the colocated reference's (bytes, not just tokens).
DIGEST_ENV = {"KVXFER_KV_RECEIPT_DIGEST": "true"}
RECEIPT_HEADER = "X-Kvxfer-Transfer-Receipt"
PREFILL_ENV = {"KVXFER_TRANSFER_TIMEOUT_S": "2"}
CHUNK = 256  # PrefillSettings.prefill_chunk_tokens default: what the workers use
LONG = 1000  # tokens; 1000 + MAX_TOKENS fits the tiny model's 1024 context
# 16-token chunks spread a long prompt's writes over 63 chunks x 2 layers, and 5 ms of
# emulated compute per layer and chunk makes that push last over half a second whatever
# the machine's speed, so an event timed after its first writes falls in its middle.
SLOW_PUSH_ENV = {"KVXFER_PREFILL_CHUNK_TOKENS": "16", "KVXFER_EMULATED_LAYER_COMPUTE_MS": "5", **PREFILL_ENV}

pytestmark = pytest.mark.timeout(240)


# -- prompts and the colocated reference ---------------------------------------------------

def text_prompt(seed: int, num_tokens: int) -> str:
    """Seeded printable text whose encoding (BOS + one token per byte) has `num_tokens` tokens."""
    rng = random.Random(seed)
    words = ["kv", "cache", "page", "prefill", "decode", "layer", "push", "the", "a", "é", "€", "token"]
    text = ""
    while len(text.encode()) < num_tokens - 1:
        text += rng.choice(words) + rng.choice([" ", " ", ", ", ".\n"])
    return _exact(text.encode()[: num_tokens - 1], num_tokens - 1)


def _exact(raw: bytes, n: int) -> str:
    # Cut on a character boundary, then pad with ASCII to exactly n bytes.
    text = raw.decode("utf-8", errors="ignore")
    while len(text.encode()) > n:
        text = text[:-1]
    return text + "x" * (n - len(text.encode()))


def tokens_of(prompt: str) -> list[int]:
    return TOKENIZER.encode(prompt)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Model compute in this process on one thread, like the workers (OMP_NUM_THREADS=1).

    On two cores shared with the workers, torch's default pool spin-waits: measured 20x
    slower under load for the same (bit-identical) result."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@cache
def reference_model() -> Transformer:
    return Transformer(CONFIG)


@cache
def _reference(prompt_tokens: tuple[int, ...], max_tokens: int) -> Generation:
    with one_torch_thread():
        return reference_model().generate(list(prompt_tokens), max_tokens)


def reference(prompt_tokens: list[int], max_tokens: int = MAX_TOKENS) -> Generation:
    """The colocated generation: one process, pages in order, the workers' chunk size."""
    return _reference(tuple(prompt_tokens), max_tokens)


@cache
def _reference_digest(prompt_tokens: tuple[int, ...]) -> int:
    from kvxfer.kv.cache import PagedKVCache
    from kvxfer.kv.integrity import prompt_kv_digest

    pages = list(range(-(-len(prompt_tokens) // CONFIG.block_size)))
    with one_torch_thread():
        cache = PagedKVCache.from_config(CONFIG, max(1, len(pages)))
        reference_model().prefill(list(prompt_tokens), cache, pages, chunk_size=CHUNK)
    return prompt_kv_digest(cache, pages, len(prompt_tokens))


def reference_digest(prompt_tokens: list[int]) -> int:
    """`kv.integrity.prompt_kv_digest` of the colocated prefill's KV (pages in order)."""
    return _reference_digest(tuple(prompt_tokens))


def parse_receipt(header: str | None) -> dict[str, str] | None:
    """The decoder's receipt header as a dict (None when absent)."""
    if not header:
        return None
    return dict(part.split("=", 1) for part in header.split(";"))


# -- workers ----------------------------------------------------------------------------------


def info(worker: WorkerProc) -> dict[str, Any]:
    resp = httpx.get(f"{worker.url}/info", timeout=5)
    assert resp.status_code == 200, resp.text
    return resp.json()


def wait_pages_full(worker: WorkerProc, timeout_s: float) -> dict[str, Any]:
    """Polls /info until every page is free and nothing runs or waits."""

    def check() -> dict[str, Any] | None:
        data = info(worker)
        idle = data["free_pages"] == data["total_pages"] and data["running"] == 0 and data["queue_depth"] == 0
        return data if idle else None

    return wait_until(check, timeout_s, f"{worker.role} {worker.url} free_pages back to total_pages")


# -- the router's flow --------------------------------------------------------------------------

async def reserve(client: httpx.AsyncClient, decode: WorkerProc, rid: str, prompt: list[int],
                  max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    resp = await client.post(f"{decode.url}/reserve",
                             json={"request_id": rid, "prompt_tokens": prompt, "max_tokens": max_tokens})
    assert resp.status_code == 200, f"{rid}: reserve -> {resp.status_code} {resp.text}"
    return resp.json()


def decode_part(reservation: dict[str, Any]) -> dict[str, Any]:
    """What the router forwards to the prefiller: the reservation minus request_id."""
    return {k: v for k, v in reservation.items() if k != "request_id"}


async def prefill_call(client: httpx.AsyncClient, prefill: WorkerProc, rid: str, prompt: list[int],
                       reservation: dict[str, Any]) -> httpx.Response:
    return await client.post(f"{prefill.url}/prefill",
                             json={"request_id": rid, "prompt_tokens": prompt, "decode": decode_part(reservation)})


async def generate_call(client: httpx.AsyncClient, decode: WorkerProc, rid: str, *, stream: bool,
                        timeout_s: float | None = None) -> tuple[int, dict[str, Any]]:
    """POST /generate; returns (status, body) with a stream folded into the non-stream shape."""
    body: dict[str, Any] = {"request_id": rid, "stream": stream}
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    if not stream:
        resp = await client.post(f"{decode.url}/generate", json=body)
        return resp.status_code, {**resp.json(), "receipt": parse_receipt(resp.headers.get(RECEIPT_HEADER))}
    async with client.stream("POST", f"{decode.url}/generate", json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, json.loads(await resp.aread())
        receipt = parse_receipt(resp.headers.get(RECEIPT_HEADER))
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) async for line in resp.aiter_lines() if line.strip()]
    assert lines and lines[-1].get("done") is True, f"{rid}: stream did not end with a done line: {lines[-3:]}"
    token_lines = lines[:-1]
    for line in token_lines:
        assert set(line) == {"token", "text"} and isinstance(line["text"], str), line
    tokens = [line["token"] for line in token_lines]
    # The pieces add up to the text of the tokens (a character split over byte tokens comes
    # whole with its last byte; bytes of an unfinished last character give no text).
    streamed, full = "".join(line["text"] for line in token_lines), TOKENIZER.decode(tokens)
    assert full.startswith(streamed) and set(full[len(streamed):]) <= {"\ufffd"}, (rid, streamed, full)
    last = lines[-1]
    return 200, {"tokens": tokens, "text": TOKENIZER.decode(tokens), "finish_reason": last["finish_reason"],
                 "usage": last["usage"], "error": last.get("error"), "receipt": receipt}


async def disaggregated(client: httpx.AsyncClient, decode: WorkerProc, prefill: WorkerProc, rid: str,
                        prompt: list[int], *, stream: bool = False) -> tuple[dict[str, Any], httpx.Response, tuple[int, dict[str, Any]]]:
    """Reserve, then /prefill and /generate concurrently (as the router does)."""
    reservation = await reserve(client, decode, rid, prompt)
    pre, gen = await asyncio.gather(
        prefill_call(client, prefill, rid, prompt, reservation),
        generate_call(client, decode, rid, stream=stream),
    )
    return reservation, pre, gen


def check_against_reference(rid: str, prompt: list[int], reservation: dict[str, Any], pre: httpx.Response,
                            gen: tuple[int, dict[str, Any]]) -> None:
    ref = reference(prompt)
    n_pages = -(-len(prompt) // CONFIG.block_size)
    assert pre.status_code == 200, f"{rid}: prefill -> {pre.status_code} {pre.text}"
    p = pre.json()
    assert p["request_id"] == rid
    assert p["kv_bytes"] == CONFIG.num_layers * n_pages * CONFIG.page_bytes, (rid, p)
    assert p["writes"] == CONFIG.num_layers * -(-len(prompt) // CHUNK), (rid, p)
    if ref.tokens:
        assert p["first_token"] == ref.tokens[0], (rid, p, ref)
    assert reservation["expected_count"] == CONFIG.num_layers * n_pages + 1
    assert reservation["kv_layout"] == CONFIG.kv_layout
    assert len(reservation["pages"]) == -(-(len(prompt) + MAX_TOKENS) // CONFIG.block_size)
    status, body = gen
    assert status == 200, f"{rid}: generate -> {status} {body}"
    # The oracle: the decoder's landed prompt KV, by bytes, against the colocated prefill's
    # (first: misplaced KV can leave a random-weight model's tokens unchanged).
    receipt = body.get("receipt")
    assert receipt is not None and "kv_digest" in receipt, f"{rid}: no receipt digest (decoder without DIGEST_ENV?)"
    want_digest = f"{reference_digest(prompt):08x}"
    assert receipt["kv_digest"] == want_digest, f"{rid}: landed KV digest {receipt['kv_digest']} != colocated {want_digest}"
    assert receipt["verdict"] in ("verified", "sampled", "unchecked") and int(receipt["kv_bytes"]) == p["kv_bytes"], receipt
    assert body["tokens"] == ref.tokens, f"{rid} ({len(prompt)} tokens): disaggregated {body['tokens']} != colocated {ref.tokens}"
    assert body["finish_reason"] == ref.finish_reason.value, (rid, body)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ref.tokens)}, (rid, body)
    assert body["text"] == TOKENIZER.decode(ref.tokens)


# -- 1. disaggregated == colocated ----------------------------------------------------------------

#: Prompt lengths in tokens: one token (BOS only), page edges (16/17), chunk edges
#: (255/256/257, 513), up to 1000 tokens = 63 pages and 4 chunks of 256.
