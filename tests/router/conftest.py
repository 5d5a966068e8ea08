"""Fixtures shared by the router's test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.fake_workers import ServerHost, WorkerMux


@pytest.fixture(scope="module")
def host() -> Iterator[tuple[ServerHost, WorkerMux, str]]:
    """One event loop and one fake-worker server for the whole module (fast); each test
    mounts its own workers on it and starts its own router."""
    h = ServerHost()
    mux = WorkerMux()
    try:
        yield h, mux, h.serve(mux)
    finally:
        h.close()
