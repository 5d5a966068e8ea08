#!/usr/bin/env python3
"""Render kvxfer's kustomizations offline, without the kustomize binary.

Debian (the project's only package source) has no kustomize, and its kubectl (1.20) embeds
kustomize 2.0.3, which predates the `patches` field. This renderer implements exactly the
subset of kustomize that the files under k8s/ use, and refuses everything else with a clear
error rather than rendering it differently:

- `resources`: YAML files (several documents each) and directories holding a
  kustomization.yaml, recursively. Files must lie inside the kustomization's directory
  (kustomize's default load restrictor); directories may be anywhere.
- `namespace`: set on every namespaced object; a Namespace object is renamed to it.
- `configMapGenerator` with `files` (`key=path` allowed), `literals` and `envs`,
  `behavior` create / merge / replace, `options` (labels, annotations,
  disableNameSuffixHash) and `generatorOptions`. Generated names get kustomize's content
  hash suffix at the end of the top-level build, and pod-spec references to them
  (envFrom, env valueFrom, volumes, projected volumes) follow the new name.
- `images` (name, newName, newTag, digest) for the containers of pod templates.
- `patches` with strategic-merge patches from `path` or inline `patch`, aimed either by the
  patch's own kind and name or by `target` (group, version, kind, name regex, namespace,
  labelSelector). Lists merge by the Kubernetes patch merge keys in `LIST_MERGE_KEYS`;
  other lists are replaced; `null` deletes a field. `$patch` and other directives, and
  JSON 6902 patches, are refused.

Output order follows kustomize's default (legacy) ordering. The test suite compares this
renderer's output with `kubectl kustomize` wherever a recent kubectl is installed.

Usage: python k8s/render.py k8s/overlays/tcp [-o rendered.yaml]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "namespace", "configMapGenerator",
                    "generatorOptions", "patches", "images"}
SUPPORTED_IMAGE_FIELDS = {"name", "newName", "newTag", "digest"}
SUPPORTED_GENERATOR_FIELDS = {"name", "behavior", "files", "literals", "envs", "options"}
SUPPORTED_OPTIONS = {"labels", "annotations", "disableNameSuffixHash"}
SUPPORTED_TARGET_FIELDS = {"group", "version", "kind", "name", "namespace", "labelSelector"}

#: Merge keys of the lists our patches touch (from the Kubernetes API's
#: x-kubernetes-patch-merge-key). `ports` is keyed by containerPort in containers and by
#: port in Services; `_merge_key` tells them apart by the items' fields.
LIST_MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
}

#: Kinds without a namespace (kustomize's namespace transformer skips them).
CLUSTER_SCOPED_KINDS = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "PersistentVolume", "StorageClass", "PriorityClass", "IngressClass", "RuntimeClass",
    "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration", "APIService",
    "CSIDriver", "CSINode", "VolumeAttachment", "Node", "PodSecurityPolicy",
}

#: kustomize's legacy output order: these kinds first, in this order, ...
ORDER_FIRST = [
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition",
    "ServiceAccount", "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding",
    "ClusterRoleBinding", "ConfigMap", "Secret", "Endpoints", "Service", "LimitRange",
    "PriorityClass", "PersistentVolume", "PersistentVolumeClaim", "Deployment",
    "StatefulSet", "CronJob", "PodDisruptionBudget",
]
#: ... these last, and every other kind in between, ordered by group/version/kind.
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]

POD_TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": ("spec",),
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}


class RenderError(Exception):
    """A kustomization uses something outside the supported subset, or is invalid."""


@dataclass
class Resource:
    """One object plus what the build needs to remember about it."""

    obj: dict[str, Any]
    #: Name before any hash suffix; generators merge into and references point at it.
    original_name: str = ""
    needs_hash: bool = False
    generated: bool = False

    def __post_init__(self) -> None:
        self.original_name = self.original_name or self.name

    @property
    def kind(self) -> str:
        return self.obj["kind"]

    @property
    def name(self) -> str:
        return self.obj["metadata"]["name"]

    @property
    def namespace(self) -> Optional[str]:
        return self.obj["metadata"].get("namespace")

    def key(self) -> tuple[str, str, Optional[str], str]:
        return (self.obj["apiVersion"], self.kind, self.namespace, self.original_name)


# --- loading --------------------------------------------------------------------------

def _kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return directory / name
    raise RenderError(f"{directory}: no kustomization.yaml")


def _inside(directory: Path, path: Path) -> Path:
    """Resolve `path` and refuse files outside `directory` as kustomize does by default."""
    resolved = (directory / path).resolve()
    if directory.resolve() not in (resolved, *resolved.parents):
        raise RenderError(f"{resolved}: outside the kustomization root {directory} "
                          "(kustomize's load restrictor refuses it)")
    if not resolved.is_file():
        raise RenderError(f"{resolved}: no such file")
    return resolved


def _load_objects(path: Path) -> list[Resource]:
    resources = []
    for doc in yaml.safe_load_all(path.read_text()):
        if doc is None:
            continue
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= doc.keys():
            raise RenderError(f"{path}: a document lacks apiVersion, kind or metadata")
        if doc["kind"].endswith("List"):
            raise RenderError(f"{path}: List objects are not supported")
        if not doc["metadata"].get("name"):
            raise RenderError(f"{path}: a {doc['kind']} has no metadata.name")
        resources.append(Resource(doc))
    return resources


def _add(resources: list[Resource], new: Iterable[Resource], where: Path) -> None:
    seen = {r.key() for r in resources}
    for r in new:
        if r.key() in seen:
            raise RenderError(f"{where}: {r.kind} {r.original_name} is declared twice")
        seen.add(r.key())
        resources.append(r)


# --- configMapGenerator ---------------------------------------------------------------

def _env_file_pairs(path: Path) -> list[tuple[str, str]]:
    """Parse an env file the way kustomize does: verbatim values, `#` comment lines."""
    pairs = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.lstrip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            # kustomize would read the value from the build machine's environment, which
            # makes the output depend on who renders it; we refuse instead.
            raise RenderError(f"{path}:{number}: '{line}' has no '=' (values from the "
                              "environment are not supported)")
        key, value = line.split("=", 1)
        if not re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", key):
            raise RenderError(f"{path}:{number}: '{key}' is not a valid variable name")
        pairs.append((key, value))
    return pairs


def _literal_pair(literal: str, where: Path) -> tuple[str, str]:
    if "=" not in literal:
        raise RenderError(f"{where}: literal '{literal}' is not KEY=VALUE")
    key, value = literal.split("=", 1)
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]  # kustomize strips one pair of surrounding quotes
    return key, value


def _generate_configmap(directory: Path, spec: dict[str, Any],
                        defaults: dict[str, Any]) -> tuple[Resource, str]:
    unknown = set(spec) - SUPPORTED_GENERATOR_FIELDS
    if unknown:
        raise RenderError(f"{directory}: configMapGenerator fields {sorted(unknown)} "
                          "are not supported")
    options = {**defaults, **(spec.get("options") or {})}
    if set(options) - SUPPORTED_OPTIONS:
        raise RenderError(f"{directory}: generator options "
                          f"{sorted(set(options) - SUPPORTED_OPTIONS)} are not supported")
    data: dict[str, str] = {}
    for env in spec.get("envs") or []:
        data.update(_env_file_pairs(_inside(directory, Path(env))))
    for entry in spec.get("files") or []:
        key, _, path = entry.rpartition("=")
        file = _inside(directory, Path(path))
        try:
            data[key or file.name] = file.read_text()
        except UnicodeDecodeError:
            raise RenderError(f"{file}: binary files (binaryData) are not supported") from None
    for literal in spec.get("literals") or []:
        key, value = _literal_pair(literal, directory)
        data[key] = value
    metadata: dict[str, Any] = {"name": spec["name"]}
    if options.get("labels"):
        metadata["labels"] = dict(options["labels"])
    if options.get("annotations"):
        metadata["annotations"] = dict(options["annotations"])
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
    behavior = spec.get("behavior", "create")
    if behavior not in ("create", "merge", "replace"):
        raise RenderError(f"{directory}: unknown generator behavior '{behavior}'")
    resource = Resource(obj, needs_hash=not options.get("disableNameSuffixHash", False),
                        generated=True)
    return resource, behavior


def _apply_generator(resources: list[Resource], new: Resource, behavior: str,
                     directory: Path) -> None:
    matches = [r for r in resources if r.kind == "ConfigMap"
               and r.original_name == new.original_name]
    if behavior == "create":
        _add(resources, [new], directory)
        return
    if len(matches) != 1:
        raise RenderError(f"{directory}: behavior {behavior} needs exactly one ConfigMap "
                          f"'{new.original_name}' from the resources, found {len(matches)}")
    old = matches[0]
    if behavior == "merge":
        old.obj.setdefault("data", {}).update(new.obj["data"])
        for meta in ("labels", "annotations"):
            if meta in new.obj["metadata"]:
                old.obj["metadata"].setdefault(meta, {}).update(new.obj["metadata"][meta])
    else:  # replace
        old.obj["data"] = new.obj["data"]
        for meta in ("labels", "annotations"):
            if meta in new.obj["metadata"]:
                old.obj["metadata"][meta] = new.obj["metadata"][meta]
    old.needs_hash = old.needs_hash and new.needs_hash


# --- patches --------------------------------------------------------------------------

def _merge_key(field_name: str, items: list[Any]) -> Optional[str]:
    if field_name == "ports":
        dicts = [i for i in items if isinstance(i, dict)]
        if dicts and all("containerPort" in i for i in dicts):
            return "containerPort"
        if dicts and all("port" in i for i in dicts):
            return "port"
        return None
    return LIST_MERGE_KEYS.get(field_name)


def _check_no_directives(patch: Any, where: str) -> None:
    if isinstance(patch, dict):
        for key, value in patch.items():
            if isinstance(key, str) and key.startswith("$"):
                raise RenderError(f"{where}: patch directive '{key}' is not supported")
            _check_no_directives(value, where)
    elif isinstance(patch, list):
        for item in patch:
            _check_no_directives(item, where)


def strategic_merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Strategic-merge `patch` into a copy of `target` (see the module doc for the subset).

    Merged lists put the patch's items first, in patch order, followed by the target's
    items the patch did not name: the order kustomize produces.
    """
    result = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = strategic_merge(result[key], value)
        elif isinstance(value, list) and isinstance(result.get(key), list):
            merge_key = _merge_key(key, value + result[key])
            if merge_key is None:
                result[key] = copy.deepcopy(value)
                continue
            current = {item.get(merge_key): item for item in result[key]}
            merged = [strategic_merge(current[item[merge_key]], item)
                      if item.get(merge_key) in current else copy.deepcopy(item)
                      for item in value]
            named = {item.get(merge_key) for item in value}
            merged += [copy.deepcopy(item) for item in result[key]
                       if item.get(merge_key) not in named]
            result[key] = merged
        else:
            result[key] = copy.deepcopy(value)
    return result


def _parse_label_selector(selector: str) -> list[tuple[str, str, set[str]]]:
    """Parse `a=b,c in (d,e),!f` into (key, operator, values) requirements."""
    requirements = []
    for part in re.findall(r"(?:[^,(]|\([^)]*\))+", selector):
        part = part.strip()
        m = re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", part)
        if m:
            values = {v.strip() for v in m.group(3).split(",") if v.strip()}
            requirements.append((m.group(1), m.group(2), values))
            continue
        m = re.fullmatch(r"([\w./-]+)\s*(==|!=|=)\s*([\w./-]*)", part)
        if m:
            op = "!=" if m.group(2) == "!=" else "="
            requirements.append((m.group(1), op, {m.group(3)}))
            continue
        m = re.fullmatch(r"(!?)([\w./-]+)", part)
        if m:
            requirements.append((m.group(2), "!exists" if m.group(1) else "exists", set()))
            continue
        raise RenderError(f"label selector '{selector}': cannot parse '{part}'")
    return requirements


def _selects(labels: dict[str, str], requirements: list[tuple[str, str, set[str]]]) -> bool:
    for key, op, values in requirements:
        present = key in labels
        if op in ("=", "in") and not (present and labels[key] in values):
            return False
        if op in ("!=", "notin") and present and labels[key] in values:
            return False
        if op == "exists" and not present:
            return False
        if op == "!exists" and present:
            return False
    return True


def _matches_target(resource: Resource, target: dict[str, Any]) -> bool:
    group, _, version = resource.obj["apiVersion"].rpartition("/")
    if "kind" in target and target["kind"] != resource.kind:
        return False
    if "group" in target and target["group"] != group:
        return False
    if "version" in target and target["version"] != version:
        return False
    if "name" in target and not re.fullmatch(target["name"], resource.original_name):
        return False
    if "namespace" in target and target["namespace"] != (resource.namespace or ""):
        return False
    if "labelSelector" in target:
        labels = resource.obj["metadata"].get("labels") or {}
        if not _selects(labels, _parse_label_selector(target["labelSelector"])):
            return False
    return True


def _apply_patch(resources: list[Resource], entry: dict[str, Any], directory: Path) -> None:
    unknown = set(entry) - {"path", "patch", "target"}
    if unknown:
        raise RenderError(f"{directory}: patch fields {sorted(unknown)} are not supported")
    if ("path" in entry) == ("patch" in entry):
        raise RenderError(f"{directory}: a patch needs exactly one of path or patch")
    source = (_inside(directory, Path(entry["path"])).read_text() if "path" in entry
              else entry["patch"])
    where = f"{directory}/{entry.get('path', '<inline patch>')}"
    docs = [d for d in yaml.safe_load_all(source) if d is not None]
    if len(docs) != 1:
        raise RenderError(f"{where}: one patch document per entry is supported, found {len(docs)}")
    patch = docs[0]
    if isinstance(patch, list):
        raise RenderError(f"{where}: JSON 6902 patches are not supported")
    if not isinstance(patch, dict):
        raise RenderError(f"{where}: not a strategic-merge patch")
    _check_no_directives(patch, where)
    target = entry.get("target")
    if target is not None:
        if set(target) - SUPPORTED_TARGET_FIELDS:
            raise RenderError(f"{where}: target fields "
                              f"{sorted(set(target) - SUPPORTED_TARGET_FIELDS)} are not supported")
        chosen = [r for r in resources if _matches_target(r, target)]
    else:
        name = (patch.get("metadata") or {}).get("name")
        chosen = [r for r in resources if r.kind == patch.get("kind")
                  and r.original_name == name]
        if len(chosen) != 1:
            raise RenderError(f"{where}: patch for {patch.get('kind')} {name} matches "
                              f"{len(chosen)} resources, needs exactly one")
    if not chosen:
        raise RenderError(f"{where}: the patch's target matches no resource")
    for resource in chosen:
        body = copy.deepcopy(patch)
        # The target names the object; the patch's own identity must not rename it.
        body.pop("apiVersion", None)
        body.pop("kind", None)
        meta = body.get("metadata") or {}
        meta.pop("name", None)
        meta.pop("namespace", None)
        resource.obj = strategic_merge(resource.obj, body)


# --- images -----------------------------------------------------------------------------

def _split_image(image: str) -> tuple[str, str]:
    """`registry:5000/app:tag@sha256:...` -> ("registry:5000/app", ":tag@sha256:...")."""
    at = image.find("@")
    name, digest = (image[:at], image[at:]) if at >= 0 else (image, "")
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:  # a colon after the last slash starts the tag, not a registry port
        return name[:colon], name[colon:] + digest
    return name, digest


def _set_images(resources: list[Resource], images: list[dict[str, Any]], where: Path) -> None:
    for image in images:
        if set(image) - SUPPORTED_IMAGE_FIELDS or "name" not in image:
            raise RenderError(f"{where}: images entries take {sorted(SUPPORTED_IMAGE_FIELDS)}")
        for resource in resources:
            pod_spec = _pod_spec(resource.obj)
            if pod_spec is None:
                continue
            for group in ("containers", "initContainers"):
                for container in pod_spec.get(group) or []:
                    name, suffix = _split_image(container.get("image", ""))
                    if name != image["name"]:
                        continue
                    name = image.get("newName", name)
                    if "digest" in image:
                        suffix = "@" + image["digest"]
                    elif "newTag" in image:
                        suffix = ":" + str(image["newTag"])
                    container["image"] = name + suffix


# --- namespace, hashes, order ---------------------------------------------------------

def _set_namespace(resources: list[Resource], namespace: str) -> None:
    for resource in resources:
        if resource.kind == "Namespace":
            resource.obj["metadata"]["name"] = namespace
            resource.original_name = namespace
        elif resource.kind not in CLUSTER_SCOPED_KINDS:
            resource.obj["metadata"]["namespace"] = namespace


def _go_json(value: Any) -> str:
    """JSON as Go's encoding/json writes it: sorted keys, no spaces, HTML characters escaped."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    return text


def configmap_hash(obj: dict[str, Any]) -> str:
    """kustomize's name suffix for a ConfigMap.

    sha256 of {"data", "kind", "name"} as Go JSON, first 10 hex digits with 0, 1, 3, a, e
    swapped for letters (no accidental words or all-digit suffixes). kustomize 4 and 5 look
    the name up with a path their yaml library does not split, so the name they hash is
    always empty; we reproduce that, which the kubectl cross-check test confirms.
    """
    encoded: dict[str, Any] = {"kind": "ConfigMap", "name": "", "data": obj.get("data") or {}}
    if obj.get("binaryData"):
        encoded["binaryData"] = obj["binaryData"]
    digest = hashlib.sha256(_go_json(encoded).encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _pod_spec(obj: dict[str, Any]) -> Optional[dict[str, Any]]:
    path = POD_TEMPLATE_PATHS.get(obj["kind"])
    node: Any = obj
    for step in path or ():
        node = node.get(step) if isinstance(node, dict) else None
    return node if path and isinstance(node, dict) else None


def _rename_configmap_refs(pod_spec: dict[str, Any], renames: dict[str, str]) -> None:
    def fix(ref: Optional[dict[str, Any]]) -> None:
        if isinstance(ref, dict) and ref.get("name") in renames:
            ref["name"] = renames[ref["name"]]

    for group in ("containers", "initContainers", "ephemeralContainers"):
        for container in pod_spec.get(group) or []:
            for env_from in container.get("envFrom") or []:
                fix(env_from.get("configMapRef"))
            for env in container.get("env") or []:
                fix((env.get("valueFrom") or {}).get("configMapKeyRef"))
    for volume in pod_spec.get("volumes") or []:
        fix(volume.get("configMap"))
        for source in (volume.get("projected") or {}).get("sources") or []:
            fix(source.get("configMap"))


def _add_hashes(resources: list[Resource]) -> None:
    renames: dict[str, str] = {}
    for resource in resources:
        if resource.needs_hash:
            new_name = f"{resource.original_name}-{configmap_hash(resource.obj)}"
            resource.obj["metadata"]["name"] = new_name
            renames[resource.original_name] = new_name
    for resource in resources:
        pod_spec = _pod_spec(resource.obj)
        if pod_spec is not None:
            _rename_configmap_refs(pod_spec, renames)


def _order_key(resource: Resource) -> tuple[int, str, str, str]:
    """Kind rank, then group/version/kind, then namespace, then name (kustomize's legacy order)."""
    group, _, version = resource.obj["apiVersion"].rpartition("/")
    gvk = f"{resource.kind}.{version}.{group or '[noGrp]'}"
    if resource.kind in ORDER_FIRST:
        rank = ORDER_FIRST.index(resource.kind)
    elif resource.kind in ORDER_LAST:
        rank = len(ORDER_FIRST) + 1 + ORDER_LAST.index(resource.kind)
    else:
        rank = len(ORDER_FIRST)
    return (rank, gvk, resource.namespace or "", resource.name)


# --- build ----------------------------------------------------------------------------

def _accumulate(directory: Path, stack: tuple[Path, ...]) -> list[Resource]:
    directory = directory.resolve()
    if directory in stack:
        chain = " -> ".join(map(str, stack))
        raise RenderError(f"{directory}: kustomization cycle through {chain}")
    kfile = _kustomization_file(directory)
    kust = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(kust) - SUPPORTED_FIELDS
    if unknown:
        raise RenderError(f"{kfile}: fields {sorted(unknown)} are outside the subset "
                          "render.py implements (see its docstring)")
    if kust.get("kind", "Kustomization") != "Kustomization":
        raise RenderError(f"{kfile}: kind {kust['kind']} is not supported")

    resources: list[Resource] = []
    for entry in kust.get("resources") or []:
        path = (directory / entry)
        if path.is_dir():
            _add(resources, _accumulate(path, stack + (directory,)), kfile)
        else:
            _add(resources, _load_objects(_inside(directory, Path(entry))), kfile)

    defaults = kust.get("generatorOptions") or {}
    if set(defaults) - SUPPORTED_OPTIONS:
        raise RenderError(f"{kfile}: generatorOptions "
                          f"{sorted(set(defaults) - SUPPORTED_OPTIONS)} are not supported")
    for spec in kust.get("configMapGenerator") or []:
        generated, behavior = _generate_configmap(directory, spec, defaults)
        _apply_generator(resources, generated, behavior, directory)

    for entry in kust.get("patches") or []:
        _apply_patch(resources, entry, directory)

    if kust.get("namespace"):
        _set_namespace(resources, kust["namespace"])
    _set_images(resources, kust.get("images") or [], kfile)
    return resources


def build(directory: str | Path) -> list[dict[str, Any]]:
    """Render the kustomization in `directory` into a list of Kubernetes objects."""
    resources = _accumulate(Path(directory), ())
    _add_hashes(resources)
    resources.sort(key=_order_key)
    return [r.obj for r in resources]


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """Serialize objects as one multi-document YAML stream (what `kubectl apply -f -` reads)."""
    return yaml.safe_dump_all(objects, sort_keys=True, default_flow_style=False)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="a directory with a kustomization.yaml")
    parser.add_argument("-o", "--output", help="write here instead of stdout")
    args = parser.parse_args(argv)
    try:
        text = to_yaml(build(args.directory))
    except RenderError as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 1
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
