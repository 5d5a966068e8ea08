"""The prefill service's cancel glue (workers/prefill/service.py), in this process: a
`PrefillService` of the tiny model pushes into the regions of a bare decoder engine (two
engines over libfabric loopback, the same-host path off).

- a /prefill whose id was cancelled before it arrived is refused (409), and holds nothing;
- only the caller that sent a /prefill may cancel it; its own cancel answers once none of
  its writes is in flight, the /prefill fails as cancelled and its pages come back;
- a push that completes answers with its figures and frees its local pages.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from support.waiting import wait_until

from kvxfer.kv.cache import PagedKVCache
from kvxfer.kv.protocol import MAILBOX_SLOT_BYTES, KVReservation, encode_imm, mailbox_slot_bytes, pages_for_tokens
from kvxfer.model.config import ModelConfig
from kvxfer.transfer.engine import TransferEngine
from kvxfer.workers.prefill.service import PrefillService, PrefillSettings
from kvxfer.workers.rejection import Rejection, RequestRejected

CONFIG = ModelConfig.preset("tiny")
DECODER_PAGES = 64
PREFILL_PAGES = 64
# Each layer of a chunk "computes" this long: a request stays running long enough for a
# cancel to find it (2 layers, one chunk: 0.8 s).
EMULATED_LAYER_COMPUTE_MS = 400.0
PROMPT_TOKENS = 40  # 3 pages
RELEASE_TIMEOUT_S = 15.0  # a push's pages come back once its writes drained (loopback: ms)

_imm_slots = itertools.count(1)


@dataclass
class BareDecoder:
    """A decoder's KV cache and mailbox registered with an engine, and nothing else."""

    engine: TransferEngine
    kv_descriptor: bytes
    meta_descriptor: bytes
    kv_layout: str


@pytest.fixture(scope="module")
def decoder() -> Iterator[BareDecoder]:
    engine = TransferEngine("net", bind_host="127.0.0.1", same_host=False)
    try:
        cache = PagedKVCache.from_config(CONFIG, DECODER_PAGES)
        mailbox = np.zeros(4 * mailbox_slot_bytes(CONFIG.num_layers, DECODER_PAGES), dtype=np.uint8)
        kv_region, meta_region = engine.register(cache.tensor), engine.register(mailbox)
        yield BareDecoder(engine, kv_region.descriptor, meta_region.descriptor, cache.kv_layout)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def service() -> Iterator[PrefillService]:
    settings = PrefillSettings(model="tiny", provider="net", bind_host="127.0.0.1", same_host=False,
                               num_pages=PREFILL_PAGES, emulated_layer_compute_ms=EMULATED_LAYER_COMPUTE_MS)
    prefill = PrefillService(settings)
    try:
        yield prefill
    finally:
        prefill._compute.shutdown(wait=True)
        prefill.core.close()


def reservation_for(decoder: BareDecoder, service: PrefillService, request_id: str) -> KVReservation:
    """Pages 0.. of the bare decoder for a prompt of PROMPT_TOKENS tokens."""
    pages = pages_for_tokens(PROMPT_TOKENS, CONFIG.block_size)
    return KVReservation(
        request_id=request_id, descriptor=decoder.kv_descriptor, pages=list(range(pages)), num_pages=DECODER_PAGES,
        imm=encode_imm(next(_imm_slots), 1), expected_count=CONFIG.num_layers * pages + 1,
        kv_layout=decoder.kv_layout, meta_descriptor=decoder.meta_descriptor, meta_offset=MAILBOX_SLOT_BYTES,
        nonce=11, fence_timeout_s=service.core.engine.transfer_timeout_s + 5.0,
    )


def prompt_of(seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, CONFIG.vocab_size, PROMPT_TOKENS)]


def wait_pages_back(service: PrefillService) -> None:
    wait_until(lambda: service.allocator.free_pages == service.allocator.total_pages and not service.jobs,
               RELEASE_TIMEOUT_S, "the prefiller's pages freed and no request left")


def test_a_prefill_after_its_cancel_is_refused(decoder: BareDecoder, service: PrefillService) -> None:
    async def cancel_then_prefill() -> dict[str, object]:
        answer = await service.cancel("too-late", caller="router")
        with pytest.raises(RequestRejected) as refused:
            await service.prefill("too-late", prompt_of(1), reservation_for(decoder, service, "too-late"), "router")
        assert refused.value.reason is Rejection.CONFLICT
        assert str(refused.value) == "request too-late was cancelled before it arrived"
        return answer

    assert asyncio.run(cancel_then_prefill()) == {"request_id": "too-late", "in_flight": False, "known": False}
    assert service.allocator.free_pages == service.allocator.total_pages
    assert not service.jobs


def test_only_the_sender_cancels_and_its_cancel_frees_the_pages(decoder: BareDecoder,
                                                               service: PrefillService) -> None:
    async def cancel_while_running() -> None:
        running = asyncio.create_task(
            service.prefill("running", prompt_of(2), reservation_for(decoder, service, "running"), "owner"))
        for _ in range(500):  # bounded: the request is accepted within the first few turns
            if "running" in service.jobs or running.done():
                break
            await asyncio.sleep(0.01)
        assert "running" in service.jobs, "the request never started"
        with pytest.raises(RequestRejected) as intruder:
            await service.cancel("running", caller="intruder")
        assert intruder.value.reason is Rejection.UNKNOWN_REQUEST
        assert str(intruder.value) == "unknown request id running"
        assert await service.cancel("running", caller="owner") == {
            "request_id": "running", "in_flight": False, "known": True}
        with pytest.raises(RequestRejected) as cancelled:
            await running
        assert cancelled.value.reason is Rejection.CONFLICT
        assert str(cancelled.value).startswith("request running was cancelled")

    asyncio.run(cancel_while_running())
    wait_pages_back(service)


def test_a_completed_push_answers_its_figures_and_frees_its_pages(decoder: BareDecoder,
                                                                  service: PrefillService) -> None:
    answer = asyncio.run(service.prefill("whole", prompt_of(3), reservation_for(decoder, service, "whole"), "router"))
    pages = pages_for_tokens(PROMPT_TOKENS, CONFIG.block_size)
    assert answer["request_id"] == "whole"
    assert (answer["pages_pushed"], answer["pages_skipped"], answer["chunks"]) == (pages, 0, 1)
    assert answer["writes"] == CONFIG.num_layers  # one paged write per layer of the one chunk
    assert answer["kv_bytes"] == CONFIG.num_layers * pages * service.core.cache.page_bytes
    assert answer["computed_tokens"] == PROMPT_TOKENS
    wait_pages_back(service)
