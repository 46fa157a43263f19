"""The package's import graph has no circles: every ``import``/``from ... import`` of a package module
counts, the ones inside functions and under ``TYPE_CHECKING`` too (a lazy import only hides a circle).
And every entry point ``pyproject.toml`` declares names a module and attribute that exist."""

import ast
import importlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

PACKAGE = Path(__file__).resolve().parents[1] / "sglang_wgkv"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from pkg import name`` counts as ``pkg.name`` where
    that is a module, else as ``pkg``)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_package_has_no_import_circles():
    graph = import_graph()
    assert "sglang_wgkv.memory.extend_step" in graph["sglang_wgkv.memory.dual_pool"]
    assert circles(graph) == []


def test_entry_points_resolve():
    """SGLang loads these by name in every process: a moved module must take its entry point along."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    targets = [value for group in project["entry-points"].values() for value in group.values()]
    assert targets
    for target in targets:
        module, attr = target.split(":")
        assert callable(getattr(importlib.import_module(module), attr)), target
