"""A real single-member etcd on loopback, for single-machine runs and tests.

`LocalEtcd` runs the Debian `etcd` binary (package `etcd-server`) as a subprocess on free
127.0.0.1 ports with its data in a temporary directory, so the registry code is exercised
against the real server (leases, watches, revisions, restarts) rather than a fake. Given a
`client_cert_dir`, it serves TLS and requires a client certificate signed by a CA made for
it (kvxfer.cluster.etcd_certificates): what `kvxfer up` runs, so an anonymous client on
the machine gets nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

from kvxfer.cluster.etcd_certificates import EtcdClientTls, EtcdServerTls, make_etcd_certificates
from kvxfer.errors import KvxferError

__all__ = ["LocalEtcd", "LocalEtcdError"]

_LOOPBACK = "127.0.0.1"
# How often the readiness loop polls /health; etcd needs ~1 s to elect itself, so 50 ms
# costs nothing and keeps start-up latency low.
_HEALTH_POLL_INTERVAL_S = 0.05
# One /health probe; a loopback server that is up answers in milliseconds.
_HEALTH_REQUEST_TIMEOUT_S = 1.0
# Lines of the etcd log quoted in error messages: enough to show the cause, short enough
# to read in a test failure.
_LOG_TAIL_LINES = 25

# Probes go straight to loopback even when http_proxy is set in the environment.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# Every running instance, so that interpreter exit kills processes that a crashed test or
# a forgotten stop() left behind; weak so the set never keeps an instance alive.
_live_instances: "weakref.WeakSet[LocalEtcd]" = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for instance in list(_live_instances):
        with contextlib.suppress(Exception):
            instance.stop()


atexit.register(_stop_all_at_exit)


class LocalEtcdError(KvxferError, RuntimeError):
    """Raised when the local etcd cannot be found, started or stopped.

    The message says what failed and quotes the tail of the etcd log when there is one,
    so a failing test shows the server's own explanation.
    """


def _free_loopback_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now.

    The port is released before etcd binds it, so another process can take it in
    between; `LocalEtcd.start` retries with fresh ports when that happens.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK, 0))
        return int(sock.getsockname()[1])


class LocalEtcd:
    """A single-member etcd server running as a child process on loopback.

    Ports are picked free on 127.0.0.1 (or given), the data directory lives in a
    temporary directory unless one is given, and the server log goes to `log_path`.
    `start()` waits, up to `startup_timeout_s`, until `/health` answers; `stop()` kills
    the whole process group and removes the temporary directory; `restart()` brings the
    server back on the same ports and data directory (optionally after some downtime),
    which is how tests check that registrations survive an etcd restart or outage. Use
    it as a context manager so the process and the temporary directory are always
    cleaned up. With `client_cert_dir`, the first start makes a CA and certificates there
    and etcd's client and peer ports take only clients that present one (`client_tls`
    names the files); the folder is the caller's to remove. With `own_session=False` etcd
    stays in the caller's session (still in a process group of its own, so `stop()` works
    the same): where the kernel's autogroup is on, each session is a scheduling group of its
    own, and an etcd alone in its group beside vLLM instances that spin while they wait for
    KV went unscheduled for seconds (docs/architecture.md, "Scheduling groups").
    """

    #: Address etcd listens on and advertises; a subclass that runs etcd elsewhere (the
    #: tests' pod harness) replaces it together with `_command`.
    host: str = _LOOPBACK

    def __init__(
        self,
        *,
        etcd_binary: str = "etcd",
        client_port: int | None = None,
        peer_port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        name: str = "kvxfer-local",
        startup_timeout_s: float = 15.0,
        stop_timeout_s: float = 5.0,
        extra_args: tuple[str, ...] = (),
        client_cert_dir: str | os.PathLike[str] | None = None,
        own_session: bool = True,
    ) -> None:
        self._etcd_binary = etcd_binary
        self._fixed_client_port = client_port
        self._fixed_peer_port = peer_port
        self._name = name
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._extra_args = tuple(extra_args)
        self._client_cert_dir = Path(client_cert_dir) if client_cert_dir is not None else None
        self._own_session = own_session
        self._tls: EtcdServerTls | None = None

        # A temporary directory is created lazily and owned (removed on stop) only when
        # the caller did not give a data directory.
        self._owned_tmp_dir: Path | None = None
        self._data_dir: Path | None = Path(data_dir) if data_dir is not None else None
        self._log_path: Path | None = Path(log_path) if log_path is not None else None

        self._client_port: int | None = None
        self._peer_port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    # ----------------------------------------------------------------- properties

    @property
    def _scheme(self) -> str:
        return "https" if self._client_cert_dir is not None else "http"

    @property
    def client_url(self) -> str:
        """URL clients connect to, e.g. ``http://127.0.0.1:41234`` (``https://`` with
        `client_cert_dir`); set once started."""
        if self._client_port is None:
            raise LocalEtcdError("LocalEtcd has not been started; call start() first")
        return f"{self._scheme}://{self.host}:{self._client_port}"

    @property
    def peer_url(self) -> str:
        """Raft peer URL of the single member; set once started."""
        if self._peer_port is None:
            raise LocalEtcdError("LocalEtcd has not been started; call start() first")
        return f"{self._scheme}://{self.host}:{self._peer_port}"

    @property
    def client_tls(self) -> EtcdClientTls | None:
        """The CA, client certificate and key a client needs; None without
        `client_cert_dir`. Set once started."""
        if self._client_cert_dir is not None and self._tls is None:
            raise LocalEtcdError("LocalEtcd has not been started; call start() first")
        return self._tls.client if self._tls is not None else None

    @property
    def data_dir(self) -> Path:
        """Directory holding the etcd data (kept across `restart()`)."""
        if self._data_dir is None:
            raise LocalEtcdError("LocalEtcd has not been started; call start() first")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        """File receiving the server's stdout and stderr (appended across restarts)."""
        if self._log_path is None:
            raise LocalEtcdError("LocalEtcd has not been started; call start() first")
        return self._log_path

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or None when stopped."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    @property
    def is_running(self) -> bool:
        """True while the etcd child process is alive."""
        return self._process is not None and self._process.poll() is None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "LocalEtcd":
        """Start etcd and block until it answers `/health`, or raise `LocalEtcdError`.

        On the first start, free ports are chosen (unless given) and the data and log
        locations are created; later starts reuse them, so the server comes back with
        the same URLs and data. If a freshly chosen port was taken by another process
        in the meantime, the first start retries with new ports.
        """
        if self.is_running:
            return self
        binary = shutil.which(self._etcd_binary)
        if binary is None:
            raise LocalEtcdError(
                f"etcd binary {self._etcd_binary!r} not found on PATH; install the Debian "
                "package 'etcd-server' (apt-get install etcd-server) or pass "
                "etcd_binary=<path to etcd>"
            )
        self._prepare_dirs()
        first_start = self._client_port is None
        # Only freshly picked ports can be re-picked; fixed or reused ports get one try.
        attempts = 3 if first_start and self._fixed_client_port is None else 1
        last_error: LocalEtcdError | None = None
        for _ in range(attempts):
            if first_start:
                self._client_port = self._fixed_client_port or _free_loopback_port()
                self._peer_port = self._fixed_peer_port or _free_loopback_port()
            try:
                self._spawn_and_wait(binary)
                _live_instances.add(self)
                return self
            except LocalEtcdError as exc:
                last_error = exc
                self._kill_process_group()
        assert last_error is not None
        raise last_error

    def stop(self) -> None:
        """Stop the server and clean up: SIGTERM to its process group, SIGKILL after
        `stop_timeout_s`, then remove the temporary directory if this object made it.

        Idempotent. A caller-given data directory is kept. A later `start()` reuses the
        ports; with an owned temporary directory it starts from empty data.
        """
        self._kill_process_group()
        _live_instances.discard(self)
        if self._owned_tmp_dir is not None:
            shutil.rmtree(self._owned_tmp_dir, ignore_errors=True)
            self._owned_tmp_dir = None
            self._data_dir = None
            self._log_path = None

    def restart(self, *, downtime_s: float = 0.0, wipe_data: bool = False) -> None:
        """Kill the server and start it again on the same ports and data directory.

        `downtime_s` keeps it down that long first (an outage, e.g. longer than a lease
        TTL). With `wipe_data=True` the data directory is emptied in between, which
        simulates etcd being replaced by a fresh cluster: leases and keys are gone and
        revisions restart from 1.
        """
        if self._client_port is None or self._data_dir is None:
            raise LocalEtcdError("restart() needs a LocalEtcd that was started")
        self._kill_process_group()
        if wipe_data:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        if downtime_s > 0:
            time.sleep(downtime_s)
        self.start()

    def __enter__(self) -> "LocalEtcd":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        url = f"{self._scheme}://{self.host}:{self._client_port}" if self._client_port else "unstarted"
        state = "running" if self.is_running else "stopped"
        return f"LocalEtcd({url}, {state})"

    # ------------------------------------------------------------------ internals

    def _prepare_dirs(self) -> None:
        if self._data_dir is None or self._log_path is None:
            if self._owned_tmp_dir is None:
                self._owned_tmp_dir = Path(tempfile.mkdtemp(prefix="kvxfer-etcd-"))
            if self._data_dir is None:
                self._data_dir = self._owned_tmp_dir / "data"
            if self._log_path is None:
                self._log_path = self._owned_tmp_dir / "etcd.log"
        self._data_dir.mkdir(parents=True, exist_ok=True)
        # etcd refuses data directories readable by others in newer versions and warns
        # in 3.4; 0700 keeps both quiet.
        os.chmod(self._data_dir, 0o700)
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._client_cert_dir is not None and self._tls is None:
            self._tls = make_etcd_certificates(self._client_cert_dir, self.host)

    def _tls_args(self) -> list[str]:
        if self._tls is None:
            return []
        # One certificate for the client and the peer port: a single member has no peers,
        # but the port listens all the same and must not take anyone's raft messages.
        # (etcd 3.4 already asks clients for a certificate once --trusted-ca-file is set;
        # --client-cert-auth says so rather than relying on it.)
        tls = self._tls
        return [
            "--client-cert-auth", "--trusted-ca-file", str(tls.ca_path),
            "--cert-file", str(tls.cert_path), "--key-file", str(tls.key_path),
            "--peer-client-cert-auth", "--peer-trusted-ca-file", str(tls.ca_path),
            "--peer-cert-file", str(tls.cert_path), "--peer-key-file", str(tls.key_path),
        ]

    def _command(self, binary: str) -> list[str]:
        return [
            binary,
            "--name", self._name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", f"{self._name}={self.peer_url}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"{self._name}-{self._client_port}",
            # Keep one hour of revision history (registry load updates write ~1 GB/day
            # otherwise kept forever) and cap the database at 1 GiB (NOSPACE, not a full
            # disk). Later extra_args override these (etcd takes the last value).
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1h",
            "--quota-backend-bytes", str(1 << 30),
            *self._tls_args(),
            *self._extra_args,
        ]

    def _spawn_and_wait(self, binary: str) -> None:
        # Owner-only, like every log of `kvxfer up`: it names keys, clients and addresses.
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(log_fd, 0o600)
        with os.fdopen(log_fd, "ab") as log_file:
            log_file.write(f"\n=== starting etcd on {self.client_url} ===\n".encode())
            log_file.flush()
            # Either way etcd leads a process group of its own, so stop() can kill it (and
            # anything it spawns) without touching our group; a new session also makes it
            # a scheduling group of its own where the kernel's autogroup is on.
            # (process_group is Python 3.11's: only own_session=False needs it.)
            placement: dict[str, Any] = (
                {"start_new_session": True} if self._own_session else {"process_group": 0}
            )
            self._process = subprocess.Popen(
                self._command(binary),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                **placement,
            )
        deadline = time.monotonic() + self._startup_timeout_s
        opener = self._health_opener()
        while True:
            if self._process.poll() is not None:
                raise LocalEtcdError(
                    f"etcd exited with code {self._process.returncode} during start-up on "
                    f"{self.client_url}; log {self.log_path}:\n{self._log_tail()}"
                )
            if self._is_healthy(opener):
                return
            if time.monotonic() >= deadline:
                raise LocalEtcdError(
                    f"etcd on {self.client_url} did not answer /health within "
                    f"{self._startup_timeout_s:.1f} s; log {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(_HEALTH_POLL_INTERVAL_S)

    def _health_opener(self) -> urllib.request.OpenerDirector:
        if self._tls is None:
            return _NO_PROXY_OPENER
        # /health is behind the client-certificate check like everything on that port.
        context = ssl.create_default_context(cafile=str(self._tls.ca_path))
        context.load_cert_chain(str(self._tls.client.cert_path), str(self._tls.client.key_path))
        return urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))

    def _is_healthy(self, opener: urllib.request.OpenerDirector) -> bool:
        try:
            with opener.open(f"{self.client_url}/health", timeout=_HEALTH_REQUEST_TIMEOUT_S) as resp:
                return resp.status == 200 and b'"true"' in resp.read()
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _kill_process_group(self) -> None:
        process = self._process
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                try:
                    process.wait(timeout=self._stop_timeout_s)
                except subprocess.TimeoutExpired as exc:
                    raise LocalEtcdError(
                        f"etcd (pid {process.pid}) survived SIGKILL for "
                        f"{self._stop_timeout_s:.1f} s"
                    ) from exc
        # The leader may be gone while children of its group linger; sweep the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-_LOG_TAIL_LINES:])
