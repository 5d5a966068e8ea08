"""The vLLM component's manifests agree with the connector, vLLM and the cluster around them.

Rendered with the real kustomize: the shipped overlay k8s/overlays/vllm-gpu and the vLLM
combinations of tests/support/deploy_render.py (each transport and etcd choice once, and
monitoring). Schema validation and the checks that hold for any worker (NetworkPolicies,
Pod Security, TLS, budgets...) run on them in test_manifests.py; here: the
--kv-transfer-config each instance gets (expanded as Kubernetes expands it, then parsed by
the connector's own settings class), the Secrets, the container command that derives vLLM's
API key from the cluster key (run for real with `kvxfer vllm-args`, vLLM replaced by a stub),
tensor parallel size and GPUs per role, drain within the grace period, probes and scrapes.
No vLLM pods are started (k8s/README.md says why).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from support.deploy_pods import expand
from support.deploy_render import (DOWNWARD_API, REPO, VLLM_COMBINATIONS, by_kind,
                                   combination_name, main_container, pod_spec,
                                   prestop_sleep_s, rendered, rendered_combination, resolved_env,
                                   selects, settings, workload)

from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.registry.signing import vllm_api_key

OVERLAY = "overlays/vllm-gpu"
#: The shipped overlay's choice: prefill wide, decode narrow.
OVERLAY_TENSOR_PARALLEL = {"prefill": 2, "decode": 1}
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
WORKER_ROLES = ("prefill", "decode")
CLUSTER_KEY_SECRET = "kvxfer-cluster-key"
TLS_SECRET = "kvxfer-etcd-tls"
GPU = "nvidia.com/gpu"
#: After vLLM's drain: the connector revokes its lease, the processes exit (as for the
#: builtin workers in test_manifests.py).
EXIT_MARGIN_S = 10
CASES = [OVERLAY, *VLLM_COMBINATIONS]
CASE_IDS = ["vllm-gpu-overlay", *(combination_name(*c) for c in VLLM_COMBINATIONS)]

cases = pytest.mark.parametrize("case", CASES, ids=CASE_IDS)


def objects_of(case: Any) -> list[dict[str, Any]]:
    return rendered(case) if case == OVERLAY else rendered_combination(*case)


class Instance:
    """One role's vLLM container, its environment and its arguments as the kubelet gives them."""

    def __init__(self, objects: list[dict[str, Any]], role: str) -> None:
        self.role = role
        self.deployment = workload(objects, role)
        self.container = main_container(self.deployment)
        self.env = resolved_env(objects, self.container)
        self.args = [expand(arg, self.env) for arg in self.container["args"]]
        self.ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}

    def flag(self, name: str) -> str:
        """The value of `--name=value` among the args (given exactly once)."""
        values = [a.split("=", 1)[1] for a in self.args if a.startswith(name + "=")]
        assert len(values) == 1, (self.role, name, values)
        return values[0]

    def kv_transfer_config(self) -> dict[str, Any]:
        return json.loads(self.flag("--kv-transfer-config"))

    def secret_mounts(self, secret: str) -> dict[str, set[str]]:
        """mountPath -> the file names of `secret` mounted there."""
        volumes = {v["name"]: v["secret"] for v in pod_spec(self.deployment)["volumes"]
                   if v.get("secret", {}).get("secretName") == secret}
        return {m["mountPath"]: {item["path"] for item in volumes[m["name"]]["items"]}
                for m in self.container["volumeMounts"] if m["name"] in volumes}

    def reads_from_secret(self, path: str, secret: str) -> bool:
        directory, _, name = path.rpartition("/")
        return name in self.secret_mounts(secret).get(directory, set())


def instances(case: Any) -> list[Instance]:
    objects = objects_of(case)
    return [Instance(objects, role) for role in WORKER_ROLES]


def _package_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


# --- the connector's configuration ------------------------------------------------------

@cases
def test_each_instance_runs_the_kvxfer_connector_in_its_role_with_a_valid_config(case: Any) -> None:
    objects = objects_of(case)
    values = settings(objects)
    router = main_container(workload(objects, "router"))
    registry_prefix = expand(next(a for a in router["args"] if a.startswith("--registry-prefix=")),
                             resolved_env(objects, router)).split("=", 1)[1]
    for instance in instances(case):
        # Every $(VAR) names a variable the container has: Kubernetes would leave an unknown
        # one as it is, and vLLM would get it verbatim.
        unresolved = [a for a in instance.args if re.search(r"\$\([A-Za-z_]\w*\)", a)]
        assert not unresolved, (instance.role, unresolved)
        config = instance.kv_transfer_config()
        assert config["kv_connector"] == "KvxferConnector"
        assert config["kv_connector_module_path"] == "kvxfer.integrations.vllm"
        assert "KvxferConnector" in importlib.import_module(config["kv_connector_module_path"]).__all__
        assert config["kv_role"] == KV_ROLES[instance.role], instance.role
        # The connector's own parser: unknown keys and bad values are errors there.
        extra = ConnectorSettings.from_extra_config(config["kv_connector_extra_config"])
        # The same registry, transport and cluster as the router and the settings say.
        assert extra.etcd == values["KVXFER_ETCD"]
        assert extra.etcd_prefix == registry_prefix
        assert (extra.provider, extra.rails) == (instance.env["KVXFER_PROVIDER"],
                                                 int(instance.env["KVXFER_RAILS"]))
        assert not extra.insecure
        assert instance.reads_from_secret(extra.cluster_key_file, CLUSTER_KEY_SECRET)
        for path in (extra.etcd_ca_file, extra.etcd_cert_file, extra.etcd_key_file):
            assert instance.reads_from_secret(path, TLS_SECRET), (instance.role, path)
        # The router reaches the instance's API at the pod IP on the port it serves; the
        # engine binds the pod IP (KVXFER_BIND_HOST, read by the engine itself).
        api_port = instance.ports["http"]
        assert int(instance.flag("--port")) == api_port
        assert extra.advertise_url == f"http://{DOWNWARD_API['status.podIP']}:{api_port}"
        assert instance.env["KVXFER_BIND_HOST"] == DOWNWARD_API["status.podIP"]
        assert extra.worker_id == DOWNWARD_API["metadata.name"]
        assert extra.metrics_port == instance.ports["metrics"] != api_port
        assert f"--role={instance.role}" in instance.container["command"][2]


@cases
def test_both_roles_serve_one_model_from_one_versioned_image(case: Any) -> None:
    prefill, decode = instances(case)
    assert prefill.container["image"] == decode.container["image"]
    assert prefill.container["envFrom"] == decode.container["envFrom"]
    for flag in ("--model", "--served-model-name"):
        assert prefill.flag(flag) == decode.flag(flag) != ""
    assert prefill.flag("--served-model-name") == prefill.env["SERVED_MODEL_NAME"]
    # The image carries kvxfer: its tag is kvxfer's version, like the kvxfer image's.
    expected = ("registry.example.com/kvxfer-vllm" if case == OVERLAY else "kvxfer-vllm")
    assert prefill.container["image"] == f"{expected}:{_package_version()}"


# --- Secrets ------------------------------------------------------------------------------

SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)$")


@cases
def test_secrets_are_mounted_or_referenced_never_written_into_the_manifests(case: Any) -> None:
    objects = objects_of(case)
    assert not by_kind(objects, "Secret")
    for config_map in by_kind(objects, "ConfigMap"):
        assert not [k for k in config_map["data"] if SECRET_NAME.search(k)], config_map["metadata"]["name"]
    for instance in instances(case):
        for var in instance.container["env"]:
            if SECRET_NAME.search(var["name"]):
                assert "value" not in var and "secretKeyRef" in var["valueFrom"], var
        # vLLM's API key is derived at start from the mounted cluster key (the command);
        # it is never an env value or a flag (which `ps` would show).
        assert "VLLM_API_KEY" not in {v["name"] for v in instance.container["env"]}
        assert not [a for a in instance.args if a.startswith("--api-key")]
        assert '--cluster-key-file="$KVXFER_CLUSTER_KEY_FILE"' in instance.container["command"][2]
        assert instance.reads_from_secret(instance.env["KVXFER_CLUSTER_KEY_FILE"], CLUSTER_KEY_SECRET)


def _run_container_command(instance: Instance, key_file: Path, stub_out: Path,
                           tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The container's command and args as the kubelet runs them, here: `kvxfer` from this
    environment, and a stub `python3` first on PATH that records what vLLM would get."""
    stub_dir = tmp_path / "image-bin"
    stub_dir.mkdir(exist_ok=True)
    stub = stub_dir / "python3"
    stub.write_text('#!/bin/sh\nprintf %s "$VLLM_API_KEY" > "$STUB_OUT/api-key"\n'
                    'printf "%s\\n" "$$" > "$STUB_OUT/pid"\nprintf "%s\\0" "$@" > "$STUB_OUT/argv"\n')
    stub.chmod(0o755)
    env = {**instance.env, "KVXFER_CLUSTER_KEY_FILE": str(key_file), "HOME": str(tmp_path),
           "STUB_OUT": str(stub_out),
           "PATH": f"{stub_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    command = [expand(c, instance.env) for c in instance.container["command"]] + instance.args
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    stdout, stderr = process.communicate(timeout=60)
    stub_out.joinpath("bash-pid").write_text(str(process.pid))
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_the_container_derives_vllms_api_key_from_the_cluster_key_then_execs_vllm(
        tmp_path: Path) -> None:
    key = b"k" * 48
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(key)
    for instance in instances(OVERLAY):
        out = tmp_path / instance.role
        out.mkdir()
        result = _run_container_command(instance, key_file, out, tmp_path)
        assert result.returncode == 0, result.stderr
        # The key the router derives and sends (scheduler/kvxfer_router/worker_auth.py).
        assert (out / "api-key").read_text() == vllm_api_key(key)
        argv = (out / "argv").read_text().split("\0")[:-1]
        assert argv == ["-m", "vllm.entrypoints.openai.api_server", *instance.args]
        # exec: vLLM's API server is the container's PID 1 and gets the kubelet's SIGTERM.
        assert (out / "pid").read_text().strip() == (out / "bash-pid").read_text()


def test_the_container_stops_without_a_usable_cluster_key_and_never_starts_vllm(
        tmp_path: Path) -> None:
    short_key = tmp_path / "cluster.key"
    short_key.write_bytes(b"too short")
    instance = instances(OVERLAY)[1]
    out = tmp_path / "out"
    out.mkdir()
    result = _run_container_command(instance, short_key, out, tmp_path)
    assert result.returncode != 0
    assert "cluster key" in result.stderr
    assert not (out / "argv").exists()  # an instance with an open API never started


# --- GPUs and tensor parallelism ---------------------------------------------------------

@cases
def test_each_role_gets_one_gpu_per_tensor_parallel_rank(case: Any) -> None:
    for instance in instances(case):
        size = int(instance.flag("--tensor-parallel-size"))
        resources = instance.container["resources"]
        # Extended resources are schedulable only with requests == limits.
        assert int(resources["limits"][GPU]) == int(resources["requests"][GPU]) == size, instance.role
        if case == OVERLAY:
            assert size == OVERLAY_TENSOR_PARALLEL[instance.role]
    router = main_container(workload(objects_of(case), "router"))
    assert GPU not in router["resources"]["limits"]


# --- shutdown -----------------------------------------------------------------------------

@cases
def test_vllm_drains_within_the_grace_period_and_as_long_as_the_router_waits(case: Any) -> None:
    values = settings(objects_of(case))
    longest_s = {"decode": float(values["KVXFER_ROUTER_REQUEST_DEADLINE_S"]),
                 "prefill": float(values["KVXFER_ROUTER_PREFILL_TIMEOUT_S"])}
    for instance in instances(case):
        # vLLM's --shutdown-timeout: 0 aborts in-flight requests, N waits up to N s for them.
        shutdown_s = int(instance.flag("--shutdown-timeout"))
        assert shutdown_s >= longest_s[instance.role], instance.role
        grace_s = pod_spec(instance.deployment)["terminationGracePeriodSeconds"]
        assert prestop_sleep_s(instance.container) + shutdown_s + EXIT_MARGIN_S <= grace_s, instance.role


# --- probes and metrics -------------------------------------------------------------------

def _vllm_guarded_prefixes() -> tuple[str, ...]:
    """The paths vLLM's API key guards (GUARDED_PREFIX of the installed vLLM, read from its
    source: importing vLLM takes seconds)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vllm is not installed"
    source = Path(spec.origin).parent / "entrypoints" / "serve" / "middleware" / "authenticate.py"
    match = re.search(r"^GUARDED_PREFIX = (\(.*?\))$", source.read_text(), re.M)
    assert match, f"{source}: no GUARDED_PREFIX"
    return ast.literal_eval(match.group(1))


@cases
def test_probes_and_scrapes_use_paths_that_vllm_serves_without_the_api_key(case: Any) -> None:
    guarded = _vllm_guarded_prefixes()
    assert "/v1" in guarded
    for instance in instances(case):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = instance.container[probe]["httpGet"]
            assert get == {"path": "/health", "port": "http"}, (instance.role, probe)
            assert not get["path"].startswith(guarded)
    for monitor in by_kind(objects_of(case), "PodMonitor"):
        assert not [e for e in monitor["spec"]["podMetricsEndpoints"] if e["path"].startswith(guarded)]


@pytest.mark.parametrize("case", [c for c in VLLM_COMBINATIONS if "monitoring" in c[2]],
                         ids=lambda c: combination_name(*c))
def test_prometheus_scrapes_vllm_and_the_connector_on_every_instance(case: Any) -> None:
    objects = objects_of(case)
    monitors = by_kind(objects, "PodMonitor")
    scrape = next(n for n in by_kind(objects, "NetworkPolicy")
                  if n["metadata"]["name"] == "kvxfer-allow-prometheus")
    for instance in instances(case):
        labels = instance.deployment["spec"]["template"]["metadata"]["labels"]
        scraped = {e["port"] for m in monitors if selects(m["spec"]["selector"], labels)
                   for e in m["spec"]["podMetricsEndpoints"]}
        # vLLM's vllm:* on its API port, the connector's kvxfer_connector_* on metrics_port.
        assert scraped == {"http", "metrics"}, (instance.role, scraped)
        metrics_port = instance.kv_transfer_config()["kv_connector_extra_config"]["metrics_port"]
        assert instance.ports["metrics"] == metrics_port
        # ... and the NetworkPolicy lets Prometheus in on both.
        assert selects(scrape["spec"]["podSelector"], labels)
        admitted = {p["port"] for rule in scrape["spec"]["ingress"] for p in rule["ports"]}
        assert scraped <= admitted
