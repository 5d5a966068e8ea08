"""Parsed remote descriptors, kept so that a write does not parse its target again.

A decoder hands out a new windows descriptor for every reservation, so a prefill engine
sees one new descriptor per request for as long as it runs. Each miss must therefore
cost about the same however many descriptors are cached: the cache is bounded and drops
its oldest entry first, and nothing walks all entries on every miss.

What must still be walked now and then: a descriptor of a same-host peer keeps that
peer's memory mapped in this process (the whole KV cache of a SharedBuffer region), so
entries whose owner exited or withdrew the region are dropped by a sweep. A sweep runs
when a descriptor names a same-host region none of the cached ones names (a peer that
started or restarted, or registered anew: when there can be something to let go of), and
otherwise once as many new descriptors arrived as the last sweep kept (at least
`sweep_every`), so that each new descriptor pays for about one entry of a sweep, not for
all of them.

Hits are one dict lookup with no lock (the write path); misses take a lock, since
several threads may submit at once.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

# Descriptors kept per engine: at ~1 KiB each, a few MiB at most.
REMOTE_CACHE_ENTRIES = 4096
# The fewest new descriptors between two sweeps when no new same-host region forces one
# (more when the cache holds more: see the module's docstring).
REMOTE_SWEEP_EVERY = 256


class RemoteDescriptorCache:
    """Descriptor bytes -> the native engine's parsed RemoteRegion.

    `parse` is the native engine's `parse_remote`; what it returns must have the
    properties `same_host`, `engine_id`, `region_id`, `owner_exited` and
    `same_host_region_withdrawn` (kvxfer._native.RemoteRegion).
    """

    def __init__(
        self,
        parse: Callable[[bytes], Any],
        max_entries: int = REMOTE_CACHE_ENTRIES,
        sweep_every: int = REMOTE_SWEEP_EVERY,
    ) -> None:
        if max_entries < 1 or sweep_every < 1:
            raise ValueError("max_entries and sweep_every must be at least 1")
        self._parse = parse
        self._max_entries = max_entries
        self._sweep_every = sweep_every
        self._entries: dict[bytes, Any] = {}  # insertion order: oldest first
        self._same_host_regions: set[tuple[int, int]] = set()  # (engine id, region id) cached
        self._misses_since_sweep = 0
        self._sweep_due = sweep_every  # misses after which the next sweep runs
        self._miss_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Any:
        """The parsed descriptor for `key`, parsing it on a miss (errors from the parse
        propagate and nothing is cached)."""
        remote = self._entries.get(key)
        if remote is not None:
            return remote
        with self._miss_lock:
            remote = self._entries.get(key)  # another thread may have parsed it meanwhile
            if remote is None:
                remote = self._parse(key)
                self._insert(key, remote)
            return remote

    def forget_owner(self, engine_id: int) -> None:
        """Drops every descriptor of the engine `engine_id` (a peer that went away)."""
        with self._miss_lock:
            self._replace({k: v for k, v in self._entries.items() if v.engine_id != engine_id})

    def _insert(self, key: bytes, remote: Any) -> None:
        self._misses_since_sweep += 1
        region = (remote.engine_id, remote.region_id) if remote.same_host else None
        new_region = region is not None and region not in self._same_host_regions
        if new_region or self._misses_since_sweep >= self._sweep_due:
            self._sweep_locked()
        entries = self._entries
        if len(entries) >= self._max_entries:
            # Oldest first: a descriptor still in use that goes is parsed again (tens of us).
            del entries[next(iter(entries))]
        entries[key] = remote
        if region is not None:
            self._same_host_regions.add(region)

    def _sweep_locked(self) -> None:
        """Drops descriptors whose same-host owner exited or no longer lists their region."""
        self._misses_since_sweep = 0
        exited: dict[int, bool] = {}  # by owner: one system call each, not one per descriptor
        kept: dict[bytes, Any] = {}
        for key, remote in self._entries.items():
            if remote.same_host:
                owner = remote.engine_id
                if owner not in exited:
                    exited[owner] = remote.owner_exited
                if exited[owner] or remote.same_host_region_withdrawn:
                    continue
            kept[key] = remote
        self._replace(kept)
        self._sweep_due = max(self._sweep_every, len(kept))

    def _replace(self, entries: dict[bytes, Any]) -> None:
        # A new dict, swapped in whole: lock-free readers see the old one or the new one.
        self._entries = entries
        self._same_host_regions = {(v.engine_id, v.region_id) for v in entries.values() if v.same_host}
