"""Two-sided control messages and asyncio: round trips, size limits, the bounded inbox, awaiting.

Between two processes on every loopback provider and the same-host path (tests/support/engine_pairs.py).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from support.engine_pairs import (
    KIB,
    LOOPBACK,
    WAIT_S,
    EnginePair,
    OwnPeers,
    assert_same_bytes,
    fresh_imm,
    only_first_provider,
    ops_posted,
    wait_for_stat,
)
from support.engine_peer import (
    engine_options,
    seeded_bytes,
)

from kvxfer.errors import BoundsError, TransferTimeout
from kvxfer.transfer.engine import TransferEngine


@only_first_provider
@pytest.mark.parametrize("bound", ["messages", "bytes"])
def test_unread_control_messages_are_held_up_to_the_inbox_bounds_and_the_rest_dropped_and_counted(
    provider: str, peers: OwnPeers, bound: str
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvxfer.metrics import EngineMetrics

    size, sent, kept = 16 * KIB, 20, 5
    limits = (
        {"inbox_max_messages": kept}
        if bound == "messages"
        else {"inbox_max_bytes": kept * size + size - 1}
    )
    with TransferEngine(**engine_options(provider), bind_host=LOOPBACK, **limits) as receiver:
        sender = peers.spare()
        sender.call("send_many", target=receiver.address.hex(), count=sent, size=size)
        wait_for_stat(receiver, "inbox_dropped_messages", sent - kept)

        stats = receiver.engine_stats()
        assert stats["inbox_dropped_bytes"] == (sent - kept) * size
        assert (stats["inbox_messages"], stats["inbox_bytes"]) == (kept, kept * size)
        received = [receiver.recv(WAIT_S) for _ in range(kept)]
        assert all(m is not None and len(m) == size and m == m[:1] * size for m in received)
        assert receiver.recv(0.1) is None
        assert (receiver.engine_stats()["inbox_messages"], receiver.engine_stats()["inbox_bytes"]) == (0, 0)

        registry = CollectorRegistry()
        EngineMetrics(registry, receiver.path_stats, receiver.engine_stats)
        text = generate_latest(registry).decode()
        assert f"kvxfer_engine_inbox_dropped_messages_total {float(sent - kept)}" in text
        assert f"kvxfer_engine_inbox_dropped_bytes_total {float((sent - kept) * size)}" in text


# -- asyncio ----------------------------------------------------------------------------


def test_transfers_and_immediate_counts_can_be_awaited_in_an_event_loop(pair: EnginePair) -> None:
    out_imm, in_imm, seed = fresh_imm(), fresh_imm(), 17
    data = seeded_bytes(seed, 64 * KIB)
    pair.src[: data.size] = data
    pair.target.call("fill", seed=seed, length=16 * KIB)
    inbox = pair.inbox_mr.descriptor.hex()

    async def scenario() -> None:
        await pair.engine.write(pair.mr, 0, pair.descriptor, 0, data.size, out_imm)
        arrival = asyncio.ensure_future(pair.engine.wait_imm_async(in_imm, 2, WAIT_S))
        # The peer's blocking request runs in a thread while this loop keeps running.
        await asyncio.to_thread(
            pair.target.call, "write_paged", descriptor=inbox,
            src_pages=[3, 0], dst_pages=[1, 5], page_size=4 * KIB, imm=in_imm,
        )
        await arrival
        with pytest.raises(TransferTimeout, match=rf"imm {in_imm}: 2 of 3 arrived"):
            await pair.engine.wait_imm_async(in_imm, 3, 0.2)

    asyncio.run(asyncio.wait_for(scenario(), 60))

    pair.wait_target_count(out_imm, 1)
    assert_same_bytes(pair.target_bytes(0, data.size), data, "awaited write")
    peer_bytes = seeded_bytes(seed, 16 * KIB)
    assert_same_bytes(pair.inbox[4 * KIB : 8 * KIB], peer_bytes[12 * KIB : 16 * KIB], "peer page 3")
    assert_same_bytes(pair.inbox[20 * KIB : 24 * KIB], peer_bytes[: 4 * KIB], "peer page 0")


# -- control messages -------------------------------------------------------------------


def test_control_messages_round_trip_between_processes(pair: EnginePair) -> None:
    payload = seeded_bytes(23, 1000).tobytes()
    message = pair.engine.address.hex().encode() + b"|" + payload.hex().encode()

    pair.engine.send(pair.target.address, message).wait(WAIT_S)
    assert pair.target.call("echo", timeout=WAIT_S)["echoed"]

    assert pair.engine.recv(WAIT_S) == payload[::-1]


def test_control_message_of_64_kib_arrives_whole_and_larger_or_empty_ones_are_refused(
    pair: EnginePair,
) -> None:
    largest = seeded_bytes(29, 64 * KIB).tobytes()
    pair.engine.send(pair.target.address, largest).wait(WAIT_S)
    assert bytes.fromhex(pair.target.call("recv", timeout=WAIT_S)["payload"]) == largest

    posted = ops_posted(pair.engine)
    with pytest.raises(BoundsError, match="exceeds the 65536-byte limit"):
        pair.engine.send(pair.target.address, largest + b"x")
    with pytest.raises(BoundsError, match="empty message"):
        pair.engine.send(pair.target.address, b"")
    assert ops_posted(pair.engine) == posted
    assert pair.target.call("recv", timeout=0.1)["payload"] is None


def test_recv_with_nothing_sent_returns_none_after_its_timeout(pair: EnginePair) -> None:
    started = time.monotonic()
    assert pair.engine.recv(0.2) is None
    assert 0.2 <= time.monotonic() - started < 5.0
