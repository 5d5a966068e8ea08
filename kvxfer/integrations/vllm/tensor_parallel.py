"""Where a worker sits in vLLM's tensor parallel group, and which KV heads each rank holds.

vLLM splits a model's `total` KV heads over `tp` ranks: with `tp <= total` rank r holds
the `total / tp` consecutive heads from `r * total / tp`; with `tp > total` each head is
replicated on `tp / total` consecutive ranks (rank r holds head `r // (tp / total)`,
`QKVParallelLinear`'s `num_kv_head_replicas`). A decode rank's heads are then sliced from
the prefill ranks that hold them, whatever either side's TP size: `head_sources` says
which prefill rank gives which of its heads to which of the decode rank's, and
`head_targets` which decode ranks a prefill rank serves (so it knows how many reservations
to wait for). Both sides compute the same answer from (total heads, prefill TP, decode TP);
nothing of it travels but the slice itself.

`RankAddresses` is how one instance's ranks are reached: the registry record's engine
address, and the `peer_engine` of a hand-off, list every rank's engine (a single rank's
address is its engine address unchanged, as before tensor parallelism).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvxfer.errors import KvxferError

#: Starts an encoded list of rank addresses. Engine addresses start with b"KVXA", so a
#: single engine address is never read as a list.
_RANKS_MAGIC = b"KVXT"
_RANKS_HEADER = struct.Struct("<4sB")
_ADDRESS_LENGTH = struct.Struct("<H")


class TensorParallelError(KvxferError, ValueError):
    """Two tensor parallel sizes whose KV heads cannot be mapped, or a malformed rank list."""


@dataclass(frozen=True)
class TensorParallelPlace:
    """This worker's rank, its group's size, and the model's KV heads over every rank
    (1 for MLA's latent cache, which every rank holds whole)."""

    rank: int = 0
    size: int = 1
    total_kv_heads: int = 1

    def __post_init__(self) -> None:
        check_tp_size(self.total_kv_heads, self.size)
        if not 0 <= self.rank < self.size:
            raise TensorParallelError(f"rank {self.rank} is outside a tensor parallel group of {self.size}")

    @property
    def heads(self) -> tuple[int, int]:
        """[first, end) of the global KV heads this rank holds."""
        return rank_heads(self.total_kv_heads, self.size, self.rank)


@dataclass(frozen=True)
class HeadSlice:
    """Heads `src_heads` (local to prefill rank `src_rank`) go to heads `dst_heads` (local
    to the decode rank): both ranges [first, end) of the same length."""

    src_rank: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]


def check_tp_size(total_kv_heads: int, tp: int) -> None:
    """TensorParallelError unless vLLM can split `total_kv_heads` over `tp` ranks."""
    if total_kv_heads < 1 or tp < 1:
        raise TensorParallelError(f"{total_kv_heads} KV heads over {tp} ranks: both must be positive")
    if total_kv_heads % tp and tp % total_kv_heads:
        raise TensorParallelError(f"{total_kv_heads} KV heads cannot be split over tensor parallel size {tp} "
                                  "(one must divide the other)")


def rank_heads(total_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """[first, end) of the global KV heads rank `rank` of `tp` holds (vLLM's split)."""
    check_tp_size(total_kv_heads, tp)
    if tp <= total_kv_heads:
        per = total_kv_heads // tp
        return (rank * per, (rank + 1) * per)
    head = rank // (tp // total_kv_heads)
    return (head, head + 1)


def head_sources(total_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadSlice]:
    """Which prefill rank (of `src_tp`) gives which heads to decode rank `dst_rank` (of
    `dst_tp`): every head of the decode rank exactly once, consecutive heads from one
    prefill rank in one slice. A head replicated on several prefill ranks is taken from
    the replica at the decode rank's position among them, so decode ranks spread their
    reads. TensorParallelError where either size cannot split the heads."""
    check_tp_size(total_kv_heads, src_tp)
    d0, d1 = rank_heads(total_kv_heads, dst_tp, dst_rank)
    replicas = max(1, src_tp // total_kv_heads)
    slices: list[HeadSlice] = []
    for head in range(d0, d1):
        if src_tp <= total_kv_heads:
            per = total_kv_heads // src_tp
            src_rank, src_local = head // per, head % per
        else:
            src_rank, src_local = head * replicas + dst_rank % replicas, 0
        last = slices[-1] if slices else None
        if last is not None and last.src_rank == src_rank and last.src_heads[1] == src_local:
            slices[-1] = HeadSlice(src_rank, (last.src_heads[0], src_local + 1),
                                   (last.dst_heads[0], last.dst_heads[1] + 1))
        else:
            slices.append(HeadSlice(src_rank, (src_local, src_local + 1), (head - d0, head - d0 + 1)))
    return slices


def head_targets(total_kv_heads: int, src_tp: int, dst_tp: int, src_rank: int) -> list[int]:
    """The decode ranks that draw heads from prefill rank `src_rank`, ascending."""
    return [d for d in range(dst_tp)
            if any(s.src_rank == src_rank for s in head_sources(total_kv_heads, src_tp, dst_tp, d))]


def encode_rank_addresses(addresses: list[bytes]) -> bytes:
    """One instance's engine addresses, rank order: a lone address as it is (the record of
    a TP 1 instance is what it always was), several as a length-prefixed list."""
    if not addresses:
        raise TensorParallelError("an instance has at least one rank")
    if len(addresses) == 1:
        return addresses[0]
    if len(addresses) > 255:
        raise TensorParallelError(f"{len(addresses)} ranks: at most 255 are listed")
    parts = [_RANKS_HEADER.pack(_RANKS_MAGIC, len(addresses))]
    for address in addresses:
        parts += [_ADDRESS_LENGTH.pack(len(address)), address]
    return b"".join(parts)


def decode_rank_addresses(raw: bytes) -> list[bytes]:
    """The ranks' engine addresses `encode_rank_addresses` wrote (a lone address: one rank)."""
    if not raw.startswith(_RANKS_MAGIC):
        return [raw]
    if len(raw) < _RANKS_HEADER.size:
        raise TensorParallelError("a truncated rank address list")
    _, count = _RANKS_HEADER.unpack_from(raw)
    out: list[bytes] = []
    at = _RANKS_HEADER.size
    for _ in range(count):
        if at + _ADDRESS_LENGTH.size > len(raw):
            raise TensorParallelError("a truncated rank address list")
        (length,) = _ADDRESS_LENGTH.unpack_from(raw, at)
        at += _ADDRESS_LENGTH.size
        if length == 0 or at + length > len(raw):
            raise TensorParallelError("a rank address list with an empty or truncated address")
        out.append(raw[at:at + length])
        at += length
    if at != len(raw) or not out:
        raise TensorParallelError("a rank address list with trailing bytes or no rank")
    return out
