"""Fixtures of the transfer tests: one pool of engine pairs per test mode for the whole
session (peer processes are the slow part), a zeroed single-rail pair per test, and peers a
test starts for itself."""

from __future__ import annotations

from typing import Iterator

import pytest
from support.engine_pairs import MODES, EnginePair, OwnPeers, PairPool


@pytest.fixture(scope="session", params=MODES)
def provider(request: pytest.FixtureRequest) -> str:
    """The test mode: a libfabric provider, or SAME_HOST."""
    return request.param


@pytest.fixture(scope="session")
def pairs(provider: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PairPool]:
    pool = PairPool(provider, tmp_path_factory.mktemp(f"engine-{provider}"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture()
def pair(pairs: PairPool) -> EnginePair:
    """The provider's single-rail pair, target zeroed."""
    return pairs.get(1)


@pytest.fixture()
def peers(pairs: PairPool) -> Iterator[OwnPeers]:
    own = OwnPeers(pairs)
    try:
        yield own
    finally:
        for peer in own.taken:
            peer.close()
