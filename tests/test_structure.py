"""The package's structure: no import cycle (type-only and function-local imports included), no mixins,
no private reads of the coordinator from other modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import flatten_parametrize

PACKAGE = Path(flatten_parametrize.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text()) for path in sorted(PACKAGE.glob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """Return module -> package modules it imports anywhere (top level, functions, TYPE_CHECKING)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module is not None:
                    graph[name].add(node.module.split(".")[0])
                else:  # from . import _x
                    graph[name].update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flatten_parametrize."):
                graph[name].add(node.module.split(".")[1])  # type: ignore[union-attr]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("flatten_parametrize."):
                        graph[name].add(alias.name.split(".")[1])
        graph[name] &= set(modules)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_package_has_no_import_cycle():
    """No module imports, even for type checking or inside a function, one that imports it back."""
    assert import_cycles(import_graph()) == []


def test_the_package_has_no_mixin_classes():
    """Features are objects the coordinator holds, not base classes of it."""
    mixins = [
        f"{name}.{node.name}"
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin")
    ]
    assert mixins == []
    assert flatten_parametrize.FlatStorage.__bases__ == (object,)


def test_no_module_reads_private_attributes_of_the_coordinator():
    """Other modules use the coordinator's read API (groups(), slots()), not its private attributes."""
    pattern = re.compile(r"\b(storage|self\._storage|state\.storage)\._[a-z]\w*")
    reads = [
        f"{path.name}: {match.group(0)}"
        for path in sorted(PACKAGE.glob("*.py"))
        if path.name != "_storage.py"
        for match in pattern.finditer(path.read_text())
    ]
    assert reads == []
