"""The router's modules form no import cycle: each can be read knowing only the ones below it.

Read statically (every import statement, lazy and TYPE_CHECKING ones too), so an import
moved into a function to dodge a circular import at run time is still an edge here. An
edge is a module of ``kvxfer_router`` naming another one; ``from . import x`` names ``x``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROUTER = REPO / "scheduler" / "kvxfer_router"
PACKAGE = "kvxfer_router"


def router_imports(path: Path, modules: set[str]) -> set[str]:
    """The router modules (names without the package) that the module at ``path`` imports."""
    tree = ast.parse(path.read_text(), str(path))
    named: list[str] = []  # dotted names relative to the package
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.extend(a.name.removeprefix(PACKAGE + ".") for a in node.names if a.name.startswith(PACKAGE + "."))
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            # from .x import y names x; from . import x, y names x and y
            named.extend([node.module] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGE):
            module = node.module.removeprefix(PACKAGE).removeprefix(".")  # type: ignore[union-attr]
            named.extend([module] if module else [a.name for a in node.names])
    return {name.split(".")[0] for name in named if name.split(".")[0] in modules} - {path.stem}


def import_graph() -> dict[str, set[str]]:
    """Each router module (``__init__`` aside: it only re-exports) and the router modules it imports."""
    paths = {p.stem: p for p in ROUTER.glob("*.py") if p.stem != "__init__"}
    modules = set(paths)
    return {name: router_imports(path, modules) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the modules along it (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_the_reader_sees_edges_of_every_import_form() -> None:
    # The checker itself: top-level, lazy, TYPE_CHECKING and `from . import` edges all count.
    graph = import_graph()
    assert "settings" in graph["dispatch"]
    assert "app" in graph["cli"]  # imported inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_router_modules_import_each_other_without_a_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle in kvxfer_router: {' -> '.join(cycle or [])}"
