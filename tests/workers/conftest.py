"""Fixtures of the worker tests."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from support.worker_procs import WorkerSet


@pytest.fixture
def own_workers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[WorkerSet]:
    """Workers owned by one test: killed at teardown, logs printed if the test failed."""
    workers = WorkerSet(tmp_path)
    failed_before = request.session.testsfailed
    try:
        yield workers
    finally:
        if request.session.testsfailed > failed_before:
            print(f"\n===== worker logs ({request.node.name}) =====\n{workers.logs()}")
        workers.close()
