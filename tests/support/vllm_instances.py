"""Real vLLM OpenAI servers with the kvxfer connector, for tests and benchmarks.

`VllmFleet` starts instances (each its own process tree, pinned to its own core), a local
etcd they register in, and a cluster key; it waits for readiness with a deadline and
stops everything on exit, whatever happened. `SharedConnectorFleet` is the one prefill +
decode pair (and a router in front of it) that the vLLM test modules share: each instance
costs about 20 s of start-up on 2 cores. Its instances are started as a user's own command
lines are (README, "Your own vLLM command line"): plain vLLM API servers with the
environment and flags that `kvxfer vllm-args` prints.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

import httpx

from kvxfer.cluster.local_etcd import LocalEtcd
from kvxfer.integrations.vllm.launch import KVRole, VllmInstanceSpec
from kvxfer.registry import RegistrySettings, RegistryWatcher, WorkerRecord
from kvxfer.registry.signing import load_cluster_key, vllm_api_headers, vllm_api_key
from support.vllm_faults import HOOKS_SPEC


def popen_instance(argv: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    """Starts one vLLM instance's process tree, logging to `log`.

    Its own process group, so that killpg reaches every rank, but the caller's session: with
    `kernel.sched_autogroup_enabled=1` each new session is its own scheduling group, and
    instances that share cores in separate groups starved each other's threads here. A TP 2
    decoder waiting for its KV steps in a busy loop; the connector's progress threads then
    waited on the run queue for minutes, so transfers between live ranks stalled until their
    timeouts. In one group every hand-off completed at once (docs/architecture.md,
    "Scheduling groups").
    """
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0)


#: Start-up of one instance: about 20 s idle on 2 cores, several times that when loaded.
READY_TIMEOUT_S = 420.0


#: The connector's deadlines for the tensor parallel modules' instances. Several ranks share
#: 2 cores there, beside other instances: under that load a first control message to a peer
#: (its connection set up on the way) took over 10 s and failed at transfer_timeout_s (etcd
#: itself went unanswered for 48 s in that run), so every deadline is generous; none is what
#: a test checks.
TP_CONNECTOR_TIMEOUTS = {"transfer_timeout_s": 30.0, "load_stall_timeout_s": 90.0, "load_timeout_s": 300.0,
                         "fence_timeout_s": 45.0, "reservation_wait_s": 90.0}
#: GiB the machine must have available before tensor parallel instances start (about 3 GiB
#: per rank set).
TP_MIN_AVAILABLE_GIB = 7.0


def available_gib() -> float:
    """GiB of memory the machine has available (MemAvailable), for a guard before instances start."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def assert_memory_for_tp_instances() -> None:
    """Fails with the figures where the machine has less than TP_MIN_AVAILABLE_GIB available."""
    gib = available_gib()
    assert gib >= TP_MIN_AVAILABLE_GIB, f"{gib:.1f} GiB available, want {TP_MIN_AVAILABLE_GIB}"


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A free loopback TCP port whose successor is free too (an own command line's connector
    serves its metrics on the API port + 1, `kvxfer vllm-args`' default)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@dataclass
class VllmInstance:
    """One running instance, and the command line and environment it was started with."""

    name: str
    url: str  # base URL of its OpenAI API
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log_path: Path
    registers: bool = False
    #: How `VllmFleet.start` described it; None for an own command line (`start_own_command_line`).
    spec: VllmInstanceSpec | None = None
    #: Port of the connector's kvxfer_connector_* /metrics, where it serves one.
    metrics_port: int | None = None

    def log_text(self) -> str:
        """Its log so far (for assertion messages)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def drain(self) -> None:
        """SIGTERM to the API server alone: vLLM drains (--shutdown-timeout) and exits; its
        worker process would die at once on a SIGTERM of its own."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)

    def served(self) -> int:
        """Completions this instance answered 200 so far (its access log)."""
        return self.log_text().count('"POST /v1/completions HTTP/1.1" 200')

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (API server, engine core, worker)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)


@dataclass
class VllmFleet:
    """etcd + a cluster key + vLLM instances; a context manager."""

    model_dir: Path
    work_dir: Path
    served_model_name: str = "tiny"
    common_extra: dict[str, Any] = field(default_factory=dict)
    instances: dict[str, VllmInstance] = field(default_factory=dict)
    etcd: LocalEtcd | None = None
    key_file: Path | None = None
    #: vLLM's API key on every instance, as in a cluster (derived from the cluster key);
    #: callers send `headers`.
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        """What a caller of the instances' /v1 API sends (the router sends the same)."""
        return vllm_api_headers(self.api_key)

    def __enter__(self) -> "VllmFleet":
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.key_file = self.work_dir / "cluster.key"
        self.key_file.write_bytes(base64.b64encode(secrets.token_bytes(48)))
        self.api_key = vllm_api_key(load_cluster_key(self.key_file))
        # In the harness's session, with the instances (popen_instance): alone in a
        # scheduling group of its own, etcd sat runnable and unscheduled for seconds whenever
        # a decoder spun waiting for its KV, longer than the pair's leases last, and the
        # router dropped both instances until they re-registered (docs/architecture.md,
        # "Scheduling groups"). Its log goes beside the instances' (failure messages quote it).
        self.etcd = LocalEtcd(data_dir=self.work_dir / "etcd", log_path=self.work_dir / "etcd.log",
                              own_session=False).start()
        return self

    def __exit__(self, *exc: object) -> None:
        for inst in self.instances.values():
            inst.kill(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for inst in self.instances.values():
            try:
                inst.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                inst.kill()
                inst.process.wait(10)
        if self.etcd is not None:
            self.etcd.stop()

    def registry_settings(self) -> RegistrySettings:
        """How the fleet's etcd is reached, with its cluster key."""
        assert self.etcd is not None
        return RegistrySettings(endpoints=[self.etcd.client_url], cluster_key_path=self.key_file)

    def restart(self, name: str) -> VllmInstance:
        """Start a stopped (or killed) instance again as it was started (no wait)."""
        inst = self.instances[name]
        if inst.process.poll() is None:
            return inst
        inst.process = popen_instance(inst.argv, inst.env, inst.log_path.open("ab"))
        return inst

    def start(self, name: str, kv_role: KVRole | None, core: str, *, register: bool = True,
              extra: dict[str, Any] | None = None, **spec_fields: Any) -> VllmInstance:
        """Start one instance (no wait). `register=False`: no etcd settings (another connector)."""
        port = free_port()
        cfg = {**self.common_extra, **(extra or {})}
        if kv_role is not None and register:
            assert self.etcd is not None
            cfg.update(etcd=self.etcd.client_url, advertise_url=f"http://127.0.0.1:{port}",
                       cluster_key_file=str(self.key_file), worker_id=name, lease_ttl_s=2)
        spec = VllmInstanceSpec(model_dir=self.model_dir, port=port, kv_role=kv_role, cpu_cores=core,
                                served_model_name=self.served_model_name, extra_config=cfg,
                                api_key=self.api_key, **spec_fields)
        metrics_port = cfg.get("metrics_port")
        return self._launch(name, spec.url, spec.argv(), spec.env(), registers=kv_role is not None and register,
                            spec=spec, metrics_port=int(metrics_port) if metrics_port else None)

    def start_own_command_line(self, name: str, role: Literal["prefill", "decode"], core: str, *,
                               vllm_flags: list[str], connector_config: dict[str, Any] | None = None) -> VllmInstance:
        """Start one instance (no wait) as a user's own command line, as the README shows it:
        `kvxfer vllm-args` (here with --format json) gives the environment and the flags that
        go last on a plain `python -m vllm.entrypoints.openai.api_server --model DIR --port P`
        command line; `vllm_flags` are the user's own (--served-model-name is the fleet's).
        Connector settings: the fleet's common ones, then `connector_config`, through
        vllm-args' --connector-config. Pinned to `core` like `start`'s instances."""
        # Imported here: the CLI pulls in modules the benchmarks that import this file need not load.
        from kvxfer.cli import main as kvxfer_main

        assert self.etcd is not None and self.key_file is not None
        port = free_port_pair()
        config = {**self.common_extra, "lease_ttl_s": 2, **(connector_config or {})}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            status = kvxfer_main(["vllm-args", "--role", role, "--port", str(port), "--etcd", self.etcd.client_url,
                                  "--cluster-key-file", str(self.key_file), "--worker-id", name,
                                  "--connector-config", json.dumps(config), "--format", "json"])
        assert status == 0, printed.getvalue()
        own = json.loads(printed.getvalue())
        # The machine's part of the environment (cores, KV cache size, offline) as `start` sets it.
        base = VllmInstanceSpec(model_dir=self.model_dir, port=port, kv_role=None, cpu_cores=core).env()
        base.pop("VLLM_API_KEY", None)
        taskset = shutil.which("taskset")
        argv = [*([taskset, "-c", core] if taskset else []), sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", self.served_model_name, *vllm_flags, *own["flags"]]
        return self._launch(name, f"http://127.0.0.1:{port}", argv, {**base, **own["env"]}, registers=True,
                            metrics_port=port + 1)

    def _launch(self, name: str, url: str, argv: list[str], env: dict[str, str], *, registers: bool,
                spec: VllmInstanceSpec | None = None, metrics_port: int | None = None) -> VllmInstance:
        log_path = self.work_dir / f"{name}.log"
        proc = popen_instance(argv, env, log_path.open("wb"))
        inst = VllmInstance(name, url, argv, env, proc, log_path, registers=registers, spec=spec,
                            metrics_port=metrics_port)
        self.instances[name] = inst
        return inst

    def wait_ready(self, *names: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every named instance answers /v1/models and, where it registers, has published its
        record (it does so after its warm-up completion); RuntimeError with its log tail if one dies."""
        deadline = time.monotonic() + timeout_s
        for name in names:
            inst = self.instances[name]
            while True:
                if inst.process.poll() is not None:
                    raise RuntimeError(f"vLLM instance {name} exited ({inst.process.returncode}):\n"
                                       f"{inst.log_text()[-4000:]}")
                try:
                    if httpx.get(inst.url + "/v1/models", timeout=2, headers=self.headers).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM instance {name} not ready in {timeout_s}s:\n{inst.log_text()[-4000:]}")
                time.sleep(0.3)
        for name in names:
            if self.instances[name].registers:
                self.record(name, timeout_s=max(60.0, deadline - time.monotonic()))

    def record(self, name: str, timeout_s: float = 60.0) -> WorkerRecord:
        """The instance's signed record in etcd."""
        with RegistryWatcher(self.registry_settings()) as watcher:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                for rec in watcher.workers():
                    if rec.worker_id == name:
                        return rec
                time.sleep(0.2)
        raise RuntimeError(f"{name} did not register within {timeout_s}s:\n{self.instances[name].log_text()[-3000:]}")


# ---- the pair the vLLM test modules share ---------------------------------------------------

BLOCK = 32
CHUNK = 64  # max_num_batched_tokens of the prefill instance: prompts over it prefill in chunks
#: The connector's deadlines on the shared pair, short so that fault tests end quickly.
CONNECTOR_TIMEOUTS = {"transfer_timeout_s": 2.0, "load_stall_timeout_s": 6.0, "load_timeout_s": 60.0,
                      "fence_timeout_s": 3.0, "reservation_wait_s": 5.0}
SLOW_LAYER_MS = 2500  # fault slow_layers: 4 layers take 10 s in all, 2.5 s apart
ROUTER_READY_TIMEOUT_S = 60.0
ROUTER_START_ATTEMPTS = 2
#: The KV cache of the test suite's instances, in blocks (vLLM's --num-gpu-blocks-override):
#: 2,048 blocks of BLOCK tokens hold 16 prompts of the model's full 4,096 positions, more than
#: any test keeps. vLLM's least on CPU (VLLM_CPU_KVCACHE_SPACE=1, 16,384 blocks) cost every
#: start-up 3 to 7 s more, allocating, registering and locking its pages.
TEST_KV_BLOCKS = 2048
#: The shared pair's own vLLM flags (the README's, a fixed seed and the suite's cache size).
SHARED_PAIR_FLAGS = ["--block-size", str(BLOCK), "--enforce-eager", "--seed", "0",
                     "--num-gpu-blocks-override", str(TEST_KV_BLOCKS)]


class SharedConnectorFleet:
    """`prefill-a` and `decode-a` (KvxferConnector over the fabric path, same_host off,
    KV digests written to `digests`) and a router process in front of them, started on
    first use and stopped by `close()` (tests/integrations/conftest.py closes it after the
    last test that uses it). An instance found dead (a test killed it) is started again.

    Both instances are own command lines (`VllmFleet.start_own_command_line`): what
    tests/integrations/test_vllm_own_command_lines.py checks of the README's way runs on
    this pair, with no pair of its own."""

    def __init__(self, work_dir: Path, model_dir: Path) -> None:
        self.work_dir = work_dir
        self.model_dir = model_dir
        self._stack: contextlib.ExitStack | None = None
        self._fleet: VllmFleet | None = None
        self._router_url: str | None = None
        self._admin_url: str | None = None

    def fleet(self) -> VllmFleet:
        """The running pair, started (or restarted where an instance died) as needed."""
        from kvxfer.integrations.vllm.checkpoint import make_checkpoint

        if self._fleet is None:
            self._stack = contextlib.ExitStack()
            model = make_checkpoint(self.model_dir)
            digests = self.work_dir / "digests"
            digests.mkdir(parents=True, exist_ok=True)
            # The connector's test hooks (tests/support/vllm_faults.py): digest files of every
            # push and load, and faults for transfer ids that name them (`fault-<name>...`),
            # never for the router's own ids.
            hooks = {"digest_dir": str(digests)}
            common = {"same_host": False, "bind_host": "127.0.0.1", "hooks": HOOKS_SPEC, "hooks_config": hooks,
                      **CONNECTOR_TIMEOUTS}
            fleet = self._stack.enter_context(VllmFleet(model, self.work_dir, common_extra=common))
            fleet.start_own_command_line(
                "prefill-a", "prefill", "0", vllm_flags=[*SHARED_PAIR_FLAGS, "--max-num-batched-tokens", str(CHUNK)],
                connector_config={"hooks_config": {**hooks, "stall_after_layer": 1, "slow_layer_ms": SLOW_LAYER_MS}})
            fleet.start_own_command_line("decode-a", "decode", "1", vllm_flags=SHARED_PAIR_FLAGS)
            fleet.digests = digests  # type: ignore[attr-defined]
            self._fleet = fleet
        dead = [name for name, inst in self._fleet.instances.items() if inst.process.poll() is not None]
        for name in dead:
            self._fleet.restart(name)
        self._fleet.wait_ready(*self._fleet.instances)
        return self._fleet

    def router_url(self) -> str:
        """A router process (`python -m kvxfer_router`) on the fleet's etcd and cluster key."""
        fleet = self.fleet()
        if self._router_url is None:
            assert self._stack is not None
            admin_port = free_port()
            self._router_url = self._stack.enter_context(router_process(
                fleet, self.work_dir / "router.log", env={"KVXFER_ROUTER_ADMIN_PORT": str(admin_port)}))
            self._admin_url = f"http://127.0.0.1:{admin_port}"
        return self._router_url

    def admin_url(self) -> str:
        """The router's admin port (its worker inventory, GET /workers)."""
        self.router_url()
        assert self._admin_url is not None
        return self._admin_url

    def close(self) -> None:
        """Stop the router, the instances and etcd."""
        stack, self._stack, self._fleet, self._router_url, self._admin_url = self._stack, None, None, None, None
        if stack is not None:
            stack.close()


@contextlib.contextmanager
def router_process(fleet: VllmFleet, log_path: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """A router process (`python -m kvxfer_router`) on `fleet`'s etcd and cluster key, until
    the block ends (SIGTERM, then SIGKILL); yields its URL once it lists the fleet's model.

    Its admin server takes any free port (the default, 8001, is taken by whatever other
    router runs on the machine); a router that exits at start-up (its public port taken
    between `free_port` and its bind) is started once more on another port."""
    assert fleet.etcd is not None
    for attempt in range(ROUTER_START_ATTEMPTS):
        port = free_port()
        full_env = {**os.environ, "KVXFER_ROUTER_ETCD_ENDPOINTS": fleet.etcd.client_url,
                    "KVXFER_ROUTER_CLUSTER_KEY_FILE": str(fleet.key_file), "KVXFER_ROUTER_PORT": str(port),
                    "KVXFER_ROUTER_HOST": "127.0.0.1", "KVXFER_ROUTER_ADMIN_PORT": "0", **(env or {})}
        with log_path.open("wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvxfer_router"], env=full_env, stdout=log,
                                    stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
        while _served_models(url) != [fleet.served_model_name] and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        if _served_models(url) == [fleet.served_model_name]:
            break
        _stop(proc)
        text = log_path.read_text(errors="replace")
        if attempt + 1 == ROUTER_START_ATTEMPTS:
            raise RuntimeError(f"the router did not list the model:\n{text[:2000]}\n...\n{text[-2000:]}")
    try:
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _served_models(url: str) -> list[str]:
    try:
        return [m["id"] for m in httpx.get(url + "/v1/models", timeout=2).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
