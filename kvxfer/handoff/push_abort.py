"""The abort of a push, for both senders: the builtin prefiller and the vLLM connector.

A push that ends early (cancelled, a failed write, a local error) tells its decoder with
the protocol's abort message (`encode_abort(imm, nonce, reason)`, sent to the
reservation's descriptor) so that the decoder fails the request at once and reuses its
pages instead of holding them to its fence deadline. The message may go only once the
push has stopped (no longer live in push_state.py's table: nothing more will be posted)
and none of its writes is in flight (InflightWrites: nothing can land any more), and it
goes at most once per push: each push keeps a `PushAbort`, and the sender's
`AbortSender.abort` checks both before it sends. A reservation of which nothing was ever
posted (the connector's reservation whose request never arrived) is told with `send`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvxfer.handoff.push_state import LIVE, PushState
from kvxfer.kv.protocol import KVReservation, encode_abort
from kvxfer.transfer.engine import Transfer, TransferEngine


@dataclass(frozen=True)
class AbortWords:
    """How one sender words its aborts in its own log (operators and tests read them).

    `not_sent` (at `not_sent_level`) is logged when a send fails, with the request id and
    the error; `sending` (at INFO, where given) before each send, with the request id and
    the reason.
    """

    logger: logging.Logger
    not_sent: str
    not_sent_level: int = logging.WARNING
    sending: str | None = None


class PushAbort:
    """One push's abort: whether it went, so that it goes at most once."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False

    def due(self, state: PushState, writes_in_flight: bool) -> bool:
        """The abort may go now: not sent yet, the push stopped and nothing of it can land."""
        return not self.sent and state not in LIVE and not writes_in_flight


class AbortSender:
    """Sends abort messages over `engine` and never waits for them.

    Its callers (the builtin push monitor's thread, vLLM's worker thread) must not block on
    a decoder: a send not yet completed is kept referenced here until it is. A send that
    fails is logged and dropped, never raised: the decoder then fails the request at its
    fence deadline instead.
    """

    def __init__(self, engine: TransferEngine, words: AbortWords) -> None:
        self.engine = engine
        self.words = words
        self._lock = threading.Lock()
        self._sending: list[Transfer] = []

    def abort(self, push: PushAbort, reservation: KVReservation | None, state: PushState,
              writes_in_flight: bool, reason: str) -> bool:
        """Tells the decoder of `reservation` that the push ended, and `reason`, if the push
        may (`PushAbort.due`) and has a reservation; True if the message was handed to the
        engine."""
        if reservation is None or not push.due(state, writes_in_flight):
            return False
        push.sent = True
        return self.send(reservation, reason)

    def send(self, reservation: KVReservation, reason: str) -> bool:
        """Tells the decoder of `reservation`, of which nothing is in flight, that the push
        ended, and `reason`; False (logged) where the engine refused the send."""
        words = self.words
        if words.sending is not None:
            words.logger.info(words.sending, reservation.request_id, reason)
        try:
            transfer = self.engine.send(reservation.descriptor,
                                        encode_abort(reservation.imm, reservation.nonce, reason))
        except Exception as exc:  # the decoder is gone, a descriptor the engine refuses
            words.logger.log(words.not_sent_level, words.not_sent, reservation.request_id, exc)
            return False
        with self._lock:
            self._sending = [t for t in self._sending if not t.done()] + [transfer]
        return True
