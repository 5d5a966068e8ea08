"""`kvxfer up --engine vllm` as a vLLM user meets it, with real processes: a checkpoint of 2,048
positions (not kvxfer's 4,096) serves with the user's own flags in effect, the console is quiet
and says what happens, a real Prometheus finds vLLM's `vllm:*` and the connector's
`kvxfer_connector_*` through the targets file `up` writes, the Grafana dashboard's vLLM
panels answer, and an instance that dies or cannot start is reported with its log's last lines.

One `kvxfer up` (one prefill, one decode instance) serves every assertion: vLLM start-ups are
the cost.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.vllm_instances import TEST_KV_BLOCKS, free_port  # noqa: E402

from kvxfer.cluster.prometheus_runner import PrometheusRunner, find_prometheus_binary  # noqa: E402
from kvxfer.integrations.vllm.checkpoint import CheckpointShape, make_checkpoint  # noqa: E402
from kvxfer.registry.signing import load_cluster_key, vllm_api_headers, vllm_api_key  # noqa: E402

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "k8s" / "grafana" / "kvxfer-dashboard.json"
READY_TIMEOUT_S = 420.0
SERVED = "up2k"  # --served-model-name, passed through after --
MAX_NUM_SEQS = 3  # --decode-args
LEASE_LOST_WITHIN_S = 12.0  # the registry's lease TTL (5 s), its expiry sweep and the router's watch
#: How long the dashboard's panels may take to have data once the requests were answered.
PANEL_DATA_TIMEOUT_S = 15.0


@dataclass
class UpProcess:
    """A running `kvxfer up` and what it printed."""

    process: subprocess.Popen[str]
    out_path: Path
    log_dir: Path
    router: str
    admin: str

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def targets(self) -> list[dict]:
        return json.loads((self.log_dir / "prometheus-targets.json").read_text())

    def instance(self, worker: str) -> tuple[str, int]:
        """(API URL, connector metrics port) of a worker, from the targets file."""
        groups = {(g["labels"]["job"], g["labels"].get("worker")): g["targets"][0] for g in self.targets()}
        api, metrics = groups[("vllm", worker)], groups[("kvxfer-connector", worker)]
        return f"http://{api}", int(metrics.rsplit(":", 1)[1])

    def headers(self) -> dict[str, str]:
        return vllm_api_headers(vllm_api_key(load_cluster_key(self.log_dir / "cluster.key")))


def _wait_for_output(up: UpProcess, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in up.output():
        assert up.process.poll() is None, f"kvxfer up exited with {up.process.returncode}:\n{up.output()}"
        assert time.monotonic() < deadline, f"{text!r} not printed in {timeout_s} s:\n{up.output()}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.getbasetemp() / "llama-2k", CheckpointShape(max_positions=2048))


@pytest.fixture(scope="module")
def up(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    work = tmp_path_factory.mktemp("vllm-up")
    port, admin_port = free_port(), free_port()
    out_path = work / "up.out"
    with out_path.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvxfer.cli", "up", "--engine", "vllm", "--model", str(model), "--port", str(port),
             "--admin-port", str(admin_port), "--log-dir", str(work / "logs"),
             # A restarted vLLM instance takes minutes here: the death test checks the line
             # that says it stays down (restarts: tests/deploy/test_instance_restarts.py).
             "--max-restarts", "0",
             "--decode-args", f"--max-num-seqs {MAX_NUM_SEQS}", "--", "--served-model-name", SERVED,
             # Also makes the connector's warm-up (a chunk and a block) short: 288 tokens, not 2,046.
             "--max-num-batched-tokens", "256", "--num-gpu-blocks-override", str(TEST_KV_BLOCKS)],
            stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    up = UpProcess(proc, out_path, work / "logs", f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}")
    try:
        _wait_for_output(up, "metrics: Prometheus file_sd targets in", READY_TIMEOUT_S)
        yield up
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # drains the instances, stops router and etcd
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_the_console_prints_the_log_folder_first_then_each_instance_and_no_poll_lines(up: UpProcess) -> None:
    lines = up.output().splitlines()
    assert lines[0] == f"kvxfer up: logs in {up.log_dir}"
    for worker in ("prefill-1", "decode-2"):
        assert any(line.startswith(f"kvxfer up: {worker}: starting vLLM") for line in lines), lines
        assert any(line.startswith(f"kvxfer up: {worker}: ready") for line in lines), lines
    assert not [line for line in lines if "httpx" in line or "GET /workers" in line]


def test_a_2048_position_checkpoint_serves_with_the_users_own_flags_in_effect(up: UpProcess) -> None:
    r = httpx.post(f"{up.router}/v1/completions", timeout=120,
                   json={"model": SERVED, "prompt": "The licence grants you", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert [m["id"] for m in httpx.get(f"{up.router}/v1/models", timeout=10).json()["data"]] == [SERVED]
    for worker in ("prefill-1", "decode-2"):
        api, _ = up.instance(worker)
        (served,) = httpx.get(f"{api}/v1/models", headers=up.headers(), timeout=10).json()["data"]
        assert (served["id"], served["max_model_len"]) == (SERVED, 2048)  # vLLM's, from the checkpoint
    decode_log = (up.log_dir / "decode-2.log").read_text(errors="replace")
    prefill_log = (up.log_dir / "prefill-1.log").read_text(errors="replace")
    assert f"'max_num_seqs': {MAX_NUM_SEQS}" in decode_log  # vLLM's "non-default args" line
    assert "'max_num_seqs'" not in prefill_log  # --decode-args: the decode role only


@pytest.mark.skipif(find_prometheus_binary() is None, reason="no prometheus binary (Debian's `prometheus`)")
def test_prometheus_finds_vllm_and_connector_metrics_and_the_dashboards_vllm_panels_answer(up: UpProcess) -> None:
    with PrometheusRunner({}, file_sd_files=[up.log_dir / "prometheus-targets.json"]) as prom:
        for job in ("vllm", "kvxfer-connector", "kvxfer-router"):
            prom.wait_for(f'count(up{{job="{job}"}} == 1)', lambda v: v == (1 if job == "kvxfer-router" else 2),
                          timeout_s=30)
        # A prompt, then the same prompt with as much again after it: the second time the
        # decode instance's prefix cache holds the first half's full blocks, and fewer pages
        # travel; the router counts both from the answers. (Half new, so the default policy,
        # kv_aware, still gives it a prefill leg rather than serving it on the decoder alone.)
        for prompt in ("Permission is hereby granted " * 20,
                       "Permission is hereby granted " * 20 + "free of charge to any person " * 20):
            r = httpx.post(f"{up.router}/v1/completions", timeout=120,
                           json={"model": SERVED, "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["kv_transfer_params"] is None  # the connector's report is the router's, as plain vLLM
        prom.wait_for('sum(kvxfer_connector_pushed_pages_total{worker="prefill-1"})', lambda v: v > 0, timeout_s=20)
        prom.wait_for('sum(kvxfer_connector_received_pages_total{worker="decode-2"})', lambda v: v > 0, timeout_s=20)
        prom.wait_for('sum(vllm:request_success_total{job="vllm"})', lambda v: v >= 2, timeout_s=20)
        prom.wait_for("sum(kvxfer_router_request_kv_moved_bytes_count)", lambda v: v >= 2, timeout_s=20)
        prom.wait_for("sum(kvxfer_router_kv_pages_moved_total)", lambda v: v > 0, timeout_s=5)
        prom.wait_for("sum(kvxfer_router_kv_pages_not_sent_total)", lambda v: v > 0, timeout_s=5)  # the prefix hit
        # The dashboard's vLLM and KV-moved panels, as Grafana sends them (every namespace, a 1 m window).
        panels = [p for p in json.loads(DASHBOARD.read_text())["panels"]
                  if any(re.search(r"vllm:|kvxfer_connector_|kvxfer_router_(request_kv_moved|kv_pages)", t.get("expr", ""))
                         for t in p.get("targets", []))]
        assert len(panels) >= 8
        # rate() needs two scrapes after the request: each query is polled until it has them.
        deadline = time.monotonic() + PANEL_DATA_TIMEOUT_S
        for panel in panels:
            for target in panel["targets"]:
                expr = target["expr"].replace("$namespace", ".*").replace("$__rate_interval", "1m")
                while not prom.query(expr):
                    assert time.monotonic() < deadline, f"{panel['title']}: {expr} returned nothing"
                    time.sleep(0.25)


def test_an_instance_that_dies_is_reported_with_its_logs_last_lines_reaped_and_left_down(up: UpProcess) -> None:
    api, _ = up.instance("decode-2")
    port = api.rsplit(":", 1)[1]
    (pid,) = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_api_server(p, port)]
    os.killpg(pid, signal.SIGKILL)
    _wait_for_output(up, "kvxfer up: decode-2 was killed by SIGKILL; the last lines of", 20)
    tail = up.output().split("decode-2 was killed by SIGKILL; the last lines of", 1)[1].splitlines()[1:]
    assert tail and tail[0].startswith("    "), tail  # the log's lines follow, indented
    _wait_for_output(up, "kvxfer up: decode-2: not restarted (restarts are off: --max-restarts 0); the others "
                         "keep serving", 5)
    assert not Path(f"/proc/{pid}").exists()  # reaped: no zombie left
    # The registry loses it within its lease (5 s): the router's worker list, and its
    # kvxfer_router_workers gauge, no longer count it.
    deadline = time.monotonic() + LEASE_LOST_WITHIN_S
    while "decode-2" in {w["worker_id"] for w in _workers(up)}:
        assert time.monotonic() < deadline, f"the router still lists decode-2 after {LEASE_LOST_WITHIN_S} s"
        time.sleep(0.3)
    gauge = httpx.get(f"{up.router}/metrics", timeout=10).text
    assert re.search(r'kvxfer_router_workers\{role="decode",state="ready"\} 0\.0', gauge), gauge


def _workers(up: UpProcess) -> list[dict]:
    body = httpx.get(f"{up.admin}/workers", timeout=5).json()
    return body.get("workers", body) if isinstance(body, dict) else body


def _is_api_server(proc_dir: Path, port: str) -> bool:
    try:
        cmd = (proc_dir / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"vllm.entrypoints.openai.api_server" in cmd and port.encode() in cmd and b"--port" in cmd


def test_an_instance_that_fails_at_start_up_shows_vllms_own_error(model: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "up", "--engine", "vllm", "--model", str(model), "--prefill", "0",
         "--decode", "1", "--port", str(free_port()), "--log-dir", str(tmp_path), "--", "--max-model-len", "4096"],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "start-up failed: decode-1 exited with 1; the last lines of" in result.stdout
    assert "max_model_len (4096) is greater than the derived max_model_len" in result.stdout
