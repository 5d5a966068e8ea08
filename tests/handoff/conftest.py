"""Fixtures the hand-off tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvxfer.transfer.engine import TransferEngine


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """A decoder's engine and a prefiller's, on loopback (one pair per test module)."""
    with TransferEngine(provider="net", bind_host="127.0.0.1") as decoder, \
            TransferEngine(provider="net", bind_host="127.0.0.1") as prefiller:
        yield decoder, prefiller
