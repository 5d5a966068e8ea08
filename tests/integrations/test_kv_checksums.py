"""The vLLM path's page checksums (kvxfer/integrations/vllm/kv_checksums.py), on caches laid
out as vLLM's workers lay them out: a block's checksum covers exactly its bytes in every
layout, the table travels in parts that fit a control message, only this load's tagged table
counts, and a flipped bit is found and named by layer and block."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.vllm_kv_caches import attention_spec, vllm_cache  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvxfer.integrations.vllm.kv_checksums import (  # noqa: E402
    LoadChecksums,
    block_checksums,
    decode_table,
    encode_table,
)
from kvxfer.kv.integrity import KVIntegrity, KVIntegrityError, crc32c  # noqa: E402
from kvxfer.kv.protocol import MAX_CONTROL_MESSAGE_BYTES  # noqa: E402

KEY = bytes(range(32))
BLOCKS = 8


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_a_blocks_checksum_is_the_crc_of_exactly_its_bytes(layout: KVCacheLayout) -> None:
    region = vllm_cache(layout, attention_spec(), BLOCKS, seed=5).region
    for layer in range(region.num_layers):
        got = block_checksums(region, layer, [5, 0, 3])
        want = [crc32c(region.page_bytes(layer, block)) for block in (5, 0, 3)]
        assert list(got) == want, (layer, layout)


def test_a_table_too_big_for_one_message_travels_in_whole_layers() -> None:
    table = np.arange(6 * 5000, dtype=np.uint32).reshape(6, 5000)  # 20 kB per layer
    parts = [decode_table(raw) for raw in encode_table(7, 11, table, KEY)]
    assert len(parts) == 2 and all(p is not None for p in parts)
    assert all(len(raw) <= MAX_CONTROL_MESSAGE_BYTES for raw in encode_table(7, 11, table, KEY))
    load = LoadChecksums("r", nonce=11, num_layers=6, pages=5000, table_key=KEY)
    assert not load.complete
    for part in parts:
        assert part is not None and load.accept(part) == ""
    assert load.complete and np.array_equal(load.table, table)


def test_only_the_loads_own_tagged_table_counts() -> None:
    table = np.ones((2, 3), dtype=np.uint32)
    load = LoadChecksums("r", nonce=11, num_layers=2, pages=3, table_key=KEY)
    untagged, = encode_table(7, 11, table, None)
    other_key, = encode_table(7, 11, table, bytes(32))
    other_nonce, = encode_table(7, 12, table, KEY)
    assert load.accept(decode_table(untagged)) == "bad_tag"  # type: ignore[arg-type]
    assert load.accept(decode_table(other_key)) == "bad_tag"  # type: ignore[arg-type]
    assert load.accept(decode_table(other_nonce)) == "wrong_nonce"  # type: ignore[arg-type]
    forged = bytearray(encode_table(7, 11, table, KEY)[0])
    forged[-1] ^= 1  # one checksum changed after tagging
    assert load.accept(decode_table(bytes(forged))) == "bad_tag"  # type: ignore[arg-type]
    assert not load.complete
    assert decode_table(b"KVRS{}") is None and decode_table(bytes(forged[:-1])) is None


@pytest.mark.parametrize("mode", [KVIntegrity.FULL, KVIntegrity.SAMPLED])
def test_a_flipped_bit_is_found_and_named_by_layer_and_block(mode: KVIntegrity) -> None:
    cache = vllm_cache(KVCacheLayout.LBHNC, attention_spec(), BLOCKS, seed=9)
    region, blocks = cache.region, [6, 2, 4]
    table = np.stack([block_checksums(region, layer, blocks) for layer in range(region.num_layers)])
    load = LoadChecksums("req-1", nonce=1, num_layers=region.num_layers, pages=len(blocks), table_key=None)
    part, = encode_table(3, 1, table, None)
    assert load.accept(decode_table(part)) == ""  # type: ignore[arg-type]
    rng = random.Random(0)
    assert load.verify(region, blocks, 2, mode, 0.01, rng).checked == region.num_layers * (3 if mode is KVIntegrity.FULL else 1)
    start, _ = region.geometry.runs(1, 2)[0]
    assert region.buffer is not None
    region.buffer[start + 10] ^= 0x04
    # Sampled checks one block of three per layer: enough draws find it.
    with pytest.raises(KVIntegrityError) as failed:
        for _ in range(64):
            load.verify(region, blocks, 2, mode, 0.01, rng)
    assert failed.value.reason == "checksum_mismatch"
    assert "request req-1" in str(failed.value) and "layer 1, block 2 (prompt page 3)" in str(failed.value)
