"""The KV path end to end with real worker processes (issue 3, "Must show").

A decode worker and prefill workers run as real `kvxfer` processes (`--provider net`), each
as a pod: in a network and PID namespace of its own (tests/support/pod_namespaces.py), so
the same-host path cannot engage and the KV crosses the fabric between them, as between
Kubernetes pods (checked on the prefiller's per-path byte counters). Where namespaces cannot
be made (not root) they run on loopback with the same-host path off. The test talks to them
from the pods' client namespace and drives them the way the router does: decode POST /reserve,
then prefill POST /prefill and decode POST /generate concurrently. Every generation is
compared token for token with the colocated reference
`Transformer(ModelConfig.preset("tiny")).generate(ByteTokenizer().encode(prompt), n)`.

1. disaggregated == colocated for 12 prompts of 1..1000 tokens (multi-page, multi-chunk),
   some streamed; pages all come back.
2. the decoder's pages hold exactly the bytes the prefiller computed (in-process runtimes).
4. decode-side cancel mid-push: fenced pages are not handed out again, new requests
   stay correct; prefill /cancel answers in_flight false, and relayed to the decoder (as
   the router does) it frees the fenced pages.
5. bad requests get a clear 4xx and disturb nothing.
3. SIGKILL of the prefill worker mid-push: 504 within the deadline naming the request and
   the count, pages freed after the fence deadline, the decoder keeps serving (runs last: it
   kills a worker of the module fixture).

The shared decode worker runs with KVXFER_FENCE_TIMEOUT_S=3 so that fenced pages come back
within the test's time budget; its prefillers have a 2 s transfer deadline, which
prefillers require to be shorter than the decoder's fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.kv_requests import (
    CHUNK,
    CONFIG,
    DIGEST_ENV,
    FENCE_S,
    LONG,
    MAX_TOKENS,
    NUM_PAGES,
    PREFILL_ENV,
    SLOW_PUSH_ENV,
    check_against_reference,
    decode_part,
    disaggregated,
    generate_call,
    info,
    one_torch_thread,
    prefill_call,
    reference,
    reference_model,
    reserve,
    text_prompt,
    tokens_of,
    wait_pages_full,
)
from support.pod_cluster import POD_MODE_UNAVAILABLE, assert_kv_crossed_fabric
from support.pod_namespaces import PodNetwork
from support.push_faults import fault_env
from support.waiting import wait_until
from support.worker_procs import WorkerProc, WorkerSet


@pytest.fixture(scope="module")
def pod_net() -> Iterator[PodNetwork | None]:
    """The module's pod network (None where namespaces cannot be made)."""
    if POD_MODE_UNAVAILABLE is not None:
        yield None
        return
    net = PodNetwork()
    try:
        yield net
    finally:
        net.close()


@pytest.fixture(autouse=True)
def on_pod_network(pod_net: PodNetwork | None) -> Iterator[None]:
    """Each test's thread (and what it starts) on the pods' bridge."""
    with pod_net.client() if pod_net is not None else contextlib.nullcontext():
        yield


@pytest.fixture(scope="module")
def kv_workers(tmp_path_factory: pytest.TempPathFactory, pod_net: PodNetwork | None) -> Iterator[WorkerSet]:
    """The module's workers, as pods of `pod_net` (or on loopback with the same-host path off)."""
    workers = WorkerSet(tmp_path_factory.mktemp("kv_path_workers"), pods=pod_net,
                        env={"KVXFER_SAME_HOST": "false"} if pod_net is None else None)
    try:
        yield workers
    finally:
        workers.close()


@pytest.fixture(scope="module")
def cluster(kv_workers: WorkerSet, pod_net: PodNetwork | None,
            request: pytest.FixtureRequest) -> Iterator[dict[str, WorkerProc]]:
    """Workers shared by the module: a decode worker (fence 3 s), a prefill worker, and
    a "slow" prefill worker (SLOW_PUSH_ENV) whose push of a long prompt lasts over half a
    second, so that an event timed after its first completed writes reliably falls in the
    middle of a push. The last test kills it."""
    workers = kv_workers
    failed_before = request.session.testsfailed
    try:
        with pod_net.client() if pod_net is not None else contextlib.nullcontext():
            decode, prefill, slow = workers.start_many([
                ("decode", {"num_pages": NUM_PAGES, "env": {"KVXFER_FENCE_TIMEOUT_S": str(FENCE_S), **DIGEST_ENV}}),
                ("prefill", {"num_pages": NUM_PAGES, "env": PREFILL_ENV}),
                ("prefill", {"num_pages": NUM_PAGES, "env": SLOW_PUSH_ENV}),
            ])
        yield {"decode": decode, "prefill": prefill, "slow_prefill": slow}
    finally:
        if request.session.testsfailed > failed_before:
            print(f"\n===== worker logs (module fixture) =====\n{workers.logs()}")



PROMPT_LENGTHS = [1, 2, 16, 17, 100, 255, 256, 257, 513, 700, 900, LONG]


def test_disaggregated_equals_colocated(cluster: dict[str, WorkerProc]) -> None:
    decode, prefill = cluster["decode"], cluster["prefill"]
    wait_pages_full(decode, timeout_s=FENCE_S + 5)  # (a failed test before may still hold fenced pages)
    prompts = {f"eq-{i}-{n}": tokens_of(text_prompt(i, n)) for i, n in enumerate(PROMPT_LENGTHS)}
    assert [len(p) for p in prompts.values()] == PROMPT_LENGTHS
    for p in prompts.values():
        reference(p)  # computed before the clock of the concurrent run starts

    async def run() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=60) as client:
            flows = [
                disaggregated(client, decode, prefill, rid, p, stream=(i % 3 == 1))
                for i, (rid, p) in enumerate(prompts.items())
            ]
            return dict(zip(prompts, await asyncio.gather(*flows)))

    results = asyncio.run(run())
    for rid, (reservation, pre, gen) in results.items():
        check_against_reference(rid, prompts[rid], reservation, pre, gen)
    # Reservations were all live at once: no page was handed to two requests.
    all_pages = [pg for reservation, _, _ in results.values() for pg in reservation["pages"]]
    assert len(all_pages) == len(set(all_pages))
    # Finished requests free their pages at once (no fence: their KV fully arrived).
    wait_pages_full(decode, timeout_s=FENCE_S / 2)
    pinfo = info(prefill)
    assert (pinfo["free_pages"], pinfo["running"], pinfo["queue_depth"]) == (pinfo["total_pages"], 0, 0), pinfo
    # Between pods every KV byte crossed the fabric; none took the same-host path.
    assert_kv_crossed_fabric([prefill.url])


# -- 2. the decoder's pages hold exactly the prefiller's bytes -------------------------------------

@pytest.fixture
def single_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def test_decode_pages_hold_prefilled_bytes(single_torch_thread: None) -> None:
    """Two runtimes in this process (two engines over libfabric loopback): after the push,
    every prompt page of every layer on the decoder equals a reference PagedKVCache
    prefilled locally with the same chunk size; the mailbox carries the first token and
    nonce; nothing outside the prompt pages was written."""
    import numpy as np

    from kvxfer.kv.cache import PagedKVCache
    from kvxfer.kv.protocol import MAILBOX_SLOT_BYTES, KVReservation, decode_mailbox
    from kvxfer.workers.decode.service import DecodeService, DecodeSettings
    from kvxfer.workers.prefill.service import PrefillService, PrefillSettings

    # Same-host path off: one process, so only that keeps the KV on the fabric.
    common = dict(model="tiny", provider="net", bind_host="127.0.0.1", prefill_chunk_tokens=CHUNK, same_host=False)
    decode = DecodeService(DecodeSettings(num_pages=256, max_requests=16, **common))
    prefill = PrefillService(PrefillSettings(num_pages=256, **common))
    lengths = [1, 15, 16, 17, 255, 256, 257, 600, LONG]
    prompts = {f"bytes-{n}": tokens_of(text_prompt(100 + n, n)) for n in lengths}
    try:
        async def push_all() -> dict[str, tuple[KVReservation, dict[str, Any]]]:
            reservations = {rid: decode.reserve(rid, len(p), 1) for rid, p in prompts.items()}
            results = await asyncio.gather(*(prefill.prefill(rid, p, reservations[rid]) for rid, p in prompts.items()))
            return {rid: (reservations[rid], r) for rid, r in zip(prompts, results)}

        pushed = asyncio.run(push_all())
        cache = decode.core.cache
        touched: set[int] = set()
        for rid, (res, result) in pushed.items():
            prompt = prompts[rid]
            job = decode.jobs[rid]
            # Admission gate: every page of every layer plus the mailbox landed.
            decode.core.engine.wait_imm(job.imm, job.expected_count, timeout=10)
            assert decode.core.engine.imm_count(job.imm) == job.expected_count
            ref_cache = PagedKVCache.from_config(CONFIG, len(res.pages))
            ref = reference_model().prefill(prompt, ref_cache, list(range(len(res.pages))), chunk_size=CHUNK)
            assert result["first_token"] == ref.first_token
            off = job.slot * decode.mailbox_slot_stride
            assert decode_mailbox(bytes(decode.mailbox[off: off + MAILBOX_SLOT_BYTES]))[:3] == (
                res.nonce, ref.first_token, len(prompt))
            n_pages = -(-len(prompt) // CONFIG.block_size)
            for layer in range(CONFIG.num_layers):
                for i, page in enumerate(res.pages[:n_pages]):
                    got = cache.page_view(layer, page).numpy()
                    want = ref_cache.page_view(layer, i).numpy()
                    valid = min(CONFIG.block_size, len(prompt) - i * CONFIG.block_size)
                    # K and V of every prompt token of the page, bit for bit. (The tail of a
                    # last, partial page is whatever the prefiller's own page held.)
                    assert got[:, :valid].tobytes() == want[:, :valid].tobytes(), (rid, layer, i, page)
                    if valid == CONFIG.block_size:
                        assert cache.read_page_bytes(layer, page) == ref_cache.read_page_bytes(layer, i)
            touched.update(res.pages[:n_pages])
        # No write outside the prompt pages of the reservations: every other page is zero.
        raw = cache.tensor.numpy()
        untouched = sorted(set(range(cache.num_pages)) - touched)
        assert not np.any(raw[:, untouched]), "a write landed outside the reserved prompt pages"
        for rid in prompts:
            decode.cancel(rid, prefill_stopped=True)  # every push completed: nothing can land
        wait_until(lambda: decode.allocator.free_pages == decode.allocator.total_pages, 5, "in-process pages freed")
    finally:
        decode.close()
        prefill._compute.shutdown(wait=True)
        prefill.core.close()


# -- metrics ----------------------------------------------------------------------------------------

KILL_AFTER_WRITES = 4


def completed_writes(metrics: httpx.Response) -> float:
    """kvxfer_engine_completed_operations summed over rails, from a /metrics response."""
    assert metrics.status_code == 200, metrics.text
    total = 0.0
    for line in metrics.text.splitlines():
        if line.startswith("kvxfer_engine_completed_operations_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- 4. cancel from the decode side mid-push --------------------------------------------------------

def test_decode_cancel_mid_push(cluster: dict[str, WorkerProc]) -> None:
    """The victim is pushed by the slow prefiller; once its first write completed, the
    decoder cancels it. Right away other requests (through the other prefiller) reserve and
    run while the victim's writes may still land: they never get a fenced page and
    their generations stay exact. The prefiller's /cancel answers only once nothing is in
    flight; relayed to the decoder, that answer frees the fenced pages."""
    decode, prefill, slow = cluster["decode"], cluster["prefill"], cluster["slow_prefill"]
    wait_pages_full(decode, timeout_s=FENCE_S + 5)  # (a failed test before may still hold fenced pages)
    victim_rid = "cancel-victim"
    victim = tokens_of(text_prompt(400, LONG))
    others = {f"after-cancel-{i}": tokens_of(text_prompt(410 + i, n)) for i, n in enumerate([LONG, 300, 17, 1])}
    for p in others.values():
        reference(p)

    async def run() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=60) as client:
            seen: dict[str, Any] = {}
            seen["reservation"] = await reserve(client, decode, victim_rid, victim)
            before = completed_writes(await client.get(f"{slow.url}/metrics"))
            pre_task = asyncio.create_task(prefill_call(client, slow, victim_rid, victim, seen["reservation"]))
            deadline = time.monotonic() + 10
            while completed_writes(await client.get(f"{slow.url}/metrics")) <= before:
                assert time.monotonic() < deadline, "the victim's push never started"
                await asyncio.sleep(0.002)
            # The decoder gives up on the request while the prefiller computes and pushes.
            seen["dcancel"] = await client.post(f"{decode.url}/cancel", json={"request_id": victim_rid})
            cancelled_at = time.monotonic()
            # The router's second leg, sent at once: stop the victim's push; it is answered
            # only once nothing is in flight. (The busy prefiller takes a while to handle it,
            # so the victim's writes go on landing while the next requests reserve.)
            pcancel_task = asyncio.create_task(client.post(f"{slow.url}/cancel", json={"request_id": victim_rid}))
            seen["pcancel_task"] = pcancel_task
            seen["during"] = (await client.get(f"{decode.url}/info")).json()
            seen["during_delay"] = time.monotonic() - cancelled_at
            # Right away, other requests take pages and run through the other prefiller.
            seen["new"] = {rid: await reserve(client, decode, rid, p) for rid, p in others.items()}
            flows = [
                asyncio.gather(prefill_call(client, prefill, rid, p, seen["new"][rid]),
                               generate_call(client, decode, rid, stream=(i % 2 == 0)))
                for i, (rid, p) in enumerate(others.items())
            ]
            flows_task = asyncio.gather(*flows)
            seen["pcancel"] = await pcancel_task
            # The router relays the prefiller's in_flight false: the fenced pages come back.
            seen["release"] = await client.post(f"{decode.url}/cancel",
                                                json={"request_id": victim_rid, "prefill_stopped": True})
            seen["after_release"] = (await client.get(f"{decode.url}/info")).json()
            seen["pre_victim"] = await pre_task
            seen["results"] = dict(zip(others, await flows_task))
            return seen

    seen = asyncio.run(run())
    dcancel, pcancel, pre_victim = seen["dcancel"], seen["pcancel"], seen["pre_victim"]
    assert dcancel.status_code == 200, dcancel.text
    assert dcancel.json() == {"request_id": victim_rid, "state": "fenced", "known": True}
    assert seen["release"].status_code == 200, seen["release"].text
    assert seen["release"].json()["state"] == "free", seen["release"].text
    assert pcancel.status_code == 200, pcancel.text
    # Either the prefiller's cancel stopped the push (409), or, first, its next write met
    # the reservation's registration already closed by the decoder's cancel (502 with the
    # provider's refusal, kv_registration=per_reservation): both end the push, nothing lands.
    stopped_by_cancel = pre_victim.status_code == 409 and "cancelled" in pre_victim.json()["detail"]
    failed_first = pre_victim.status_code == 502 and pre_victim.json()["reason"] == "push_failed"
    assert stopped_by_cancel or failed_first, pre_victim.text
    # The slow push takes far longer than the few calls above: a cancel that stopped it found
    # it running. Only a push that had already failed may be forgotten by then.
    assert pcancel.json() in ({"request_id": victim_rid, "in_flight": False, "known": True},
                              *([{"request_id": victim_rid, "in_flight": False, "known": False}] if failed_first else []))
    # (The cancel stops the writes, not the compute: the prefiller's own pages come back
    # once its compute thread is done with the request.)
    wait_pages_full(slow, timeout_s=10)
    # Fenced pages stay out of the pool: no new request got one of them.
    victim_pages = set(seen["reservation"]["pages"])
    if seen["during_delay"] < FENCE_S / 2:
        during = seen["during"]
        assert during["free_pages"] == during["total_pages"] - len(victim_pages), during
    for rid, res in seen["new"].items():
        assert not victim_pages & set(res["pages"]), f"{rid} was given a fenced page"
    for rid, (pre, gen) in seen["results"].items():
        check_against_reference(rid, others[rid], seen["new"][rid], pre, gen)
    # Once released every page is free again, and the cancelled id is gone.
    wait_pages_full(decode, timeout_s=FENCE_S + 5)
    resp = httpx.post(f"{decode.url}/cancel", json={"request_id": victim_rid}, timeout=5)
    assert resp.status_code == 404, resp.text


# -- 5. bad requests ---------------------------------------------------------------------------------

def test_bad_requests_get_4xx_and_disturb_nothing(cluster: dict[str, WorkerProc]) -> None:
    from kvxfer.transfer.engine import TransferEngine

    decode, prefill = cluster["decode"], cluster["prefill"]
    wait_pages_full(decode, timeout_s=FENCE_S + 5)  # (a failed test before may still hold fenced pages)
    prompt = tokens_of(text_prompt(500, 300))
    ctx = CONFIG.max_context

    def expect(resp: httpx.Response, status: int, *words: str) -> None:
        assert resp.status_code == status, f"{resp.request.method} {resp.request.url} -> {resp.status_code} {resp.text}"
        detail = resp.json()["detail"]
        text = detail if isinstance(detail, str) else json.dumps(detail)
        for word in words:
            assert word.lower() in text.lower(), f"{word!r} not in {text!r}"

    with httpx.Client(timeout=30) as c:
        d, p = decode.url, prefill.url
        expect(c.post(f"{d}/reserve", json={"request_id": "bad-empty", "prompt_tokens": [], "max_tokens": 4}), 400, "empty")
        expect(c.post(f"{d}/reserve", json={"request_id": "bad-long", "prompt_tokens": [1] * (ctx - 10), "max_tokens": 11}),
               400, "context", str(ctx))
        expect(c.post(f"{d}/reserve", json={"request_id": "bad-neg", "prompt_tokens": [1, 2], "max_tokens": -1}), 400, "max_tokens")
        expect(c.post(f"{d}/reserve", json={"request_id": "bad-zero", "prompt_tokens": [1, 2], "max_tokens": 0}), 400, "max_tokens")
        expect(c.post(f"{d}/generate", json={"request_id": "no-such-request", "stream": False}), 404, "no-such-request")
        expect(c.post(f"{d}/generate", json={"request_id": "no-such-request", "stream": True}), 404, "no-such-request")
        expect(c.post(f"{d}/cancel", json={"request_id": "no-such-request"}), 404, "no-such-request")
        expect(c.post(f"{d}/reserve", json={"request_id": "bad-token", "prompt_tokens": [1, CONFIG.vocab_size], "max_tokens": 4}),
               422, "prompt_tokens")
        expect(c.post(f"{d}/reserve", json={"request_id": "bad-type", "prompt_tokens": [1, 2], "max_tokens": "4"}),
               422, "max_tokens")
        for url in (f"{d}/reserve", f"{d}/generate", f"{d}/cancel", f"{p}/prefill", f"{p}/cancel"):
            expect(c.post(url, content=b'{"request_id": "x", "prompt_tokens": [1,', headers={"content-type": "application/json"}),
                   400, "malformed JSON")
        dinfo = info(decode)  # none of the above took a page or left a request behind
        assert (dinfo["free_pages"], dinfo["running"], dinfo["queue_depth"]) == (dinfo["total_pages"], 0, 0), dinfo

        # A valid reservation, then bad variants of it sent to the prefiller.
        res = c.post(f"{d}/reserve", json={"request_id": "bad-victim", "prompt_tokens": prompt, "max_tokens": MAX_TOKENS})
        assert res.status_code == 200, res.text
        good = decode_part(res.json())
        expect(c.post(f"{d}/reserve", json={"request_id": "bad-victim", "prompt_tokens": prompt, "max_tokens": 4}),
               409, "bad-victim")  # the id is taken
        for bad_timeout in ("soon", None, -1, 0):
            expect(c.post(f"{d}/generate", json={"request_id": "bad-victim", "timeout_s": bad_timeout}), 422, "timeout_s")

        def prefill_with(**changes: Any) -> httpx.Response:
            return c.post(f"{p}/prefill", json={"request_id": "bad-victim", "prompt_tokens": prompt, "decode": {**good, **changes}})

        desc = bytearray(bytes.fromhex(good["descriptor"]))
        desc[len(desc) // 2] ^= 0xFF
        expect(prefill_with(descriptor=desc.hex()), 422, "descriptor")
        expect(prefill_with(descriptor="not hex at all"), 422, "malformed")
        expect(prefill_with(descriptor="deadbeef"), 422, "descriptor")
        meta = bytearray(bytes.fromhex(good["meta_descriptor"]))
        meta[5] ^= 0x01
        expect(prefill_with(meta_descriptor=meta.hex()), 422, "descriptor")
        with TransferEngine("shm") as shm:  # an engine of another provider
            import numpy as np

            buf = np.zeros(CONFIG.page_bytes * 4, dtype=np.uint8)
            foreign = shm.register(buf).descriptor.hex()
            expect(prefill_with(descriptor=foreign), 422, "shm")
            expect(prefill_with(meta_descriptor=foreign), 422, "shm")
        expect(c.post(f"{p}/prefill", json={"request_id": "bad-victim", "prompt_tokens": prompt,
                                             "decode": {k: v for k, v in good.items() if k != "imm"}}), 422, "imm")
        expect(prefill_with(pages=[NUM_PAGES + 7] * len(good["pages"])), 422, "pages")
        expect(prefill_with(pages=good["pages"][:10] + [-1] * (len(good["pages"]) - 10)), 422, "pages")
        expect(prefill_with(num_pages=NUM_PAGES * 100), 422, "pages")
        expect(prefill_with(meta_offset=10**9), 422, "meta_offset")
        expect(prefill_with(imm=-5), 422, "imm")
        # Fewer pages than the prompt needs: the reservation contradicts itself (protocol check).
        expect(prefill_with(pages=good["pages"][:3]), 422, "expected_count")
        expect(prefill_with(version=2), 422, "version")
        expect(prefill_with(imm=True), 422, "imm")
        expect(prefill_with(fence_timeout_s=1), 409, "transfer_timeout_s")
        expect(prefill_with(kv_layout="L2-H8-D128-float32-bs16"), 409, "layout")  # (same layer count: consistent)
        expect(c.post(f"{p}/prefill", json={"request_id": "bad-victim", "prompt_tokens": [], "decode": good}), 400, "empty")
        expect(c.post(f"{p}/prefill", json={"request_id": "bad-victim", "prompt_tokens": [1, 999], "decode": good}), 422, "prompt_tokens")
        expect(c.post(f"{p}/cancel", json={"request": "x"}), 422, "request_id")
        resp = c.post(f"{p}/cancel", json={"request_id": "no-such-request"})  # nothing to wait for
        assert resp.status_code == 200 and resp.json()["in_flight"] is False, resp.text

        # Nothing was disturbed: the prefiller holds nothing, the decoder only the one
        # reservation, and that very reservation still serves a normal request.
        pinfo = info(prefill)
        assert (pinfo["free_pages"], pinfo["running"], pinfo["queue_depth"]) == (pinfo["total_pages"], 0, 0), pinfo
        dinfo = info(decode)
        assert dinfo["free_pages"] == dinfo["total_pages"] - len(good["pages"]), dinfo

    async def normal() -> tuple[httpx.Response, tuple[int, dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                prefill_call(client, prefill, "bad-victim", prompt, {"request_id": "bad-victim", **good}),
                generate_call(client, decode, "bad-victim", stream=True),
            )

    pre, gen = asyncio.run(normal())
    check_against_reference("bad-victim", prompt, {"request_id": "bad-victim", **good}, pre, gen)
    wait_pages_full(decode, timeout_s=FENCE_S / 2)


# -- 3. the prefill worker dies mid-push (last: it kills the module's slow prefiller) -------------

def test_prefill_killed_mid_push(cluster: dict[str, WorkerProc], kv_workers: WorkerSet) -> None:
    """Runs last: it kills the module's slow prefiller (16-token chunks, so a kill after its
    first completed writes lands mid-push). A new prefill worker boots meanwhile and serves
    the decoder afterwards."""
    decode, doomed = cluster["decode"], cluster["slow_prefill"]
    wait_pages_full(decode, timeout_s=FENCE_S + 5)  # (a failed test before may still hold fenced pages)
    fresh = kv_workers.spawn("prefill", env=PREFILL_ENV)  # the new prefill worker for after the kill
    gen_timeout_s = 3.0
    prompts = {f"kill-{i}": tokens_of(text_prompt(300 + i, LONG - 8 * i)) for i in range(3)}
    total = info(decode)["total_pages"]

    async def run() -> tuple[dict[str, Any], list[Any], list[tuple[int, dict[str, Any], float]]]:
        async with httpx.AsyncClient(timeout=30) as client:
            reservations = {rid: await reserve(client, decode, rid, p) for rid, p in prompts.items()}
            before = completed_writes(await client.get(f"{doomed.url}/metrics"))

            async def timed_generate(rid: str) -> tuple[int, dict[str, Any], float]:
                t0 = time.monotonic()
                status, body = await generate_call(client, decode, rid, stream=False, timeout_s=gen_timeout_s)
                return status, body, time.monotonic() - t0

            gens = [asyncio.create_task(timed_generate(rid)) for rid in prompts]
            pres = [asyncio.create_task(prefill_call(client, doomed, rid, p, reservations[rid]))
                    for rid, p in prompts.items()]
            # Kill once the first request's first writes completed (~120 more are still to
            # come; the other two requests queue behind it).
            deadline = time.monotonic() + 10
            while completed_writes(await client.get(f"{doomed.url}/metrics")) < before + KILL_AFTER_WRITES:
                assert time.monotonic() < deadline, "the doomed prefiller never completed a write"
                await asyncio.sleep(0.002)
            doomed.kill()
            pre_results = await asyncio.gather(*pres, return_exceptions=True)
            gen_results = await asyncio.gather(*gens)
            failed_at = time.monotonic()
            right_after = (await client.get(f"{decode.url}/info")).json()
            return reservations, pre_results, gen_results, (time.monotonic() - failed_at, right_after)

    reservations, pre_results, gens, (info_delay, right_after) = asyncio.run(run())
    assert not doomed.alive()
    for rid, result in zip(prompts, pre_results):
        assert isinstance(result, httpx.TransportError), f"{rid}: /prefill on the killed worker gave {result!r}"
    landed_counts = {}
    for (rid, reservation), (status, body, elapsed) in zip(reservations.items(), gens):
        assert status == 504, f"{rid}: /generate -> {status} {body}"
        detail = body["detail"]
        assert rid in detail, f"504 does not name the request: {detail!r}"
        m = re.search(r"(\d+) of (\d+) writes landed", detail)
        assert m, f"504 does not give the count: {detail!r}"
        landed, expected = int(m.group(1)), int(m.group(2))
        landed_counts[rid] = (landed, expected)
        assert expected == reservation["expected_count"], detail
        assert gen_timeout_s - 0.1 <= elapsed <= gen_timeout_s + 3.0, f"{rid}: failed after {elapsed:.2f} s"
    # The request in compute was killed mid-push; the two queued behind it never started.
    # (Which one computed first depends on the order in which the three /prefill arrived.)
    partial = [rid for rid, (landed, expected) in landed_counts.items() if 0 < landed < expected]
    untouched = [rid for rid, (landed, _) in landed_counts.items() if landed == 0]
    assert len(partial) == 1 and len(untouched) == 2, landed_counts
    # The failed requests' pages are fenced (a late write could still land)...
    held = sum(len(r["pages"]) for r in reservations.values())
    if info_delay < FENCE_S / 2:  # (only meaningful if we looked before it could end)
        assert right_after["free_pages"] == total - held, right_after
    # ...and come back after the fence deadline; the worker never went down.
    wait_pages_full(decode, timeout_s=FENCE_S + 10)
    assert decode.alive()

    # The decoder keeps serving: a new prefill worker, long and short prompts, exact output.
    after = {"after-kill-long": tokens_of(text_prompt(310, LONG)), "after-kill-short": tokens_of(text_prompt(311, 40))}
    for p in after.values():
        reference(p)
    fresh.wait_ready()

    async def serve_more() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=60) as client:
            flows = [disaggregated(client, decode, fresh, rid, p, stream=(rid.endswith("short"))) for rid, p in after.items()]
            return dict(zip(after, await asyncio.gather(*flows)))

    for rid, (reservation, pre, gen) in asyncio.run(serve_more()).items():
        check_against_reference(rid, after[rid], reservation, pre, gen)
    data = wait_pages_full(decode, timeout_s=FENCE_S / 2)
    assert data["total_pages"] == total


def test_oracle_catches_two_swapped_pages_of_one_layer(kv_workers: WorkerSet) -> None:
    """The mutation the equality tests must catch: the prefiller swaps two pages of layer 1
    before it checksums and pushes them (misplaced KV that every checksum agrees with). The
    request succeeds, the integrity check passes, and the oracle (landed KV digest against
    the colocated reference's) fails it, whatever the tokens do."""
    decode, prefill = kv_workers.start_many([
        ("decode", {"env": DIGEST_ENV}),
        ("prefill", {"env": {**PREFILL_ENV, **fault_env("swap_pages:1")}}),
    ])
    prompt = tokens_of(text_prompt(800, 300))

    async def run() -> tuple[dict[str, Any], httpx.Response, tuple[int, dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await disaggregated(client, decode, prefill, "swapped", prompt)

    reservation, pre, gen = asyncio.run(run())
    assert pre.status_code == 200 and gen[0] == 200, (pre.text, gen)
    assert gen[1]["receipt"]["verdict"] == "verified", gen[1]["receipt"]
    with pytest.raises(AssertionError, match="landed KV digest"):
        check_against_reference("swapped", prompt, reservation, pre, gen)
