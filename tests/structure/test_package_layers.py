"""The package follows its layers: each subpackage imports only from the layers below it.

Read statically (every import statement, function-level ones too), so a lazy import
cannot hide an upward edge. The layers, bottom up (docs/architecture.md, "Layers"):
base (errors, metrics) -> transfer -> kv -> handoff (the prefill/decode hand-off both
engines share) and model -> workers; registry sits on base
alone; integrations (kvxfer inside other engines: the vLLM connector) sit on transfer, kv,
handoff and registry, beside workers, and only cluster and cli may import them; cluster
(developer tooling) and cli may use everything; the router uses only registry, the model's
tokenizer, the hand-off protocol, the prefix block hashes, metrics and errors. That page's
"may import" table states the same map, and a test holds the two equal.

Faults are injected from outside (handoff.push_hooks): no production module imports a test
helper or a fault module, or names a fault the drills make.

The hand-off's state machines are written once (kvxfer/handoff): the engines' adapters
(workers, integrations) define no enum of hand-off states and no transition table.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from support import push_faults, vllm_faults

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kvxfer"
ROUTER = REPO / "scheduler" / "kvxfer_router"
#: The page whose "Layers" section states, in its "may import" table, what ALLOWED holds.
ARCHITECTURE_DOC = REPO / "docs" / "architecture.md"

BASE = {"errors", "metrics", "_native"}
#: What each layer of kvxfer may import from kvxfer (besides itself).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "metrics": set(),
    "transfer": {"errors", "_native"},
    "kv": BASE | {"transfer"},
    "handoff": BASE | {"transfer", "kv"},
    "model": BASE | {"kv"},
    "registry": BASE,
    "workers": BASE | {"transfer", "kv", "handoff", "model", "registry"},
    "integrations": BASE | {"transfer", "kv", "handoff", "registry"},
    "cluster": BASE | {"transfer", "kv", "handoff", "model", "registry", "workers", "integrations"},
    "cli": BASE | {"transfer", "kv", "handoff", "model", "registry", "workers", "cluster", "integrations"},
    "__init__": BASE | {"transfer"},
}
ROUTER_ALLOWED = {"registry", "model.tokenizer", "kv.protocol", "kv.prefix_hash", "metrics", "errors"}
#: Modules that are HTTP-free by contract: services raise typed errors instead.
HTTP_FREE = ["workers/worker_core.py", "workers/rejection.py",
             *sorted(str(p.relative_to(PACKAGE)) for role in ("prefill", "decode")
                     for p in (PACKAGE / "workers" / role).glob("*.py") if p.name != "http.py")]
HTTP_PACKAGES = ("fastapi", "starlette", "uvicorn")
PRODUCTION = sorted([*PACKAGE.rglob("*.py"), *ROUTER.rglob("*.py")])
#: Top-level packages of the test tree (tests/ on sys.path makes `support` importable).
TEST_PACKAGES = ("tests", "support", "conftest")
#: prometheus_client's names that declare a metric: only kvxfer/metrics.py uses them.
METRIC_DECLARERS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
#: Every fault the tests and drills inject (the modules that make them list them).
FAULT_NAMES = (*push_faults.KINDS, *vllm_faults.KINDS)


def imported_modules(path: Path) -> list[str]:
    """Absolute module names imported anywhere in `path` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(REPO).with_suffix("")
    package_parts = list(rel.parts[:-1])
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.append(node.module)
                # `from kvxfer import engine` names a module in the alias
                names.extend(f"{node.module}.{a.name}" for a in node.names if node.module == "kvxfer")
    return names


def layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def kvxfer_layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kvxfer" or len(parts) < 2:
        return None
    return parts[1]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_imports_only_from_the_layers_below(path: Path) -> None:
    layer = layer_of(path)
    assert layer in ALLOWED, f"{path}: new top-level module or package {layer!r}: give it a layer here"
    upward = sorted(
        {m for m in imported_modules(path)
         if (target := kvxfer_layer(m)) is not None and target != layer and target not in ALLOWED[layer]}
    )
    assert not upward, f"kvxfer/{path.relative_to(PACKAGE)} ({layer}) imports from above its layer: {upward}"


@pytest.mark.parametrize("path", sorted(ROUTER.rglob("*.py")), ids=lambda p: p.name)
def test_the_router_uses_only_registry_tokenizer_metrics_and_errors(path: Path) -> None:
    used = {m.removeprefix("kvxfer.") for m in imported_modules(path) if m.startswith("kvxfer.")}
    bad = sorted(m for m in used if not any(m == a or m.startswith(a + ".") for a in ROUTER_ALLOWED))
    assert not bad, f"{path.name} imports {bad}: the router must not depend on the engine or the workers"


@pytest.mark.parametrize("rel", HTTP_FREE)
def test_worker_services_know_nothing_of_http(rel: str) -> None:
    http = sorted(m for m in imported_modules(PACKAGE / rel) if m.split(".")[0] in HTTP_PACKAGES)
    assert not http, f"kvxfer/{rel} imports {http}: HTTP belongs in the http modules"


def test_kv_and_model_form_no_cycle() -> None:
    kv_imports = {m for p in (PACKAGE / "kv").rglob("*.py") for m in imported_modules(p)}
    assert not any(m.startswith("kvxfer.model") for m in kv_imports), "kv imports the model: a cycle"


def declares_metrics(path: Path) -> bool:
    """Whether `path` uses one of prometheus_client's metric types or metric families."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "prometheus_client":
            if any(a.name in METRIC_DECLARERS or a.name.endswith("MetricFamily") for a in node.names):
                return True
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "prometheus_client" and node.attr in METRIC_DECLARERS:
            return True
    return False


def test_every_metric_is_declared_in_kvxfer_metrics() -> None:
    # One home for every kvxfer_* metric (docs/architecture.md, "Layers"): the dashboards,
    # alerts and tests read their names from one module.
    elsewhere = [str(p.relative_to(REPO)) for p in PRODUCTION if p != PACKAGE / "metrics.py" and declares_metrics(p)]
    assert not elsewhere, f"{elsewhere} declare metrics: declare them in kvxfer/metrics.py"

def documented_imports() -> dict[str, set[str]]:
    """The "may import" table of docs/architecture.md's "Layers" section: each layer (the
    backquoted names of a row's first cell; the router as `kvxfer_router`) -> the backquoted
    names of its second cell."""
    text = ARCHITECTURE_DOC.read_text()
    start = text.index("\n## Layers")
    section = text[start:text.index("\n## ", start + 1)]
    table: dict[str, set[str]] = {}
    in_table = False
    for line in section.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[:2] == ["layer", "may import"]:
            in_table = True
        elif in_table and set(cells[0]) - {"-"}:
            for layer in re.findall(r"`([^`]+)`", cells[0]):
                assert layer not in table, f"{ARCHITECTURE_DOC.name}: layer {layer!r} has two rows"
                table[layer] = set(re.findall(r"`([^`]+)`", cells[1]))
    return table


def test_the_architecture_docs_layer_table_is_the_map_this_module_enforces() -> None:
    documented = documented_imports()
    router = documented.pop("kvxfer_router", None)
    differ = {layer: (sorted(documented.get(layer, ())), sorted(ALLOWED.get(layer, ())))
              for layer in documented.keys() | ALLOWED.keys() if documented.get(layer) != ALLOWED.get(layer)}
    assert not differ, f"docs/architecture.md's 'may import' table differs from ALLOWED (doc, ALLOWED): {differ}"
    assert router == ROUTER_ALLOWED, f"the router's row of the table: {sorted(router or ())}, " \
                                     f"ROUTER_ALLOWED: {sorted(ROUTER_ALLOWED)}"


#: The engines' adapters: they drive the hand-off's state machines and keep none of their own.
HANDOFF_ADAPTERS = sorted([*(PACKAGE / "workers").rglob("*.py"), *(PACKAGE / "integrations").rglob("*.py")])
#: States only a hand-off state machine has (kvxfer.handoff's ReservationState and PushState,
#: and the names the engines' own copies used before there was one: FENCING, QUARANTINED).
HANDOFF_STATE_NAMES = frozenset({"RESERVED", "RECEIVING", "ADMITTED", "FENCED", "FENCING", "QUARANTINED", "FREE",
                                 "WAITING_FOR_RESERVATION", "PUSHING", "STOPPING"})


def handoff_state_machines(source: str) -> list[str]:
    """What in `source` looks like a hand-off state machine of its own: an Enum with a
    hand-off state among its members, or a transition table."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(base) for base in node.bases):
            members = {t.id for stmt in node.body if isinstance(stmt, ast.Assign)
                       for t in stmt.targets if isinstance(t, ast.Name)}
            if members & HANDOFF_STATE_NAMES:
                found.append(f"enum {node.name} ({', '.join(sorted(members & HANDOFF_STATE_NAMES))})")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.extend(f"transition table {t.id}" for t in targets
                         if isinstance(t, ast.Name) and "TRANSITION" in t.id.upper())
    return found


@pytest.mark.parametrize("path", HANDOFF_ADAPTERS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_engine_adapters_define_no_handoff_state_machine_of_their_own(path: Path) -> None:
    found = handoff_state_machines(path.read_text())
    assert not found, f"kvxfer/{path.relative_to(PACKAGE)} defines {found}: the hand-off's states and " \
                      "transitions live in kvxfer/handoff (reservation_state, push_state) only"


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: str(p.relative_to(REPO)))
def test_no_production_module_imports_a_test_helper_or_a_fault_module(path: Path) -> None:
    bad = sorted(m for m in imported_modules(path) if m.split(".")[0] not in sys.stdlib_module_names  # faulthandler
                 and (m.split(".")[0] in TEST_PACKAGES or any("fault" in part for part in m.split("."))))
    assert not bad, f"{path.relative_to(REPO)} imports {bad}: tests and drills inject their faults from outside"


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: str(p.relative_to(REPO)))
def test_no_production_module_names_a_fault(path: Path) -> None:
    text = path.read_text()
    named = sorted(name for name in FAULT_NAMES if name in text)
    assert not named, f"{path.relative_to(REPO)} names the faults {named}: a fault belongs in its test hooks"
