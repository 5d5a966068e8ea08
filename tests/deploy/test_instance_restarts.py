"""`kvxfer up` looks after its workers (kvxfer.cluster.local_cluster `supervise`): a worker
that dies is reported with its log's last lines and reaped, restarted under its own name
after the backoff, at most `max_restarts` times, and then left down with a clear line.

The workers here are real processes that only print and sleep (the placement hook
`_launch` is replaced), so the supervision is tested without a cluster; the same path with
a real vLLM instance is in tests/integrations/test_vllm_up.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from kvxfer.cluster.instance_restarts import RestartSettings
from kvxfer.cluster.local_cluster import LocalCluster

SUPERVISE_DEADLINE_S = 10.0


class SleepingWorkers(LocalCluster):
    """A LocalCluster whose workers are processes that print a line and sleep."""

    def _launch(self, role: str, name: str, extra_env: dict[str, str] | None) -> str:
        code = f"print('{name} serving', flush=True); import time; time.sleep(600)"
        self.workers[name] = self._spawn(name, [sys.executable, "-c", code], {})
        return name


def _supervise_until(cluster: LocalCluster, lines: list[str], text: str) -> None:
    deadline = time.monotonic() + SUPERVISE_DEADLINE_S
    while not any(text in line for line in lines):
        assert time.monotonic() < deadline, f"{text!r} never said:\n" + "\n".join(lines)
        cluster.supervise()
        time.sleep(0.05)


def _printed(cluster: LocalCluster, name: str) -> None:
    deadline = time.monotonic() + SUPERVISE_DEADLINE_S
    while "serving" not in cluster.log_tail(name):
        assert time.monotonic() < deadline, f"{name} printed nothing"
        time.sleep(0.05)


def test_a_dead_worker_is_reported_restarted_under_its_name_then_left_down_once_restarts_run_out(
        tmp_path: Path) -> None:
    lines: list[str] = []
    cluster = SleepingWorkers(insecure=True, log_dir=str(tmp_path), progress=lines.append,
                              restarts=RestartSettings(max_restarts=1, restart_backoff_s=0.2))
    cluster.etcd_url = "http://127.0.0.1:9"  # never contacted: the workers here do not register
    try:
        name = cluster.start_worker("decode")
        first = cluster.workers[name]
        _printed(cluster, name)
        os.killpg(first.pid, signal.SIGKILL)
        _supervise_until(cluster, lines, f"{name}: restarted")
        assert lines[0].startswith(f"{name} was killed by SIGKILL; the last lines of {tmp_path / (name + '.log')}:")
        assert lines[0].endswith(f"    {name} serving")
        assert lines[1] == f"{name}: restarting in 0.2 s (restart 1 of 1)"
        assert lines[2] == f"{name}: restarted (restart 1 of 1); the log before it is {tmp_path / (name + '.1.log')}"
        assert (tmp_path / f"{name}.1.log").read_text() == f"{name} serving\n"
        assert first.returncode == -signal.SIGKILL  # reaped: no zombie
        second = cluster.workers[name]
        assert second.pid != first.pid and second.poll() is None
        _printed(cluster, name)

        os.killpg(second.pid, signal.SIGKILL)
        _supervise_until(cluster, lines, "not restarted")
        assert lines[-1] == (f"{name}: not restarted again: it died after all 1 restarts (--max-restarts); "
                             "the others keep serving")
        time.sleep(0.5)
        cluster.supervise()
        assert cluster.workers[name] is second and second.returncode == -signal.SIGKILL
    finally:
        cluster.stop(drain_timeout_s=5)
