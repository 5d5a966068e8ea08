"""Fixtures of the worker tests."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from support.pod_cluster import pod_worker_set
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


@pytest.fixture
def pod_workers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[WorkerSet]:
    """Like `own_workers`, each worker a pod (own network and PID namespace) so KV between
    them crosses the fabric; the test runs on the pods' bridge (`workers.pods.client()`),
    and an in-process engine there binds the client's address (`workers.pods.addresses
    ["client"]`). Where namespaces cannot be made: loopback with the same-host path off."""
    with pod_worker_set(tmp_path, request, request.node.name) as workers:
        yield workers
