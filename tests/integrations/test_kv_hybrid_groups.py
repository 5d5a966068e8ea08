"""Several KV cache groups (vLLM's hybrid KV cache manager: full plus sliding-window
attention) through the connector's worker halves, without vLLM processes.

The caches are laid out as vLLM's workers lay them out for two groups: each group's
layers viewed over the same allocation from byte 0 (`create_kv_cache_views`), so layer i
of one group and layer i of the other share a place, and block ids come from one pool.
The sliding-window group keeps no block for the pages before its window (vLLM's null
block, -1 here). The oracle is vLLM's own views: every layer's pushed pages equal the
prefiller's pages of that layer's group, byte for byte, and nothing else of the decoder's
cache changed (its other group's blocks in the same place included).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

import torch  # noqa: E402
from support.connector_halves import (  # noqa: E402
    decode_half,
    deliver_to_receiver,
    halves_engines,
    prefill_half,
)
from support.vllm_kv_caches import OverlaidGroupsCache, same_bytes  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.handoff.push_plan import LayerGroups, PushPlan, PushPlanError  # noqa: E402
from kvxfer.integrations.vllm.kv_region import KVRegion, region_from_kv_caches  # noqa: E402
from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, LoadSpec, PushSpec  # noqa: E402
from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.kv.protocol import KVReservation, ReservationError, decode_reservation_message  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
TOKENS, HEADS, HEAD_SIZE = 4, 2, 8
FULL = [f"model.layers.{i}.attn" for i in (1, 3)]
WINDOW = [f"model.layers.{i}.attn" for i in (0, 2)]
PROMPT_PAGES = 5
# Per group, the block of each prompt page (one pool: no id in both groups). The window
# keeps the last two pages only, on both sides.
SRC = [[1, 2, 3, 4, 5], [-1, -1, -1, 6, 7]]
DST = [[9, 3, 11, 5, 2], [-1, -1, -1, 8, 12]]
DEADLINE_S = 20.0


class GroupedCache(OverlaidGroupsCache):
    """Two KV cache groups (full and sliding-window attention) over one seeded allocation."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        super().__init__([(FULL, spec), (WINDOW, spec)], spec, num_blocks, seed)
        self.region: KVRegion = region_from_kv_caches(self.views, KVCacheLayout.LBHNC, isa="test",
                                                      groups=[FULL, WINDOW])


@pytest.fixture(scope="module")
def engines() -> Iterator[list[TransferEngine]]:
    with halves_engines(PROVIDER, 2) as pair:
        yield pair


def _group_of(region: KVRegion, name: str) -> int:
    return region.group(region.layer_index(name))


def test_the_region_places_each_layer_of_two_overlaid_groups_in_its_slot_and_tags_the_layout() -> None:
    cache = GroupedCache(num_blocks=8, seed=1)
    region = cache.region
    assert region.num_groups == 2 and region.num_layers == 4 and region.geometry.num_layers == 2
    for name in FULL + WINDOW:
        layer = region.layer_index(name)
        group = 0 if name in FULL else 1
        assert region.group(layer) == group
        start, length = cache.page_range(name, 5)
        assert region.geometry.runs(region.slot(layer), 5) == [(start, length)]
    assert "-hma2_" in region.kv_layout  # a one-group peer's kv_layout never matches it


def _reservation(group_pages: list[list[int]] | None, expected: int, pages: list[int] | None = None,
                 num_pages: int = 16) -> KVReservation:
    named = pages if pages is not None else [p for g in group_pages or [] for p in g if p >= 0]
    return KVReservation(request_id="t", descriptor=b"\x01", pages=named, num_pages=num_pages, imm=7 << 8 | 1,
                         expected_count=expected, kv_layout="L2-H2-D8-bfloat16-bs4-vllm-lbhnc-test-hma2_0",
                         meta_descriptor=b"", meta_offset=0, nonce=1, fence_timeout_s=10.0, mailbox=False,
                         group_pages=group_pages)


def test_the_push_plan_posts_each_layer_its_groups_kept_pages_into_the_decoders_blocks_of_that_group() -> None:
    region = GroupedCache(num_blocks=8, seed=2).region
    groups = LayerGroups(tuple(region.slot(i) for i in range(4)), tuple(region.group(i) for i in range(4)))
    expected = groups.expected_writes(DST)
    assert expected == 2 * 5 + 2 * 2  # the window's layers push 2 pages, the full ones 5
    plan = PushPlan(_reservation(DST, expected), region.geometry, layer_groups=groups)
    posted = 0
    for layer in range(region.num_layers):
        g = region.group(layer)
        pages = plan.final(layer, PROMPT_PAGES, SRC[g])
        assert pages is not None
        kept = [i for i, page in enumerate(DST[g]) if page >= 0]
        assert list(pages.local) == [SRC[g][i] for i in kept]
        assert pages.remote.tolist() == [DST[g][i] for i in kept]
        assert list(pages.table_columns) == kept
        assert [w.src_offset for w in plan.runs(layer)] == [region.geometry.offset(region.slot(layer), 0)]
        plan.posted(pages)
        posted += len(pages.remote)
    assert posted == expected and plan.complete


def test_a_reservation_of_the_wrong_group_shape_is_refused() -> None:
    region = GroupedCache(num_blocks=8, seed=3).region
    groups = LayerGroups(tuple(region.slot(i) for i in range(4)), tuple(region.group(i) for i in range(4)))
    one_group = KVReservation(request_id="t", descriptor=b"\x01", pages=[9, 3], num_pages=16, imm=7 << 8 | 1,
                              expected_count=4, kv_layout="L2-H2-D8-bfloat16-bs4-vllm-lbhnc-test",
                              meta_descriptor=b"", meta_offset=0, nonce=1, fence_timeout_s=10.0, mailbox=False)
    with pytest.raises(PushPlanError, match="groups"):
        PushPlan(one_group, region.geometry, layer_groups=groups)  # group 0's ids never land in group 1's layers
    three = [DST[0], DST[1], [-1, -1, -1, -1, 13]]
    with pytest.raises(PushPlanError, match="groups"):
        PushPlan(_reservation(three, 15), region.geometry, layer_groups=groups)
    with pytest.raises(PushPlanError, match="several KV cache groups"):
        PushPlan(_reservation(DST, 14), region.geometry)  # a one-group cache
    with pytest.raises(ReservationError, match="group_pages"):
        _reservation([DST[0], [-1, -1, -1, 8]], 14)  # groups of different lengths
    with pytest.raises(ReservationError, match="group_pages"):
        _reservation([DST[0], [-1, -1, -1, 9, 12]], 14, pages=[9, 3, 11, 5, 2, 12])  # one page in both groups
    # A peer that knows one group only (it ignores group_pages) compares kv_layout strings
    # first: a one-group cache's never carries the groups' tag, so it refuses the reservation.
    one = region_from_kv_caches({name: view for name, view in GroupedCache(8, seed=4).views.items() if name in FULL},
                                KVCacheLayout.LBHNC, isa="test")
    assert region.kv_layout.startswith(one.kv_layout + "-hma2_") and region.kv_layout != one.kv_layout


def _hand_off(engines: list[TransferEngine], prefill: GroupedCache, decode: GroupedCache,
              tid: str, staged: bool = False) -> tuple[bool, str]:
    """One request through the halves with kv_integrity full (through staging and landing
    blocks where `staged`, the device caches' path): (admitted, failure reason)."""
    settings = ConnectorSettings(provider=PROVIDER, kv_integrity="full")
    pusher = prefill_half(engines[0], prefill.region, settings, staged=staged)
    receiver = decode_half(engines[1], decode.region, settings, staged=staged)
    request = f"decode-{tid}"
    loaded = [b for g in DST for b in g if b >= 0]
    receiver.start(LoadSpec(request, tid, engines[0].address, loaded, 0, group_block_ids=[list(g) for g in DST]))
    tokens = PROMPT_PAGES * TOKENS
    pusher.on_step(KvxferStepMetadata(pushes=[PushSpec(f"prefill-{tid}", tid, engines[1].address, tokens,
                                                       list(SRC[0]), tokens, group_block_ids=[list(g) for g in SRC])]))
    for layer in range(prefill.region.num_layers):  # computed before the reservation came: caught up
        pusher.save_layer(layer)
    end = time.monotonic() + DEADLINE_S
    reason = receiver.failure(request)
    while time.monotonic() < end:
        raw = engines[0].recv(0.0)
        reservation = decode_reservation_message(bytes(raw)) if raw is not None else None
        if reservation is not None:
            pusher.on_reservation(reservation)
        pusher.poll(set())
        deliver_to_receiver(receiver, engines[1].recv(0.0))
        reason = receiver.failure(request) or reason
        finished, failed = receiver.poll(set())
        if request in finished:
            return request not in failed, reason
        time.sleep(0.002)
    return False, f"no outcome within {DEADLINE_S} s ({reason})"


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_two_groups_land_each_layers_pages_in_its_groups_blocks_and_nothing_else(
        engines: list[TransferEngine], staged: bool) -> None:
    prefill, decode = GroupedCache(num_blocks=8, seed=11), GroupedCache(num_blocks=16, seed=12)
    before = decode.host_bytes().copy()
    admitted, reason = _hand_off(engines, prefill, decode, f"hybrid-bytes-{staged}", staged)
    assert admitted, reason
    moved = np.zeros(before.size, dtype=bool)
    for names, g in ((FULL, 0), (WINDOW, 1)):
        for name in names:
            for src, dst in zip(SRC[g], DST[g]):
                if dst < 0:
                    continue  # the window keeps none: nothing pushed
                assert same_bytes(decode.views[name][dst], prefill.views[name][src]), (name, src, dst)
                start, length = decode.page_range(name, dst)
                moved[start:start + length] = True
    after = decode.host_bytes()
    assert (after[~moved] == before[~moved]).all()
