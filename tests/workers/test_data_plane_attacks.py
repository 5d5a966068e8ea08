"""Attacks on a decoder's data plane from an outside engine, with workers as pods (own
network and PID namespaces, so all KV crosses the fabric) and a cluster key.

The outsider holds what a leak would give it: a reservation's descriptor (stolen while the
reservation lives, or kept after it ended), its immediate, and the decoder's engine
address. With `kv_registration: per_reservation` (the default) and the router naming the
prefiller in /reserve, each case ends in an error at the outsider, a dropped and counted
arrival, or a refusal at the decoder, and the KV of the legitimate requests is
byte-for-byte the colocated reference (the receipt's digest) with the full CRC-32C check on.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from support.cluster_load import get_metrics, metric_value
from support.descriptor_forge import parse, whole_region_with_window_key
from support.kv_requests import (
    CONFIG,
    DIGEST_ENV,
    FENCE_S,
    PREFILL_ENV,
    check_against_reference,
    disaggregated,
    generate_call,
    prefill_call,
    reserve,
    text_prompt,
    tokens_of,
)
from support.pod_cluster import POD_MODE_UNAVAILABLE
from support.pod_namespaces import PodNetwork
from support.waiting import wait_until
from support.worker_procs import WorkerProc, WorkerSet

from kvxfer.cluster.control_client import ControlTokenAuth
from kvxfer.errors import BoundsError, TransferError
from kvxfer.transfer.engine import TransferEngine

pytestmark = pytest.mark.timeout(240)

PROMPT = tokens_of(text_prompt(21, 200))
PAGES_PER_REQUEST = -(-(len(PROMPT) + 16) // CONFIG.block_size)
# Two requests' worth: the pool is reused within a few reservations, as under load.
NUM_PAGES = 2 * PAGES_PER_REQUEST
PROMPT_PAGES = -(-len(PROMPT) // CONFIG.block_size)
# The outsider's writes fail by the provider's error completion; this only bounds a hang.
OUTSIDER_TIMEOUT_S = 5.0


class DataPlane:
    """A decode and a prefill pod sharing a cluster key, and an outside engine on the bridge."""

    def __init__(self, key_path: Path, decode: WorkerProc, prefill: WorkerProc, outsider: TransferEngine) -> None:
        self.key_path = key_path
        self.decode = decode
        self.prefill = prefill
        self.outsider = outsider
        self.garbage = np.full(NUM_PAGES * CONFIG.page_bytes, 0x5A, dtype=np.uint8)
        self.garbage_mr = outsider.register(self.garbage)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=30, trust_env=False, auth=ControlTokenAuth(self.key_path, "router"))

    def metric(self, sample: str) -> float:
        return metric_value(get_metrics(self.decode.url), sample)

    def pool_is_whole(self) -> None:
        def whole() -> bool:
            resp = httpx.get(f"{self.decode.url}/info", auth=ControlTokenAuth(self.key_path), trust_env=False)
            return resp.json()["free_pages"] == NUM_PAGES
        wait_until(whole, FENCE_S + 10, "decoder's pages all free")


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DataPlane]:
    if POD_MODE_UNAVAILABLE is not None:
        pytest.skip(f"pod namespaces: {POD_MODE_UNAVAILABLE}")
    tmp = tmp_path_factory.mktemp("data-plane")
    key_path = tmp / "cluster.key"
    key_path.write_bytes(base64.b64encode(secrets.token_bytes(48)))
    net = PodNetwork()
    workers = WorkerSet(tmp, pods=net, env={"KVXFER_CLUSTER_KEY_FILE": str(key_path)})
    try:
        with net.client() as client_address:
            decode, prefill = workers.start_many([
                ("decode", {"num_pages": NUM_PAGES, "env": {**DIGEST_ENV, "KVXFER_FENCE_TIMEOUT_S": str(FENCE_S)}}),
                ("prefill", {"env": PREFILL_ENV}),
            ])
            outsider = TransferEngine("net", bind_host=client_address, same_host=False,
                                      transfer_timeout_s=OUTSIDER_TIMEOUT_S)
            try:
                yield DataPlane(key_path, decode, prefill, outsider)
            finally:
                outsider.close()
    except BaseException:
        print(workers.logs())
        raise
    finally:
        workers.close()
        net.close()


def layer_page_offsets(pages: list[int], layers: range) -> list[int]:
    """Byte offsets in the decoder's cache of `pages` in each layer of `layers`."""
    return [(layer * NUM_PAGES + page) * CONFIG.page_bytes for layer in layers for page in pages]


def outsider_write_fails(plane: DataPlane, descriptor: bytes, dst_offset: int) -> str:
    """One page of garbage from the outsider; returns the error it got (fails if it landed)."""
    with pytest.raises(TransferError) as failed:
        transfer = plane.outsider.write(plane.garbage_mr, 0, descriptor, dst_offset, CONFIG.page_bytes)
        transfer.wait(OUTSIDER_TIMEOUT_S * 2)
    assert "timed out" not in str(failed.value), "expected the provider's refusal, not silence"
    return str(failed.value)


async def cancel(client: httpx.AsyncClient, plane: DataPlane, rid: str) -> None:
    resp = await client.post(f"{plane.decode.url}/cancel", json={"request_id": rid, "prefill_stopped": True})
    assert resp.status_code == 200, resp.text


def test_a_stolen_live_descriptor_cannot_write_outside_its_own_reservation(plane: DataPlane) -> None:
    plane.pool_is_whole()
    registrations = plane.metric("kvxfer_decode_reservation_registrations_total")

    async def run() -> None:
        async with plane.client() as client:
            stolen = await reserve(client, plane.decode, "kx-stolen-live", PROMPT)
            legit = await reserve(client, plane.decode, "kx-legit-beside", PROMPT)
            pre = await prefill_call(client, plane.prefill, "kx-legit-beside", PROMPT, legit)
            assert pre.status_code == 200, pre.text  # its KV landed; admission checks it at /generate
            descriptor = bytes.fromhex(stolen["descriptor"])
            assert parse(descriptor).windows, "the reservation handed out a whole-cache descriptor"
            # Through our own planner: refused before anything is posted.
            with pytest.raises(BoundsError, match="outside the windows"):
                neighbour_page = layer_page_offsets(legit["pages"][:1], range(1))[0]
                plane.outsider.write(plane.garbage_mr, 0, descriptor, neighbour_page, CONFIG.page_bytes)
            # A forged descriptor claiming the whole cache under the stolen key: only the
            # provider's check of key and range stands between it and the neighbour's KV.
            forged = whole_region_with_window_key(descriptor)
            window_start = parse(descriptor).windows[0][0]
            neighbour = layer_page_offsets(legit["pages"][:PROMPT_PAGES], range(1, CONFIG.num_layers))
            targets = [o - window_start for o in neighbour]
            for offset in targets:
                outsider_write_fails(plane, forged, offset)
            # The neighbour is admitted with its full CRC check and its KV is the reference's.
            gen = await generate_call(client, plane.decode, "kx-legit-beside", stream=False)
            check_against_reference("kx-legit-beside", PROMPT, legit, pre, gen)
            await cancel(client, plane, "kx-stolen-live")

    asyncio.run(run())
    # One registration per reservation, and none left open.
    assert plane.metric("kvxfer_decode_reservation_registrations_total") - registrations == 2
    assert plane.metric("kvxfer_decode_reservation_registrations_open") == 0


def test_a_descriptor_kept_after_its_reservation_ended_writes_nothing(plane: DataPlane) -> None:
    plane.pool_is_whole()

    async def run() -> None:
        async with plane.client() as client:
            first, pre, gen = await disaggregated(client, plane.decode, plane.prefill, "kx-ended", PROMPT)
            check_against_reference("kx-ended", PROMPT, first, pre, gen)
            old = bytes.fromhex(first["descriptor"])
            # The pool is two requests wide: within two reservations one gets the ended
            # request's pages back, as the next user of them.
            held: list[str] = []
            for i in range(2):
                rid = f"kx-reuser-{i}"
                victim = await reserve(client, plane.decode, rid, PROMPT)
                held.append(rid)
                if set(victim["pages"][:PROMPT_PAGES]) & set(first["pages"][:PROMPT_PAGES]):
                    break
            else:
                pytest.fail("no reservation reused the ended request's pages")
            pre = await prefill_call(client, plane.prefill, rid, PROMPT, victim)
            assert pre.status_code == 200, pre.text
            # The victim's KV has landed but is not admitted yet: the old descriptor writes
            # garbage over every prompt page of the ended request, in every layer.
            for layer in range(CONFIG.num_layers):
                for page in first["pages"][:PROMPT_PAGES]:
                    outsider_write_fails(plane, old, (layer * NUM_PAGES + page) * CONFIG.page_bytes)
            gen = await generate_call(client, plane.decode, rid, stream=False)
            check_against_reference(rid, PROMPT, victim, pre, gen)
            for other in held[:-1]:
                await cancel(client, plane, other)

    asyncio.run(run())


def test_immediates_from_anyone_but_the_named_prefiller_are_dropped_counted_never_credited(
        plane: DataPlane) -> None:
    # The router names the prefiller in /reserve; on net (FI_SOURCE) the decoder's engine
    # drops arrivals of the reservation's immediate from any other sender. The outsider
    # sends a whole reservation's worth before the real push: without the check the count
    # completes early (or overshoots) and the request fails; with it the request is exact.
    plane.pool_is_whole()
    dropped_before = plane.metric("kvxfer_engine_imm_foreign_dropped_total")
    prefill_address = info_of(plane, plane.prefill)["engine_address"]
    decode_address = bytes.fromhex(info_of(plane, plane.decode)["engine_address"])

    async def run() -> int:
        async with plane.client() as client:
            resp = await client.post(f"{plane.decode.url}/reserve", json={
                "request_id": "kx-imm-victim", "prompt_tokens": PROMPT, "max_tokens": 16,
                "prefill_engine_address": prefill_address})
            assert resp.status_code == 200, resp.text
            victim = resp.json()
            forged = victim["expected_count"]
            for _ in range(forged):
                plane.outsider.write_imm(decode_address, victim["imm"]).wait(OUTSIDER_TIMEOUT_S)
            pre, gen = await asyncio.gather(prefill_call(client, plane.prefill, "kx-imm-victim", PROMPT, victim),
                                            generate_call(client, plane.decode, "kx-imm-victim", stream=False))
            check_against_reference("kx-imm-victim", PROMPT, victim, pre, gen)
            return int(forged)

    forged = asyncio.run(run())
    assert plane.metric("kvxfer_engine_imm_foreign_dropped_total") - dropped_before == forged


#: More distinct values than the decoder's immediate table has slots (its default 65,536),
#: each with the top bit set, which no reservation's immediate ever has.
FLOOD_VALUES = 70_000
#: Slots of the decoder's immediate table (TransferEngine's default imm_table_capacity).
TABLE_SLOTS = 1 << 16
#: Immediate-only writes the outsider keeps in flight while it sprays.
FLOOD_WINDOW = 512


def test_a_flood_of_unclaimed_immediates_takes_no_slot_and_the_decoder_keeps_serving(plane: DataPlane) -> None:
    # Immediate-only writes need no memory key, only the decoder's engine address (which
    # the registry shows anyone). A decoder that gave every new value a slot of its
    # immediate table for good was disabled by one spray of more values than slots: every
    # later reservation failed. Now only values of live reservations are counted.
    plane.pool_is_whole()
    dropped_before = plane.metric("kvxfer_engine_imm_unclaimed_dropped_total")
    decode_address = bytes.fromhex(info_of(plane, plane.decode)["engine_address"])
    in_flight = []
    for i in range(FLOOD_VALUES):
        in_flight.append(plane.outsider.write_imm(decode_address, 0x8000_0000 | i))
        if len(in_flight) == FLOOD_WINDOW:
            for transfer in in_flight:
                transfer.wait(OUTSIDER_TIMEOUT_S)
            in_flight.clear()
    for transfer in in_flight:
        transfer.wait(OUTSIDER_TIMEOUT_S)

    def flood_taken_in() -> bool:
        # Dropped unclaimed, or (a decoder that gives every value a slot) past a full table.
        dropped = plane.metric("kvxfer_engine_imm_unclaimed_dropped_total") - dropped_before
        overflowed = plane.metric("kvxfer_engine_imm_table_overflows_total")
        return dropped >= FLOOD_VALUES or overflowed >= FLOOD_VALUES - TABLE_SLOTS

    wait_until(flood_taken_in, 30, "the decoder took in every flooded immediate")

    async def run() -> list[str]:
        served: list[str] = []
        async with plane.client() as client:
            for i in range(8):
                rid = f"kx-after-flood-{i}"
                reservation = await reserve(client, plane.decode, rid, PROMPT)
                try:
                    pre, gen = await asyncio.gather(prefill_call(client, plane.prefill, rid, PROMPT, reservation),
                                                    generate_call(client, plane.decode, rid, stream=False))
                except ValueError:  # not even a JSON answer: the decoder's 500
                    continue
                if gen[0] == 200:
                    check_against_reference(rid, PROMPT, reservation, pre, gen)
                    served.append(rid)
        return served

    served = asyncio.run(run())
    assert len(served) == 8, f"{len(served)} of 8 requests served after the flood"
    assert plane.metric("kvxfer_engine_imm_unclaimed_dropped_total") - dropped_before == FLOOD_VALUES
    assert plane.metric("kvxfer_engine_imm_table_overflows_total") == 0
    plane.pool_is_whole()


def test_a_malformed_prefiller_address_is_refused_and_takes_nothing(plane: DataPlane) -> None:
    plane.pool_is_whole()

    async def run() -> httpx.Response:
        async with plane.client() as client:
            return await client.post(f"{plane.decode.url}/reserve", json={
                "request_id": "kx-bad-prefiller", "prompt_tokens": PROMPT, "max_tokens": 16,
                "prefill_engine_address": "00" * 40})

    resp = asyncio.run(run())
    assert resp.status_code == 400 and "prefill_engine_address" in resp.text, resp.text
    assert info_of(plane, plane.decode)["free_pages"] == NUM_PAGES


def info_of(plane: DataPlane, worker: WorkerProc) -> dict[str, Any]:
    resp = httpx.get(f"{worker.url}/info", auth=ControlTokenAuth(plane.key_path), trust_env=False)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())
