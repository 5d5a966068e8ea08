"""A forged push over the socket providers (tcp, net), between real worker processes.

The outsider is an engine that is not the prefiller the router named, and holds what a
leak of a live reservation gives: its descriptors, immediate, nonce and expected count. It
writes forged pages into the reserved pages, then the mailbox record with the stolen nonce
and the correct CRC-32C table of its own pages (CRC-32C is not keyed: anyone can compute
it). The decoder binds the immediate to the named prefiller, but an RMA write carrying an
immediate is not always named right by the provider (tcp credited an outsider's write to
the bound prefiller: docs/architecture.md, "Data plane"), so the binding alone may not
stop it. What must hold on every provider: the forgery is never admitted. It either never
counts (dropped as foreign, 504 at its deadline) or fails admission (502 `integrity`),
because the table carries no tag that verifies under the cluster key. The named
prefiller's own push, tagged, is admitted byte for byte beside it.

Workers on loopback with the same-host path off, so every write crosses the provider.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import secrets
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from support.cluster_load import get_metrics, metric_value
from support.descriptor_forge import CHECKSUM_CRC32C, CHECKSUM_CRC32C_TAGGED, mailbox_record
from support.kv_requests import (
    CONFIG,
    DIGEST_ENV,
    FENCE_S,
    MAX_TOKENS,
    PREFILL_ENV,
    check_against_reference,
    generate_call,
    prefill_call,
    text_prompt,
    tokens_of,
)
from support.worker_procs import WorkerProc, WorkerSet

from kvxfer.cluster.control_client import ControlTokenAuth
from kvxfer.kv.integrity import crc32c
from kvxfer.transfer.engine import TransferEngine

pytestmark = pytest.mark.timeout(120)

PROMPT = tokens_of(text_prompt(28, 200))
PROMPT_PAGES = -(-len(PROMPT) // CONFIG.block_size)
# Three reservations (two forgeries, one legitimate push) with their pages fenced after a
# refusal, and room to spare.
NUM_PAGES = 64
# The outsider's writes land or fail by the provider; this only bounds a hang.
OUTSIDER_TIMEOUT_S = 5.0
# A forgery the decoder drops as foreign never completes its count: the KV deadline of its
# /generate then ends it (504). Short, so that case costs little.
FORGED_KV_WAIT_S = 3.0
FORGED_FIRST_TOKEN = 65


class ForgeryBench:
    """A decoder and the prefiller it names, both on one provider and sharing a cluster
    key, and an outsider engine on that provider."""

    def __init__(self, provider: str, key_path: Path, decode: WorkerProc, prefill: WorkerProc,
                 outsider: TransferEngine) -> None:
        self.provider = provider
        self.key_path = key_path
        self.decode = decode
        self.prefill = prefill
        self.outsider = outsider

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=30, trust_env=False, auth=ControlTokenAuth(self.key_path, "router"))

    def metric(self, sample: str) -> float:
        return metric_value(get_metrics(self.decode.url), sample)

    def engine_address(self, worker: WorkerProc) -> str:
        resp = httpx.get(f"{worker.url}/info", auth=ControlTokenAuth(self.key_path), trust_env=False)
        assert resp.status_code == 200, resp.text
        return str(resp.json()["engine_address"])


@pytest.fixture(scope="module", params=["tcp", "net"])
def bench(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForgeryBench]:
    provider = str(request.param)
    tmp = tmp_path_factory.mktemp(f"forged-push-{provider}")
    key_path = tmp / "cluster.key"
    key_path.write_bytes(base64.b64encode(secrets.token_bytes(48)))
    workers = WorkerSet(tmp, env={"KVXFER_CLUSTER_KEY_FILE": str(key_path), "KVXFER_SAME_HOST": "false"})
    try:
        decode, prefill = workers.start_many([
            ("decode", {"provider": provider, "num_pages": NUM_PAGES,
                        "env": {**DIGEST_ENV, "KVXFER_FENCE_TIMEOUT_S": str(FENCE_S)}}),
            ("prefill", {"provider": provider, "env": PREFILL_ENV}),
        ])
        outsider = TransferEngine(provider, bind_host="127.0.0.1", same_host=False,
                                  transfer_timeout_s=OUTSIDER_TIMEOUT_S)
        try:
            yield ForgeryBench(provider, key_path, decode, prefill, outsider)
        finally:
            outsider.close()
    except BaseException:
        print(workers.logs())
        raise
    finally:
        workers.close()


async def reserve_naming(client: httpx.AsyncClient, bench: ForgeryBench, rid: str) -> dict[str, Any]:
    """/reserve as the router sends it: naming the prefiller it chose."""
    resp = await client.post(f"{bench.decode.url}/reserve", json={
        "request_id": rid, "prompt_tokens": PROMPT, "max_tokens": MAX_TOKENS,
        "prefill_engine_address": bench.engine_address(bench.prefill)})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def forge_push(bench: ForgeryBench, reservation: dict[str, Any], seed: int, algorithm: int, tag_key: bytes) -> None:
    """The outsider's whole push into a live reservation: seeded forged pages into every
    prompt page of every layer, then a mailbox record with the stolen nonce and the right
    CRC-32C of those pages, each write carrying the reservation's immediate, exactly
    `expected_count` of them. `tag_key` (the outsider's own key) tags the table where
    `algorithm` has a tag."""
    engine, page_bytes, layers = bench.outsider, CONFIG.page_bytes, CONFIG.num_layers
    assert reservation["expected_count"] == layers * PROMPT_PAGES + 1
    pages = np.random.default_rng(seed).integers(0, 256, (layers, PROMPT_PAGES, page_bytes), dtype=np.uint8)
    table = b"".join(struct.pack("<I", crc32c(pages[layer, block]))
                     for layer in range(layers) for block in range(PROMPT_PAGES))
    units = reservation["expected_count"]  # the total the decoder wants declared: the forgery owns up to it
    head = mailbox_record(reservation["nonce"], FORGED_FIRST_TOKEN, len(PROMPT), table, algorithm, units=units)
    tag = hmac.new(tag_key, head, hashlib.sha256).digest() if algorithm == CHECKSUM_CRC32C_TAGGED else b""
    record = np.frombuffer(mailbox_record(reservation["nonce"], FORGED_FIRST_TOKEN, len(PROMPT), table,
                                          algorithm, tag, units=units), dtype=np.uint8).copy()
    pages_mr, record_mr = engine.register(pages), engine.register(record)
    try:
        descriptor = bytes.fromhex(reservation["descriptor"])
        for layer in range(layers):
            engine.write_paged(pages_mr, list(range(PROMPT_PAGES)), descriptor, reservation["pages"][:PROMPT_PAGES],
                               page_bytes, src_offset=layer * PROMPT_PAGES * page_bytes,
                               dst_offset=layer * reservation["num_pages"] * page_bytes,
                               imm=reservation["imm"]).wait(OUTSIDER_TIMEOUT_S)
        engine.write(record_mr, 0, bytes.fromhex(reservation["meta_descriptor"]), reservation["meta_offset"],
                     record.size, imm=reservation["imm"]).wait(OUTSIDER_TIMEOUT_S)
    finally:
        engine.deregister(pages_mr)
        engine.deregister(record_mr)


def test_a_forged_push_with_the_stolen_nonce_and_a_correct_crc_table_is_never_admitted(
        bench: ForgeryBench) -> None:
    foreign = "kvxfer_engine_imm_foreign_dropped_total"
    refused = 'kvxfer_decode_kv_integrity_failures_total{reason="mailbox_mismatch"}'
    foreign_before, refused_before = bench.metric(foreign), bench.metric(refused)
    # Two forgeries: the unkeyed table decoders took before tables were keyed, and the
    # keyed form under the outsider's own key.
    forgeries = {"kx-forged-unkeyed": CHECKSUM_CRC32C, "kx-forged-own-key": CHECKSUM_CRC32C_TAGGED}

    async def run() -> dict[str, tuple[int, dict[str, Any]]]:
        async with bench.client() as client:
            reservations = {rid: await reserve_naming(client, bench, rid) for rid in forgeries}
            for seed, (rid, algorithm) in enumerate(forgeries.items()):
                forge_push(bench, reservations[rid], seed, algorithm, secrets.token_bytes(32))
            results = await asyncio.gather(*(
                generate_call(client, bench.decode, rid, stream=False, timeout_s=FORGED_KV_WAIT_S)
                for rid in forgeries))
            return dict(zip(forgeries, results))

    results = asyncio.run(run())
    dropped = bench.metric(foreign) - foreign_before
    failed = bench.metric(refused) - refused_before
    expected_count = CONFIG.num_layers * PROMPT_PAGES + 1
    for rid, (status, body) in results.items():
        # Never admitted: refused at admission, or never counted because the provider named
        # the outsider and the decoder dropped its immediates.
        assert status in (502, 504), f"{bench.provider}: {rid} was answered {status} {body}: forged KV admitted"
        if status == 502:
            assert body.get("reason") == "integrity" and "tag" in body.get("detail", ""), (rid, body)
        else:
            assert body.get("reason") == "kv_timeout" and f"0 of {expected_count}" in body["detail"], (rid, body)
    assert failed == sum(status == 502 for status, _ in results.values()), (results, failed)
    # Each 504 is a forgery whose every write (at least one completion per layer and the
    # mailbox's) the engine dropped as foreign.
    timed_out = sum(status == 504 for status, _ in results.values())
    assert dropped >= (CONFIG.num_layers + 1) * timed_out, (results, dropped)


def test_the_named_prefillers_keyed_push_is_admitted_byte_for_byte(bench: ForgeryBench) -> None:
    async def run() -> None:
        async with bench.client() as client:
            rid = "kx-named-prefiller"
            reservation = await reserve_naming(client, bench, rid)
            pre, gen = await asyncio.gather(prefill_call(client, bench.prefill, rid, PROMPT, reservation),
                                            generate_call(client, bench.decode, rid, stream=False))
            check_against_reference(rid, PROMPT, reservation, pre, gen)
            assert gen[1]["receipt"]["verdict"] == "verified", gen

    asyncio.run(run())
