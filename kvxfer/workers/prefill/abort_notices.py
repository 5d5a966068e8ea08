"""Abort messages from a prefill worker to the decoders of its failed pushes.

A push that cannot complete (cancelled, a failed write, a local error) ends with an abort
message to its decoder, sent once none of its writes is in flight: the decoder then fails
the request at once and reuses its pages, instead of holding them to its fence deadline.
"""

from __future__ import annotations

import logging
import threading

from kvxfer.errors import KvxferError
from kvxfer.kv.protocol import KVReservation, encode_abort
from kvxfer.transfer.engine import Transfer, TransferEngine

log = logging.getLogger("kvxfer.prefill")


class AbortNotices:
    """Sends abort messages over `engine` without waiting for them.

    Called from the push monitor's thread, which must not block on a decoder; a send not
    yet completed is kept referenced here until it is. A send that fails is logged and
    dropped: the decoder then fails the request at its fence deadline instead.
    """

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._sending: list[Transfer] = []

    def send(self, reservation: KVReservation, why: str) -> None:
        """Tells the decoder of `reservation` that its push failed, and `why`."""
        try:
            transfer = self.engine.send(reservation.descriptor, encode_abort(reservation.imm, reservation.nonce, why))
        except (KvxferError, ValueError) as exc:
            log.warning("request %s: abort not sent: %s", reservation.request_id, exc)
            return
        with self._lock:
            self._sending = [t for t in self._sending if not t.done()] + [transfer]
