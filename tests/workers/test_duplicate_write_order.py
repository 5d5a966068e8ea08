"""A page written twice is refused before admission, whichever of its writes the decoder
counts last (kvxfer/handoff/admission.py, `check_landed`'s declared total).

A push that writes one page twice posts `expected_count + 1` immediate units. The decoder's
count reaches `expected_count` with one of them not counted yet, and which one is up to the
transport (writes are unordered across rails and providers) and to the decoder's progress
thread (a write's bytes are in memory before its completion is counted):

- the mailbox counted, the extra write not yet: the count is exact and the mailbox is this
  reservation's, so a count-only check admits, and the extra write lands after admission;
- the extra write counted in place of the mailbox, whose bytes already landed but whose
  completion is not counted yet: the same.

Only the push can say how many it posted: its mailbox record carries the total, and the
decoder admits only when that total is exactly what it expects. The faulty prefiller here
is this process, an engine of its own on loopback, so the order is set, not hoped for: it
writes every page once, then the two orders above, then (once the decoder answered) the
write it held back. The same push without the page written twice is admitted, so the
refusal is the count's and nothing else's (tests/workers/test_fault_injection.py runs the
drill with a real prefill worker and its push hooks, where the order is the transport's).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from support.kv_requests import CONFIG, FENCE_S, reserve, text_prompt, tokens_of, wait_pages_full
from support.worker_procs import WorkerProc, WorkerSet

from kvxfer.errors import TransferError
from kvxfer.kv.integrity import crc32c
from kvxfer.kv.protocol import encode_mailbox
from kvxfer.transfer.engine import RegisteredMemory, TransferEngine

pytestmark = pytest.mark.timeout(120)

PROMPT = 120  # tokens: 8 pages of the tiny model per layer
PAGES = -(-PROMPT // CONFIG.block_size)
FIRST_TOKEN = ord("d")
#: Each of this process's writes lands or fails within it (the engine's own deadline).
WRITE_TIMEOUT_S = 5.0
#: The KV wait of /generate: the count is complete before it is asked, so this only bounds a hang.
KV_WAIT_S = 5.0
OVERCOUNT = 'kvxfer_decode_kv_integrity_failures_total{reason="write_overcount"}'


@pytest.fixture(scope="module")
def decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProc]:
    """A decode worker on loopback, the same-host path off: every write crosses the provider."""
    workers = WorkerSet(tmp_path_factory.mktemp("duplicate_write_order"))
    try:
        yield workers.start("decode", env={"KVXFER_SAME_HOST": "false", "KVXFER_KV_INTEGRITY": "full",
                                           "KVXFER_FENCE_TIMEOUT_S": str(FENCE_S)})
    except BaseException:
        print(workers.logs())
        raise
    finally:
        workers.close()


@pytest.fixture(scope="module")
def engine() -> Iterator[TransferEngine]:
    with TransferEngine("net", bind_host="127.0.0.1", same_host=False, transfer_timeout_s=WRITE_TIMEOUT_S) as eng:
        yield eng


def metric(worker: WorkerProc, name: str) -> float:
    text = httpx.get(f"{worker.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


class RawPush:
    """One reservation's push from this process: seeded pages, their CRC-32C table, and a
    mailbox record that declares every unit the push posts (with `twice`, one page written
    twice: one unit more than expected)."""

    def __init__(self, engine: TransferEngine, reservation: dict[str, Any], seed: int, *, twice: bool) -> None:
        assert reservation["checksums"] and not reservation.get("checksum_tag")
        assert reservation["first_page"] == 0 and reservation["expected_count"] == CONFIG.num_layers * PAGES + 1
        self.engine, self.res = engine, reservation
        page_bytes = CONFIG.page_bytes
        self.pages = np.random.default_rng(seed).integers(0, 256, (CONFIG.num_layers, PAGES, page_bytes),
                                                          dtype=np.uint8)
        table = b"".join(struct.pack("<I", crc32c(self.pages[layer, block]))
                         for layer in range(CONFIG.num_layers) for block in range(PAGES))
        # Every page once, the mailbox, and with `twice` one page again: what it posts.
        record = encode_mailbox(reservation["nonce"], FIRST_TOKEN, PROMPT, table,
                                units=reservation["expected_count"] + int(twice))
        self.record = np.frombuffer(record, dtype=np.uint8).copy()
        self.pages_mr: RegisteredMemory = engine.register(self.pages)
        self.record_mr: RegisteredMemory = engine.register(self.record)

    def close(self) -> None:
        self.engine.deregister(self.pages_mr)
        self.engine.deregister(self.record_mr)

    def write_layer_pages(self, layer: int, blocks: list[int]) -> None:
        """Blocks `blocks` of `layer` into their reserved pages, one unit each, landed on return."""
        page_bytes, res = CONFIG.page_bytes, self.res
        self.engine.write_paged(self.pages_mr, blocks, bytes.fromhex(res["descriptor"]),
                                [res["pages"][b] for b in blocks], page_bytes,
                                src_offset=layer * PAGES * page_bytes,
                                dst_offset=layer * res["num_pages"] * page_bytes,
                                imm=res["imm"]).wait(WRITE_TIMEOUT_S)

    def write_every_page_once(self) -> None:
        for layer in range(CONFIG.num_layers):
            self.write_layer_pages(layer, list(range(PAGES)))

    def write_duplicate(self) -> None:
        """Layer 0's first page again, the same bytes: only the count can tell."""
        self.write_layer_pages(0, [0])

    def write_mailbox(self, *, counted: bool) -> None:
        """The record's bytes into the mailbox slot, landed on return; `counted`: with the
        reservation's immediate, else without (its unit follows in `count_mailbox`)."""
        res = self.res
        self.engine.write(self.record_mr, 0, bytes.fromhex(res["meta_descriptor"]), res["meta_offset"],
                          self.record.size, imm=res["imm"] if counted else None).wait(WRITE_TIMEOUT_S)

    def count_mailbox(self) -> None:
        """The mailbox write's unit, late: the completion the decoder had not counted yet."""
        self.engine.write_imm(bytes.fromhex(self.res["meta_descriptor"]), self.res["imm"]).wait(WRITE_TIMEOUT_S)


Step = Callable[[RawPush], object]
#: (writes before /generate, the write held back until it answered) of each order.
ORDERS: dict[str, tuple[Step, Step]] = {
    # The extra write is counted after the mailbox: the count is exact with the mailbox in it.
    "duplicate_counted_after_the_mailbox": (
        lambda push: (push.write_every_page_once(), push.write_mailbox(counted=True)),
        lambda push: push.write_duplicate()),
    # The extra write completes the count while the mailbox's bytes landed uncounted.
    "mailbox_landed_before_its_count": (
        lambda push: (push.write_every_page_once(), push.write_mailbox(counted=False), push.write_duplicate()),
        lambda push: push.count_mailbox()),
}


def push_and_generate(decode: WorkerProc, engine: TransferEngine, rid: str, seed: int, twice: bool,
                      before_count: Step, late: Step | None) -> tuple[int, dict[str, Any]]:
    """Reserve, `before_count`, then /generate, then `late`; the /generate answer."""
    prompt = tokens_of(text_prompt(seed, PROMPT))
    assert len(prompt) == PROMPT

    async def run() -> tuple[int, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=30) as client:
            reservation = await reserve(client, decode, rid, prompt)
            push = RawPush(engine, reservation, seed, twice=twice)
            try:
                # Off the event loop: each write waits for its landing.
                await asyncio.to_thread(before_count, push)
                # Every expected unit is counted now, one of the push's is not: the decoder
                # decides here.
                resp = await client.post(f"{decode.url}/generate",
                                         json={"request_id": rid, "stream": False, "timeout_s": KV_WAIT_S})
                # The held-back write lands after the answer, as it would have after admission.
                # A refused request keeps its registration open until the fence (no prefiller
                # word comes), so it lands in fenced pages; an admitted one has closed it.
                if late is not None:
                    try:
                        await asyncio.to_thread(late, push)
                    except TransferError as exc:  # an admitted request's closed registration
                        print(f"late write of {rid}: {exc}")
                return resp.status_code, resp.json()
            finally:
                push.close()

    return asyncio.run(run())


def test_the_same_push_without_the_page_written_twice_is_admitted(decode: WorkerProc,
                                                                  engine: TransferEngine) -> None:
    wait_pages_full(decode, timeout_s=FENCE_S + 5)
    status, body = push_and_generate(
        decode, engine, "once", 899, False,
        lambda push: (push.write_every_page_once(), push.write_mailbox(counted=True)), None)
    assert status == 200 and body["tokens"][0] == FIRST_TOKEN, body
    wait_pages_full(decode, timeout_s=FENCE_S + 5)


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_page_written_twice_is_refused_whichever_write_is_counted_last(decode: WorkerProc, engine: TransferEngine,
                                                                         order: str) -> None:
    before_count, late = ORDERS[order]
    wait_pages_full(decode, timeout_s=FENCE_S + 5)
    overcounts = metric(decode, OVERCOUNT)
    status, body = push_and_generate(decode, engine, f"twice-{order}", 900 + list(ORDERS).index(order), True,
                                     before_count, late)
    assert status == 502 and body.get("reason") == "integrity", (order, status, body)
    assert "write_overcount" in body["detail"] and "posted" in body["detail"], body
    assert metric(decode, OVERCOUNT) == overcounts + 1
    # FAILED, then FENCED (the last write is not known to have landed), then free.
    wait_pages_full(decode, timeout_s=FENCE_S + 5)
