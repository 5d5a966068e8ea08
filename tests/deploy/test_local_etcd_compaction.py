"""The etcd that `kvxfer up` starts (kvxfer.cluster.local_etcd.LocalEtcd) compacts its history and
has a bounded quota: without compaction registry load updates pile up (~1 GB a day)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvxfer.cluster.local_etcd import LocalEtcd

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None or shutil.which("etcdctl") is None,
                                reason="needs the etcd and etcdctl binaries (etcd-server, etcd-client)")


def _etcdctl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["etcdctl", f"--endpoints={url}", *args], capture_output=True,
                          text=True, timeout=10, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})


def _flag(argv: list[str], name: str) -> str:
    """The value etcd uses for `name`: the last occurrence wins (Go flag parsing)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    values += [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert values, f"{name} not on etcd's command line {argv}"
    return values[-1]


def test_local_etcd_runs_with_periodic_compaction_and_a_quota() -> None:
    with LocalEtcd() as etcd:
        argv = Path(f"/proc/{etcd.pid}/cmdline").read_bytes().decode().split("\0")
    assert _flag(argv, "--auto-compaction-mode") == "periodic"
    assert _flag(argv, "--auto-compaction-retention") not in ("", "0")
    quota = int(_flag(argv, "--quota-backend-bytes"))
    assert 0 < quota <= 8 << 30  # etcd's own recommended maximum is 8 GiB


def test_local_etcd_compacts_old_revisions(tmp_path: Path) -> None:
    # The default arguments with only the retention shortened (extra_args come last).
    with LocalEtcd(log_path=tmp_path / "etcd.log",
                   extra_args=("--auto-compaction-retention=1s",)) as etcd:
        for i in range(20):
            assert _etcdctl(etcd.client_url, "put", "/kvxfer/k", str(i)).returncode == 0
        status = json.loads(_etcdctl(etcd.client_url, "endpoint", "status", "-w", "json").stdout)
        first_rev = 2  # revision 1 is the empty store; the first put made revision 2
        last_rev = status[0]["Status"]["header"]["revision"]
        assert last_rev >= first_rev + 19
        deadline = time.monotonic() + 15
        while True:
            out = _etcdctl(etcd.client_url, "get", "/kvxfer/k", f"--rev={first_rev}")
            if out.returncode != 0 and "compacted" in out.stderr:
                break
            assert time.monotonic() < deadline, (
                f"revision {first_rev} still readable after 15 s with a 1 s retention: "
                f"{out.stdout!r} {out.stderr!r}\n{(tmp_path / 'etcd.log').read_text()[-2000:]}")
            # Keep writing: the periodic compactor compacts to a revision it sampled.
            _etcdctl(etcd.client_url, "put", "/kvxfer/k", "again")
            time.sleep(0.5)
