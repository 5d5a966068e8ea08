"""The builtin workers' prefix cache (issue 29): reuse on both sides, only missing pages sent.

One decode worker and two prefill workers run as real `kvxfer` processes on loopback
(module fixture); the test drives them as the router does (decode /reserve, then /prefill
and /generate together). The oracle for KV bytes is the decoder's receipt digest
(`kv_receipt_digest`) against the same computation done here: the colocated prefill of the
first prompt, then the cached-prefix prefill (`Transformer.prefill(start_pos=...)`) of the
later one on top of it, which is what the workers do. Tokens are compared with the
colocated reference `generate`.

1. a repeated prompt: the prefiller computes only its last block and pushes one page per
   layer; the decoder's whole prompt KV has the expected bytes; tokens equal.
2. a prompt sharing a prefix with an earlier one: only the tail pages travel; pages only
   the prefiller holds are pushed from its cache.
3. /generate_local of a cached prompt computes only the tail and answers the same tokens;
   a chat's next turn reuses the pages of the answer the decoder generated.
4. /prefix_index reports the held blocks and answers null blocks when nothing changed.
5. fault: a reservation whose pages include cached ones, its push standing still between
   two layers (`write_late`) while a flood of other prompts forces evictions on a small
   decoder: the pinned pages are never handed out (the late request's KV digest and
   tokens, and every flood request's tokens, equal the reference; every page comes back).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from functools import cache

import httpx
import pytest
from support.kv_requests import (
    CHUNK,
    CONFIG,
    DIGEST_ENV,
    MAX_TOKENS,
    PREFILL_ENV,
    decode_part,
    generate_call,
    info,
    one_torch_thread,
    reference,
    reference_model,
    reserve,
    text_prompt,
    tokens_of,
    wait_pages_full,
)
from support.push_faults import fault_env
from support.waiting import wait_until
from support.worker_procs import WorkerProc, WorkerSet

from kvxfer.kv.cache import PagedKVCache
from kvxfer.kv.integrity import prompt_kv_digest
from kvxfer.kv.prefix_hash import block_hashes_hex

#: How long the late prefiller stands still before its layer-1 write (test 5): longer than
#: the flood takes, shorter than its stall limit (the decoder's fence_timeout_s of 15 s
#: minus its transfer_timeout_s of 2 s).
LATE_MS = 6000
BS = CONFIG.block_size
L = CONFIG.num_layers
#: A small decoder: the flood of test 5 must run out of free pages and evict.
DECODE_PAGES = 48

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def prefix_workers(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[dict[str, WorkerProc]]:
    """A decode worker (48 pages, receipt digests), a prefill worker and one that stands
    still LATE_MS before every push's layer-1 write."""
    workers = WorkerSet(tmp_path_factory.mktemp("prefix_reuse_workers"), env={"KVXFER_PREFIX_CACHE": "true"})
    failed_before = request.session.testsfailed
    try:
        decode, prefill, late = workers.start_many([
            ("decode", {"num_pages": DECODE_PAGES, "env": DIGEST_ENV}),
            ("prefill", {"num_pages": 256, "env": PREFILL_ENV}),
            ("prefill", {"num_pages": 256, "env": {**PREFILL_ENV, **fault_env(f"write_late:{LATE_MS}")}}),
        ])
        yield {"decode": decode, "prefill": prefill, "late_prefill": late}
    finally:
        if request.session.testsfailed > failed_before:
            print(f"\n===== worker logs (prefix reuse) =====\n{workers.logs()}")
        workers.close()


@cache
def expected_digest(earlier: tuple[int, ...], prompt: tuple[int, ...], decoder_blocks: int, prefiller_blocks: int) -> int:
    """Digest of `prompt`'s KV on the decoder when both workers cached the colocated prefill
    of `earlier`: the decoder's first `decoder_blocks` blocks are those cached pages, the
    rest is what the prefiller computed from its own first `prefiller_blocks` cached ones."""
    model = reference_model()
    pages_earlier, pages_prompt = -(-len(earlier) // BS), -(-len(prompt) // BS)
    with one_torch_thread():
        kv = PagedKVCache.from_config(CONFIG, pages_earlier + pages_prompt)
        if earlier:
            model.prefill(list(earlier), kv, list(range(pages_earlier)), chunk_size=CHUNK)
        computed = list(range(prefiller_blocks)) + list(range(pages_earlier, pages_earlier + pages_prompt - prefiller_blocks))
        model.prefill(list(prompt), kv, computed, chunk_size=CHUNK, start_pos=prefiller_blocks * BS)
    table = list(range(decoder_blocks)) + computed[decoder_blocks:]
    return prompt_kv_digest(kv, table, len(prompt))


async def pair(client: httpx.AsyncClient, decode: WorkerProc, prefill: WorkerProc, rid: str,
               prompt: list[int]) -> tuple[dict, dict, dict]:
    """Reserve, then /prefill and /generate together; all three answers, checked for 200."""
    reservation = await reserve(client, decode, rid, prompt)
    pre, (status, body) = await asyncio.gather(
        client.post(f"{prefill.url}/prefill",
                    json={"request_id": rid, "prompt_tokens": prompt, "decode": decode_part(reservation)}),
        generate_call(client, decode, rid, stream=False),
    )
    assert pre.status_code == 200, f"{rid}: prefill -> {pre.status_code} {pre.text}"
    assert status == 200, f"{rid}: generate -> {status} {body}"
    return reservation, pre.json(), body


def check_reuse(rid: str, prompt: list[int], reservation: dict, pre: dict, body: dict, *, decoder_blocks: int,
                prefiller_blocks: int, want_digest: int) -> None:
    """The reservation, the prefiller's answer and the decoder's receipt of a request whose
    first `decoder_blocks` blocks the decoder held and `prefiller_blocks` the prefiller."""
    pushed = -(-len(prompt) // BS) - decoder_blocks
    assert reservation["cached_tokens"] == decoder_blocks * BS, (rid, reservation)
    # With a held prefix, exactly the pages to push; without, the whole table (decode pages too).
    table = pushed if decoder_blocks else -(-(len(prompt) + MAX_TOKENS) // BS)
    assert reservation["first_page"] == decoder_blocks and len(reservation["pages"]) == table, (rid, reservation)
    assert reservation["expected_count"] == L * pushed + 1, (rid, reservation)
    assert pre["prefix_hit_tokens"] == prefiller_blocks * BS, (rid, pre)
    assert pre["computed_tokens"] == len(prompt) - prefiller_blocks * BS, (rid, pre)
    assert (pre["pages_skipped"], pre["pages_pushed"]) == (decoder_blocks, pushed), (rid, pre)
    assert pre["kv_bytes"] == L * pushed * CONFIG.page_bytes, (rid, pre)
    assert body["receipt"]["kv_digest"] == f"{want_digest:08x}", (rid, body["receipt"])
    assert int(body["receipt"]["pages"]) == pushed, (rid, body["receipt"])
    ref = reference(prompt)
    assert body["tokens"] == ref.tokens and body["finish_reason"] == ref.finish_reason.value, (rid, body, ref)


#: The first prompt: 18 full blocks and a partial one (a chunk edge inside).
FIRST = tokens_of(text_prompt(2901, 300))
#: Shares FIRST's first 10 blocks (160 tokens), then goes its own way.
SHARED = FIRST[:160] + tokens_of(text_prompt(2902, 91))[1:]


def test_a_repeated_prompt_moves_only_its_last_page(prefix_workers: dict[str, WorkerProc]) -> None:
    decode, prefill = prefix_workers["decode"], prefix_workers["prefill"]

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            reservation, pre, body = await pair(client, decode, prefill, "rep-1", FIRST)
            check_reuse("rep-1", FIRST, reservation, pre, body, decoder_blocks=0, prefiller_blocks=0,
                        want_digest=expected_digest((), tuple(FIRST), 0, 0))
            reservation, pre, body = await pair(client, decode, prefill, "rep-2", FIRST)
            full = (len(FIRST) - 1) // BS
            check_reuse("rep-2", FIRST, reservation, pre, body, decoder_blocks=full, prefiller_blocks=full,
                        want_digest=expected_digest(tuple(FIRST), tuple(FIRST), full, full))

    asyncio.run(run())


def test_a_shared_prefix_moves_only_the_tail_pages(prefix_workers: dict[str, WorkerProc]) -> None:
    decode, prefill = prefix_workers["decode"], prefix_workers["prefill"]
    shared_blocks = 160 // BS
    assert SHARED[:160] == FIRST[:160] and SHARED[160] != FIRST[160]

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await pair(client, decode, prefill, "shared-0", FIRST)  # FIRST cached on both (whatever ran before)
            reservation, pre, body = await pair(client, decode, prefill, "shared-1", SHARED)
            check_reuse("shared-1", SHARED, reservation, pre, body, decoder_blocks=shared_blocks,
                        prefiller_blocks=shared_blocks,
                        want_digest=expected_digest(tuple(FIRST), tuple(SHARED), shared_blocks, shared_blocks))

    asyncio.run(run())


def test_pages_only_the_prefiller_holds_are_pushed_from_its_cache(prefix_workers: dict[str, WorkerProc]) -> None:
    decode, prefill = prefix_workers["decode"], prefix_workers["prefill"]
    prompt = tokens_of(text_prompt(2907, 90))
    full = (len(prompt) - 1) // BS

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            # Pushed but never admitted (cancelled): the prefiller caches it, the decoder not.
            reservation = await reserve(client, decode, "only-prefiller-0", prompt)
            pre = await client.post(f"{prefill.url}/prefill", json={
                "request_id": "only-prefiller-0", "prompt_tokens": prompt, "decode": decode_part(reservation)})
            assert pre.status_code == 200, pre.text
            cancel = await client.post(f"{decode.url}/cancel",
                                       json={"request_id": "only-prefiller-0", "prefill_stopped": True})
            assert cancel.status_code == 200, cancel.text
            reservation, pre_json, body = await pair(client, decode, prefill, "only-prefiller-1", prompt)
            check_reuse("only-prefiller-1", prompt, reservation, pre_json, body, decoder_blocks=0,
                        prefiller_blocks=full, want_digest=expected_digest(tuple(prompt), tuple(prompt), 0, full))

    asyncio.run(run())


def test_generate_local_computes_only_what_the_cache_lacks(prefix_workers: dict[str, WorkerProc]) -> None:
    decode, prefill = prefix_workers["decode"], prefix_workers["prefill"]
    prompt = tokens_of(text_prompt(2903, 200))

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            await pair(client, decode, prefill, "local-0", prompt)
            answers = []
            for rid in ("local-1", "local-2"):
                resp = await client.post(f"{decode.url}/generate_local",
                                         json={"request_id": rid, "prompt_tokens": prompt, "max_tokens": MAX_TOKENS})
                assert resp.status_code == 200, resp.text
                answers.append(resp.json())
            return answers

    ref = reference(prompt)
    for answer in asyncio.run(run()):
        assert answer["cached_tokens"] == (len(prompt) - 1) // BS * BS, answer
        assert answer["tokens"] == ref.tokens and answer["finish_reason"] == ref.finish_reason.value, answer


def test_a_next_turn_reuses_the_pages_of_the_generated_answer(prefix_workers: dict[str, WorkerProc]) -> None:
    decode, prefill = prefix_workers["decode"], prefix_workers["prefill"]
    turn1 = tokens_of(text_prompt(2908, 57))

    async def run() -> tuple[dict, dict, dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            _, _, first = await pair(client, decode, prefill, "turn-1", turn1)
            assert len(first["tokens"]) == MAX_TOKENS, first  # ended by length: all but the last were fed back
            turn2 = turn1 + first["tokens"] + tokens_of(text_prompt(2909, 30))[1:]
            return turn2, *(await pair(client, decode, prefill, "turn-2", turn2))

    turn2, reservation, pre, body = asyncio.run(run())
    # K/V was written for the prompt and every generated token but the last.
    written = len(turn1) + MAX_TOKENS - 1
    assert reservation["cached_tokens"] == written // BS * BS > len(turn1) // BS * BS, reservation
    assert pre["pages_skipped"] == written // BS, pre
    # Decode steps computed those K/V one token at a time: equal within float tolerance to
    # a prefill, so the tokens (not the bytes) are compared with the colocated reference.
    ref = reference(turn2)
    assert body["tokens"] == ref.tokens and body["finish_reason"] == ref.finish_reason.value, (body, ref)


def test_prefix_index_reports_the_held_blocks(prefix_workers: dict[str, WorkerProc]) -> None:
    decode, prefill = prefix_workers["decode"], prefix_workers["prefill"]
    prompt = tokens_of(text_prompt(2904, 70))

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await pair(client, decode, prefill, "index-0", prompt)
            for worker in (decode, prefill):
                resp = await client.post(f"{worker.url}/prefix_index", json={"since_version": 0})
                assert resp.status_code == 200, resp.text
                report = resp.json()
                assert set(report) == {"worker_id", "epoch", "version", "block_size", "namespace",
                                       "capacity_pages", "blocks"}
                assert (report["block_size"], report["namespace"]) == (BS, CONFIG.name)
                assert set(block_hashes_hex(prompt, BS, CONFIG.name)) <= set(report["blocks"]), report
                again = (await client.post(f"{worker.url}/prefix_index",
                                           json={"since_version": report["version"]})).json()
                assert again["blocks"] is None and again["epoch"] == report["epoch"], again
                bad = await client.post(f"{worker.url}/prefix_index", json={"since_version": "x"})
                assert bad.status_code == 422, bad.text

    asyncio.run(run())


def metric(worker: WorkerProc, name: str) -> float:
    text = httpx.get(f"{worker.url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_pinned_pages_survive_an_eviction_flood_while_their_push_is_late(
        prefix_workers: dict[str, WorkerProc]) -> None:
    decode, prefill, slow = prefix_workers["decode"], prefix_workers["prefill"], prefix_workers["late_prefill"]
    base = tokens_of(text_prompt(2905, 120))
    late_prompt = base + tokens_of(text_prompt(2906, 40))[1:]
    held_blocks = len(base) // BS
    floods = [tokens_of(text_prompt(2950 + i, 100)) for i in range(10)]
    evictions_before = metric(decode, "kvxfer_decode_prefix_cache_evictions_total")

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await pair(client, decode, prefill, "pin-0", base)  # base's blocks cached on the decoder
            # The late prefiller has nothing cached: it computes everything, pushes layer 0
            # of the pages the decoder lacks, and stands still LATE_MS before layer 1.
            late = asyncio.ensure_future(pair(client, decode, slow, "pin-late", late_prompt))
            await asyncio.to_thread(wait_until, lambda: info(decode)["queue_depth"] == 1 or None, 10,
                                    "the late request reserved")
            for i, prompt in enumerate(floods):  # 10 x 7 pages through a 48-page decoder
                resp = await client.post(f"{decode.url}/generate_local",
                                         json={"request_id": f"flood-{i}", "prompt_tokens": prompt, "max_tokens": 2})
                assert resp.status_code == 200, resp.text
                assert resp.json()["tokens"] == reference(prompt, 2).tokens, f"flood-{i}"
            assert not late.done(), f"the late push ended within the flood: {late.result()}"
            reservation, pre, body = await late
            check_reuse("pin-late", late_prompt, reservation, pre, body, decoder_blocks=held_blocks,
                        prefiller_blocks=0, want_digest=expected_digest(tuple(base), tuple(late_prompt), held_blocks, 0))

    asyncio.run(run())
    assert metric(decode, "kvxfer_decode_prefix_cache_evictions_total") > evictions_before
    wait_pages_full(decode, 10)
