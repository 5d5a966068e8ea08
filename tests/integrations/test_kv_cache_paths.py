"""The connector's two ways of moving a layer's blocks, between real engines: read and
written in place (host caches registered with the engine) and through pinned staging and
landing blocks (the path device caches take; driven here with host tensors, and with CUDA
tensors too where this machine has a GPU). The worker halves run as vLLM's worker drives
them (tests/support/connector_halves.py), over caches vLLM's own code lays out; the
oracle is vLLM's views of the decoder's cache, and every byte outside the moved blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

import torch  # noqa: E402
from support.connector_halves import decode_half, hand_off, halves_engine, prefill_half  # noqa: E402
from support.vllm_kv_caches import TOKENS, attention_spec, mask_of, mla_spec, same_bytes, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvxfer.kv.cache_geometry import GeometryError  # noqa: E402
from kvxfer.transfer.engine import TransferEngine, available_providers  # noqa: E402

PROVIDER = "net" if "net" in available_providers() else "tcp"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SRC_BLOCKS, DST_BLOCKS = 6, 9
SRC, DST = [1, 2, 4], [7, 3, 5]
#: The preferred layout, tokens outside heads in a block (LBNHC), MLA in cross-layer blocks (BLHNC).
CASES = [("LBHNC", "attention"), ("LBNHC", "attention"), ("BLHNC", "mla")]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    prefill, decode = halves_engine(PROVIDER), halves_engine(PROVIDER)
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["direct", "staged"])
@pytest.mark.parametrize(("layout", "content"), CASES, ids=["-".join(c) for c in CASES])
def test_a_hand_off_lands_every_block_where_vllm_reads_it_and_nothing_else(
        engines: tuple[TransferEngine, TransferEngine], layout: str, content: str, path: str, device: str) -> None:
    if path == "direct" and device != "cpu":
        pytest.skip("device caches always take the staged path")
    spec = mla_spec() if content == "mla" else attention_spec()
    src = vllm_cache(KVCacheLayout[layout], spec, SRC_BLOCKS, seed=11, device=device)
    dst = vllm_cache(KVCacheLayout[layout], spec, DST_BLOCKS, seed=12, device=device)
    before = dst.host_bytes().copy()
    settings = ConnectorSettings(provider=PROVIDER)
    staged = path == "staged"
    pusher = prefill_half(engines[0], src.region, settings, staged)
    receiver = decode_half(engines[1], dst.region, settings, staged)
    outcome = hand_off(pusher, receiver, SRC, DST, tokens=len(SRC) * TOKENS, transfer_id=f"{layout}-{content}-{path}")
    assert outcome.admitted, outcome.reason
    moved = np.zeros(before.size, dtype=bool)
    for layer, (s_view, d_view) in enumerate(zip(src.views, dst.views)):
        for s, d in zip(SRC, DST):
            assert same_bytes(d_view[d], s_view[s]), (layer, s, d)
            moved |= mask_of(dst.cells(layer, d), before.size)
    assert (dst.host_bytes()[~moved] == before[~moved]).all()


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_a_layout_that_cuts_a_block_per_head_is_refused_with_the_layouts_that_work(
        engines: tuple[TransferEngine, TransferEngine], layout: str, staged: bool) -> None:
    # The reservation counts one write per (layer, block) (kv/protocol.py); a block of these
    # layouts is one run per head, so the connector refuses them when the cache registers.
    cache = vllm_cache(KVCacheLayout[layout], attention_spec(), SRC_BLOCKS, seed=13)
    settings = ConnectorSettings(provider=PROVIDER)
    with pytest.raises(GeometryError, match=f"{layout} stores a block as 4 runs .* use LBHNC"):
        prefill_half(engines[0], cache.region, settings, staged)
    with pytest.raises(GeometryError, match=f"{layout} stores a block as 4 runs .* use LBHNC"):
        decode_half(engines[1], cache.region, settings, staged)
