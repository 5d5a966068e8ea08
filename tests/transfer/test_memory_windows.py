"""Per-reservation registrations (`TransferEngine.register_windows`) between two processes.

The target peer registers parts of its region again with fresh keys and hands out that
descriptor; this process writes with it. What must hold on every socket provider: writes
inside the windows land, writes outside them are refused before anything is posted, and
after the windows are closed a write with the old descriptor fails at the writer with an
error and the target's bytes stay as they were (the provider checks the key, the engine
does not: this is what the per-reservation registration relies on).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.engine_pairs import KIB, LOOPBACK, EnginePair, assert_same_bytes, assert_zero
from support.engine_peer import seeded_bytes

from kvxfer.errors import BoundsError, TransferError
from kvxfer.transfer.engine import TransferEngine, available_providers

PAGE = 4 * KIB
# Two windows with a gap between them, as a reservation's runs of pages in two layers.
WINDOWS = [(0, 4 * PAGE), (8 * PAGE, 2 * PAGE)]
# A refused write must fail well before the transfer deadline would expire it.
REFUSED_WRITE_TIMEOUT_S = 3.0

CASES = [(p, r) for p in ("net", "tcp") if p in available_providers() for r in (1, 2)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{p}-r{r}" for p, r in CASES])
def window_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePair]:
    provider, rails = request.param
    pair = EnginePair(provider, rails, tmp_path_factory.mktemp(f"windows-{provider}-{rails}"))
    # Refused writes fail by the provider's error completion; the deadline is only a backstop.
    pair.engine.close()
    pair.engine = TransferEngine(provider=provider, rails=rails, same_host=False, bind_host=LOOPBACK,
                                 transfer_timeout_s=REFUSED_WRITE_TIMEOUT_S * 2)
    pair.mr = pair.engine.register(pair.src)
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture()
def pair(window_pair: EnginePair) -> EnginePair:
    return window_pair.reset()


def open_windows(pair: EnginePair) -> tuple[int, bytes]:
    reply = pair.target.call("register_windows", ranges=[list(w) for w in WINDOWS])
    return int(reply["windows"]), bytes.fromhex(reply["descriptor"])


def test_writes_inside_the_windows_land_page_by_page(pair: EnginePair) -> None:
    _, descriptor = open_windows(pair)
    pair.src[: 6 * PAGE] = seeded_bytes(7, 6 * PAGE)
    # Pages 0..3 fill the first window, pages 8..9 the second: one paged write across both.
    pair.engine.write_paged(pair.mr, [0, 1, 2, 3, 4, 5], descriptor, [0, 1, 2, 3, 8, 9], PAGE).wait(10)
    assert_same_bytes(pair.target_bytes(0, 4 * PAGE), pair.src[: 4 * PAGE], "first window")
    assert_same_bytes(pair.target_bytes(8 * PAGE, 2 * PAGE), pair.src[4 * PAGE: 6 * PAGE], "second window")
    assert_zero(pair.target_bytes(4 * PAGE, 4 * PAGE), "the gap between the windows")


@pytest.mark.parametrize("dst_page", [4, 7, 10, 40])
def test_a_write_outside_the_windows_is_refused_before_it_is_posted(pair: EnginePair, dst_page: int) -> None:
    _, descriptor = open_windows(pair)
    pair.src[:PAGE] = 0xAB
    with pytest.raises(BoundsError, match="outside the windows"):
        pair.engine.write_paged(pair.mr, [0], descriptor, [dst_page], PAGE)
    with pytest.raises(BoundsError, match="outside the windows"):
        # A single write that starts inside a window and runs past its end.
        pair.engine.write(pair.mr, 0, descriptor, 3 * PAGE + 1, PAGE)
    assert_zero(pair.target_bytes(0, 12 * PAGE), "the target region")


def test_a_write_with_a_closed_windows_descriptor_fails_and_lands_nothing(pair: EnginePair) -> None:
    windows, descriptor = open_windows(pair)
    pair.src[:PAGE] = seeded_bytes(11, PAGE)
    pair.engine.write(pair.mr, 0, descriptor, 0, PAGE).wait(10)  # the descriptor worked
    pair.target.call("close_windows", windows=windows)
    pair.src[:PAGE] = 0xEE
    for attempt in range(3):  # not once by luck: every late write fails
        with pytest.raises(TransferError) as failed:
            pair.engine.write(pair.mr, 0, descriptor, PAGE, PAGE, imm=None).wait(REFUSED_WRITE_TIMEOUT_S * 2)
        assert "timed out" not in str(failed.value), f"attempt {attempt}: expected the provider's refusal"
    assert_same_bytes(pair.target_bytes(0, PAGE), seeded_bytes(11, PAGE), "the page written while open")
    assert_zero(pair.target_bytes(PAGE, 11 * PAGE), "pages written after the close")


def test_each_registration_of_the_same_bytes_gets_fresh_keys(pair: EnginePair) -> None:
    _, first = open_windows(pair)
    _, second = open_windows(pair)
    # Same owner, region, offsets and lengths: only the keys can differ.
    assert first != second
