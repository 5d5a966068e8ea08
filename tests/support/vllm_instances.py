"""Real vLLM OpenAI servers with the kvxfer connector, for tests and benchmarks.

`VllmFleet` starts instances (each its own process tree, pinned to its own core), a local
etcd they register in, and a cluster key; it waits for readiness with a deadline and
stops everything on exit, whatever happened.
"""

from __future__ import annotations

import base64
import os
import secrets
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvxfer.cluster.local_etcd import LocalEtcd
from kvxfer.integrations.vllm.launch import KVRole, VllmInstanceSpec
from kvxfer.registry import RegistrySettings, RegistryWatcher, WorkerRecord
from kvxfer.registry.signing import load_cluster_key, vllm_api_headers, vllm_api_key

#: Start-up of one instance: about 20 s idle on 2 cores, several times that when loaded.
READY_TIMEOUT_S = 420.0


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmInstance:
    """One running instance."""

    name: str
    spec: VllmInstanceSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    registers: bool = False

    @property
    def url(self) -> str:
        """Base URL of its OpenAI API."""
        return self.spec.url

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
        self.etcd = LocalEtcd(data_dir=self.work_dir / "etcd").start()
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
        log_path = self.work_dir / f"{name}.log"
        proc = subprocess.Popen(spec.argv(), env=spec.env(), stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        inst = VllmInstance(name, spec, proc, log_path, registers=kv_role is not None and register)
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
                time.sleep(1.0)
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
