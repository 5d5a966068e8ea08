"""Reads and rewrites kvxfer memory descriptors (wire version 4), and writes mailbox
records, the way an attacker with the format (docs/architecture.md, native/src/descriptors.cpp)
could: to test that the provider, not our own planner, refuses what a forged descriptor asks
for, and that the decoder, not our own encoder, refuses a forged record.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

WIRE_VERSION = 4


def fnv1a(data: bytes) -> int:
    """The 32-bit FNV-1a checksum every descriptor ends with."""
    h = 2166136261
    for byte in data:
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h


@dataclass
class Descriptor:
    """A parsed descriptor: the owner address bytes kept whole, the region and its keys."""

    owner: bytes
    rail_count: int
    region_id: int
    addr: int
    length: int
    share_fd: int
    share_offset: int
    rails: list[tuple[int, int]] = field(default_factory=list)  # (base, key) of the whole region
    windows: list[tuple[int, int, list[tuple[int, int]]]] = field(default_factory=list)  # (offset, length, keys)

    def serialize(self) -> bytes:
        out = b"KVXD" + struct.pack("<H", WIRE_VERSION) + self.owner
        out += struct.pack("<QQQiQ", self.region_id, self.addr, self.length, self.share_fd, self.share_offset)
        out += struct.pack("<H", len(self.rails)) + b"".join(struct.pack("<QQ", b, k) for b, k in self.rails)
        out += struct.pack("<H", len(self.windows))
        for offset, length, keys in self.windows:
            out += struct.pack("<QQ", offset, length) + b"".join(struct.pack("<QQ", b, k) for b, k in keys)
        return out + struct.pack("<I", fnv1a(out))


def parse(blob: bytes) -> Descriptor:
    """Parses a version-4 descriptor (no validation beyond what the layout needs)."""
    assert blob[:4] == b"KVXD" and struct.unpack_from("<H", blob, 4)[0] == WIRE_VERSION
    pos = 6
    start = pos
    pos += 8  # engine id
    pos += 1 + blob[pos]  # provider
    (rails,) = struct.unpack_from("<H", blob, pos)
    pos += 2
    for _ in range(rails):
        (n,) = struct.unpack_from("<H", blob, pos)
        pos += 2 + n
    pos += 1 + blob[pos]  # host key
    pos += 4 + 8 + 4  # pid, table address, table fd
    owner = blob[start:pos]
    region_id, addr, length, share_fd, share_offset = struct.unpack_from("<QQQiQ", blob, pos)
    pos += struct.calcsize("<QQQiQ")
    d = Descriptor(owner, rails, region_id, addr, length, share_fd, share_offset)
    (n,) = struct.unpack_from("<H", blob, pos)
    pos += 2
    for _ in range(n):
        d.rails.append(struct.unpack_from("<QQ", blob, pos))
        pos += 16
    (n,) = struct.unpack_from("<H", blob, pos)
    pos += 2
    for _ in range(n):
        offset, length = struct.unpack_from("<QQ", blob, pos)
        pos += 16
        keys = []
        for _ in range(rails):
            keys.append(struct.unpack_from("<QQ", blob, pos))
            pos += 16
        d.windows.append((offset, length, keys))
    assert pos + 4 == len(blob), "trailing bytes"
    return d


def whole_region_with_window_key(blob: bytes, window: int = 0) -> bytes:
    """A descriptor that claims the whole region under one window's keys: our planner then
    lets any offset through, so only the provider's check of key and range stands."""
    d = parse(blob)
    offset, _, keys = d.windows[window]
    # The key's range starts at the window: offsets of the forged descriptor count from there.
    d.addr, d.length = d.addr + offset, d.length - offset
    d.rails, d.windows = list(keys), []
    return d.serialize()


# The mailbox record (docs/architecture.md, "KV integrity"), as the format describes it:
# magic "KVMC", nonce, first token, prompt tokens, checksum algorithm, checksum count, units
# posted; from byte 32 the table's tag where the algorithm has one; the CRC-32C table from
# byte 64.
MAILBOX_MAGIC = 0x4B564D43
MAILBOX_RECORD_BYTES = 64
CHECKSUM_CRC32C = 1
CHECKSUM_CRC32C_TAGGED = 2


def mailbox_record(nonce: int, first_token: int, prompt_tokens: int, table: bytes,
                   algorithm: int = CHECKSUM_CRC32C, tag: bytes = b"", *, units: int) -> bytes:
    """A mailbox record written from the format alone: what an outsider who holds a
    reservation's nonce can put in its mailbox slot, with any algorithm and tag it likes,
    declaring `units` posted (a leaked reservation names the count it expects)."""
    head = struct.pack("<IQiiIII", MAILBOX_MAGIC, nonce, first_token, prompt_tokens, algorithm, len(table) // 4,
                       units)
    return (head + tag).ljust(MAILBOX_RECORD_BYTES, b"\0") + table
