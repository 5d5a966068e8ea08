"""What one reservation lets its prefiller do on a decoder, opened and revoked as one.

Both decoders (the builtin decode worker and the vLLM connector's decode side) scope a
reservation three ways while it waits for its KV:

- its immediate claimed, on an engine that counts claimed immediates only
  (`imm_admission="claimed"`, what the decoders use): arrivals for it are counted from now
  on, and arrivals for any value no live reservation claimed are dropped without taking a
  slot of the immediate table. A sender spraying immediate-only writes therefore cannot
  fill the table (which would leave no slot for the next reservation);
- its own registrations: the reservation's pages (`write_windows.reservation_windows`) and,
  on the builtin decoder, its mailbox slot, registered again with fresh random keys. Their
  descriptors are what the prefiller gets, so a holder of them can write nothing else;
- its immediate bound to the prefiller the reservation names, so arrivals from any other
  sender never count (where the provider can name a sender, `capabilities["source"]`, and
  the prefiller has no more rails than the decoder).

`ReservationScope.revoke()` undoes all of it the moment the reservation stops waiting
(admitted, cancelled, timed out, failed). A write with its descriptors then fails at the
writer and lands nothing, and its immediate is released: later arrivals for it are dropped
(on an engine that counts every value, it counts arrivals from anyone again, which is
harmless: the decoder forgets the immediate and a slot comes back only under a new
generation). The caller reads the count before revoking, never after.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvxfer.errors import DescriptorError
from kvxfer.transfer.engine import MemoryWindows, RegisteredMemory, TransferEngine

log = logging.getLogger(__name__)

#: Providers already warned about (once per process) for not naming a sender.
_warned_unbound: set[str] = set()


class PrefillAddressError(DescriptorError):
    """The prefiller address a reservation names is not an engine address."""


class ReservationScope:
    """The registrations and the immediate binding of one reservation (see the module)."""

    def __init__(self, engine: TransferEngine, label: str) -> None:
        self._engine = engine
        self.label = label  # says which reservation in logs: a request or transfer id
        self.windows: list[MemoryWindows] = []  # open registrations, in the order asked for
        self.bound_imm: int | None = None  # the immediate while it counts only its prefiller's arrivals
        self.claimed_imm: int | None = None  # the immediate while the engine counts it (imm_admission "claimed")

    @classmethod
    def open(cls, engine: TransferEngine, label: str, imm: int, prefill_address: bytes | None,
             parts: Sequence[tuple[RegisteredMemory, list[tuple[int, int]]]]) -> ReservationScope:
        """Claims `imm` (on an engine with imm_admission "claimed"), binds it to
        `prefill_address` (None: no binding) and registers each (region, ranges) of `parts`
        again (none: the reservation hands out whole-region descriptors).

        All or nothing: whatever was opened is revoked again before an error propagates.
        Raises ImmCounterOverflow when the engine's table has no slot left for `imm`,
        PrefillAddressError for a malformed address, and what `register_windows` raises for
        ranges the provider or the bounds refuse.
        """
        scope = cls(engine, label)
        try:
            if engine.imm_admission == "claimed":
                # Before anything is handed out: no write for it can have been counted yet.
                engine.claim_imm(imm)
                scope.claimed_imm = imm
            if prefill_address is not None:
                scope._bind(imm, prefill_address)
            for region, ranges in parts:
                scope.windows.append(engine.register_windows(region, ranges))
        except BaseException:
            scope.revoke()
            raise
        return scope

    def _bind(self, imm: int, prefill_address: bytes) -> None:
        try:
            bound = self._engine.bind_imm_source(imm, prefill_address)
        except ValueError as exc:  # DescriptorError included: not an engine address
            raise PrefillAddressError(str(exc)) from None
        if bound:
            self.bound_imm = imm
        elif self._engine.provider not in _warned_unbound:
            _warned_unbound.add(self._engine.provider)
            log.warning("the %s provider cannot name the sender of an immediate, or the prefiller has more rails "
                        "than this decoder: immediates are credited from any sender; scoped descriptors still hold",
                        self._engine.provider)

    @property
    def descriptors(self) -> list[bytes]:
        """The descriptor of each registration, in the order `parts` asked for them."""
        return [w.descriptor for w in self.windows]

    def revoke(self) -> None:
        """Closes the registrations and unbinds the immediate; harmless to call again.

        Errors are logged, not raised: an engine closing under us closed and unbound them
        itself, and a caller revoking on its way to FAILED must get there.
        """
        windows, self.windows = self.windows, []
        for part in windows:
            try:
                part.close()
            except Exception:
                log.exception("closing a registration of %s failed", self.label)
        if self.bound_imm is not None:
            imm, self.bound_imm = self.bound_imm, None
            try:
                self._engine.unbind_imm_source(imm)
            except Exception:
                log.exception("unbinding the immediate of %s failed", self.label)
        if self.claimed_imm is not None:
            imm, self.claimed_imm = self.claimed_imm, None
            try:
                self._engine.release_imm(imm)
            except Exception:
                log.exception("releasing the immediate of %s failed", self.label)
