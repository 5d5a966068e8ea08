"""RemoteDescriptorCache: what a writer keeps of the descriptors it parsed.

Unit tests with stand-ins for the native RemoteRegion (the cache only reads five of its
properties); that a withdrawn region's memory really leaves the writer is tested between
processes in test_same_host_path.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvxfer.errors import DescriptorError
from kvxfer.transfer.remote_cache import RemoteDescriptorCache


@dataclass
class Owner:
    """A peer engine; counts how often a sweep asked whether it exited (a system call)."""

    engine_id: int
    exited: bool = False
    exit_checks: int = 0


@dataclass
class Remote:
    """Stands in for kvxfer._native.RemoteRegion."""

    owner: Owner
    region_id: int
    same_host: bool = True
    withdrawn: bool = False
    withdrawn_checks: int = 0

    @property
    def engine_id(self) -> int:
        return self.owner.engine_id

    @property
    def owner_exited(self) -> bool:
        self.owner.exit_checks += 1
        return self.owner.exited

    @property
    def same_host_region_withdrawn(self) -> bool:
        self.withdrawn_checks += 1
        return self.same_host and self.withdrawn


@dataclass
class Parser:
    """Parses b'<key>' to the Remote registered for it, counting parses."""

    remotes: dict[bytes, Remote] = field(default_factory=dict)
    parsed: list[bytes] = field(default_factory=list)

    def __call__(self, key: bytes) -> Remote:
        self.parsed.append(key)
        if key not in self.remotes:
            raise DescriptorError(f"not a descriptor: {key!r}")
        return self.remotes[key]


def windows(owner: Owner, region_id: int, count: int, parser: Parser, same_host: bool = True) -> list[bytes]:
    """`count` descriptors of one region (a reservation's windows each), known to `parser`."""
    keys = [f"{owner.engine_id}/{region_id}/{i}".encode() for i in range(count)]
    for key in keys:
        parser.remotes[key] = Remote(owner, region_id, same_host)
    return keys


def test_a_hit_parses_nothing_and_a_miss_parses_once() -> None:
    parser = Parser()
    (key,) = windows(Owner(1), 1, 1, parser)
    cache = RemoteDescriptorCache(parser)
    first = cache.get(key)
    assert cache.get(key) is first
    assert parser.parsed == [key]


def test_a_descriptor_that_does_not_parse_raises_and_is_not_kept() -> None:
    parser = Parser()
    cache = RemoteDescriptorCache(parser)
    for _ in range(2):
        with pytest.raises(DescriptorError):
            cache.get(b"garbage")
    assert parser.parsed == [b"garbage", b"garbage"] and len(cache) == 0


def test_when_full_the_oldest_descriptor_goes_first() -> None:
    parser = Parser()
    keys = windows(Owner(1), 1, 4, parser)
    cache = RemoteDescriptorCache(parser, max_entries=3)
    for key in keys:
        cache.get(key)
    assert len(cache) == 3
    for key in keys[1:]:
        cache.get(key)
    assert parser.parsed == keys  # the three newest were still there
    cache.get(keys[0])
    assert parser.parsed == keys + keys[:1]  # the oldest was not


def test_a_new_same_host_region_drops_descriptors_whose_owner_exited_or_withdrew_them() -> None:
    parser = Parser()
    restarted, resized, live, remote_host = Owner(1), Owner(2), Owner(3), Owner(4)
    gone = windows(restarted, 1, 3, parser)
    old_cache = windows(resized, 1, 3, parser)
    kept = windows(resized, 2, 1, parser) + windows(remote_host, 1, 2, parser, same_host=False)
    cache = RemoteDescriptorCache(parser, sweep_every=1000)
    for key in gone + old_cache + kept:
        cache.get(key)
    restarted.exited = True
    for key in old_cache:
        parser.remotes[key].withdrawn = True

    for owner in (restarted, resized, remote_host):
        owner.exit_checks = 0  # earlier new regions swept too
    (fresh,) = windows(live, 1, 1, parser)
    cache.get(fresh)

    parser.parsed.clear()
    for key in kept + [fresh]:
        cache.get(key)
    assert parser.parsed == []  # all still cached
    assert len(cache) == len(kept) + 1  # and nothing else
    # One question per owner, however many of its descriptors were cached.
    assert (restarted.exit_checks, resized.exit_checks, remote_host.exit_checks) == (1, 1, 0)


def test_new_descriptors_of_cached_regions_pay_a_constant_share_of_the_sweeps() -> None:
    # A decoder's reservations each bring a new windows descriptor of its one KV cache:
    # one miss per request, which must not walk the whole cache every time. Sweeps come
    # once as many misses arrived as the last sweep kept (at least sweep_every), so all
    # of them together look at fewer than two entries per miss.
    parser = Parser()
    decoder = Owner(1)
    misses = 1000
    keys = windows(decoder, 1, misses, parser)
    cache = RemoteDescriptorCache(parser, sweep_every=25)
    for key in keys:
        cache.get(key)
    looked_at = sum(parser.remotes[key].withdrawn_checks for key in keys)
    assert looked_at < 2 * misses
    assert decoder.exit_checks >= 5  # yet they ran: at 25, 50, 100, ... cached


def test_forget_owner_drops_every_descriptor_of_that_engine_only() -> None:
    parser = Parser()
    a, b = Owner(1), Owner(2)
    of_a, of_b = windows(a, 1, 3, parser), windows(b, 1, 2, parser, same_host=False)
    cache = RemoteDescriptorCache(parser)
    for key in of_a + of_b:
        cache.get(key)
    cache.forget_owner(a.engine_id)
    parser.parsed.clear()
    for key in of_b + of_a:
        cache.get(key)
    assert parser.parsed == of_a


def test_sizes_below_one_are_refused() -> None:
    with pytest.raises(ValueError):
        RemoteDescriptorCache(Parser(), max_entries=0)
    with pytest.raises(ValueError):
        RemoteDescriptorCache(Parser(), sweep_every=0)
