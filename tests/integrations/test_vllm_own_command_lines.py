"""A vLLM user's own command lines, end to end with real processes: the README's section "Your
own vLLM command line" run as written (ports changed to free ones), i.e. two plain vLLM API
servers started from `kvxfer vllm-args` output and the router alone (`kvxfer router`), in a
real etcd; completions through the router equal colocated ones; then `kvxfer join` adds a
decoder, and under load it gets traffic.

vLLM start-ups are the cost (about 20 s each on 2 cores): one module-scoped cluster serves
every assertion, and the joined decoder is the only third instance.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.vllm_instances import free_port  # noqa: E402

from kvxfer.cli import main as kvxfer_main  # noqa: E402
from kvxfer.cluster.local_etcd import LocalEtcd  # noqa: E402
from kvxfer.integrations.vllm.checkpoint import CheckpointShape, make_checkpoint  # noqa: E402
from kvxfer.registry.signing import load_cluster_key, vllm_api_headers, vllm_api_key  # noqa: E402

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
#: Start-up of two instances side by side on 2 cores, with their warm-ups; several times the idle figure under load.
READY_TIMEOUT_S = 420.0
SERVED = "llama"  # the README's --served-model-name
PROMPTS = ("The licence grants you", "Permission is hereby granted, free of charge, to any person " * 12)
#: How long the joined decoder may take to receive its first KV once the load runs.
TRAFFIC_TIMEOUT_S = 120.0
README_PORTS = {"prefill": 8100, "decode": 8200, "router": 8000, "admin": 8001}


def readme_command_block() -> str:
    """The README's shell block that starts the instances from `kvxfer vllm-args` and the router."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Your own vLLM command line", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    (block,) = [b for b in blocks if "kvxfer vllm-args" in b]
    return block


@dataclass
class OwnCluster:
    """The README's processes, as this module started them."""

    work: Path
    model: Path
    etcd: str
    key: Path
    ports: dict[str, int]
    headers: dict[str, str]
    shell: subprocess.Popen[bytes]

    @property
    def router(self) -> str:
        return f"http://127.0.0.1:{self.ports['router']}"

    def instance(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(self.work.glob("*.log")))


def _roles_listed(admin: str) -> dict[str, int]:
    try:
        body = httpx.get(f"{admin}/workers", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return {}
    counts: dict[str, int] = {}
    for w in body.get("workers", body) if isinstance(body, dict) else body:
        counts[w["role"]] = counts.get(w["role"], 0) + 1
    return counts


def _group_commands(pgid: int) -> list[str]:
    """Command lines of the live processes in process group `pgid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return found


def _connector_counter(metrics_port: int, name: str) -> float:
    """`name`'s value on a connector's /metrics; 0 while a busy instance does not answer in
    time (the caller polls until its own deadline)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    except httpx.TimeoutException:
        return 0.0
    match = re.search(rf"^{name} (\S+)$", text, flags=re.M)
    assert match, f"{name} not on port {metrics_port}"
    return float(match.group(1))


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnCluster]:
    work = tmp_path_factory.mktemp("own-command-line")
    model = make_checkpoint(tmp_path_factory.getbasetemp() / "llama-2k", CheckpointShape(max_positions=2048))
    key = work / "cluster.key"
    key.write_bytes(base64.b64encode(secrets.token_bytes(48)))
    ports = {role: free_port() for role in README_PORTS}
    script = readme_command_block()
    for role, port in README_PORTS.items():
        script = re.sub(rf"\b{port}\b", str(ports[role]), script)
    etcd = LocalEtcd(data_dir=work / "etcd").start()
    env = {**os.environ, "MODEL": str(model), "ETCD": etcd.client_url, "KEY": str(key),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_API_KEY", None)
    shell = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, start_new_session=True)
    cluster = OwnCluster(work, model, etcd.client_url, key, ports,
                         vllm_api_headers(vllm_api_key(load_cluster_key(key))), shell)
    try:
        admin = f"http://127.0.0.1:{ports['admin']}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while _roles_listed(admin) != {"prefill": 1, "decode": 1}:
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s:\n{cluster.logs()}"
            if shell.poll() is not None:  # the block ran: every process it started must live on
                assert shell.returncode == 0, f"the README block failed ({shell.returncode}):\n{cluster.logs()}"
                running = " ".join(_group_commands(shell.pid))
                for role in ("prefill", "decode", "router"):
                    assert f"--port {ports[role]}" in running, f"{role} exited:\n{cluster.logs()}"
            time.sleep(0.5)
        yield cluster
    finally:
        # The README's processes share the shell's process group (no job control in `bash -c`).
        try:
            os.killpg(shell.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        shell.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(shell.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            os.killpg(shell.pid, signal.SIGKILL)
        etcd.stop()


def _complete(url: str, prompt: str, headers: dict[str, str] | None = None, **extra: object) -> dict:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_through_the_router_alone_equal_colocated_and_move_kv(own: OwnCluster) -> None:
    pushed_before = _connector_counter(own.ports["prefill"] + 1, "kvxfer_connector_pushed_pages_total")
    received_before = _connector_counter(own.ports["decode"] + 1, "kvxfer_connector_received_pages_total")
    for prompt in PROMPTS:
        routed = _complete(own.router, prompt)
        # Colocated: the prefill instance alone, its own cache salt keeping the prefix cache apart.
        alone = _complete(own.instance("prefill"), prompt, own.headers, cache_salt=uuid.uuid4().hex)
        assert routed["choices"][0]["text"] == alone["choices"][0]["text"]
        assert routed["usage"] == alone["usage"]
    assert _connector_counter(own.ports["prefill"] + 1, "kvxfer_connector_pushed_pages_total") > pushed_before
    assert _connector_counter(own.ports["decode"] + 1, "kvxfer_connector_received_pages_total") > received_before


def test_kvxfer_join_adds_a_decoder_that_then_gets_traffic_under_load(own: OwnCluster) -> None:
    # The newcomer starts while the others idle: on 2 cores, a third vLLM instance starting
    # beside two busy ones took over 7 minutes (tests/integrations/test_vllm_connector.py
    # runs that case with KVXFER_VLLM_SCALE_TEST=1). What this checks is the join itself:
    # the user's flags reach it, it registers, and the router sends it requests.
    port = free_port()
    log = (own.work / "joined.log").open("wb")
    joined = subprocess.Popen(
        [sys.executable, "-m", "kvxfer.cli", "join", "--engine", "vllm", "--role", "decode", "--model", str(own.model),
         "--port", str(port), "--cpu-cores", "1", "--etcd", own.etcd, "--cluster-key-file", str(own.key),
         "--", "--served-model-name", SERVED, "--block-size", "32", "--enforce-eager",
         "--max-num-batched-tokens", "256"],  # a short warm-up (a chunk and a block) before it registers
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    stop = threading.Event()
    statuses: list[int] = []

    def load(seed: int) -> None:
        i = 0
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                i += 1
                # Distinct from the first token on: no decoder holds a prefix of it, so the
                # router (kv_aware) chooses by load alone.
                body = {"model": SERVED, "prompt": f"{seed} {i} {PROMPTS[1]}", "max_tokens": 4, "temperature": 0}
                statuses.append(client.post(f"{own.router}/v1/completions", json=body).status_code)
                stop.wait(0.2)

    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while _roles_listed(f"http://127.0.0.1:{own.ports['admin']}").get("decode", 0) < 2:
            assert joined.poll() is None, f"kvxfer join exited with {joined.returncode}:\n{own.logs()}"
            assert time.monotonic() < deadline, f"the joined decoder never registered:\n{own.logs()}"
            time.sleep(1.0)
        # Two clients at once: the least-loaded choice sends the second of two overlapping
        # requests to the idle decoder, whichever the first went to.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            loaders = [pool.submit(load, seed) for seed in range(2)]
            try:
                deadline = time.monotonic() + TRAFFIC_TIMEOUT_S
                received = 0.0
                while received == 0.0:
                    assert time.monotonic() < deadline, f"the joined decoder got no KV in time:\n{own.logs()}"
                    time.sleep(1.0)
                    received = _connector_counter(port + 1, "kvxfer_connector_received_pages_total")
            finally:
                stop.set()
                for f in loaders:
                    f.result(timeout=150)
        assert _roles_listed(f"http://127.0.0.1:{own.ports['admin']}") == {"prefill": 1, "decode": 2}
        assert statuses and set(statuses) == {200}, f"{len(statuses)} requests: {sorted(set(statuses))}"
    finally:
        if joined.poll() is None:
            # The whole group (the exec'd API server, its engine core and worker), as the
            # fixture stops the README's processes: the load has stopped, nothing is left to
            # drain, and a worker signalled only through its parent waited out vLLM's 5 s
            # grace and then took seconds more to exit.
            os.killpg(joined.pid, signal.SIGTERM)
            try:
                joined.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(joined.pid, signal.SIGKILL)
                joined.wait(10)
        log.close()


def test_vllm_args_takes_the_cluster_key_file_as_given_and_refuses_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "cluster.key"
    key.write_bytes(base64.b64encode(secrets.token_bytes(48)))
    assert kvxfer_main(["vllm-args", "--role", "decode", "--port", "8200", "--etcd", "http://127.0.0.1:2379",
                        "--cluster-key-file", str(key), "--format", "json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["env"] == {"VLLM_API_KEY": vllm_api_key(load_cluster_key(str(key)))}
    config = json.loads(line["flags"][line["flags"].index("--kv-transfer-config") + 1])
    assert config["kv_role"] == "kv_consumer"
    assert config["kv_connector_extra_config"]["advertise_url"] == "http://127.0.0.1:8200"
    assert config["kv_connector_extra_config"]["metrics_port"] == 8201
    assert line["flags"][-2:] == ["--shutdown-timeout", "30"]
    with pytest.raises(SystemExit, match="--cluster-key-file is required"):
        kvxfer_main(["vllm-args", "--role", "prefill"])
    with pytest.raises(TypeError, match="load_cluster_key"):
        vllm_api_key(str(key))  # type: ignore[arg-type]
