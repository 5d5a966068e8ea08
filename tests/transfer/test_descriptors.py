"""Memory descriptors: they round-trip, and anything malformed or foreign is a DescriptorError.

Between two processes on every loopback provider and the same-host path (tests/support/engine_pairs.py).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from support.engine_pairs import (
    KIB,
    LOOPBACK,
    PROVIDERS,
    WAIT_S,
    EnginePair,
    NothingPosted,
    assert_same_bytes,
    assert_still_delivers,
    fnv1a32,
    fresh_imm,
)
from support.engine_peer import (
    provider_of,
    seeded_bytes,
)

from kvxfer.errors import DescriptorError
from kvxfer.transfer.engine import TransferEngine

# -- descriptors ------------------------------------------------------------------------


def test_pickled_descriptor_round_trips_and_still_addresses_the_region(pair: EnginePair) -> None:
    imm = fresh_imm()
    descriptor = pickle.loads(pickle.dumps(pair.descriptor))
    assert type(descriptor) is bytes and descriptor == pair.descriptor
    mine = pickle.loads(pickle.dumps(pair.inbox_mr.descriptor))
    assert mine == pair.inbox_mr.descriptor
    data = seeded_bytes(37, 777)
    pair.src[: data.size] = data

    pair.engine.write(pair.mr, 0, descriptor, 100, data.size, imm).wait(WAIT_S)

    pair.wait_target_count(imm, 1)
    assert_same_bytes(pair.target_bytes(100, data.size), data, "write through a pickled descriptor")


def test_descriptor_with_any_one_byte_flipped_is_refused_with_descriptor_error(
    pair: EnginePair,
) -> None:
    imm = fresh_imm()
    with NothingPosted(pair, imm):
        for i in range(len(pair.descriptor)):
            corrupt = bytearray(pair.descriptor)
            corrupt[i] ^= 0x01
            with pytest.raises(DescriptorError, match="malformed memory descriptor"):
                pair.engine.write(pair.mr, 0, bytes(corrupt), 0, 64, imm)


def test_truncated_descriptor_is_refused_with_descriptor_error(pair: EnginePair) -> None:
    imm = fresh_imm()
    with NothingPosted(pair, imm):
        for length in range(len(pair.descriptor)):
            with pytest.raises(DescriptorError, match="malformed memory descriptor"):
                pair.engine.write(pair.mr, 0, pair.descriptor[:length], 0, 64, imm)
            with pytest.raises(DescriptorError):
                pair.engine.write_paged(pair.mr, [0], pair.descriptor[:length], [0], 64, imm=imm)


def test_foreign_descriptors_are_refused_with_descriptor_error(
    pair: EnginePair, provider: str
) -> None:
    imm = fresh_imm()
    other = next((p for p in PROVIDERS if p != provider_of(provider)), None)
    with NothingPosted(pair, imm):
        with pytest.raises(DescriptorError, match="wrong magic"):
            # An engine address is a valid blob of the wrong kind.
            pair.engine.write(pair.mr, 0, pair.target.address, 0, 64, imm)
        with pytest.raises(DescriptorError):
            noise = seeded_bytes(41, len(pair.descriptor)).tobytes()
            pair.engine.write(pair.mr, 0, noise, 0, 64, imm)
        if other is not None:
            with TransferEngine(other, bind_host=LOOPBACK) as stranger:
                buf = np.zeros(4 * KIB, dtype=np.uint8)
                foreign = stranger.register(buf).descriptor
                with pytest.raises(DescriptorError, match=f"provider '{other}'"):
                    pair.engine.write(pair.mr, 0, foreign, 0, 64, imm)
                with pytest.raises(DescriptorError, match=f"provider '{other}'"):
                    pair.engine.write_imm(stranger.address, imm)


def test_descriptor_naming_a_provider_that_is_not_utf8_is_refused_with_descriptor_error(
    pair: EnginePair,
) -> None:
    imm = fresh_imm()
    provider = pair.engine.provider.encode()
    body = pair.descriptor[:-4]
    assert body.count(bytes([len(provider)]) + provider) == 1
    # Same length, checksum valid again: only the name itself is wrong.
    bad = body.replace(provider, provider[:-1] + b"\xff")
    bad += fnv1a32(bad).to_bytes(4, "little")
    with NothingPosted(pair, imm):
        with pytest.raises(DescriptorError, match="provider name is not printable ASCII"):
            pair.engine.write(pair.mr, 0, bad, 0, 64, imm)


def test_seeded_fuzz_of_descriptors_only_ever_raises_descriptor_error(pair: EnginePair) -> None:
    # Bounded and seeded (no hypothesis): random bytes, and valid descriptors truncated or
    # with a few bytes mutated, half of them with a repaired checksum so that the field
    # checks behind it are reached. Parsing only: a mutant that parses is never written to.
    rng = np.random.default_rng(20251123)
    valid = pair.descriptor
    for case in range(1500):
        kind = case % 3
        if kind == 0:
            blob = rng.bytes(int(rng.integers(0, 200)))
        else:
            blob = bytearray(valid)
            for _ in range(int(rng.integers(1, 5))):
                blob[int(rng.integers(0, len(blob) - 4))] = int(rng.integers(0, 256))
            if kind == 2 and rng.integers(0, 4) == 0:
                blob = blob[: int(rng.integers(0, len(blob)))]
            if rng.integers(0, 2) and len(blob) >= 4:
                blob[-4:] = fnv1a32(bytes(blob[:-4])).to_bytes(4, "little")
            blob = bytes(blob)
        try:
            assert pair.engine.path_to(blob) in ("fabric", "same_host", "same_host_mapped")
        except DescriptorError:
            pass
        except Exception as e:  # noqa: BLE001 - the point of the test
            raise AssertionError(f"case {case}: {type(e).__name__} for {blob.hex()}") from e
    assert_still_delivers(pair)
