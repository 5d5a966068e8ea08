"""A reservation for a head slice: what a decode rank sends a prefill rank of another
tensor parallel size.

Between equal TP sizes a decode rank's blocks are its prefill rank's blocks, head for
head, and the protocol's reservation (`kvxfer.kv.protocol`) says everything. Between
different sizes a decode rank takes some of a prefill rank's heads into some of its own:
this message is that reservation behind a header naming the decode rank (the prefill rank
waits for each rank `head_targets` names), the slice on both sides, and the decode rank's
heads per block (its cache's geometry, from which the prefiller plans each write). The
reservation's own checks (kv_layout at that head count, pages, fence) still apply.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvxfer.kv.protocol import KVReservation, ReservationError, decode_reservation_message, encode_reservation_message

from .tensor_parallel import HeadSlice

_MAGIC = b"KVHS"
_VERSION = 1
# magic, version, decode rank, decode TP size, source heads [first, end), destination
# heads [first, end), the decode rank's heads per block; then the reservation message.
_HEADER = struct.Struct("<4sHHHHHHHH")


@dataclass(frozen=True)
class SliceTarget:
    """Where one decode rank wants heads of this prefill rank's blocks."""

    decode_rank: int
    decode_tp: int
    slice: HeadSlice
    dst_num_heads: int


def encode_sliced_reservation(target: SliceTarget, reservation: KVReservation) -> bytes:
    """The control message of a sliced reservation."""
    s = target.slice
    header = _HEADER.pack(_MAGIC, _VERSION, target.decode_rank, target.decode_tp, *s.src_heads, *s.dst_heads,
                          target.dst_num_heads)
    return header + encode_reservation_message(reservation)


def decode_sliced_reservation(raw: bytes, src_rank: int) -> tuple[SliceTarget, KVReservation] | None:
    """(target, reservation) of a sliced reservation received by prefill rank `src_rank`;
    None for any other message; ReservationError for a malformed one."""
    if not raw.startswith(_MAGIC):
        return None
    if len(raw) < _HEADER.size:
        raise ReservationError("slice", "a truncated header")
    _, version, rank, tp, s0, s1, d0, d1, dst_heads = _HEADER.unpack_from(raw)
    if version != _VERSION:
        raise ReservationError("slice", f"version {version}, this prefiller reads {_VERSION}")
    if not (0 <= rank < tp and s0 < s1 and d0 < d1 and s1 - s0 == d1 - d0 and d1 <= dst_heads):
        raise ReservationError("slice", f"an impossible slice: rank {rank} of {tp}, heads "
                               f"{s0}..{s1} into {d0}..{d1} of {dst_heads}")
    reservation = decode_reservation_message(raw[_HEADER.size:])
    if reservation is None:
        raise ReservationError("slice", "no reservation behind the header")
    return SliceTarget(rank, tp, HeadSlice(src_rank, (s0, s1), (d0, d1)), dst_heads), reservation
