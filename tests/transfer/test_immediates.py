"""The ImmCounter: per-value counts in any arrival order, deadlines, reuse and overflow.

Between two processes on every loopback provider and the same-host path (tests/support/engine_pairs.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path

import numpy as np
import pytest
from support.engine_pairs import (
    KIB,
    LOOPBACK,
    MIB,
    SPARE_BYTES,
    STRAY_ARRIVAL_GRACE_S,
    WAIT_S,
    EnginePair,
    OwnPeers,
    PairPool,
    PeerProcess,
    fresh_imm,
    only_first_provider,
    wait_for_stat,
)
from support.engine_peer import (
    SAME_HOST_MODES,
    engine_options,
)

from kvxfer.errors import TransferTimeout
from kvxfer.transfer.engine import TransferEngine

# -- immediates -------------------------------------------------------------------------


@pytest.mark.parametrize("rails", [1, 2])
def test_interleaved_immediates_are_counted_exactly_per_value_in_any_arrival_order(
    pairs: PairPool, rails: int
) -> None:
    pair = pairs.get(rails)
    imms = [fresh_imm() for _ in range(3)]
    rng = np.random.default_rng(5)
    expected = dict.fromkeys(imms, 0)
    transfers = []
    # All submitted before any is waited for, so arrivals interleave freely across rails.
    for step in range(48):
        imm = imms[int(rng.integers(3))]
        kind = step % 4
        if kind == 0:
            transfers.append(
                pair.engine.write(pair.mr, 0, pair.descriptor, step * 4 * KIB, 4 * KIB, imm)
            )
            expected[imm] += 1
        elif kind == 1:
            pages = int(rng.integers(1, 9))
            dst = rng.permutation(256)[:pages]
            transfers.append(
                pair.engine.write_paged(
                    pair.mr, np.arange(pages), pair.descriptor, dst, 4 * KIB, imm=imm
                )
            )
            expected[imm] += pages
        elif kind == 2:
            transfers.append(pair.engine.write_imm(pair.target.address, imm))
            expected[imm] += 1
        else:  # large enough to be sharded when rails=2
            transfers.append(pair.engine.write(pair.mr, 0, pair.descriptor, 2 * MIB, 1 * MIB, imm))
            expected[imm] += 1
    for t in transfers:
        t.wait(WAIT_S)

    for imm, count in expected.items():
        pair.wait_target_count(imm, count)


def test_wait_imm_that_is_not_reached_raises_transfer_timeout_saying_how_many_arrived(
    pair: EnginePair,
) -> None:
    imm, inbox = fresh_imm(), pair.inbox_mr.descriptor.hex()
    pair.target.call("write", descriptor=inbox, src_offset=0, dst_offset=0, length=64, imm=imm)
    pair.engine.wait_imm(imm, 1, WAIT_S)

    started = time.monotonic()
    with pytest.raises(TransferTimeout, match=rf"^imm {imm}: 1 of 2 arrived within 0\.3 s$"):
        pair.engine.wait_imm(imm, 2, 0.3)
    assert 0.3 <= time.monotonic() - started < 5.0

    refused = pair.target.request("wait_imm", imm=imm, count=1, timeout=0.2)
    assert (refused["ok"], refused["error"]) == (False, "TransferTimeout")
    assert refused["message"] == f"imm {imm}: 0 of 1 arrived within 0.2 s"


def test_wait_imm_any_wakes_for_whichever_wanted_count_is_reached_first(pair: EnginePair) -> None:
    # A decode instance with several loads pending waits for any of them: the newest may
    # complete first, and a wait on the oldest would sleep through it.
    oldest, newest = fresh_imm(), fresh_imm()
    wanted = [(oldest, 1), (newest, 2)]
    assert pair.engine.wait_imm_any(wanted, 0.1) is None  # nothing arrived: None at the timeout
    assert pair.engine.wait_imm_any([], 0.1) is None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(pair.engine.wait_imm_any, wanted, 5.0)
        time.sleep(0.2)
        assert not waiting.done()
        pair.target.call("write_paged", descriptor=pair.inbox_mr.descriptor.hex(), src_pages=[0, 1],
                         dst_pages=[4, 5], page_size=4 * KIB, imm=newest)
        assert waiting.result(timeout=WAIT_S) == 1, "woke for the newest load's count"
    assert pair.engine.imm_count(oldest) == 0


def test_consume_imm_subtracts_a_finished_request_so_the_value_can_be_reused(
    pair: EnginePair,
) -> None:
    imm, inbox = fresh_imm(), pair.inbox_mr.descriptor.hex()
    pages = {"descriptor": inbox, "page_size": 4 * KIB, "imm": imm}
    pair.target.call("write_paged", src_pages=[0, 1, 2], dst_pages=[4, 5, 6], **pages)
    pair.engine.wait_imm(imm, 3, WAIT_S)

    pair.engine.consume_imm(imm, 3)

    assert pair.engine.imm_count(imm) == 0
    with pytest.raises(TransferTimeout):
        pair.engine.wait_imm(imm, 1, 0.1)
    pair.target.call("write_paged", src_pages=[0, 1], dst_pages=[7, 8], **pages)
    pair.engine.wait_imm(imm, 2, WAIT_S)
    time.sleep(STRAY_ARRIVAL_GRACE_S)
    assert pair.engine.imm_count(imm) == 2




@only_first_provider
def test_arrivals_beyond_the_immediate_table_are_counted_as_overflows_and_their_waits_fail(
    provider: str, peers: OwnPeers
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvxfer.errors import ImmCounterOverflow
    from kvxfer.metrics import EngineMetrics

    capacity, extra = 16, 5
    with TransferEngine(
        **engine_options(provider), bind_host=LOOPBACK, imm_table_capacity=capacity
    ) as receiver:
        sender = peers.spare()
        imms = list(range(1, capacity + extra + 1))
        sender.call("write_imms", target=receiver.address.hex(), imms=imms)
        wait_for_stat(receiver, "imm_table_overflows", extra)

        receiver.wait_imm(imms[0], 1, WAIT_S)  # counted values still work
        started = time.monotonic()
        with pytest.raises(ImmCounterOverflow, match=rf"^imm {imms[-1]}: 0 of 1 arrived, .*table is full \({capacity} distinct.* {extra} arrivals were dropped"):
            receiver.wait_imm(imms[-1], 1, WAIT_S)
        with pytest.raises(ImmCounterOverflow):
            receiver.wait_imm(10_000, 1, WAIT_S)  # no slot left for it either
        with pytest.raises(ImmCounterOverflow):
            asyncio.run(asyncio.wait_for(receiver.wait_imm_async(imms[-2], 1, WAIT_S), 60))
        assert time.monotonic() - started < WAIT_S / 2, "failed waits must not run to their deadline"

        registry = CollectorRegistry()
        EngineMetrics(registry, receiver.path_stats, receiver.engine_stats)
        assert f"kvxfer_engine_imm_table_overflows_total {float(extra)}" in generate_latest(registry).decode()


def test_an_immediate_bound_to_a_peer_with_fewer_rails_counts_its_rails_and_no_one_else(
    provider: str, peers: OwnPeers, tmp_path: Path
) -> None:
    """A 1-rail prefiller writes only to rail 0 of a 2-rail decoder: the binding hears it
    there and nobody on rail 1. Before, a binding needed equal rail counts, so none was made
    and anyone's immediates counted. The other way round (more prefiller rails than decoder
    rails) binds nothing, said by the False return: net names only one of several peer
    rails that write to one rail of ours (see TransferEngine::bind_imm_source)."""
    if provider in SAME_HOST_MODES:
        pytest.skip("the same-host path posts no fabric immediates")
    with TransferEngine(**engine_options(provider), rails=2, bind_host=LOOPBACK) as decoder:
        if not decoder.capabilities["source"]:
            pytest.skip(f"{provider} cannot name an immediate's sender")
        region = decoder.register(np.zeros(2 * MIB, dtype=np.uint8))
        prefiller = PeerProcess(provider, 1, SPARE_BYTES, tmp_path)
        wider = PeerProcess(provider, 3, SPARE_BYTES, tmp_path)
        try:
            imm = fresh_imm()
            assert not decoder.bind_imm_source(fresh_imm(), wider.address), "bound a peer with more rails"
            assert decoder.bind_imm_source(imm, prefiller.address), "no binding across rail counts"
            for _ in range(4):
                prefiller.call("write", descriptor=region.descriptor.hex(), src_offset=0, dst_offset=0,
                               length=1 * MIB, imm=imm)
            decoder.wait_imm(imm, 4, WAIT_S)
            assert decoder.engine_stats()["imm_foreign_dropped"] == 0

            # Outsiders' immediate-only writes (they need no key: the injection this check
            # stops) never count. RMA writes are not sent: their completions' sources are
            # not reliable on these providers (docs/architecture.md, "Data plane").
            peers.spare().call("write_imms", target=decoder.address.hex(), imms=[imm] * 3)
            wider.call("write_imms", target=decoder.address.hex(), imms=[imm] * 2)
            wait_for_stat(decoder, "imm_foreign_dropped", 5)
            time.sleep(STRAY_ARRIVAL_GRACE_S)
            assert decoder.imm_count(imm) == 4
        finally:
            prefiller.close()
            wider.close()
