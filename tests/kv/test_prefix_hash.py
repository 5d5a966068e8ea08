"""Block hashes name a prompt prefix: equal exactly when the tokens up to that block are."""

from __future__ import annotations

import pytest

from kvxfer.kv.prefix_hash import block_hashes, block_hashes_hex, matched_blocks


def test_prompts_share_a_block_hash_exactly_when_they_share_every_token_up_to_it() -> None:
    base = list(range(100, 164))  # 4 blocks of 16
    other = base[:40] + [7] + base[41:]  # differs in block 2
    a, b = block_hashes(base, 16), block_hashes(other, 16)
    assert len(a) == 4
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]  # the chain carries the difference forward
    assert matched_blocks(b, set(a)) == 2


def test_a_partial_block_has_no_hash_and_a_namespace_separates_models() -> None:
    tokens = list(range(40))
    assert len(block_hashes(tokens, 16)) == 2
    assert block_hashes(tokens, 16, "model-a") != block_hashes(tokens, 16, "model-b")
    assert all(len(h) == 32 for h in block_hashes_hex(tokens, 16))


@pytest.mark.parametrize("tokens, block_size", [([1, 2], 0), ([-1] * 4, 2), ([2**32] * 2, 2)])
def test_bad_input_is_a_value_error(tokens: list[int], block_size: int) -> None:
    with pytest.raises(ValueError):
        block_hashes(tokens, block_size)
