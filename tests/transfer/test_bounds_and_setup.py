"""Bounds checks, engine set-up errors and closing from several threads.

Between two processes on every loopback provider and the same-host path (tests/support/engine_pairs.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from support.engine_pairs import (
    KIB,
    LOOPBACK,
    PAIR_BYTES,
    PROVIDERS,
    WAIT_S,
    EnginePair,
    NothingPosted,
    assert_same_bytes,
    assert_still_delivers,
    fresh_imm,
)
from support.engine_peer import (
    engine_options,
    seeded_bytes,
)

from kvxfer.errors import BoundsError, EngineError
from kvxfer.transfer.engine import TransferEngine, available_providers

# -- bounds -----------------------------------------------------------------------------


def test_write_beyond_a_smaller_remote_region_raises_bounds_error_and_lands_nothing(
    pair: EnginePair,
) -> None:
    imm = fresh_imm()
    small = pair.target.call("register", size=4 * KIB)
    descriptor = bytes.fromhex(small["descriptor"])
    with NothingPosted(pair, imm, watch=(0, 4 * KIB), region=small["region"]):
        for dst_offset, length in [(0, 4 * KIB + 1), (1, 4 * KIB), (4 * KIB, 1), (2**62, 1)]:
            with pytest.raises(BoundsError, match="destination range"):
                pair.engine.write(pair.mr, 0, descriptor, dst_offset, length, imm)
        with pytest.raises(BoundsError, match="destination page 1"):
            pair.engine.write_paged(pair.mr, [0, 1], descriptor, [0, 1], 4 * KIB, imm=imm)
    # The small region itself is writable within its bounds.
    data = seeded_bytes(43, 4 * KIB)
    pair.src[: data.size] = data
    pair.engine.write(pair.mr, 0, descriptor, 0, data.size, imm).wait(WAIT_S)
    pair.wait_target_count(imm, 1)
    assert_same_bytes(pair.target_bytes(0, 4 * KIB, region=small["region"]), data, "small region")


def test_source_range_beyond_the_local_region_raises_bounds_error(pair: EnginePair) -> None:
    imm, size = fresh_imm(), PAIR_BYTES[1]
    with NothingPosted(pair, imm):
        for src_offset, length in [(size - 10, 11), (size, 1), (size + 1, 1), (0, size + 1)]:
            with pytest.raises(BoundsError, match="source range"):
                pair.engine.write(pair.mr, src_offset, pair.descriptor, 0, length, imm)


def test_negative_or_zero_sizes_and_out_of_range_immediates_raise_bounds_error(
    pair: EnginePair,
) -> None:
    imm = fresh_imm()
    with NothingPosted(pair, imm):
        for kwargs in [
            dict(src_offset=-1, dst_offset=0, length=8, imm=imm),
            dict(src_offset=0, dst_offset=-1, length=8, imm=imm),
            dict(src_offset=0, dst_offset=0, length=-1, imm=imm),
            dict(src_offset=0, dst_offset=0, length=0, imm=imm),
            dict(src_offset=0, dst_offset=0, length=8, imm=-1),
            dict(src_offset=0, dst_offset=0, length=8, imm=2**32),
        ]:
            with pytest.raises(BoundsError):
                pair.engine.write(pair.mr, remote_descriptor=pair.descriptor, **kwargs)
        with pytest.raises(BoundsError):
            pair.engine.write_imm(pair.target.address, 2**32)


def test_bad_page_lists_raise_bounds_error_before_any_page_is_posted(pair: EnginePair) -> None:
    imm, page = fresh_imm(), 4 * KIB
    end = PAIR_BYTES[1] // page  # first page index past either region
    # Valid pages first and the bad entry last: a planner that posted as it validated would
    # already have written something.
    ok = list(range(8))
    huge = 2**63 - 1
    # (what is wrong, src_pages, dst_pages, other arguments, expected message)
    cases: list[tuple[str, Any, Any, dict[str, int], str]] = [
        ("src index one past the end", ok + [end], ok + [8], {}, "source page"),
        ("dst index one past the end", ok + [8], ok + [end], {}, "destination page"),
        ("negative src index", ok + [-1], ok + [8], {}, "negative page index at position 8"),
        ("negative dst index", ok + [8], ok + [-1], {}, "negative page index at position 8"),
        ("huge dst index", ok + [8], ok + [2**62], {}, "destination page"),
        ("longer src list", ok + [8], ok, {}, "src_pages has 9 entries but dst_pages has 8"),
        ("longer dst list", ok, ok + [8], {}, "src_pages has 8 entries but dst_pages has 9"),
        ("two-dimensional", [ok], [ok], {}, "one-dimensional"),
        ("float indices", [0.5], [1.0], {}, "must hold integers"),
        ("no pages", [], [], {}, "no pages"),
        ("zero page size", ok, ok, {"page_size": 0}, "page_size must be > 0"),
        ("stride below page", ok, ok, {"dst_stride": page - 1}, "strides must be >= page_size"),
        ("negative offset", ok, ok, {"dst_offset": -1}, "dst_offset must be >= 0"),
        ("offset past the end", [0], [0], {"dst_offset": PAIR_BYTES[1]}, "destination page 0"),
        # offset + index * stride wraps past 2**64 back into the region: still refused.
        ("wrapping dst geometry", [0], [1],
         {"page_size": 2, "dst_offset": huge, "dst_stride": huge}, "destination page 1"),
        ("wrapping src geometry", [1], [0],
         {"page_size": 2, "src_offset": huge, "src_stride": huge}, "source page 1"),
    ]
    with NothingPosted(pair, imm, watch=(0, 64 * KIB)):
        for wrong, src_pages, dst_pages, other, message in cases:
            args = {"page_size": page, "imm": imm, **other}
            with pytest.raises(BoundsError, match=message):
                pair.engine.write_paged(pair.mr, src_pages, pair.descriptor, dst_pages, **args)
                pytest.fail(f"{wrong}: accepted")


def test_close_from_several_threads_while_others_write_and_read_stats_ends_cleanly(
    pair: EnginePair,
) -> None:
    # closed() is read by every call from any thread while another thread closes: each
    # caller gets a result or EngineError, every close() returns once the engine is shut,
    # and the process survives (two threads joining the worker at once would not).
    for round_ in range(5):
        engine = TransferEngine(**engine_options(pair.target.provider), bind_host=LOOPBACK)
        mr = engine.register(np.ones(64 * KIB, dtype=np.uint8))
        start = threading.Barrier(6)
        errors: list[BaseException] = []

        def closer() -> None:
            start.wait(WAIT_S)
            engine.close()

        def user() -> None:
            start.wait(WAIT_S)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                try:
                    engine.stats()
                    engine.engine_stats()
                    engine.write(mr, 0, pair.descriptor, 32 * KIB, 4 * KIB).wait(WAIT_S)
                except EngineError:
                    if engine.closed:
                        return
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return

        threads = [threading.Thread(target=f) for f in [closer] * 3 + [user] * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads), f"round {round_}: a thread hung"
        assert not errors, f"round {round_}: {errors!r}"
        assert engine.closed
    assert_still_delivers(pair)


def test_unknown_provider_raises_engine_error_listing_the_available_ones() -> None:
    with pytest.raises(EngineError) as refused:
        TransferEngine("no-such-fabric", bind_host=LOOPBACK)
    message = str(refused.value)
    assert "no-such-fabric" in message
    for name in available_providers():
        assert name in message


@pytest.mark.parametrize("rails", [0, -1, 1.5])
def test_rails_that_are_not_a_positive_integer_raise_engine_error(rails: Any) -> None:
    with pytest.raises(EngineError, match="rails must be a positive integer"):
        TransferEngine(PROVIDERS[0] if PROVIDERS else "auto", rails=rails, bind_host=LOOPBACK)


def test_registering_a_non_contiguous_read_only_or_empty_buffer_raises_bounds_error(
    pair: EnginePair,
) -> None:
    read_only = np.zeros(4 * KIB, dtype=np.uint8)
    read_only.flags.writeable = False
    refused = {
        "strided numpy": (np.zeros(8 * KIB, dtype=np.uint8)[::2], "C-contiguous"),
        "fortran-order numpy": (np.zeros((64, 64), dtype=np.uint8, order="F"), "C-contiguous"),
        "read-only numpy": (read_only, "writable"),
        "bytes": (b"immutable", "cannot register bytes"),
        "read-only memoryview": (memoryview(b"immutable"), "writable"),
        "strided memoryview": (memoryview(bytearray(64))[::2], "contiguous"),
        "empty bytearray": (bytearray(), "empty"),
        "a list": ([1, 2, 3], "cannot register list"),
    }
    registered = len(pair.engine._regions)
    for name, (buf, message) in refused.items():
        with pytest.raises(BoundsError, match=message):
            pair.engine.register(buf)
            pytest.fail(f"{name}: registered")
    assert len(pair.engine._regions) == registered
    assert_still_delivers(pair)


def test_writing_from_a_buffer_this_engine_has_not_registered_raises_engine_error(
    pair: EnginePair, provider: str
) -> None:
    imm = fresh_imm()
    dropped = pair.engine.register(np.zeros(4 * KIB, dtype=np.uint8))
    pair.engine.deregister(dropped)
    with TransferEngine(**engine_options(provider), bind_host=LOOPBACK) as other:
        elsewhere = other.register(np.zeros(4 * KIB, dtype=np.uint8))
        with NothingPosted(pair, imm):
            for source, message in [
                (np.zeros(4 * KIB, dtype=np.uint8), "must be a RegisteredMemory"),
                (dropped, "was deregistered"),
                (elsewhere, "registered with another engine"),
            ]:
                with pytest.raises(EngineError, match=message):
                    pair.engine.write(source, 0, pair.descriptor, 0, 64, imm)
                with pytest.raises(EngineError, match=message):
                    pair.engine.write_paged(source, [0], pair.descriptor, [0], 64, imm=imm)
    with pytest.raises(EngineError, match="not registered"):
        pair.engine.deregister(dropped)
