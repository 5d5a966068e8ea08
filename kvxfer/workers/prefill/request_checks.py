"""The checks of a /prefill request against this prefill worker, made before any compute.

A request this worker cannot serve is refused here with a `RequestRejected` that names the
field, not failed half-way through its writes: a prompt out of range, a reservation that
does not parse or whose pages and mailbox offset lie outside the decoder's regions, a KV
layout other than this worker's, a decoder fence not longer than this worker's write
deadline, a prefix hit that does not add up to the prompt.
"""

from __future__ import annotations

from typing import Any

from kvxfer.errors import KvxferError
from kvxfer.kv.protocol import (
    CHECKSUM_BYTES,
    MAILBOX_SLOT_BYTES,
    KVReservation,
    ReservationError,
    pages_for_tokens,
)
from kvxfer.metrics import PrefillMetrics
from kvxfer.transfer.engine import TransferEngine
from kvxfer.workers.rejection import Rejection, RequestRejected


class PrefillRequestChecks:
    """Checks one /prefill request (its prompt and the decoder's reservation) against this
    worker's engine, model geometry and mailbox slots; each check raises `RequestRejected`.

    The service calls them in a fixed order, interleaved with its own checks of queue room
    and destination health, so that a request wrong in several ways gets the same answer
    whatever the load. A layout mismatch is also counted in `metrics` (a failed transfer of
    reason "layout_mismatch"): it means two workers of the cluster disagree.
    """

    def __init__(self, engine: TransferEngine, kv_layout: str, num_layers: int, block_size: int,
                 max_context: int, page_bytes: int, mailbox_slot_stride: int, metrics: PrefillMetrics) -> None:
        self.engine = engine
        self.kv_layout = kv_layout
        self.num_layers = num_layers
        self.block_size = block_size
        self.max_context = max_context
        self.page_bytes = page_bytes
        self.mailbox_slot_stride = mailbox_slot_stride
        self.metrics = metrics

    def parse_reservation(self, request_id: str, decode: dict[str, Any]) -> KVReservation:
        """Parses a decoder's reservation (`KVReservation.from_json`, which names any bad
        field) and checks it against the decoder's regions.

        Out-of-range pages, offsets or immediates are the caller's error, found before any
        compute, not a failed push half-way through the writes. `from_json` already checks
        the fields against each other (page ids below `num_pages`, the immediate's form);
        here they are checked against the regions the descriptors name.
        """
        try:
            reservation = KVReservation.from_json(decode, request_id=request_id)
        except ReservationError as exc:
            raise RequestRejected(Rejection.INVALID, str(exc), request_id) from None
        lengths = []
        for name in ("descriptor", "meta_descriptor"):
            try:
                lengths.append(self.engine.remote_length(getattr(reservation, name)))
            except (KvxferError, ValueError, TypeError) as exc:
                raise RequestRejected(Rejection.INVALID, f"malformed decode reservation: {name}: {exc}",
                                      request_id) from None
        kv_length, meta_length = lengths
        layer_bytes = reservation.num_pages * self.page_bytes
        record_bytes = MAILBOX_SLOT_BYTES
        if reservation.checksums:
            record_bytes += CHECKSUM_BYTES * reservation.num_layers * reservation.prompt_pages
        if (
            self.num_layers * layer_bytes > kv_length
            or not reservation.meta_offset <= meta_length - record_bytes
            or record_bytes > self.mailbox_slot_stride
        ):
            raise RequestRejected(
                Rejection.INVALID,
                "malformed decode reservation: pages or meta_offset outside the decoder's regions",
                request_id,
            )
        return reservation

    def check_prompt(self, request_id: str, prompt: list[int]) -> None:
        """The prompt is not empty and fits the model's context."""
        if not prompt:
            raise RequestRejected(Rejection.BAD_REQUEST, "prompt is empty", request_id)
        if len(prompt) > self.max_context:
            raise RequestRejected(Rejection.BAD_REQUEST, f"prompt of {len(prompt)} tokens exceeds the context of "
                                  f"{self.max_context}", request_id)

    def check_layout(self, request_id: str, reservation: KVReservation) -> None:
        """The decoder's pages have this worker's KV layout (else the bytes would not mean the same)."""
        if reservation.kv_layout != self.kv_layout:
            self.metrics.count_transfer_failure("layout_mismatch")
            raise RequestRejected(
                Rejection.CONFLICT,
                f"KV layout mismatch: decoder {reservation.kv_layout}, prefiller {self.kv_layout}",
                request_id,
            )

    def check_fence(self, request_id: str, reservation: KVReservation) -> None:
        """The decoder fences its pages longer than a write of this worker may take, so no
        late write can land in pages it gave to another request."""
        if reservation.fence_timeout_s <= self.engine.transfer_timeout_s:
            raise RequestRejected(
                Rejection.CONFLICT,
                f"the decoder fences its pages for {reservation.fence_timeout_s} s, not longer than this "
                f"prefiller's transfer_timeout_s={self.engine.transfer_timeout_s} s: a late write "
                "could land in reused pages",
                request_id,
            )

    def check_prefix_pages(self, request_id: str, prompt: list[int], reservation: KVReservation) -> None:
        """With a prefix hit on the decoder, the pages it holds and those it reserved make the prompt."""
        prompt_pages = pages_for_tokens(len(prompt), self.block_size)
        if reservation.first_page and reservation.first_page + len(reservation.pages) != prompt_pages:
            raise RequestRejected(
                Rejection.CONFLICT,
                f"the decoder holds {reservation.first_page} prompt pages and reserved {len(reservation.pages)} more; "
                f"the prompt has {prompt_pages}",
                request_id,
            )
