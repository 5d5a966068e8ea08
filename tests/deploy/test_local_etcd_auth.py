"""`kvxfer up` with its defaults: its etcd takes no anonymous client, the cluster still serves,
its run folder and logs are owner-only, and its workers' pages follow the memory budget.

One real `kvxfer up` (the command, a tiny model, one prefill and one decode worker, a KV
budget small enough to size the pages down) serves the whole module. An attacker on the
machine tries etcd as the review did: plaintext gRPC and TLS without a client certificate,
for a read, a write, a lease grant and the revocation of a worker's real lease. Each is
refused while the same calls with the run's client certificate work, the worker stays
registered, and a disaggregated request is answered.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pyetcd
import pytest

from kvxfer.cluster.local_cluster import free_port
from kvxfer.model.config import ModelConfig

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None or shutil.which("openssl") is None,
                                reason="needs Debian's etcd-server and openssl")

STARTUP_S = 120.0
STOP_S = 60.0
# Small enough to size the tiny model's pages below the 2,048 default: 2 workers share it.
BUDGET_GIB = 0.01
TINY = ModelConfig.preset("tiny")
EXPECTED_PAGES = int(BUDGET_GIB * (1 << 30)) // (2 * TINY.page_bytes * TINY.num_layers)
ETCD_TIMEOUT_S = 3


@dataclass
class UpRun:
    """The running `kvxfer up`: what it printed, where it listens, its run folder."""

    proc: subprocess.Popen[str]
    log_dir: Path
    router_url: str
    admin_url: str
    etcd_url: str
    lines: list[str]

    @property
    def tls_dir(self) -> Path:
        return self.log_dir / "etcd-tls"

    def etcd_host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.etcd_url)
        assert parts.hostname and parts.port
        return parts.hostname, parts.port

    def authorized(self) -> Any:
        host, port = self.etcd_host_port()
        return pyetcd.client(host, port, ca_cert=str(self.tls_dir / "ca.crt"), cert_cert=str(self.tls_dir / "client.crt"),
                             cert_key=str(self.tls_dir / "client.key"), timeout=ETCD_TIMEOUT_S)


def _read_until(proc: subprocess.Popen[str], pattern: str, lines: list[str], deadline: float) -> re.Match[str]:
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            lines.append(line.rstrip())
            match = re.search(pattern, line)
            if match:
                return match
            continue
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"kvxfer up did not print {pattern!r} (exit {proc.poll()}):\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpRun]:
    log_dir = tmp_path_factory.mktemp("up") / "run"
    argv = [sys.executable, "-m", "kvxfer.cli", "up", "--model", "tiny", "--prefill", "1", "--decode", "1",
            "--port", str(free_port()), "--admin-port", str(free_port()), "--log-dir", str(log_dir),
            "--kv-memory-budget-gib", str(BUDGET_GIB)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        m = _read_until(proc, r"router (http://\S+) \(admin (http://\S+)\).* etcd (\S+)$", lines,
                        time.monotonic() + STARTUP_S)
        yield UpRun(proc, log_dir, m.group(1), m.group(2), m.group(3), lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), True)
        rest = proc.stdout.read()
        proc.stdout.close()
        assert proc.returncode == 0, "\n".join(lines) + rest
        # The credentials were good for this run only: gone with it, while the logs stay.
        assert not (log_dir / "etcd-tls").exists() and not (log_dir / "cluster.key").exists()
        assert (log_dir / "router.log").exists()


def _refused(call: Callable[[], Any]) -> str:
    """Runs `call` and returns how it failed; fails the test if it succeeded."""
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - any client-side failure shape counts as refused
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"an anonymous etcd call succeeded: {result!r}")


def _worker_lease(up: UpRun) -> tuple[str, int]:
    for value, meta in up.authorized().get_prefix("/kvxfer"):
        if meta.lease_id:
            return meta.key.decode(), int(meta.lease_id)
    raise AssertionError("no worker record under a lease in etcd")


def test_anonymous_etcd_clients_are_refused_get_put_lease_and_revoke(up: UpRun) -> None:
    key, lease_id = _worker_lease(up)
    host, port = up.etcd_host_port()
    ca = str(up.tls_dir / "ca.crt")
    anonymous: dict[str, Callable[[], Any]] = {
        "plaintext": lambda: pyetcd.client(host, port, timeout=ETCD_TIMEOUT_S),
        "TLS without a client certificate": lambda: pyetcd.client(host, port, ca_cert=ca, timeout=ETCD_TIMEOUT_S),
    }
    for how, make in anonymous.items():
        # A fresh client per call: the library marks a failed endpoint and would not try again.
        calls: dict[str, Callable[[], Any]] = {
            "get": lambda: make().get(key),
            "put": lambda: make().put("/kvxfer/forged", "x"),
            "lease grant": lambda: make().lease(60),
            "revoke a worker's lease": lambda: make().revoke_lease(lease_id),
        }
        for what, call in calls.items():
            reason = _refused(call)
            assert "Connection" in reason or "UNAVAILABLE" in reason, (how, what, reason)

    # The same server answers the run's own certificate: the refusals were the missing credential.
    etcd = up.authorized()
    assert etcd.get("/kvxfer/forged")[0] is None
    lease = etcd.lease(60)
    etcd.put("/probe/authorized", "ok", lease=lease)
    assert etcd.get("/probe/authorized")[0] == b"ok"
    lease.revoke()
    assert int(etcd.get_lease_info(lease_id).TTL) > 0, "the worker's lease was revoked"
    seen = httpx.get(f"{up.admin_url}/workers", timeout=5).json()["workers"]
    assert sorted(w["role"] for w in seen) == ["decode", "prefill"]


def test_the_peer_port_refuses_clients_without_a_certificate(up: UpRun) -> None:
    argv = Path(f"/proc/{_etcd_pid(up)}/cmdline").read_bytes().decode().split("\0")
    peer_url = argv[argv.index("--listen-peer-urls") + 1]
    assert peer_url.startswith("https://127.0.0.1:")
    context = ssl.create_default_context(cafile=str(up.tls_dir / "ca.crt"))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        opener.open(f"{peer_url}/members", timeout=ETCD_TIMEOUT_S)


def _etcd_pid(up: UpRun) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if argv and Path(argv[0]).name == "etcd" and up.etcd_url in argv:
                return int(entry.name)
    raise AssertionError(f"no etcd process serving {up.etcd_url}")


def test_the_cluster_serves_with_etcd_closed(up: UpRun) -> None:
    r = httpx.post(f"{up.router_url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "the quick brown fox jumps over the lazy dog " * 2, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvxfer-serving-mode"] == "disaggregated"


def test_run_folder_is_owner_only_and_every_log_0600(up: UpRun) -> None:
    assert stat.S_IMODE(up.log_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(up.tls_dir.stat().st_mode) == 0o700
    logs = sorted(up.log_dir.glob("*.log"))
    assert {p.name for p in logs} >= {"etcd.log", "router.log", "prefill-1.log", "decode-2.log"}
    for path in [*logs, *up.tls_dir.iterdir(), up.log_dir / "cluster.key"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert not (up.tls_dir / "ca.key").exists(), "the CA key outlived the signing"


def test_workers_get_the_pages_the_memory_budget_allows(up: UpRun) -> None:
    assert 0 < EXPECTED_PAGES < 2048
    assert any(f"x {EXPECTED_PAGES} pages" in line for line in up.lines), up.lines
    seen = httpx.get(f"{up.admin_url}/workers", timeout=5).json()["workers"]
    assert [w["total_pages"] for w in seen] == [EXPECTED_PAGES, EXPECTED_PAGES]
