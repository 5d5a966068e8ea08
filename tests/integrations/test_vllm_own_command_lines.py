"""A vLLM user's own command lines, end to end with real processes (README, "Your own vLLM
command line"): the README's shell block run as written (ports changed to free ones) starts
two vLLM API servers from `kvxfer vllm-args` output and the router alone; the command lines
it gives are those the shared pair (tests/integrations/conftest.py) runs, and through that
pair and a router process alone completions equal colocated ones and move KV (a streamed
one counted in the router's KV figures as the same prompt not streamed); then `kvxfer
join` adds a decoder, and under load it gets traffic; an instance whose lease is revoked in
etcd registers again by itself, and the router lists it and routes to it.

vLLM start-ups are the cost (about 20 s each on 2 cores): the README block's vLLM command
is run by a stand-in that records its arguments and environment, since the shared pair,
started from the same `kvxfer vllm-args` output in the same form, serves what a real
instance must do; the joined decoder is the only instance of this module's own.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
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
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pyetcd
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.vllm_instances import TEST_KV_BLOCKS, SharedConnectorFleet, VllmFleet, free_port  # noqa: E402

from kvxfer.cli import main as kvxfer_main  # noqa: E402
from kvxfer.registry.record import worker_key  # noqa: E402
from kvxfer.registry.signing import load_cluster_key, vllm_api_key  # noqa: E402

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
#: Start-up of the joined instance beside two idle ones, with its warm-up; several times the idle figure under load.
READY_TIMEOUT_S = 420.0
#: How long the README block's processes (two `kvxfer vllm-args`, the stand-in, the router) may take to be up.
README_BLOCK_TIMEOUT_S = 60.0
#: How long the README block's router may take to exit on SIGTERM.
GROUP_STOP_TIMEOUT_S = 20.0
#: How long the router may take to forget the joined decoder once it stopped (its lease is revoked on SIGTERM).
LEFT_TIMEOUT_S = 30.0
PROMPTS = ("The licence grants you", "Permission is hereby granted, free of charge, to any person " * 12)
#: How long the joined decoder may take to receive its first KV once the load runs.
TRAFFIC_TIMEOUT_S = 120.0
#: How long an instance whose lease was lost may take to be listed by the router again: its
#: keep-alive finds the lease gone (a third of the TTL), it grants a new one and puts its
#: record, and the router's watch sees the put; generous for a loaded machine.
REREGISTERED_TIMEOUT_S = 30.0
#: One call of the test's own etcd client.
ETCD_CALL_TIMEOUT_S = 5.0
README_PORTS = {"prefill": 8100, "decode": 8200, "router": 8000, "admin": 8001}
README_CORES = {"prefill": "0", "decode": "1"}
README_SERVED = "llama"  # the README's --served-model-name
API_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]
#: Stands in for `python` on the README block's PATH: records the arguments and the two
#: variables the block sets for vLLM, one JSON file per run, and exits.
RECORDING_PYTHON = """#!/bin/sh
exec {python} -c 'import json, os, sys
names = ("VLLM_API_KEY", "VLLM_CPU_OMP_THREADS_BIND")
record = {{"argv": sys.argv[1:], "env": {{n: os.environ.get(n) for n in names}}}}
path = os.path.join(os.environ["RECORD_DIR"], str(os.getpid()))
json.dump(record, open(path + ".part", "w"))
os.replace(path + ".part", path + ".json")' "$@"
"""


def readme_command_block() -> str:
    """The README's shell block that starts the instances from `kvxfer vllm-args` and the router."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Your own vLLM command line", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    (block,) = [b for b in blocks if "kvxfer vllm-args" in b]
    return block


def vllm_args(role: str, port: int, etcd: str, key: Path) -> dict:
    """What `kvxfer vllm-args --format json` prints for an instance of the cluster."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert kvxfer_main(["vllm-args", "--role", role, "--port", str(port), "--etcd", etcd,
                            "--cluster-key-file", str(key), "--format", "json"]) == 0
    return json.loads(printed.getvalue())


def _roles_listed(admin: str) -> dict[str, int]:
    try:
        body = httpx.get(f"{admin}/workers", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return {}
    counts: dict[str, int] = {}
    for w in body.get("workers", body) if isinstance(body, dict) else body:
        counts[w["role"]] = counts.get(w["role"], 0) + 1
    return counts


def _logs(fleet: VllmFleet) -> str:
    """The tail of every log of the fleet (instances, etcd, router), for failure messages."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                     for p in sorted(fleet.work_dir.glob("*.log")))


def _connector_counter(metrics_port: int | None, name: str) -> float:
    """`name`'s value on a connector's /metrics; 0 while a busy instance does not answer in
    time (the caller polls until its own deadline)."""
    assert metrics_port is not None
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    except httpx.TimeoutException:
        return 0.0
    match = re.search(rf"^{name} (\S+)$", text, flags=re.M)
    assert match, f"{name} not on port {metrics_port}"
    return float(match.group(1))


@pytest.fixture(scope="module")
def fleet(shared_vllm_pair: SharedConnectorFleet) -> VllmFleet:
    return shared_vllm_pair.fleet()


@pytest.fixture(scope="module")
def router(shared_vllm_pair: SharedConnectorFleet) -> str:
    return shared_vllm_pair.router_url()


@pytest.fixture(scope="module")
def admin(shared_vllm_pair: SharedConnectorFleet) -> str:
    return shared_vllm_pair.admin_url()


def test_the_readme_block_runs_and_gives_the_command_lines_the_shared_pair_runs(fleet: VllmFleet,
                                                                                tmp_path: Path) -> None:
    assert fleet.etcd is not None and fleet.key_file is not None
    ports = {role: free_port() for role in README_PORTS}
    script = readme_command_block()
    for role, port in README_PORTS.items():
        script = re.sub(rf"\b{port}\b", str(ports[role]), script)
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    (stand_in / "python").write_text(RECORDING_PYTHON.format(python=sys.executable))
    (stand_in / "python").chmod(0o755)
    records = tmp_path / "records"
    records.mkdir()
    env = {**os.environ, "MODEL": str(fleet.model_dir), "ETCD": fleet.etcd.client_url, "KEY": str(fleet.key_file),
           "RECORD_DIR": str(records),
           "PATH": f"{stand_in}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VLLM_API_KEY", None)
    shell = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, start_new_session=True)
    admin = f"http://127.0.0.1:{ports['admin']}"
    try:
        assert shell.wait(README_BLOCK_TIMEOUT_S) == 0, "the README block failed"
        # The block's router, alone on the cluster's etcd and key, lists the shared pair: the
        # records its instances signed verify.
        deadline = time.monotonic() + README_BLOCK_TIMEOUT_S
        while len(list(records.glob("*.json"))) < 2 or _roles_listed(admin) != {"prefill": 1, "decode": 1}:
            assert time.monotonic() < deadline, (sorted(p.name for p in records.iterdir()),
                                                 (tmp_path / "router.log").read_text(errors="replace")[-3000:])
            time.sleep(0.3)
    finally:
        # The router the block started shares the shell's process group (no job control in `bash -c`).
        _stop_group(shell)
    runs = {r["argv"][r["argv"].index("--port") + 1]: r for r in
            (json.loads(p.read_text()) for p in records.glob("*.json"))}
    for role in ("prefill", "decode"):
        own = vllm_args(role, ports[role], fleet.etcd.client_url, fleet.key_file)
        run = runs[str(ports[role])]
        assert run["argv"] == [*API_SERVER, "--model", str(fleet.model_dir), "--port", str(ports[role]),
                               "--served-model-name", README_SERVED, "--block-size", "32", "--enforce-eager",
                               *own["flags"]]
        assert run["env"] == {"VLLM_API_KEY": fleet.api_key, "VLLM_CPU_OMP_THREADS_BIND": README_CORES[role]}
        # The shared pair's instance of the role: the same server, the same flags last (its
        # connector settings differ, by --connector-config), the same key.
        pair = fleet.instances[f"{role}-a"]
        server = pair.argv.index(API_SERVER[0])
        assert pair.argv[server:server + 2] == API_SERVER and pair.argv[server - 1] == sys.executable
        tail = pair.argv[len(pair.argv) - len(own["flags"]):]
        assert [f for f in tail if f.startswith("--")] == [f for f in own["flags"] if f.startswith("--")]
        config, readme_config = (json.loads(flags[flags.index("--kv-transfer-config") + 1]) for flags in
                                 (tail, own["flags"]))
        assert {k: v for k, v in config.items() if k != "kv_connector_extra_config"} == \
            {k: v for k, v in readme_config.items() if k != "kv_connector_extra_config"}
        assert (pair.env["VLLM_API_KEY"], pair.env["VLLM_CPU_OMP_THREADS_BIND"]) == (fleet.api_key, README_CORES[role])


def _stop_group(shell: subprocess.Popen[bytes]) -> None:
    """SIGTERM to `shell`'s process group, SIGKILL to what is left of it after GROUP_STOP_TIMEOUT_S."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(shell.pid, signal.SIGTERM)
    shell.wait(10)
    deadline = time.monotonic() + GROUP_STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.killpg(shell.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(shell.pid, signal.SIGKILL)


def _complete(url: str, model: str, prompt: str, headers: dict[str, str] | None = None, **extra: object) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_through_the_router_alone_equal_colocated_and_move_kv(fleet: VllmFleet, router: str) -> None:
    prefill, decode = fleet.instances["prefill-a"], fleet.instances["decode-a"]
    pushed_before = _connector_counter(prefill.metrics_port, "kvxfer_connector_pushed_pages_total")
    received_before = _connector_counter(decode.metrics_port, "kvxfer_connector_received_pages_total")
    for prompt in PROMPTS:
        routed = _complete(router, fleet.served_model_name, prompt)
        # Colocated: the prefill instance alone, its own cache salt keeping the prefix cache apart.
        alone = _complete(prefill.url, fleet.served_model_name, prompt, fleet.headers, cache_salt=uuid.uuid4().hex)
        assert routed["choices"][0]["text"] == alone["choices"][0]["text"]
        assert routed["usage"] == alone["usage"]
    assert _connector_counter(prefill.metrics_port, "kvxfer_connector_pushed_pages_total") > pushed_before
    assert _connector_counter(decode.metrics_port, "kvxfer_connector_received_pages_total") > received_before


#: The router's per-request KV figures (a count, then sums), as its /metrics names them.
ROUTER_KV_FIGURES = ("kvxfer_router_request_kv_moved_bytes_count", "kvxfer_router_request_kv_moved_bytes_sum",
                     "kvxfer_router_kv_pages_moved_total", "kvxfer_router_kv_pages_not_sent_total")
#: How long the router may take to count a streamed request's figures (it asks once the stream ended).
STREAMED_FIGURES_TIMEOUT_S = 15.0


def _router_kv_figures(router: str) -> tuple[float, ...]:
    text = httpx.get(f"{router}/metrics", timeout=5).text
    found = (re.search(rf"^{name} (\S+)$", text, flags=re.M) for name in ROUTER_KV_FIGURES)
    return tuple(float(m.group(1)) if m else 0.0 for m in found)


def _since(now: tuple[float, ...], before: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(a - b for a, b in zip(now, before))


def test_a_streamed_request_counts_the_kv_figures_the_same_prompt_counts_not_streamed(fleet: VllmFleet,
                                                                                     router: str) -> None:
    # Each request with a cache salt of its own: neither finds the other's blocks on the decoder.
    body = {"model": fleet.served_model_name, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
    before = _router_kv_figures(router)
    r = httpx.post(f"{router}/v1/completions", json={**body, "cache_salt": uuid.uuid4().hex}, timeout=120)
    assert r.status_code == 200, r.text
    not_streamed = _since(_router_kv_figures(router), before)  # counted before the answer left
    assert not_streamed[0] == 1 and not_streamed[2] > 0, not_streamed
    before = _router_kv_figures(router)
    with httpx.stream("POST", f"{router}/v1/completions", timeout=120,
                      json={**body, "stream": True, "cache_salt": uuid.uuid4().hex}) as streamed_answer:
        assert streamed_answer.status_code == 200, streamed_answer.read()
        lines = [line for line in streamed_answer.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    deadline = time.monotonic() + STREAMED_FIGURES_TIMEOUT_S
    while (streamed := _since(_router_kv_figures(router), before))[0] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert streamed == not_streamed


def test_kvxfer_join_adds_a_decoder_that_then_gets_traffic_under_load(fleet: VllmFleet, router: str,
                                                                      admin: str) -> None:
    # The newcomer starts while the others idle: on 2 cores, a third vLLM instance starting
    # beside two busy ones took over 7 minutes (tests/integrations/test_vllm_connector.py
    # runs that case with KVXFER_VLLM_SCALE_TEST=1). What this checks is the join itself:
    # the user's flags reach it, it registers, and the router sends it requests.
    assert fleet.etcd is not None
    served = fleet.served_model_name
    port = free_port()
    log = (fleet.work_dir / "joined.log").open("wb")
    joined = subprocess.Popen(
        [sys.executable, "-m", "kvxfer.cli", "join", "--engine", "vllm", "--role", "decode", "--model",
         str(fleet.model_dir), "--port", str(port), "--cpu-cores", "1", "--etcd", fleet.etcd.client_url,
         "--cluster-key-file", str(fleet.key_file),
         "--", "--served-model-name", served, "--block-size", "32", "--enforce-eager",
         "--num-gpu-blocks-override", str(TEST_KV_BLOCKS),
         "--max-num-batched-tokens", "256"],  # a short warm-up (a chunk and a block) before it registers
        # Its own process group (killpg below) in the harness's session, like the pair's
        # (popen_instance): a session of its own would be a scheduling group of its own.
        stdout=log, stderr=subprocess.STDOUT, process_group=0, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    stop = threading.Event()
    statuses: list[int] = []

    def load(seed: int) -> None:
        i = 0
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                i += 1
                # Distinct from the first token on: no decoder holds a prefix of it, so the
                # router (kv_aware) chooses by load alone.
                body = {"model": served, "prompt": f"{seed} {i} {PROMPTS[1]}", "max_tokens": 4, "temperature": 0}
                statuses.append(client.post(f"{router}/v1/completions", json=body).status_code)
                stop.wait(0.2)

    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while _roles_listed(admin).get("decode", 0) < 2:
            assert joined.poll() is None, f"kvxfer join exited with {joined.returncode}:\n{_logs(fleet)}"
            assert time.monotonic() < deadline, f"the joined decoder never registered:\n{_logs(fleet)}"
            time.sleep(0.5)
        # Two clients at once: the least-loaded choice sends the second of two overlapping
        # requests to the idle decoder, whichever the first went to.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            loaders = [pool.submit(load, seed) for seed in range(2)]
            try:
                deadline = time.monotonic() + TRAFFIC_TIMEOUT_S
                received = 0.0
                while received == 0.0:
                    assert time.monotonic() < deadline, f"the joined decoder got no KV in time:\n{_logs(fleet)}"
                    time.sleep(0.5)
                    received = _connector_counter(port + 1, "kvxfer_connector_received_pages_total")
            finally:
                stop.set()
                for f in loaders:
                    f.result(timeout=150)
        # Every instance is listed, at once or once it is back: a lease that expired while the
        # load had the cores (etcd answered too late) removes its instance until the instance
        # grants itself a new one and puts its record again.
        deadline = time.monotonic() + REREGISTERED_TIMEOUT_S
        while (listed := _roles_listed(admin)) != {"prefill": 1, "decode": 2}:
            assert time.monotonic() < deadline, \
                f"the router lists {listed} {REREGISTERED_TIMEOUT_S:g} s after the load:\n{_logs(fleet)}"
            time.sleep(0.5)
        assert statuses and set(statuses) == {200}, \
            f"{len(statuses)} requests: {sorted(set(statuses))}:\n{_logs(fleet)}"
    finally:
        if joined.poll() is None:
            # The whole group (the exec'd API server, its engine core and worker): the load
            # has stopped, nothing is left to drain, and a worker signalled only through its
            # parent waited out vLLM's 5 s grace and then took seconds more to exit.
            os.killpg(joined.pid, signal.SIGTERM)
            try:
                joined.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(joined.pid, signal.SIGKILL)
                joined.wait(10)
        log.close()
    # The pair's later tests meet the router as it was: the joined decoder is gone from it.
    deadline = time.monotonic() + LEFT_TIMEOUT_S
    while _roles_listed(admin) != {"prefill": 1, "decode": 1}:
        assert time.monotonic() < deadline, \
            f"the router still lists the joined decoder: {_roles_listed(admin)}:\n{_logs(fleet)}"
        time.sleep(0.3)


def _pair_leases(client: pyetcd.Etcd3Client) -> dict[str, int]:
    """The lease of each of the pair's records in etcd, by key (0: no record)."""
    leases = {}
    for name, role in (("prefill-a", "prefill"), ("decode-a", "decode")):
        key = worker_key("/kvxfer", role, name)
        value, meta = client.get(key)
        leases[key] = meta.lease_id if value is not None else 0
    return leases


def test_an_instance_whose_lease_was_lost_registers_again_and_the_router_lists_it(
        fleet: VllmFleet, router: str, admin: str) -> None:
    # As if etcd had gone unanswered for longer than the leases last: both instances' leases
    # are revoked in etcd itself, so their records go. Each must notice, grant itself a new
    # lease and put its record again, and the router list it and route to it, unaided.
    assert fleet.etcd is not None
    endpoint = urlsplit(fleet.etcd.client_url)
    client = pyetcd.client(host=endpoint.hostname, port=endpoint.port, timeout=ETCD_CALL_TIMEOUT_S)
    try:
        deadline = time.monotonic() + REREGISTERED_TIMEOUT_S
        while not all((before := _pair_leases(client)).values()):
            assert time.monotonic() < deadline, f"the pair is not registered: {before}"
            time.sleep(0.3)
        for lease in before.values():
            client.revoke_lease(lease)
        # (Under its old lease, that is: an instance may already be back under a new one.)
        assert not set(_pair_leases(client).values()) & set(before.values()), "a revoked lease kept its record"
        deadline = time.monotonic() + REREGISTERED_TIMEOUT_S
        while True:
            now = _pair_leases(client)
            listed = _roles_listed(admin)
            if all(now.values()) and listed == {"prefill": 1, "decode": 1}:
                break
            assert time.monotonic() < deadline, (f"{REREGISTERED_TIMEOUT_S:g} s after the revoke: leases {now}, "
                                                 f"the router lists {listed}:\n{_logs(fleet)}")
            time.sleep(0.3)
    finally:
        client.close()
    assert not set(now.values()) & set(before.values()), f"records back under the old leases: {before} -> {now}"
    _complete(router, fleet.served_model_name, f"{uuid.uuid4().hex} {PROMPTS[0]}")


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
