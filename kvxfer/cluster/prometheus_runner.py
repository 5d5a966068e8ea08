"""Run a throwaway Prometheus server against local kvxfer processes, for end-to-end tests.

`PrometheusRunner` writes a scrape config for the given targets, starts the `prometheus`
binary (Debian's package) on a free loopback port with its storage in a temporary
directory, and offers `query()` / `wait_for()` over the HTTP API. It is a context manager:

    with PrometheusRunner({"router": ["127.0.0.1:8000"]}) as prom:
        prom.wait_for('kvxfer_router_requests_total{status="ok"}', lambda v: v >= 1)

Only the standard library is used so it works wherever the test suite does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from kvxfer.errors import KvxferError

#: Environment variable naming a prometheus binary other than the one on PATH.
PROMETHEUS_BIN_ENV = "KVXFER_PROMETHEUS_BIN"


class PrometheusError(KvxferError, RuntimeError):
    """Prometheus did not start, or a query failed; the message carries its log tail."""


def find_prometheus_binary() -> Optional[str]:
    """Path of the prometheus binary ($KVXFER_PROMETHEUS_BIN, else PATH), or None."""
    configured = os.environ.get(PROMETHEUS_BIN_ENV)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("prometheus")


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusRunner:
    """One Prometheus process scraping `jobs` ({job name: ["host:port", ...]}).

    `scrape_interval_s` defaults to 1 s so tests see samples quickly; `metrics_path` is
    the path scraped on every target (kvxfer serves `/metrics`). `file_sd_files` are
    Prometheus file_sd_configs files (such as `kvxfer up`'s prometheus-targets.json) whose
    target groups are scraped too, with the `job` and other labels they carry.
    """

    def __init__(self, jobs: Mapping[str, Sequence[str]], *, scrape_interval_s: float = 1.0,
                 metrics_path: str = "/metrics", binary: Optional[str] = None,
                 workdir: Optional[Path] = None, file_sd_files: Sequence[Path] = ()) -> None:
        self.jobs = {job: list(targets) for job, targets in jobs.items()}
        self.file_sd_files = [Path(f).resolve() for f in file_sd_files]
        self.scrape_interval_s = scrape_interval_s
        self.metrics_path = metrics_path
        self.binary = binary or find_prometheus_binary()
        self._workdir_arg = workdir
        self._tmp: Optional[tempfile.TemporaryDirectory[str]] = None
        self.workdir: Optional[Path] = None
        self.port: Optional[int] = None
        self._process: Optional[subprocess.Popen[bytes]] = None
        self._log_file: Optional[Any] = None

    # --- lifecycle ----------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of the running server, e.g. http://127.0.0.1:40123."""
        if self.port is None:
            raise PrometheusError("prometheus is not running")
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        """The prometheus.yml contents this runner uses."""
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        scrape_configs: list[dict[str, Any]] = [
            {"job_name": job, "metrics_path": self.metrics_path, "static_configs": [{"targets": targets}]}
            for job, targets in self.jobs.items()]
        if self.file_sd_files:
            # The groups' own `job` labels win over this job name (Prometheus sets it only where unset).
            scrape_configs.append({"job_name": "file_sd", "metrics_path": self.metrics_path,
                                   "file_sd_configs": [{"files": [str(f) for f in self.file_sd_files],
                                                        "refresh_interval": interval}]})
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       # A scrape must finish within its interval.
                       "scrape_timeout": interval},
            "scrape_configs": scrape_configs,
        }

    def start(self, timeout_s: float = 30.0) -> "PrometheusRunner":
        """Start prometheus and wait until it reports ready; raises PrometheusError."""
        if self.binary is None:
            raise PrometheusError("no prometheus binary (install Debian's `prometheus` "
                                  f"package or set {PROMETHEUS_BIN_ENV})")
        if self._workdir_arg is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvxfer-prometheus-")
            self.workdir = Path(self._tmp.name)
        else:
            self.workdir = Path(self._workdir_arg)
            self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "prometheus.yml"
        # JSON is YAML, and keeps PyYAML (a test-only dependency) out of the image.
        config_path.write_text(json.dumps(self.config(), indent=2))
        # The free port can be taken between our probe and prometheus' bind; retry a few
        # times rather than make every caller handle that race.
        last_error: Optional[PrometheusError] = None
        for _ in range(3):
            self.port = _free_loopback_port()
            try:
                self._launch(config_path, timeout_s)
                return self
            except PrometheusError as e:
                last_error = e
                self._terminate()
                if "address already in use" not in str(e):
                    break
        self._cleanup()
        assert last_error is not None
        raise last_error

    def _launch(self, config_path: Path, timeout_s: float) -> None:
        assert self.workdir is not None and self.binary is not None
        self._log_file = open(self.workdir / "prometheus.log", "wb")
        self._process = subprocess.Popen(
            [self.binary,
             f"--config.file={config_path}",
             f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}",
             # Debian's defaults point at /etc/prometheus console files; none are needed.
             f"--web.console.templates={self.workdir}",
             f"--web.console.libraries={self.workdir}",
             "--log.level=warn"],
            stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self._process.returncode}: "
                                      f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        raise PrometheusError(f"prometheus not ready after {timeout_s} s: {self.log_tail()}")

    def stop(self) -> None:
        """Stop prometheus (SIGTERM, then SIGKILL after 10 s) and remove its temp dir."""
        self._terminate()
        self._cleanup()

    def _terminate(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "PrometheusRunner":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, chars: int = 4000) -> str:
        """The end of prometheus' own log, for error messages."""
        if self.workdir is None or not (self.workdir / "prometheus.log").exists():
            return "<no log>"
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-chars:]

    # --- queries ------------------------------------------------------------------

    def _get(self, path: str, params: Mapping[str, str]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:  # 400/422 carry the PromQL error in the body
            body = json.load(e)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {dict(params)}: {body.get('error', body)}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; returns the result vector as [{"metric": {...}, "value": [t, "v"]}]."""
        data = self._get("/api/v1/query", {"query": promql})
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_value(self, promql: str) -> Optional[float]:
        """The value of a query that yields at most one series; None when it yields none."""
        result = self.query(promql)
        if len(result) > 1:
            raise PrometheusError(f"{promql}: {len(result)} series, expected at most one")
        return float(result[0]["value"][1]) if result else None

    def targets(self) -> list[dict[str, Any]]:
        """Active scrape targets with their health ("up"/"down"/"unknown") and last error."""
        return self._get("/api/v1/targets", {"state": "active"})["activeTargets"]

    def wait_for(self, promql: str, predicate: Callable[[float], bool],
                 timeout_s: float = 20.0, poll_s: float = 0.25) -> float:
        """Poll `promql` (one series) until `predicate(value)` holds; return the value.

        Raises TimeoutError with the last value seen and the targets' state, so a failing
        test says whether the target was down or the value was wrong.
        """
        deadline = time.monotonic() + timeout_s
        last: Optional[float] = None
        while True:
            last = self.query_value(promql)
            if last is not None and predicate(last):
                return last
            if time.monotonic() >= deadline:
                targets = [(t["scrapeUrl"], t["health"], t.get("lastError", ""))
                           for t in self.targets()]
                raise TimeoutError(f"{promql}: last value {last} after {timeout_s} s; "
                                   f"targets {targets}")
            time.sleep(poll_s)
