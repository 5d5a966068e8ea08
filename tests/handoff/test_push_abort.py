"""A push's abort (kvxfer.handoff.push_abort): it goes only once the push stopped and
nothing of it is in flight, at most once, with the protocol's bytes; a send the engine
refuses is logged, not raised.

Two real engines (net on loopback): the prefiller's sends, the decoder's inbox receives.
The senders that use it are tested with real processes: tests/workers/test_fault_injection.py
(builtin) and tests/integrations/test_vllm_connector.py (the connector).
"""

from __future__ import annotations

import logging

import pytest

from kvxfer.handoff.push_abort import AbortSender, AbortWords, PushAbort
from kvxfer.handoff.push_state import PushState
from kvxfer.kv.protocol import KVReservation, encode_abort, encode_imm
from kvxfer.transfer.engine import TransferEngine

RECV_TIMEOUT_S = 5.0
#: Long enough to see that nothing more arrives after one message did (loopback delivers in
#: well under a millisecond).
NOTHING_MORE_S = 0.3

WORDS = AbortWords(logging.getLogger("kvxfer.test_push_abort"), "request %s: abort not sent: %s",
                   sending="transfer %s: no write in flight any more; telling the decoder (%s)")


@pytest.fixture()
def decoder_inbox(engines: tuple[TransferEngine, TransferEngine]) -> TransferEngine:
    """The decoder's engine with its inbox emptied (a failed test may leave a message in it)."""
    decoder = engines[0]
    while decoder.recv(0.0) is not None:
        pass
    return decoder


def reservation_at(descriptor: bytes, nonce: int) -> KVReservation:
    return KVReservation(request_id=f"r{nonce}", descriptor=descriptor, pages=[0, 1], num_pages=8,
                         imm=encode_imm(3, 1), expected_count=5, kv_layout="L2-H2-D16-float32-bs16",
                         meta_descriptor=b"m", meta_offset=0, nonce=nonce, fence_timeout_s=5.0)


def test_the_abort_goes_once_with_the_protocols_bytes_when_the_push_stopped_and_nothing_is_in_flight(
    engines: tuple[TransferEngine, TransferEngine], decoder_inbox: TransferEngine
) -> None:
    decoder, prefiller = decoder_inbox, engines[1]
    sender = AbortSender(prefiller, WORDS)
    reservation = reservation_at(decoder.address, nonce=41)
    push = PushAbort()

    assert not sender.abort(push, reservation, PushState.STOPPING, True, "cancelled")  # writes may still land
    assert not sender.abort(push, reservation, PushState.PUSHING, False, "cancelled")  # still posting
    assert not sender.abort(push, reservation, PushState.WAITING_FOR_RESERVATION, False, "cancelled")
    assert not sender.abort(push, None, PushState.FAILED, False, "no reservation to tell")
    assert decoder.recv(NOTHING_MORE_S) is None

    assert sender.abort(push, reservation, PushState.STOPPING, False, "cancelled by the decoder: client gone")
    assert decoder.recv(RECV_TIMEOUT_S) == encode_abort(reservation.imm, reservation.nonce,
                                                        "cancelled by the decoder: client gone")
    assert not sender.abort(push, reservation, PushState.FAILED, False, "a second time")
    assert decoder.recv(NOTHING_MORE_S) is None


@pytest.mark.parametrize("state", [PushState.STOPPING, PushState.FAILED, PushState.DONE])
def test_every_stopped_state_may_abort(state: PushState) -> None:
    assert PushAbort().due(state, writes_in_flight=False)


def test_send_tells_a_reservation_nothing_was_posted_to_and_logs_its_words(
    engines: tuple[TransferEngine, TransferEngine], decoder_inbox: TransferEngine, caplog: pytest.LogCaptureFixture
) -> None:
    decoder, prefiller = decoder_inbox, engines[1]
    reservation = reservation_at(decoder.address, nonce=42)
    with caplog.at_level(logging.INFO, logger=WORDS.logger.name):
        assert AbortSender(prefiller, WORDS).send(reservation, "cancelled before the request arrived")
    assert decoder.recv(RECV_TIMEOUT_S) == encode_abort(reservation.imm, 42, "cancelled before the request arrived")
    assert caplog.messages == ["transfer r42: no write in flight any more; telling the decoder "
                               "(cancelled before the request arrived)"]


def test_a_send_the_engine_refuses_is_logged_in_the_senders_words_not_raised(
    engines: tuple[TransferEngine, TransferEngine], caplog: pytest.LogCaptureFixture
) -> None:
    _, prefiller = engines
    sender = AbortSender(prefiller, WORDS)
    push = PushAbort()
    with caplog.at_level(logging.INFO, logger=WORDS.logger.name):
        assert not sender.abort(push, reservation_at(b"\x00not an address", nonce=43), PushState.FAILED, False,
                                "a write failed")
    assert push.sent, "a failed send is not tried again: the decoder's fence deadline covers it"
    failures = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(":")[0:2] for r in failures] == [["request r43", " abort not sent"]]
