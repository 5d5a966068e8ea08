"""The prefill worker's checks of a /prefill request (workers/prefill/request_checks.py),
against real regions: a decoder engine registers a KV cache and a mailbox region, a
prefiller engine in this process checks reservations that name them.

Each check either passes or raises `RequestRejected` with the reason and the text the HTTP
answer carries; a layout mismatch is also counted as a failed transfer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvxfer.kv.cache import PagedKVCache
from kvxfer.kv.protocol import MAILBOX_SLOT_BYTES, encode_imm, mailbox_slot_bytes
from kvxfer.metrics import PrefillMetrics
from kvxfer.model.config import ModelConfig
from kvxfer.transfer.engine import TransferEngine
from kvxfer.workers.prefill.request_checks import PrefillRequestChecks
from kvxfer.workers.rejection import Rejection, RequestRejected

CONFIG = ModelConfig.preset("tiny")
DECODER_PAGES = 32
MAILBOX_SLOTS = 4
PROMPT_PAGES = 3  # the reservations below: 3 prompt pages
TRANSFER_TIMEOUT_S = 5.0  # the prefiller's write deadline; fences must be longer


@dataclass
class Regions:
    """A decoder's registered KV cache and mailbox, and the prefiller's checks."""

    decoder: TransferEngine
    kv_descriptor: bytes
    meta_descriptor: bytes
    meta_bytes: int
    checks: PrefillRequestChecks
    registry: CollectorRegistry


@pytest.fixture(scope="module")
def regions() -> Iterator[Regions]:
    decoder = TransferEngine("net", bind_host="127.0.0.1", same_host=False)
    prefiller = TransferEngine("net", bind_host="127.0.0.1", same_host=False, transfer_timeout_s=TRANSFER_TIMEOUT_S)
    try:
        cache = PagedKVCache.from_config(CONFIG, DECODER_PAGES)
        stride = mailbox_slot_bytes(CONFIG.num_layers, DECODER_PAGES)
        mailbox = np.zeros(MAILBOX_SLOTS * stride, dtype=np.uint8)
        kv_region, meta_region = decoder.register(cache.tensor), decoder.register(mailbox)
        registry = CollectorRegistry()
        checks = PrefillRequestChecks(prefiller, cache.kv_layout, CONFIG.num_layers, CONFIG.block_size,
                                      CONFIG.max_context, cache.page_bytes, stride, PrefillMetrics(registry))
        yield Regions(decoder, kv_region.descriptor, meta_region.descriptor, mailbox.size, checks, registry)
    finally:
        prefiller.close()
        decoder.close()


def reservation_json(regions: Regions, **changes: Any) -> dict[str, Any]:
    """A reservation of PROMPT_PAGES pages in the decoder's regions (JSON form), with `changes`."""
    body: dict[str, Any] = {
        "version": 1, "request_id": "r1", "descriptor": regions.kv_descriptor.hex(), "pages": [4, 9, 2],
        "num_pages": DECODER_PAGES, "imm": encode_imm(3, 1), "expected_count": CONFIG.num_layers * PROMPT_PAGES + 1,
        "kv_layout": regions.checks.kv_layout, "meta_descriptor": regions.meta_descriptor.hex(),
        "meta_offset": MAILBOX_SLOT_BYTES, "nonce": 7, "fence_timeout_s": TRANSFER_TIMEOUT_S + 5.0,
        "first_page": 0, "mailbox": True, "checksums": False,
    }
    return {**body, **changes}


def rejection(call: Any, *args: Any) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        call(*args)
    return info.value


def layout_mismatches(regions: Regions) -> float:
    value = regions.registry.get_sample_value("kvxfer_prefill_kv_transfer_failures_total",
                                              {"reason": "layout_mismatch"})
    return value or 0.0


def test_a_reservation_inside_the_decoders_regions_is_accepted(regions: Regions) -> None:
    reservation = regions.checks.parse_reservation("r1", reservation_json(regions))
    assert reservation.pages == [4, 9, 2]
    assert reservation.descriptor == regions.kv_descriptor
    prompt = list(range(PROMPT_PAGES * CONFIG.block_size))
    regions.checks.check_prompt("r1", prompt)
    regions.checks.check_layout("r1", reservation)
    regions.checks.check_fence("r1", reservation)
    regions.checks.check_prefix_pages("r1", prompt, reservation)


def test_a_descriptor_that_does_not_parse_is_invalid_and_named(regions: Regions) -> None:
    bad = rejection(regions.checks.parse_reservation, "r1",
                    reservation_json(regions, meta_descriptor=(b"KVXD" + bytes(60)).hex()))
    assert bad.reason is Rejection.INVALID
    assert str(bad).startswith("malformed decode reservation: meta_descriptor: ")


def test_a_kv_descriptor_too_short_for_the_pages_is_invalid(regions: Regions) -> None:
    # The mailbox region is far smaller than layers x num_pages x page bytes.
    bad = rejection(regions.checks.parse_reservation, "r1",
                    reservation_json(regions, descriptor=regions.meta_descriptor.hex()))
    assert bad.reason is Rejection.INVALID
    assert str(bad) == "malformed decode reservation: pages or meta_offset outside the decoder's regions"


def test_a_mailbox_offset_past_the_meta_region_is_invalid(regions: Regions) -> None:
    past = regions.meta_bytes  # the record would start at the region's end
    bad = rejection(regions.checks.parse_reservation, "r1", reservation_json(regions, meta_offset=past))
    assert bad.reason is Rejection.INVALID
    last = regions.meta_bytes - MAILBOX_SLOT_BYTES
    assert regions.checks.parse_reservation("r1", reservation_json(regions, meta_offset=last)).meta_offset == last


def test_a_field_that_does_not_parse_is_invalid(regions: Regions) -> None:
    bad = rejection(regions.checks.parse_reservation, "r1", reservation_json(regions, pages=[4, 4, 2]))
    assert bad.reason is Rejection.INVALID
    assert "pages" in str(bad)


def test_an_empty_or_too_long_prompt_is_a_bad_request(regions: Regions) -> None:
    assert str(rejection(regions.checks.check_prompt, "r1", [])) == "prompt is empty"
    too_long = [1] * (CONFIG.max_context + 1)
    bad = rejection(regions.checks.check_prompt, "r1", too_long)
    assert bad.reason is Rejection.BAD_REQUEST
    assert str(bad) == f"prompt of {len(too_long)} tokens exceeds the context of {CONFIG.max_context}"


def test_another_layout_is_a_conflict_and_counted(regions: Regions) -> None:
    other = "L9-H2-D16-float32-bs16"
    reservation = regions.checks.parse_reservation("r1", reservation_json(regions, kv_layout=other,
                                                                        expected_count=9 * PROMPT_PAGES + 1))
    before = layout_mismatches(regions)
    bad = rejection(regions.checks.check_layout, "r1", reservation)
    assert bad.reason is Rejection.CONFLICT
    assert str(bad) == f"KV layout mismatch: decoder {other}, prefiller {regions.checks.kv_layout}"
    assert layout_mismatches(regions) == before + 1


def test_a_fence_not_longer_than_the_write_deadline_is_a_conflict(regions: Regions) -> None:
    reservation = regions.checks.parse_reservation("r1", reservation_json(regions, fence_timeout_s=TRANSFER_TIMEOUT_S))
    bad = rejection(regions.checks.check_fence, "r1", reservation)
    assert bad.reason is Rejection.CONFLICT
    assert "a late write could land in reused pages" in str(bad)


def test_held_and_reserved_pages_must_make_the_prompt(regions: Regions) -> None:
    # The decoder holds 2 pages and reserved 3 more: a prompt of 5 pages, not 4.
    reservation = regions.checks.parse_reservation("r1", reservation_json(regions, first_page=2))
    regions.checks.check_prefix_pages("r1", list(range(5 * CONFIG.block_size)), reservation)
    bad = rejection(regions.checks.check_prefix_pages, "r1", list(range(4 * CONFIG.block_size)), reservation)
    assert bad.reason is Rejection.CONFLICT
    assert str(bad) == "the decoder holds 2 prompt pages and reserved 3 more; the prompt has 4"
