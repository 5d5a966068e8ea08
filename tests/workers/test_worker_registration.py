"""A builtin worker started while the etcd it names is not up yet: it serves (/health 200,
/ready 503 with `registered: false`) instead of exiting, and its record appears in etcd,
and /ready turns 200, once etcd answers. A pod scheduled ahead of its etcd, or started
during an etcd restart, must not need a restart of its own to join.

A real `kvxfer prefill` process (tests/support/worker_procs.py) and a real etcd server on
a port chosen before the worker starts.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyetcd
import pytest

from kvxfer.cluster.local_etcd import LocalEtcd, _free_loopback_port
from kvxfer.registry import RegistrySettings, worker_key
from support.waiting import wait_until
from support.worker_procs import WorkerSet

pytestmark = pytest.mark.timeout(90)

_DEFAULTS = RegistrySettings()
#: The worker waits this long for its first registration before it prints "serving on"
#: (it used to exit then); etcd stays down past it.
FIRST_REGISTRATION_WAIT_S = _DEFAULTS.connect_timeout_s
#: Once etcd is up: the retry backoff's longest pause, one RPC and slack.
REGISTERED_AFTER_ETCD_UP_WITHIN_S = _DEFAULTS.retry_backoff_max_s + _DEFAULTS.request_timeout_s + 5.0
WORKER_ID = "prefill-before-etcd"


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[WorkerSet]:
    ws = WorkerSet(tmp_path)
    try:
        yield ws
    finally:
        ws.close()


def stored(port: int, prefix: str) -> dict[str, Any] | None:
    """The worker's record as etcd has it (None: no key)."""
    with pyetcd.client(host="127.0.0.1", port=port, timeout=2) as client:
        value, _ = client.get(worker_key(prefix, "prefill", WORKER_ID))
    return None if value is None else json.loads(value)


def ready(url: str) -> tuple[int, dict[str, Any]]:
    """GET /ready: its status and body."""
    response = httpx.get(f"{url}/ready", timeout=2.0)
    return response.status_code, response.json()


def ready_body(url: str) -> dict[str, Any] | None:
    """/ready's body once it answers 200, else None."""
    status, body = ready(url)
    return body if status == 200 else None


def test_a_worker_started_before_its_etcd_serves_unready_then_registers(tmp_path: Path, workers: WorkerSet) -> None:
    port = _free_loopback_port()
    prefix = f"/kvxfer-test-{uuid.uuid4().hex[:12]}"
    etcd = LocalEtcd(client_port=port, data_dir=tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    worker = workers.spawn("prefill", extra=["--etcd", f"http://127.0.0.1:{port}", "--etcd-prefix", prefix,
                                             "--worker-id", WORKER_ID])
    try:
        # "serving on" comes after the first registration's wait, which etcd outlasts.
        url = worker.wait_ready(timeout_s=60.0 + FIRST_REGISTRATION_WAIT_S)
        assert worker.alive(), worker.log_text()
        status, body = ready(url)
        assert (status, body["registered"]) == (503, False), body
        assert "not registered in etcd" in worker.log_text()

        etcd.start()
        record = wait_until(lambda: stored(port, prefix), REGISTERED_AFTER_ETCD_UP_WITHIN_S,
                            "the worker's record once etcd is up")
        assert record["http_url"] == url and record["role"] == "prefill"
        body = wait_until(lambda: ready_body(url), 5.0, "/ready 200 once registered")
        assert body["registered"] is True
        assert worker.alive()
    except BaseException:
        print(workers.logs())
        raise
    finally:
        etcd.stop()
