"""Fixtures of the worker tests."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest
from support.pod_cluster import POD_MODE_UNAVAILABLE
from support.pod_namespaces import PodNetwork
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
    net = PodNetwork() if POD_MODE_UNAVAILABLE is None else None
    workers = WorkerSet(tmp_path, pods=net, env={"KVXFER_SAME_HOST": "false"} if net is None else None)
    failed_before = request.session.testsfailed
    try:
        with net.client() if net is not None else contextlib.nullcontext():
            yield workers
    finally:
        if request.session.testsfailed > failed_before:
            print(f"\n===== worker logs ({request.node.name}) =====\n{workers.logs()}")
        workers.close()
        if net is not None:
            net.close()
