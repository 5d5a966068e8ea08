"""A whole kvxfer deployment on one machine: a local etcd (unless one is given), the router
and N prefill + M decode workers, each a real process on loopback.

`LocalCluster` is what `kvxfer up`, the demo and the end-to-end tests use. It starts
everything with deadlines, waits until the router reports every worker, and on stop drains
the workers (SIGTERM), then stops the router and etcd. Logs go to one file per process.

The run folder (`log_dir`) is its owner's only (0700, every log 0600): it holds the logs,
the cluster key and the certificates of the etcd it starts, which takes only clients that
present the run's client certificate (docs/architecture.md, "Threat model"). Before any
process starts, the builtin workers' KV pages are sized to the machine's free memory, or
refused with the memory they need (kvxfer.cluster.kv_memory_plan).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from kvxfer.cluster.control_client import ControlTokenAuth
from kvxfer.cluster.etcd_certificates import EtcdClientTls
from kvxfer.cluster.instance_restarts import RestartBook, RestartSettings
from kvxfer.cluster.kv_memory_plan import KvMemoryBudgetError, KvMemoryPlan, plan_kv_pages, read_mem_available_bytes
from kvxfer.cluster.local_etcd import LocalEtcd
from kvxfer.registry.signing import load_cluster_key, vllm_api_key

log = logging.getLogger("kvxfer.cluster")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """Router + workers (+ etcd) as child processes on 127.0.0.1."""

    def __init__(
        self,
        *,
        prefill: int = 1,
        decode: int = 1,
        router_port: int | None = None,
        etcd: str | None = None,
        model: str = "tiny",
        provider: str = "auto",
        num_pages: int | None = None,
        kv_memory_budget_bytes: int | None = None,
        log_dir: str | None = None,
        worker_env: dict[str, str] | None = None,
        router_env: dict[str, str] | None = None,
        startup_timeout_s: float = 90.0,
        insecure: bool = False,
        engine: str = "builtin",
        vllm_args: Sequence[str] = (),
        role_vllm_args: dict[str, list[str]] | None = None,
        admin_port: int | None = None,
        progress: Callable[[str], None] | None = None,
        restarts: RestartSettings | None = None,
    ) -> None:
        if engine not in ("builtin", "vllm"):
            raise ValueError(f'engine must be "builtin" or "vllm", got {engine!r}')
        if engine == "vllm" and (num_pages is not None or kv_memory_budget_bytes is not None):
            raise ValueError("the number of pages and the KV memory budget size the builtin workers' caches; "
                             "vLLM sizes its own")
        self.engine = engine
        self.insecure = insecure
        if engine == "vllm":
            # Each instance loads the model and compiles its kernels: minutes on a busy machine.
            startup_timeout_s = max(startup_timeout_s, 600.0)
        self.n_prefill = prefill
        self.n_decode = decode
        self.router_port = router_port or free_port()
        self.admin_port = admin_port or free_port()
        # The user's own vLLM flags: for every instance, then per role (later ones win in vLLM).
        self.vllm_args = list(vllm_args)
        self.role_vllm_args = dict(role_vllm_args or {})
        # Start-up progress and dead-worker notices, one line each (kvxfer up prints them).
        self.progress = progress or (lambda line: log.info("%s", line))
        self._registered: set[str] = set()
        self._reported_dead: set[str] = set()
        # What `supervise()` does with an instance that died (kvxfer up calls it; tests that
        # kill workers on purpose do not, and nothing restarts behind their back).
        self.restart_book = RestartBook(restarts or RestartSettings())
        self._worker_roles: dict[str, str] = {}
        self._worker_extra_env: dict[str, dict[str, str]] = {}
        self._next_listing_at = 0.0
        self._left_down: set[str] = set()  # died with no restart left
        self._gone: set[str] = set()  # died, and the router stopped listing them since
        self._dead_urls: dict[str, str] = {}  # the URL a worker that died had, from the router's list
        #: name -> ("role", API port, connector metrics port) of each vLLM instance: what Prometheus scrapes.
        self.vllm_ports: dict[str, tuple[str, int, int]] = {}
        self.etcd_url = etcd
        self.model = model
        self.provider = provider
        # None until start() plans it: as many pages as the memory budget allows.
        self.num_pages = num_pages
        self.kv_memory_budget_bytes = kv_memory_budget_bytes
        self.kv_plan: KvMemoryPlan | None = None  # what start() planned (builtin engine)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvxfer-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # The logs name requests and addresses, and the folder holds the keys: owner only.
        os.chmod(self.log_dir, 0o700)
        # The CA and certificates of the etcd this cluster starts; removed by stop() like the key.
        self.etcd_cert_dir = self.log_dir / "etcd-tls"
        self.startup_timeout_s = startup_timeout_s
        self.worker_env = dict(worker_env or {})
        self.router_env = dict(router_env or {})
        # A fresh cluster key per run: workers sign their registry records with it and the
        # router routes only to records that verify (docs/architecture.md, "Registry (etcd)");
        # it also keys the tokens of every router-to-worker call ("Threat model").
        # A key the caller's environment names wins.
        self.key_path: Path | None = None
        self._own_key: Path | None = None  # the key this cluster made; removed by stop()
        if insecure:
            log.warning("kvxfer up --insecure: registry records are unsigned and worker control APIs take "
                        "anyone's calls. Development only.")
        else:
            key_path = self.log_dir / "cluster.key"
            # Created 0600 (not chmod-ed after writing): no moment where others may read it.
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(base64.b64encode(secrets.token_bytes(48)))
            self._own_key = key_path
            self.worker_env.setdefault("KVXFER_CLUSTER_KEY_FILE", str(key_path))
            self.router_env.setdefault("KVXFER_ROUTER_CLUSTER_KEY_FILE", str(key_path))
            self.key_path = Path(self.worker_env["KVXFER_CLUSTER_KEY_FILE"])
        self.etcd: LocalEtcd | None = None
        self.router: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._counter = 0

    @property
    def router_url(self) -> str:
        """Base URL of the router."""
        return f"http://{self._address('router')}:{self.router_port}"

    # Placement hooks: where each process listens, how it starts and gets signals. Here all
    # on loopback as children of this process; the tests' pod harness overrides them to
    # run each process in a network and PID namespace of its own.

    def _address(self, name: str) -> str:
        """The address process `name` (router, prefill-1, ...) binds and advertises."""
        return "127.0.0.1"

    def _new_etcd(self) -> LocalEtcd:
        return LocalEtcd(log_path=self.log_dir / "etcd.log", client_cert_dir=self.etcd_cert_dir)

    def _signal(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        if self.engine == "vllm" and sig == signal.SIGTERM and proc is not self.router:
            # vLLM drains on SIGTERM to its API server; its worker process dies on one.
            os.kill(proc.pid, sig)
            return
        os.killpg(proc.pid, sig)

    @property
    def admin_url(self) -> str:
        """Base URL of the router's admin server (GET /workers), on the router's address
        only (loopback here)."""
        return f"http://{self._address('router')}:{self.admin_port}"

    @property
    def control_auth(self) -> ControlTokenAuth | None:
        """Signs direct calls to the workers (GET /info...); None when running insecure."""
        return ControlTokenAuth(self.key_path) if self.key_path is not None else None

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        # Created 0600, and tightened if an earlier run left one: owner-only like the folder.
        fd = os.open(self.log_dir / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        log = os.fdopen(fd, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        # Each worker shares 2 cores with the others: one torch thread each avoids thrashing.
        full_env.setdefault("OMP_NUM_THREADS", "1")
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def start_worker(self, role: str, extra_env: dict[str, str] | None = None) -> str:
        """Starts one more worker; returns its name (also its registry worker id)."""
        assert self.etcd_url
        self._counter += 1
        name = f"{role}-{self._counter}"
        self._worker_roles[name] = role
        self._worker_extra_env[name] = dict(extra_env or {})
        return self._launch(role, name, extra_env)

    def _launch(self, role: str, name: str, extra_env: dict[str, str] | None) -> str:
        if self.engine == "vllm":
            return self._start_vllm_instance(role, name, extra_env)
        args = [
            sys.executable, "-m", "kvxfer.cli", role, "--port", "0", "--etcd", self.etcd_url,
            "--provider", self.provider, "--host", self._address(name), "--bind-host", self._address(name),
            "--model", self.model,
            "--worker-id", name, "--num-pages", str(self.num_pages),
        ]
        self.workers[name] = self._spawn(name, args, {**self.worker_env, **(extra_env or {})})
        return name

    def _start_vllm_instance(self, role: str, name: str, extra_env: dict[str, str] | None) -> str:
        # Imported here: the vllm extra is needed only for --engine vllm.
        from kvxfer.integrations.vllm.checkpoint import make_checkpoint
        from kvxfer.integrations.vllm.launch import VllmInstanceSpec

        model_dir = Path(self.model)
        if not (model_dir / "config.json").is_file():
            # Not a checkpoint directory: make the small seeded one (no downloads).
            model_dir = make_checkpoint(self.log_dir / "seeded-llama")
        port, metrics_port = free_port(), free_port()
        extra: dict[str, Any] = {
            "provider": self.provider, "bind_host": "127.0.0.1", "etcd": self.etcd_url, "worker_id": name,
            "advertise_url": f"http://127.0.0.1:{port}", "metrics_port": metrics_port,
        }
        api_key: str | None = None
        if self.etcd is not None and self.etcd.client_tls is not None:
            tls = self.etcd.client_tls
            extra.update(etcd_ca_file=str(tls.ca_path), etcd_cert_file=str(tls.cert_path),
                         etcd_key_file=str(tls.key_path))
        if self.key_path is not None:
            extra["cluster_key_file"] = str(self.key_path)
            api_key = vllm_api_key(load_cluster_key(self.key_path))  # the router sends it
        else:
            extra["insecure"] = True
        # Instances pinned apart: vLLM binds its compute thread to core 0 unless told, and
        # two instances on one core take several times as long per step.
        # (From the name's number, so that a restarted instance keeps its core.)
        core = str((int(name.rsplit("-", 1)[1]) - 1) % (os.cpu_count() or 1))
        spec = VllmInstanceSpec(model_dir=model_dir, port=port, served_model_name=model_dir.name,
                                kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                                cpu_cores=core, extra_config=extra, api_key=api_key,
                                user_args=[*self.vllm_args, *self.role_vllm_args.get(role, [])])
        self.workers[name] = self._spawn(name, spec.argv(), {**spec.env({}), **(extra_env or {})})
        self.vllm_ports[name] = (role, port, metrics_port)
        self.progress(f"{name}: starting vLLM on core {core}, API http://127.0.0.1:{port}, "
                      f"log {self.log_dir / (name + '.log')}")
        return name

    def log_tail(self, name: str, lines: int = 15) -> str:
        """The last `lines` lines of process `name`'s log (what says why it exited)."""
        path = self.log_dir / f"{name}.log"
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def _exit_message(self, name: str, returncode: int) -> str:
        tail = self.log_tail(name)
        indented = "\n".join("    " + line for line in tail.splitlines())
        how = f"was killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exited with {returncode}"
        return f"{name} {how}; the last lines of {self.log_dir / (name + '.log')}:\n{indented}"

    def reap_dead(self) -> list[str]:
        """Workers that exited since the last call, each reported once as a message with its log's
        last lines (`poll()` also reaps the process: no zombie stays)."""
        return [message for _name, message in self._reap()]

    def supervise(self) -> None:
        """Look after the workers once (`kvxfer up` calls it a few times a second): report each
        that died, with its log's last lines, and restart it under its own name after a
        backoff, or say that it stays down (`RestartSettings`); start the restarts that are
        due; say when the router lists a restarted worker again. Every line goes to `progress`."""
        for name, message in self._reap():
            self.progress(message)
            self._registered.discard(name)
            if self.router is not None:
                # The dead process's record stays listed until its lease expires; a restarted
                # worker listens elsewhere (a new free port): its record is told apart by that.
                self._dead_urls[name] = next((str(w.get("http_url")) for w in self._workers_listed()
                                              if w.get("worker_id") == name), "")
            decision = self.restart_book.died(name)
            if decision.delay_s is None:
                self._left_down.add(name)
            self.progress(decision.describe())
        for name in self.restart_book.due():
            self._relaunch(name)
        waiting = [name for name in self.workers if name not in self._registered and name not in self._left_down]
        if waiting and self.router is not None and time.monotonic() >= self._next_listing_at:
            # Only while a worker that died is not listed again: one admin call a second.
            self._next_listing_at = time.monotonic() + 1.0
            listed = self._workers_listed()
            ids = {str(w.get("worker_id", "")) for w in listed}
            # A worker counts as back once the router lists a record of its new process:
            # after the dead one's expired, or one with another URL.
            self._gone.update(name for name in waiting if name not in ids)
            self._note_registered([w for w in listed if self._new_process_listed(w)])
            self._gone -= self._registered

    def _new_process_listed(self, record: dict[str, Any]) -> bool:
        """Whether a listed record is that of a restarted worker's new process."""
        name = str(record.get("worker_id", ""))
        if name in self._reported_dead:
            return False  # not restarted (yet)
        dead_url = self._dead_urls.get(name)
        return name in self._gone or (bool(dead_url) and str(record.get("http_url")) != dead_url)

    def _reap(self) -> list[tuple[str, str]]:
        """(name, message) of each worker that exited since the last call (`poll()` also
        reaps the process: no zombie stays)."""
        dead = []
        for name, proc in self.workers.items():
            if name not in self._reported_dead and proc.poll() is not None:
                self._reported_dead.add(name)
                dead.append((name, self._exit_message(name, proc.returncode)))
        return dead

    def _relaunch(self, name: str) -> None:
        """Start worker `name` again, in its own role, under its own name; its previous log
        is kept as NAME.N.log (N: the restart), and Prometheus's targets file follows."""
        restart = self.restart_book.restarts(name)
        old_log = self.log_dir / f"{name}.log"
        kept = self.log_dir / f"{name}.{restart}.log"
        if old_log.exists():
            old_log.replace(kept)
        self._reported_dead.discard(name)
        self._launch(self._worker_roles[name], name, self._worker_extra_env.get(name))
        if self.vllm_ports and (self.log_dir / "prometheus-targets.json").exists():
            self.write_prometheus_targets()  # a restarted vLLM instance has new ports
        self.progress(f"{name}: restarted (restart {restart} of {self.restart_book.settings.max_restarts}); "
                      f"the log before it is {kept}")

    def prometheus_targets(self) -> list[dict[str, Any]]:
        """Prometheus file_sd target groups: the router's /metrics, and per vLLM instance vLLM's own
        /metrics (`vllm:*`, on its API port) and the connector's (`kvxfer_connector_*`)."""
        groups: list[dict[str, Any]] = [{"targets": [f"{self._address('router')}:{self.router_port}"],
                                         "labels": {"job": "kvxfer-router"}}]
        for name, (role, port, metrics_port) in self.vllm_ports.items():
            labels = {"worker": name, "role": role}
            groups.append({"targets": [f"127.0.0.1:{port}"], "labels": {"job": "vllm", **labels}})
            groups.append({"targets": [f"127.0.0.1:{metrics_port}"],
                           "labels": {"job": "kvxfer-connector", **labels}})
        return groups

    def write_prometheus_targets(self) -> Path:
        """Writes `prometheus_targets()` to LOG_DIR/prometheus-targets.json (a file_sd_configs file)."""
        path = self.log_dir / "prometheus-targets.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.prometheus_targets(), indent=1))
        tmp.replace(path)  # Prometheus re-reads the file: never let it see half of one
        return path

    def start(self) -> "LocalCluster":
        """Starts etcd (if needed), the workers and the router; waits until ready."""
        try:
            if self.engine == "builtin":
                self._plan_kv_memory()
            if self.etcd_url is None:
                self.etcd = self._new_etcd()
                self.etcd.start()
                self.etcd_url = self.etcd.client_url
                if self.etcd.client_tls is not None:
                    self._use_etcd_client_tls(self.etcd.client_tls)
            for _ in range(self.n_prefill):
                self.start_worker("prefill")
            for _ in range(self.n_decode):
                self.start_worker("decode")
            router_args = [
                sys.executable, "-m", "kvxfer_router", "--host", self._address("router"),
                "--port", str(self.router_port), "--admin-host", self._address("router"),
                "--admin-port", str(self.admin_port), "--etcd-endpoints", self.etcd_url,
                "--log-level", "warning",
            ]
            self.router = self._spawn("router", router_args, self.router_env)
            self.wait_ready(self.n_prefill, self.n_decode, self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _plan_kv_memory(self) -> None:
        # Imported here: the model's shape comes with torch, which `kvxfer up --engine vllm`
        # never needs in this process.
        from kvxfer.model.config import ModelConfig

        self.kv_plan = plan_kv_pages(
            ModelConfig.preset(self.model), self.n_prefill + self.n_decode,
            mem_available_bytes=read_mem_available_bytes(), num_pages=self.num_pages,
            kv_memory_budget_bytes=self.kv_memory_budget_bytes)
        self.num_pages = self.kv_plan.pages_per_worker
        self.progress(self.kv_plan.describe())

    def _use_etcd_client_tls(self, tls: EtcdClientTls) -> None:
        # Workers and router present the run's client certificate; files the caller's
        # environment names win, as for the cluster key.
        for name, path in (("ETCD_CA_FILE", tls.ca_path), ("ETCD_CERT_FILE", tls.cert_path),
                           ("ETCD_KEY_FILE", tls.key_path)):
            self.worker_env.setdefault(f"KVXFER_{name}", str(path))
            self.router_env.setdefault(f"KVXFER_ROUTER_{name}", str(path))

    def _workers_listed(self) -> list[dict[str, Any]]:
        """The router's worker list now (its admin port's GET /workers); empty if it does not answer."""
        try:
            body = httpx.get(f"{self.admin_url}/workers", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return []
        items = body.get("workers", body) if isinstance(body, dict) else body
        return [w for w in items if isinstance(w, dict)] if isinstance(items, list) else []

    def workers_seen(self) -> dict[str, int]:
        """How many workers of each role the router knows now."""
        return self._count_roles(self._workers_listed())

    @staticmethod
    def _count_roles(listed: list[dict[str, Any]]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in listed:
            counts[w.get("role", "?")] = counts.get(w.get("role", "?"), 0) + 1
        return counts

    def _note_registered(self, listed: list[dict[str, Any]]) -> None:
        # Start-up progress: each worker once, as the router first lists it.
        for w in listed:
            wid = str(w.get("worker_id", ""))
            if wid in self.workers and wid not in self._registered:
                self._registered.add(wid)
                self.progress(f"{wid}: ready ({len(self._registered)} of {len(self.workers)} workers registered)")

    def wait_ready(self, prefill: int, decode: int, timeout_s: float) -> None:
        """Waits until the router is ready and lists the given worker counts."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in list(self.workers.items()) + [("router", self.router)]:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(self._exit_message(name, proc.returncode))
            listed = self._workers_listed()
            self._note_registered(listed)
            seen = self._count_roles(listed)
            if seen.get("prefill", 0) >= prefill and seen.get("decode", 0) >= decode:
                try:
                    if httpx.get(f"{self.router_url}/ready", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"cluster not ready after {timeout_s} s (router sees {self.workers_seen()}); logs in {self.log_dir}")

    def signal_worker(self, name: str, sig: int) -> None:
        """Sends a signal to one worker (SIGTERM drains, SIGKILL crashes)."""
        self._signal(self.workers[name], sig)

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Drains workers (SIGTERM), stops the router and etcd; kills what does not stop."""
        for proc in self.workers.values():
            if proc.poll() is None:
                self._signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + drain_timeout_s
        for proc in self.workers.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait(5)
        if self.router is not None and self.router.poll() is None:
            self._signal(self.router, signal.SIGTERM)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self._signal(self.router, signal.SIGKILL)
                self.router.wait(5)
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        # The logs stay for whoever looks after a failure; the key does not: it was good for
        # this cluster only, and left in the temporary folder it would outlive it.
        if self._own_key is not None:
            self._own_key.unlink(missing_ok=True)
        shutil.rmtree(self.etcd_cert_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _print(line: str) -> None:
    print(f"kvxfer up: {line}", flush=True)


def run_up(args: argparse.Namespace) -> int:
    """`kvxfer up`: start everything, serve until SIGINT/SIGTERM, then drain and stop. A worker
    that dies meanwhile is reported with the last lines of its log (the rest keep serving) and
    restarted after a backoff, at most `--max-restarts` times (`LocalCluster.supervise`)."""
    # The readiness poll of the router's admin port would log a line per call at INFO.
    logging.getLogger("httpx").setLevel(logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING)
    vllm_args = list(getattr(args, "vllm_args", None) or [])
    role_args = {role: shlex.split(getattr(args, f"{role}_args", None) or "") for role in ("prefill", "decode")}
    if args.engine != "vllm" and (vllm_args or any(role_args.values())):
        _print("vLLM flags (after --, --prefill-args, --decode-args) need --engine vllm")
        return 2
    num_pages = getattr(args, "num_pages", None)
    budget_gib = getattr(args, "kv_memory_budget_gib", None)
    if args.engine == "vllm" and (num_pages is not None or budget_gib is not None):
        _print("--num-pages and --kv-memory-budget-gib size the builtin workers' KV caches; with --engine vllm "
               "give vLLM's own flags after --")
        return 2
    defaults = RestartSettings()
    try:
        restarts = RestartSettings(max_restarts=getattr(args, "max_restarts", defaults.max_restarts),
                                   restart_backoff_s=getattr(args, "restart_backoff_s", defaults.restart_backoff_s))
    except ValidationError as exc:
        _print(f"--max-restarts and --restart-backoff-s must not be negative: {exc.errors()[0]['msg']}")
        return 2
    cluster = LocalCluster(
        prefill=args.prefill, decode=args.decode, router_port=args.port, etcd=args.etcd,
        model=args.model, provider=args.provider, insecure=args.insecure, engine=args.engine,
        log_dir=getattr(args, "log_dir", None), admin_port=getattr(args, "admin_port", None),
        vllm_args=vllm_args, role_vllm_args=role_args, progress=_print, num_pages=num_pages,
        kv_memory_budget_bytes=int(budget_gib * (1 << 30)) if budget_gib is not None else None,
        restarts=restarts,
    )
    stop = {"now": False}

    def on_signal(*_: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _print(f"logs in {cluster.log_dir}")
    try:
        cluster.start()
    except KvMemoryBudgetError as exc:
        _print(str(exc))  # refused before anything started
        return 2
    except (RuntimeError, TimeoutError) as exc:
        _print(f"start-up failed: {exc}")
        return 1
    targets = cluster.write_prometheus_targets() if cluster.engine == "vllm" else None
    _print(f"router {cluster.router_url} (admin {cluster.admin_url}) with {args.prefill} prefill + {args.decode} "
           f"decode workers, etcd {cluster.etcd_url}")
    if cluster.etcd is not None and cluster.etcd.client_tls is not None:
        _print(f"etcd takes only clients with this run's certificate: CA, client.crt and client.key in "
               f"{cluster.etcd_cert_dir}")
    if targets is not None:
        _print(f"metrics: Prometheus file_sd targets in {targets}")
    try:
        while not stop["now"]:
            cluster.supervise()
            time.sleep(0.2)
    finally:
        _print("draining and stopping")
        cluster.stop()
    return 0
