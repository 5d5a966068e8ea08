"""The P/D hand-off's failure paths with real worker processes (kv.protocol, handoff.decode_ledger).

1. abort (workers as pods, over the fabric): a prefiller that cannot complete a push
   (fault injection abort_after_layer:1) tells the decoder, which fails /generate in well under a second although its KV wait
   timeout is 30 s; no page is left held on either side.
2. TTL: a reservation nobody claims is failed after reservation_ttl_s, fenced, and its pages
   come back after the fence; a fenced reservation does not hold up shutdown.
3. fence: a late write of a cancelled request's push (a slow prefiller still pushing) never
   lands in pages handed to another request: the next request's page bytes equal the
   colocated reference, byte for byte.
4. epoch: a write carrying an earlier reservation's immediate is not counted toward the
   reservation that now holds the slot.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import httpx
import numpy as np
import pytest
from support.kv_requests import (
    CONFIG,
    generate_call,
    info,
    one_torch_thread,
    prefill_call,
    reference_model,
    reserve,
    text_prompt,
    tokens_of,
    wait_pages_full,
)
from support.push_faults import fault_env
from support.waiting import wait_until
from support.worker_procs import WorkerSet

pytestmark = pytest.mark.timeout(240)

KV_WAIT_S = 30.0
PREFILL_ENV = {"KVXFER_TRANSFER_TIMEOUT_S": "2"}


def test_aborted_push_fails_decode_at_once(pod_workers: WorkerSet) -> None:
    # As pods: the abort and the KV before it cross the fabric, not the same-host copy.
    decode, prefill = pod_workers.start_many([
        ("decode", {"env": {"KVXFER_KV_WAIT_TIMEOUT_S": str(KV_WAIT_S), "KVXFER_FENCE_TIMEOUT_S": "60"}}),
        ("prefill", {"env": {**PREFILL_ENV, **fault_env("abort_after_layer:1")}}),
    ])
    prompt = tokens_of(text_prompt(900, 600))

    async def run() -> tuple[httpx.Response, tuple[int, dict[str, Any]], float]:
        async with httpx.AsyncClient(timeout=60) as client:
            res = await reserve(client, decode, "aborted", prompt)
            t0 = time.monotonic()
            gen_task = asyncio.create_task(generate_call(client, decode, "aborted", stream=False, timeout_s=KV_WAIT_S))
            pre = await prefill_call(client, prefill, "aborted", prompt, res)
            gen = await gen_task
            return pre, gen, time.monotonic() - t0

    pre, (status, body), elapsed = asyncio.run(run())
    assert pre.status_code == 502 and "fault injection" in pre.text, pre.text
    assert status == 502, (status, body)
    assert "aborted" in body["detail"] and "abort_after_layer" in body["detail"], body
    # The fence is 60 s and the KV wait 30 s: only the abort can end it this soon.
    assert elapsed < 2.0, f"decode failed {elapsed:.2f} s after the push started"
    # The abort is sent once nothing is in flight: the pages come back at once, not fenced.
    wait_pages_full(decode, timeout_s=2)
    wait_pages_full(prefill, timeout_s=5)


def test_unclaimed_reservation_is_freed_after_its_ttl_and_shutdown_is_prompt(own_workers: WorkerSet) -> None:
    ttl_s, fence_s = 1.0, 2.0
    # The second decoder (for the shutdown check below) starts beside the first: their
    # start-ups overlap instead of running one after the other.
    decode, slow_fence = own_workers.start_many([
        ("decode", {"env": {"KVXFER_RESERVATION_TTL_S": str(ttl_s), "KVXFER_FENCE_TIMEOUT_S": str(fence_s)}}),
        ("decode", {"env": {"KVXFER_FENCE_TIMEOUT_S": "120"}}),
    ])
    prompt = tokens_of(text_prompt(901, 300))
    with httpx.Client(timeout=10) as c:
        res = c.post(f"{decode.url}/reserve", json={"request_id": "orphan", "prompt_tokens": prompt, "max_tokens": 8})
        assert res.status_code == 200, res.text
        t0 = time.monotonic()
        total = info(decode)["total_pages"]
        held = len(res.json()["pages"])
        # Past the TTL the reservation is failed and fenced (a prefiller may have it)...
        wait_until(lambda: "kvxfer_decode_reservations_expired_total 1.0" in c.get(f"{decode.url}/metrics").text,
                   ttl_s + 3, "reservation expired")
        assert info(decode)["free_pages"] == total - held
        gen = c.post(f"{decode.url}/generate", json={"request_id": "orphan", "stream": False})
        assert gen.status_code in (404, 409), gen.text  # no longer waits for KV
        # ...and its pages come back after the fence.
        wait_pages_full(decode, timeout_s=ttl_s + fence_s + 3)
        freed_after = time.monotonic() - t0
        assert freed_after >= ttl_s + fence_s - 0.3, f"freed after {freed_after:.2f} s: before TTL + fence"

        # A fenced reservation (cancelled, prefiller never answered) must not delay shutdown.
        res = c.post(f"{slow_fence.url}/reserve", json={"request_id": "f", "prompt_tokens": prompt, "max_tokens": 8})
        assert res.status_code == 200, res.text
        assert c.post(f"{slow_fence.url}/cancel", json={"request_id": "f"}).json()["state"] == "fenced"
    t0 = time.monotonic()
    slow_fence.proc.send_signal(signal.SIGTERM)
    slow_fence.proc.wait(timeout=30)
    assert time.monotonic() - t0 < 8.0, f"shutdown took {time.monotonic() - t0:.1f} s"


def test_late_write_never_lands_in_reused_pages(own_workers: WorkerSet) -> None:
    """In-process decoder with just enough pages for one long request, so the next request
    can only get the victim's pages; a real slow prefiller is still pushing the victim when
    the decoder cancels it. The next request's pages must hold exactly its own KV."""
    from kvxfer.kv.cache import PagedKVCache
    from kvxfer.workers.decode.service import DecodeService, DecodeSettings

    slow, fast = own_workers.start_many([
        ("prefill", {"env": {**PREFILL_ENV, "KVXFER_PREFILL_CHUNK_TOKENS": "16",
                             "KVXFER_EMULATED_LAYER_COMPUTE_MS": "20"}}),
        ("prefill", {"env": PREFILL_ENV}),
    ])
    victim, nxt = tokens_of(text_prompt(902, 1000)), tokens_of(text_prompt(903, 1000))
    pages_each = -(-(1000 + 8) // CONFIG.block_size)
    decode = DecodeService(DecodeSettings(model="tiny", provider="net", bind_host="127.0.0.1", num_pages=pages_each + 4,
                                          max_requests=4, fence_timeout_s=4.0))
    decode_address = decode.core.engine.address.hex()
    try:
        async def run() -> tuple[dict[str, Any], Any, float]:
            async with httpx.AsyncClient(timeout=60) as client:
                res = decode.reserve("victim", len(victim), 8).to_json()
                body = {**res, "engine_address": decode_address}
                pre = asyncio.create_task(prefill_call(client, slow, "victim", victim, body))
                await asyncio.to_thread(wait_until, lambda: decode.core.engine.imm_count(res["imm"]) > 0, 20,
                                        "the victim's first write")
                decode.cancel("victim")  # the slow prefiller is not told: its push goes on
                cancelled_at = time.monotonic()
                while True:  # the router would retry: reserve as soon as pages are free
                    try:
                        res2 = decode.reserve("next", len(nxt), 8)
                        break
                    except Exception as exc:
                        assert "OVERLOADED" in repr(exc) or "pages" in str(exc), exc
                        await asyncio.sleep(0.01)
                waited = time.monotonic() - cancelled_at
                body2 = {**res2.to_json(), "engine_address": decode_address}
                job = decode.job("next")
                p2 = asyncio.create_task(prefill_call(client, fast, "next", nxt, body2))
                await decode.wait_for_kv(job, 30)
                assert (await p2).status_code == 200
                await pre  # the victim's push is over now, whatever it wrote
                await asyncio.sleep(0.2)
                return res, res2, waited

        res, res2, waited = asyncio.run(run())
        # The pool is tight: the next request got the victim's pages (what makes this a test).
        assert set(res["pages"]) & set(res2.pages)
        with one_torch_thread():
            ref_cache = PagedKVCache.from_config(CONFIG, len(res2.pages))
            reference_model().prefill(nxt, ref_cache, list(range(len(res2.pages))), chunk_size=256)
        n_pages = -(-len(nxt) // CONFIG.block_size)
        for layer in range(CONFIG.num_layers):
            for i, page in enumerate(res2.pages[:n_pages]):
                valid = min(CONFIG.block_size, len(nxt) - i * CONFIG.block_size)
                got = decode.core.cache.page_view(layer, page).numpy()[:, :valid]
                want = ref_cache.page_view(layer, i).numpy()[:, :valid]
                assert np.array_equal(got, want), f"page {page} (layer {layer}, block {i}) holds foreign bytes"
        # It had to wait for the fence: the victim's writes might still land before.
        assert waited >= 3.5, f"the victim's pages were reused {waited:.2f} s after the cancel"
    finally:
        decode.close()


def test_late_immediate_of_an_earlier_reservation_is_not_counted(own_workers: WorkerSet) -> None:
    from kvxfer.transfer.engine import TransferEngine
    from kvxfer.workers.decode.service import DecodeService, DecodeSettings

    decode = DecodeService(DecodeSettings(model="tiny", provider="net", bind_host="127.0.0.1", num_pages=64,
                                          max_requests=1))
    try:
        first = decode.reserve("first", 20, 4)
        decode.cancel("first", prefill_stopped=True)  # its prefiller said it stopped (here: wrongly)
        second = decode.reserve("second", 20, 4)
        assert decode.job("second").slot == decode.ledger.get("second").slot == 0
        with TransferEngine("net", bind_host="127.0.0.1") as stray:
            stray.write_imm(first.descriptor, first.imm).wait(10)
            stray.write_imm(first.descriptor, second.imm).wait(10)  # (proves delivery works)
        wait_until(lambda: decode.core.engine.imm_count(second.imm) >= 1, 10, "the control write")
        assert decode.core.engine.imm_count(second.imm) == 1, "a write of the earlier reservation was counted"
    finally:
        decode.close()
