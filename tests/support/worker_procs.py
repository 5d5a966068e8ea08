"""Real prefill and decode worker processes for the KV-path tests.

Each worker is started with the `kvxfer` console script of the running interpreter's
environment, in its own session (process group) so that teardown can kill it together with
anything it spawned. Its stdout and stderr go to a log file under the test's tmp dir; the
HTTP port is chosen by the worker (`--port 0`) and read back from its "serving on" line, so
two tests or two sessions on the same machine never race for a port. Every wait has a
deadline, and a worker that dies or does not come up fails the test with its log attached.

    workers = WorkerSet(tmp_path)
    decode = workers.start("decode", env={"KVXFER_FENCE_TIMEOUT_S": "3"})
    prefill = workers.start("prefill")
    ...
    workers.close()            # SIGKILL every process group still alive

The `workers` fixture of tests/test_kv_path.py wraps this and prints every log when the
test failed.

With `WorkerSet(tmp_path, pods=PodNetwork())` each worker runs as a pod instead
(tests/support/pod_namespaces.py): in its own network and PID namespace, bound to its pod
address, so KV between workers crosses the fabric; the test then talks to them from inside
`pods.client()`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from support.pod_namespaces import PodNetwork, pod_command, pod_pid1, signal_pod
from support.waiting import wait_until_stopped

#: The console script installed next to the interpreter running the tests (.venv/bin).
KVXFER = str(Path(sys.executable).with_name("kvxfer"))
_SERVING = re.compile(r"serving on (http://[0-9.]+:\d+)")

START_TIMEOUT_S = 60.0


class WorkerStartError(RuntimeError):
    """A worker exited or did not answer /health before its deadline."""


class WorkerProc:
    """One `kvxfer prefill|decode` process: its URL, log file and process group."""

    def __init__(self, role: str, args: list[str], env: dict[str, str], log_path: Path,
                 pod_ns: str | None = None) -> None:
        self.role = role
        self.args = args
        self.log_path = log_path
        self.pod_ns = pod_ns
        self._log = open(log_path, "wb")
        argv = [KVXFER, role, *args]
        self.proc = subprocess.Popen(
            pod_command(pod_ns, argv) if pod_ns else argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group: killpg reaches every child
        )
        self.url = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<log unreadable: {exc}>"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """Waits for the "serving on" line and a 200 from GET /health; returns the URL."""
        deadline = time.monotonic() + timeout_s
        while not self.url:
            match = _SERVING.search(self.log_text())
            if match:
                self.url = match.group(1)
                break
            self._check(deadline, "print its 'serving on' line")
            time.sleep(0.05)
        with httpx.Client(timeout=2.0) as client:
            while True:
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self.url
                except httpx.TransportError:
                    pass
                self._check(deadline, "answer GET /health")
                time.sleep(0.05)

    def _check(self, deadline: float, what: str) -> None:
        if not self.alive():
            raise WorkerStartError(
                f"{self.role} worker (pid {self.pid}) exited with {self.proc.returncode} before it "
                f"could {what}; log:\n{self.log_text()}"
            )
        if time.monotonic() > deadline:
            raise WorkerStartError(f"{self.role} worker (pid {self.pid}) did not {what} in time; log:\n{self.log_text()}")

    def kill(self) -> None:
        """SIGKILL to the whole process group (no drain, no cleanup: a crash)."""
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL cannot end
            pass

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM (the worker drains), then SIGKILL after `grace_s`; reaps the process."""
        if self.alive():
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self._log.close()

    def main_pid(self) -> int:
        """Host PID of the worker process itself (a pod's PID 1, else the process)."""
        return pod_pid1(self.proc) if self.pod_ns is not None else self.proc.pid

    def freeze(self) -> None:
        """SIGSTOP the worker from outside (a pod's PID 1 honours it from an ancestor
        namespace, not from itself); waits until the kernel shows it stopped."""
        os.kill(self.main_pid(), signal.SIGSTOP)
        wait_until_stopped(self.main_pid(), f"the {self.role} worker")

    def thaw(self) -> None:
        """SIGCONT the worker (nothing if it is gone)."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError, RuntimeError):
            os.kill(self.main_pid(), signal.SIGCONT)

    def _signal_group(self, sig: int) -> None:
        if self.pod_ns is not None:
            signal_pod(self.proc, sig)  # SIGTERM to PID 1: to `unshare` it would kill the pod
            return
        try:
            os.killpg(self.proc.pid, sig)  # pgid == pid: started with start_new_session
        except (ProcessLookupError, PermissionError):
            pass


def worker_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a test's worker process: this one's without KVXFER_ settings, plus `env`."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVXFER_")}
    # Two cores shared by every worker and the test: one torch thread per process keeps
    # them from oversubscribing the machine (and keeps timings steady).
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("MKL_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    # The worker tests count pushed pages and writes of whole prompts and reuse prompts
    # across tests on shared workers: their workers run without a prefix cache; the tests
    # of the cache (tests/workers/test_prefix_reuse.py) turn it on.
    full_env["KVXFER_PREFIX_CACHE"] = "false"
    full_env.update(env or {})
    return full_env


class WorkerSet:
    """The worker processes of one test; `close()` ends them all.

    `pods`: run each worker as a pod of that network. `env`: settings every worker gets
    (a worker's own `env` wins)."""

    def __init__(self, log_dir: Path, *, pods: PodNetwork | None = None, env: dict[str, str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.procs: list[WorkerProc] = []
        self.pods = pods
        self.env = dict(env or {})

    def spawn(
        self,
        role: str,
        *,
        provider: str = "net",
        num_pages: int = 512,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> WorkerProc:
        """Starts a worker without waiting for it (see `WorkerProc.wait_ready`)."""
        index = len(self.procs)
        name = f"{index:02d}-{role}"
        pod_ns, host = self.pods.add(name) if self.pods is not None else (None, "127.0.0.1")
        args = [
            "--port", "0",
            "--provider", provider,
            "--host", host,
            "--bind-host", host,
            "--num-pages", str(num_pages),
            *(extra or []),
        ]
        proc = WorkerProc(role, args, worker_env({**self.env, **(env or {})}), self.log_dir / f"{name}.log", pod_ns)
        self.procs.append(proc)
        return proc

    def start(self, role: str, **kw: Any) -> WorkerProc:
        """Starts a worker and waits until it serves HTTP."""
        proc = self.spawn(role, **kw)
        proc.wait_ready()
        return proc

    def start_many(self, specs: list[tuple[str, dict[str, Any]]]) -> list[WorkerProc]:
        """Starts several workers in parallel (their imports overlap), then waits for each."""
        procs = [self.spawn(role, **kw) for role, kw in specs]
        for proc in procs:
            proc.wait_ready()
        return procs

    def logs(self) -> str:
        parts = []
        for proc in self.procs:
            state = "running" if proc.alive() else f"exit {proc.proc.returncode}"
            parts.append(f"----- {proc.log_path.name} (pid {proc.pid}, {state}, {proc.url or 'no url'}) -----\n"
                         f"{proc.log_text()}")
        return "\n".join(parts)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc._log.close()
