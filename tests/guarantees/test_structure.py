"""The package's structure, checked over every module of every sub-package.

- no import cycle between modules (type-only and function-local imports included);
- dependencies between sub-packages run one way (the layering in ``flatten_parametrize/__init__.py``);
  the core is the storage and nothing else: it names no outside library; only the package's front door
  imports the wing of outside code; mixed precision lives in one folder;
- no private name imported across sub-packages;
- features meet only on ``_core``'s seams: none imports another's modules, none imports a private name;
- no mixins, and no module but the coordinator's own reads its private attributes;
- only ``__init__.py`` files act when imported: no other module registers, installs or patches anything;
- the public surface of ``FlatStorage`` and ``ShardedOptimizer`` is exactly the product contract's;
- a group's gradient has one owner (``_core/grad/``, one room, made with the group): a tensor's
  ``.grad`` slot is written in at most two modules, torch's autograd-engine internals are named in
  one, and reading a flat parameter's ``.grad`` looks no group up;
- one meaning per name: no two modules share a file name, no two classes a name.

The checkers run on synthetic packages too (``test_the_checker_reports_every_kind_of_violation``,
``test_the_import_time_checker_reports_every_kind_of_action``), so these tests cannot pass by checking
nothing; and the package imported module by module in reverse order, its ``__init__`` files last, gives
the same injected classes and keeps its guarantees
(``test_the_injected_classes_and_guarantees_do_not_depend_on_the_import_order``).
"""

from __future__ import annotations

import ast
import copy
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import flatten_parametrize
from flatten_parametrize import ShardedOptimizer, get_flat_storage, register_flat_storage
from flatten_parametrize._core.features import Feature

from _helpers import core_of

PACKAGE = Path(flatten_parametrize.__file__).parent

#: Sub-package -> the sub-packages its modules may import ("top": the modules beside ``__init__.py``).
#: A module may always import from its own sub-package; "top" may import anything.
MAY_IMPORT: dict[str, set[str]] = {
    "_core": set(),
    "_state": {"_core"},
    "_guards": {"_core"},
    "_install": {"_core", "_state", "_guards"},
    "_distributed": {"_core", "_state"},
    "_features": {"_core"},
    "_inspect": {"_core"},
    # every wrapper of someone else's code: it reaches the others, only the front door reaches it
    "_outside": {"_core", "_state", "_guards", "_install", "_distributed", "_features"},
}

# ----------------------------------------------------------------------------------- the checker


@dataclass(frozen=True)
class Import:
    """One imported name: ``importer`` imports ``name`` (None: the module itself) from ``target``."""

    importer: str
    target: str
    name: str | None


def module_files(root: Path) -> dict[str, Path]:
    """Return dotted name (relative to the package, ``__init__`` for the package itself) -> file."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts) or "__init__"] = path
    return modules


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p) or "__init__"


def imports(root: Path) -> tuple[dict[str, Path], list[Import]]:
    """Every package import anywhere in every module (top level, functions, ``if TYPE_CHECKING:``)."""
    modules = module_files(root)
    found: list[Import] = []
    for module, path in modules.items():
        own = [] if module == "__init__" else module.split(".")
        package = own if path.name == "__init__.py" else own[:-1]  # what level 1 is relative to
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == root.name or alias.name.startswith(root.name + "."):
                        found.append(Import(module, _join(*alias.name.split(".")[1:]), None))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    assert node.level - 1 <= len(package), f"{module}: import above the package"
                    base = package[: len(package) - (node.level - 1)] + (node.module or "").split(".")
                elif node.module == root.name or (node.module or "").startswith(root.name + "."):
                    base = node.module.split(".")[1:]  # type: ignore[union-attr]
                else:
                    continue
                for alias in node.names:
                    submodule = _join(*base, alias.name)
                    if submodule in modules:  # from .._core import names: the module object
                        found.append(Import(module, submodule, None))
                    else:
                        found.append(Import(module, _join(*base), alias.name))
    return modules, found


def import_graph(modules: dict[str, Path], found: list[Import]) -> dict[str, set[str]]:
    """Return module -> the package modules it imports."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in found:
        graph[imp.importer].add(imp.target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of more than one module, or a self-import (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
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
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def sub_packages(modules: dict[str, Path]) -> set[str]:
    """The first-level folders that hold modules (with an ``__init__.py`` or not)."""
    return {
        name.split(".")[0]
        for name, path in modules.items()
        if name != "__init__" and ("." in name or path.name == "__init__.py")
    }


def _unit(module: str, packages: set[str]) -> str:
    """The sub-package a module belongs to, or "top" for the modules beside ``__init__.py``."""
    first = module.split(".")[0]
    return first if first in packages else "top"


def layering_violations(modules: dict[str, Path], found: list[Import]) -> list[str]:
    """Return ``importer -> imported`` for each import against ``MAY_IMPORT``."""
    packages = sub_packages(modules)
    bad = set()
    for imp in found:
        src, dst = _unit(imp.importer, packages), _unit(imp.target, packages)
        if src != "top" and src != dst and dst not in MAY_IMPORT.get(src, set()):
            bad.add(f"{imp.importer} -> {imp.target}")
    return sorted(bad)


def private_imports(modules: dict[str, Path], found: list[Import]) -> list[str]:
    """Return ``importer -> module._name`` for each private name imported from another sub-package."""
    packages = sub_packages(modules)
    return sorted(
        {
            f"{imp.importer} -> {imp.target}.{imp.name}"
            for imp in found
            if imp.name is not None
            and imp.name.startswith("_")
            and not (imp.name.startswith("__") and imp.name.endswith("__"))
            and _unit(imp.importer, packages) != _unit(imp.target, packages)
        }
    )


def feature_crossings(found: list[Import], features: dict[str, set[str]]) -> list[str]:
    """Return ``importer -> target`` for a feature importing another's module or any module's private name."""
    owner = {module: feature for feature, modules in features.items() for module in modules}
    bad = set()
    for imp in found:
        mine, theirs = owner.get(imp.importer), owner.get(imp.target)
        if mine is not None and theirs is not None and mine != theirs:
            bad.add(f"{imp.importer} -> {imp.target}")
        private = imp.name is not None and imp.name.startswith("_") and not imp.name.endswith("__")
        if mine is not None and private and imp.target != imp.importer:
            bad.add(f"{imp.importer} -> {imp.target}.{imp.name}")
    return sorted(bad)


#: A call of one of these (the called name, leading underscores dropped) registers, installs or patches.
REGISTERING = re.compile(
    r"(register|install|contribute|append|extend|insert|add|update|setdefault|patch|setattr|delattr"
    r"|when_imported)(_|$)"
)


def _called_name(func: ast.expr) -> str:
    """``f`` for ``f(...)``, ``a.b.f(...)`` and ``a.f(...)(...)``."""
    while isinstance(func, ast.Call):
        func = func.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _root_name(target: ast.expr) -> str | None:
    """``a`` for ``a.b[c].d``; ``None`` for a plain name (or anything not an attribute or item)."""
    if not isinstance(target, (ast.Attribute, ast.Subscript)):
        return None
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        target = target.value
    return target.id if isinstance(target, ast.Name) else None


def _import_time(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when a module is imported: the module's, those of its classes' bodies and of
    its ``if``/``try``/``with`` blocks and loops (not ``if __name__ == "__main__":``); a function's own
    statement stands for its decorators."""
    for stmt in body:
        if isinstance(stmt, ast.If) and "__main__" in ast.unparse(stmt.test):
            continue
        if isinstance(stmt, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            for field in ("body", "orelse", "finalbody"):
                yield from _import_time(getattr(stmt, field, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _import_time(handler.body)
        else:
            yield stmt
            if isinstance(stmt, ast.ClassDef):  # a class body runs at import
                yield from _import_time(stmt.body)


def import_time_actions(modules: dict[str, Path]) -> list[tuple[str, int, str]]:
    """Return ``(module, line, code)`` for each statement that acts when a module other than a package's
    ``__init__`` is imported (the rules: ``test_only_init_files_act_when_imported``)."""
    found = []
    for module, path in modules.items():
        if path.name == "__init__.py":
            continue
        statements = list(_import_time(ast.parse(path.read_text()).body))
        imported = {
            (alias.asname or alias.name).split(".")[0]
            for stmt in statements
            if isinstance(stmt, (ast.Import, ast.ImportFrom))
            for alias in stmt.names
        }
        for stmt in statements:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                run: list[ast.AST] = list(stmt.decorator_list)
                registering = any(REGISTERING.match(_called_name(d).lstrip("_")) for d in run)
            else:
                run = [stmt]
                targets = [
                    t
                    for node in ast.walk(stmt)
                    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                ]
                registering = (
                    isinstance(stmt, ast.Expr)
                    and isinstance(stmt.value, ast.Call)
                    and _root_name(stmt.value.func) != "__all__"
                ) or any(_root_name(t) in imported for t in targets)
            calls = [
                n
                for expr in run
                for n in ast.walk(expr)
                if isinstance(n, ast.Call) and _root_name(n.func) != "__all__"  # building __all__
            ]
            if registering or any(REGISTERING.match(_called_name(c).lstrip("_")) for c in calls):
                found.append((module, stmt.lineno, ast.unparse(stmt).splitlines()[0]))
    return found


def private_reads(source: str, cls: str) -> list[str]:
    """Return each ``x._name`` in ``source`` where ``x`` holds a ``cls``.

    A name holds one where it is annotated with ``cls`` (argument or variable), checked with
    ``isinstance(x, cls)``, or is named ``opt``, ``optim`` or ``optimizer``.
    """
    tree = ast.parse(source)
    holders = {"opt", "optim", "optimizer"}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None and cls in ast.unparse(node.annotation):
            holders.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if cls in ast.unparse(node.annotation):
                holders.add(node.target.id)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
            if isinstance(node.args[0], ast.Name) and cls in ast.unparse(node.args[1]):
                holders.add(node.args[0].id)
    return sorted(
        {
            ast.unparse(node)
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in holders
            and node.attr.startswith("_")
            and not node.attr.endswith("__")
        }
    )


#: What writes a tensor's ``.grad`` slot: ``x.grad = ...`` (not ``self.grad``, an attribute of the
#: library's own objects), ``del x.grad``, ``setattr(x, "grad", ...)`` / ``tx.set_attr(x, "grad", ...)``
#: and torch's own descriptor, ``BASE_GRAD.__set__`` / ``__delete__``.
_SETTERS = {"setattr", "set_attr"}


def _writes_grad(node: ast.AST) -> bool:
    """Whether ``node`` writes the ``.grad`` of a tensor."""

    def grad_target(target: ast.expr) -> bool:
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(grad_target(t) for t in target.elts)
        return (
            isinstance(target, ast.Attribute)
            and target.attr == "grad"
            and not (isinstance(target.value, ast.Name) and target.value.id == "self")
        )

    if isinstance(node, ast.Assign):
        return any(grad_target(t) for t in node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, ast.Delete) else [node.target]
        return any(grad_target(t) for t in targets)
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in _SETTERS:
            named = node.args[1] if len(node.args) > 1 else None
            return isinstance(named, ast.Constant) and named.value == "grad"
        return (
            name in ("__set__", "__delete__")
            and isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "BASE_GRAD"
        )
    return False


def grad_writers(modules: dict[str, Path]) -> list[str]:
    """Return the modules that write a tensor's ``.grad`` slot."""
    return sorted(
        name
        for name, path in modules.items()
        if any(_writes_grad(node) for node in ast.walk(ast.parse(path.read_text())))
    )


#: torch's private autograd-engine entry points (attributes, or names given to ``getattr``).
ENGINE_INTERNALS = {
    "_current_graph_task_id",
    "_execution_engine",
    "_will_engine_execute_node",
    "_current_autograd_node",
    "_post_accumulate_grad_hooks",
}


def engine_users(modules: dict[str, Path]) -> dict[str, list[str]]:
    """Return each of torch's autograd-engine internals -> the modules that name it."""
    users: dict[str, set[str]] = {}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS | {"queue_callback"}:
                users.setdefault(node.attr, set()).add(name)
            elif isinstance(node, ast.Constant) and node.value in ENGINE_INTERNALS:
                users.setdefault(str(node.value), set()).add(name)
    return {internal: sorted(found) for internal, found in sorted(users.items())}


MODULES, IMPORTS = imports(PACKAGE)

#: The features composed on the coordinator, with the modules that only each of them uses. They reach the
#: coordinator and each other through ``_core``'s seams only (the feature lifecycle, the flat-gradient
#: hook, the sync claim, ``no_sync``) and share ``_distributed/process_group.py``'s check.
FEATURES = {
    "grad sync": {"_distributed.grad_sync"},
    "ShardedOptimizer": {
        "_distributed.sharded",
        "_distributed.sharded_state",
        "_distributed.sharded_args",
        "_distributed.sharded_collectives",
        "_distributed.sharded_feature",
        "_distributed.sharded_grads",
        "_distributed.sharded_local",
        "_distributed.sharded_partition",
        "_distributed.sharded_reducer",
        "_distributed.sharded_rules",
        "_distributed.sharded_strategies",
        "_distributed.sharded_plan",
        "_distributed.sharded_packing",
        "_distributed.sharded_staging",
        "_distributed.sharded_costs",
        "_distributed.shard",
    },
    "disk offload": {"_features.offload"},
    "ensembles": {"_features.functional"},
}

# ----------------------------------------------------------------------------------- the rules


def test_the_walk_finds_every_sub_package_and_module():
    """The checks see all six sub-packages, more than 40 modules, and every package import resolves."""
    assert sub_packages(MODULES) == set(MAY_IMPORT), sorted(sub_packages(MODULES))
    assert len(MODULES) > 40, sorted(MODULES)
    assert len(IMPORTS) > 100, len(IMPORTS)
    unresolved = sorted({f"{imp.importer} -> {imp.target}" for imp in IMPORTS if imp.target not in MODULES})
    assert unresolved == [], f"imports of no module the walk found: {unresolved}"


def test_the_package_has_no_import_cycle():
    """No module imports, even for type checking or inside a function, one that imports it back."""
    cycles = import_cycles(import_graph(MODULES, IMPORTS))
    assert cycles == [], f"import cycles: {cycles}"


#: Libraries the core never names: their wrappers live in ``_outside/``.
OUTSIDE_LIBRARIES = (
    "timm", "torchao", "lightning", "pytorch_lightning", "transformers", "peft", "accelerate", "deepspeed",
    "fairscale", "torchtune", "safetensors", "tensordict", "opacus",
)  # fmt: skip


def test_the_core_names_no_outside_library():
    """No module of ``_core`` imports an outside library or names one of its modules (``'timm.optim...'``)."""
    pattern = re.compile(rf"^({'|'.join(OUTSIDE_LIBRARIES)})(\.|$)")
    named = sorted(
        f"{name}:{node.lineno}"
        for name, path in MODULES.items()
        if name.startswith("_core.")
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Import) and any(pattern.match(a.name) for a in node.names))
        or (isinstance(node, ast.ImportFrom) and pattern.match(node.module or ""))
        or (isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value))
    )
    assert named == [], f"the core names outside libraries: {named}"


def test_only_the_front_door_imports_the_wing_of_outside_code():
    """``flatten_parametrize/__init__.py`` imports ``_outside``; no other module outside it does."""
    importers = sorted({imp.importer for imp in IMPORTS if imp.target.split(".")[0] == "_outside"})
    assert [i for i in importers if not i.startswith("_outside.")] == ["__init__"], importers


def test_mixed_precision_lives_in_one_folder():
    """Every module of the policy (the feature, its per-tensor views, the master leaf) is in its folder."""
    scattered = [
        name
        for name in MODULES
        if any(part in name for part in ("mixed_precision", "master_leaf"))
        and not name.startswith("_features.mixed_precision")
    ]
    assert scattered == [], scattered
    assert {"_features.mixed_precision.feature", "_features.mixed_precision.master_leaf"} <= set(MODULES)


def test_sub_packages_import_only_downwards():
    """Each sub-package imports only its own modules and the sub-packages below it (see ``__init__``)."""
    violations = layering_violations(MODULES, IMPORTS)
    assert violations == [], f"imports against the layering: {violations}"


def test_no_private_name_is_imported_across_sub_packages():
    """A ``_name`` is imported only within its sub-package (or among the top-level modules)."""
    offenders = private_imports(MODULES, IMPORTS)
    assert offenders == [], f"private names imported across sub-packages: {offenders}"


def test_features_meet_only_on_the_cores_seams():
    """No feature imports another feature's module, nor a private name of any module."""
    assert set().union(*FEATURES.values()) <= set(MODULES), sorted(
        set().union(*FEATURES.values()) - set(MODULES)
    )
    offenders = feature_crossings(IMPORTS, FEATURES)
    assert offenders == [], f"features reaching past the seams: {offenders}"


def hook_lookups(source: str, hooks: set[str]) -> list[str]:
    """Return each ``getattr`` / ``hasattr`` of ``source`` that looks one of ``hooks`` up by its name."""
    return [
        f"line {node.lineno}: {_called_name(node.func)}(..., {node.args[1].value!r})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and _called_name(node.func) in {"getattr", "hasattr"}
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in hooks
    ]


def test_the_features_hooks_are_declared_not_looked_up():
    """Every hook the core calls on a feature is a method of ``Feature``; none is found with ``getattr``.

    And every feature the package composes is a ``Feature`` (so it has each hook, by default or its own).
    """
    hooks = {name for name in vars(Feature) if not name.startswith("_")}
    assert {"on_rebacked", "holds_layout", "pickle_record", "before_forward"} <= hooks
    lookups = {
        name: found for name, path in MODULES.items() if (found := hook_lookups(path.read_text(), hooks))
    }
    assert lookups == {}, f"feature hooks looked up by name: {lookups}"
    features = [
        f"{name}.{node.name}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and any(isinstance(f, ast.FunctionDef) and f.name == "copy_for" for f in node.body)
        and node.name != "Feature"
    ]
    # grad sync, the optimizer's shards, offload, ensembles, mixed precision
    assert len(features) == 5, features
    for qualified in features:
        module, cls = qualified.rsplit(".", 1)
        found = getattr(importlib.import_module(f"flatten_parametrize.{module}"), cls)
        assert issubclass(found, Feature), qualified


def test_the_hook_lookup_checker_finds_getattr_and_hasattr():
    """The checker above finds both forms, and leaves other names and computed names alone."""
    source = (
        "def f(x, n):\n"
        "    getattr(x, 'refresh', None)\n"
        "    hasattr(x, 'after_forward')\n"
        "    getattr(x, 'other', None)\n"
        "    getattr(x, n)\n"
    )
    assert hook_lookups(source, {"refresh", "after_forward"}) == [
        "line 2: getattr(..., 'refresh')",
        "line 3: hasattr(..., 'after_forward')",
    ]


def test_the_package_has_no_mixin_classes():
    """Features are objects the coordinator holds, not base classes of it."""
    mixins = [
        f"{name}.{node.name}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin")
    ]
    assert mixins == [], f"mixin classes: {mixins}"
    assert flatten_parametrize.FlatStorage.__bases__ == (object,)


def test_no_module_reads_private_attributes_of_the_coordinator():
    """Other modules use the coordinator's read API (groups(), slots()), not its private attributes."""
    pattern = re.compile(r"\b(storage|self\._storage|state\.storage|core|self\._core)\._[a-z]\w*")
    # The coordinator core moves from the facade's module to _install/coordinator.py; whichever holds it
    # may read its own attributes, and the facade (_storage.py) reads only its one private one, _core.
    owner = next(n for n in ("_install.coordinator", "_storage") if n in MODULES)
    reads = [
        f"{name}: {match.group(0)}"
        for name, path in MODULES.items()
        if name != owner
        for match in pattern.finditer(path.read_text())
        if not (name == "_storage" and match.group(0).endswith("._core"))
    ]
    assert reads == [], f"private reads of the coordinator: {reads}"


#: Import-time calls outside ``__init__.py`` files that the rule below lets stand: ``(module, code)`` -> why.
IMPORT_TIME_ALLOWED = {
    ("_core.view_cache", "never_compiled(trace_split)"): "marks its own function, as a decorator would",
    ("_core.view_cache", "never_compiled(end_trace_split)"): "marks its own function, as a decorator would",
}


def test_only_init_files_act_when_imported():
    """No module but a package's ``__init__.py`` acts when imported; each ``__init__`` wires its package.

    The rule, for every statement that runs at import (a module's top level, class bodies, decorators,
    ``if``/``try``/``with`` blocks; not ``if __name__ == "__main__":``): no bare call statement, whose
    only use is what it does (building ``__all__`` aside); no call of a registering name (``register``,
    ``install``, ``contribute``, ``append``, ``add``, ``update``, ``patch``, ``setattr``, ``when_imported``
    ..., see ``REGISTERING``), even as an assigned value or a decorator; no assignment to an attribute
    or an item of an imported name (``other.TABLE[name] = f``). Definitions (``TypeVar``,
    ``re.compile``, ``logging.getLogger``, a ``WeakKeyDictionary``) are fine. So what a module does
    when imported never depends on which modules were imported before it: the injected classes' methods
    are listed in ``_install/injected.py`` and assembled by ``_install/__init__.py``.
    """
    actions = [
        f"{module}:{line}: {code}"
        for module, line, code in import_time_actions(MODULES)
        if (module, code) not in IMPORT_TIME_ALLOWED
    ]
    assert actions == [], f"modules that act when imported (move the call into an __init__.py): {actions}"


def test_no_module_reads_private_attributes_of_the_sharded_optimizer():
    """Only ``_distributed/sharded.py`` reads ``ShardedOptimizer``'s private attributes; others use seams."""
    reads = [
        f"{name}: {read}"
        for name, path in MODULES.items()
        if name != "_distributed.sharded"
        for read in private_reads(path.read_text(), "ShardedOptimizer")
    ]
    assert reads == [], f"private reads of ShardedOptimizer: {reads}"


#: The ownership rules of ``ShardedOptimizer`` (``_distributed/sharded_strategies.py``): the one module that
#: names them. Every other module works from what a strategy says (its groups, ranges and pieces).
RULES = {"Slices", "WholeTensors"}


def test_only_the_strategies_module_names_an_ownership_rule():
    """``sharded.py`` and the shard, step, state, collective and DCP modules branch on no rule."""
    named = sorted(
        f"{name}: {node.id}"
        for name, path in MODULES.items()
        if name.startswith("_distributed.") and name != "_distributed.sharded_strategies"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Name) and node.id in RULES
    )
    assert named == [], f"ownership rules named outside sharded_strategies.py: {named}"
    # the constructor's flag goes to the strategy and nowhere else
    sharded = ast.parse(MODULES["_distributed.sharded"].read_text())
    uses = [node for node in ast.walk(sharded) if isinstance(node, ast.Name) and node.id == "whole_tensors"]
    assert len(uses) == 1, [node.lineno for node in uses]


#: Each concern of ``ShardedOptimizer`` and the one module that owns it: no parallel twin per rule.
CONCERNS = {
    "Shard": "_distributed.shard",
    "Partition": "_distributed.sharded_partition",
    "LocalStep": "_distributed.sharded_local",
    "InnerOptimizers": "_distributed.sharded_local",
    "gathered_state_dict": "_distributed.sharded_state",
    "load_gathered": "_distributed.sharded_state",
    "local_state_dict": "_distributed.sharded_state",
    "load_local_parts": "_distributed.sharded_state",
    "state_by_name": "_outside.dcp_sharded",
    "state_for": "_outside.dcp_sharded",
    "Collectives": "_distributed.sharded_collectives",
}


def test_each_concern_of_the_sharded_optimizer_has_one_owner():
    """One shard type, one local step, one state conversion, one DCP conversion for every ownership rule."""
    defined: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                defined.setdefault(node.name, []).append(name)
    assert {concern: defined.get(concern) for concern in CONCERNS} == {
        concern: [module] for concern, module in CONCERNS.items()
    }
    twins = sorted(
        f"{name}.{node.name}"
        for name, path in MODULES.items()
        if name.startswith("_distributed.")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef) and any(node.name != c and node.name.endswith(c) for c in CONCERNS)
    )
    assert twins == [], f"classes that twin a concern: {twins}"
    assert not [name for name in MODULES if "whole" in name], "a module per ownership rule"


def test_a_tensors_grad_slot_is_written_in_at_most_two_modules():
    """Only the gradient owner (``_core/grad/owner.py``) and per-tensor mode's ``leaf_slots.py`` write it."""
    writers = grad_writers(MODULES)
    assert len(writers) <= 2 and set(writers) <= {"_core.grad.owner", "_core.grad.leaf_slots"}, writers


def test_the_gradient_owner_is_one_room():
    """``_core/grad/`` holds the owner, per-tensor mode's leaves, the split node and the engine helpers.

    Per-tensor mode's leaves are reached through their owner: no module outside the room imports them.
    """
    room = sorted(name for name in MODULES if name.startswith("_core.grad."))
    assert room == ["_core.grad.engine", "_core.grad.leaf_slots", "_core.grad.owner", "_core.grad.split_node"]
    outside = sorted(
        f"{found.importer} -> {found.target}"
        for found in IMPORTS
        if found.target == "_core.grad.leaf_slots" and not found.importer.startswith("_core.grad")
    )
    assert outside == [], outside


def test_each_group_owns_its_gradient():
    """The coordinator makes each group's ``GroupGrad`` and hands it to the group's view cache.

    The view cache builds every flat gradient in the group's owner and never makes one; a deep copy's
    group owns a new one (its views and its record share it).
    """
    assert "GroupGrad(" not in (PACKAGE / "_core" / "view_cache.py").read_text()
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    storage = register_flat_storage(model)
    clone = copy.deepcopy(model)
    groups = [core_of(storage).groups()[0], core_of(get_flat_storage(clone)).groups()[0]]
    assert all(g.grads is g.views.grads for g in groups)
    assert groups[0].grads is not groups[1].grads


def test_no_two_classes_share_a_name():
    """One meaning per name: a class that other modules may import is defined once in the package."""
    defined: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                defined.setdefault(node.name, []).append(name)
    assert {cls: found for cls, found in defined.items() if len(found) > 1} == {}


def test_no_two_modules_share_a_name():
    """One meaning per name: each module's file name is the package's only one (``__init__`` aside)."""
    stems: dict[str, list[str]] = {}
    for name in MODULES:
        stems.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    assert {stem: found for stem, found in stems.items() if len(found) > 1} == {}


def test_torchs_autograd_engine_internals_are_named_in_one_module():
    """``queue_callback``, the graph task id & co. are reached through ``_core/grad/engine.py`` only."""
    users = engine_users(MODULES)
    assert set(users) >= {"_current_graph_task_id", "_execution_engine", "queue_callback"}, users
    assert {module for found in users.values() for module in found} == {"_core.grad.engine"}, users


@pytest.mark.parametrize("per_tensor", [False, True])
def test_reading_a_flat_gradient_looks_no_group_up(per_tensor, monkeypatch):
    """``flat_param.grad`` goes straight to its group's gradient owner: no scan of the storage's groups."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    storage = register_flat_storage(model, [[model[0]], [model[1]]])
    if per_tensor:
        storage.unflatten()
    model(torch.randn(2, 3)).sum().backward()
    flats = list(storage.flat_params)
    core = core_of(storage)
    looked_up = []
    monkeypatch.setattr(core, "groups", lambda: looked_up.append(1) or ())
    monkeypatch.setattr(core, "slots", lambda: looked_up.append(1) or ())
    grads = [flat.grad for flat in flats]
    assert len(grads) == 2 and all(grad is not None for grad in grads)
    assert looked_up == []


# The product contract's "Public surface": a new public name is a deliberate edit of these lists
# (and of the contract), never a side effect.
FLAT_STORAGE_PUBLIC = {
    "module", "flat_params", "group_names", "param_infos", "is_flattened", "mixed_precision",
    "named_views", "named_grads", "views_of", "flatten", "unflatten", "unflattened", "using",
    "flat_state_dict", "summary", "plot_layout", "attach_optimizer", "all_reduce_grads",
    "broadcast_params", "enable_grad_sync", "disable_grad_sync", "no_sync", "is_offloaded",
    "offload_files", "offload_to_disk", "load_to_memory", "stack", "call_stacked",
}  # fmt: skip
SHARDED_OPTIMIZER_PUBLIC = {"no_sync", "clip_grad_norm_", "sharded_state_dict", "load_sharded_state_dict",
                            "local_optimizer"}  # fmt: skip


def _public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def test_flat_storage_has_exactly_the_contracts_public_names():
    """``dir(storage)`` shows exactly the contract's public names."""
    model = nn.Linear(2, 2)
    public = _public(register_flat_storage(model))
    extra, missing = sorted(public - FLAT_STORAGE_PUBLIC), sorted(FLAT_STORAGE_PUBLIC - public)
    assert extra == [] and missing == [], f"extra: {extra}; missing: {missing}"


def test_sharded_optimizer_adds_exactly_the_contracts_public_names(world1):
    """``dir(opt)`` shows ``torch.optim.Optimizer``'s public names plus exactly the contract's."""
    base = _public(torch.optim.Optimizer([torch.zeros(1, requires_grad=True)], {}))
    model = nn.Linear(2, 2)
    opt = ShardedOptimizer(register_flat_storage(model), torch.optim.SGD, lr=0.1)
    public = _public(opt) - base
    extra, missing = sorted(public - SHARDED_OPTIMIZER_PUBLIC), sorted(SHARDED_OPTIMIZER_PUBLIC - public)
    assert extra == [] and missing == [], f"extra: {extra}; missing: {missing}"


# ----------------------------------------------------------------------------------- the checker checked

FAKE = {
    "__init__.py": "from ._core.a import A\n",
    "_top.py": "import fakepkg._core.x\nfrom ._install.b import _helper, helper as _fine\n",
    "_core/__init__.py": "",
    "_core/a.py": "from .._install import b\nA = 1\n",  # _core may import nothing
    "_core/x.py": "def f():\n    from . import y\n",  # x -> y inside a function ...
    "_core/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import f\n",  # ... y -> x
    "_install/__init__.py": "",
    "_install/b.py": "from .._core.x import _private\nfrom .. import _core\n_helper = helper = 1\n",
    "_state/__init__.py": "",
    "_state/nested/__init__.py": "",
    "_state/nested/deep.py": "from ..._core.y import public\nfrom ... import _top\nfrom .. import nested\n",
}


def test_the_checker_reports_every_kind_of_violation(tmp_path):
    """On a synthetic package the checker resolves every import form and reports each planted violation."""
    for relative, text in FAKE.items():
        (tmp_path / "fakepkg" / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fakepkg" / relative).write_text(text)
    modules, found = imports(tmp_path / "fakepkg")
    assert sub_packages(modules) == {"_core", "_install", "_state"}
    assert import_graph(modules, found) == {
        "__init__": {"_core.a"},
        "_top": {"_core.x", "_install.b"},
        "_core": set(),
        "_core.a": {"_install.b"},
        "_core.x": {"_core.y"},
        "_core.y": {"_core.x"},
        "_install": set(),
        "_install.b": {"_core.x", "_core"},
        "_state": set(),
        "_state.nested": set(),
        "_state.nested.deep": {"_core.y", "_top", "_state.nested"},
    }
    assert import_cycles(import_graph(modules, found)) == [["_core.x", "_core.y"]]
    assert layering_violations(modules, found) == ["_core.a -> _install.b", "_state.nested.deep -> _top"]
    assert private_imports(modules, found) == ["_install.b -> _core.x._private", "_top -> _install.b._helper"]
    features = {"b": {"_install.b"}, "x": {"_core.x"}, "deep": {"_state.nested.deep"}}
    assert feature_crossings(found, features) == ["_install.b -> _core.x", "_install.b -> _core.x._private"]


ACTING = {
    "__init__.py": "from . import b\nb.install()\n",  # an __init__ may act
    "a.py": (
        "import re\n"
        "from typing import TypeVar\n"
        "from . import b\n"
        "T = TypeVar('T')\n"  # a definition
        "PATTERN = re.compile('x')\n"  # a definition
        "__all__ = ['f']\n"
        "__all__.append('g')\n"  # building __all__
        "b.TABLE['f'] = print\n"  # an item of an imported name
        "b.install()\n"  # a bare call
        "HANDLE = b.register_hook(print)\n"  # a registering call, assigned
        "try:\n"
        "    import c\n"
        "except ImportError:\n"
        "    c = None\n"
        "else:\n"
        "    c.value = 1\n"  # an attribute of an imported name, in a try's else
        "@b.contribute('f')\n"  # a registering decorator (said at the def's line)
        "def f():\n"
        "    b.install()\n"  # runs when called, not at import
        "class K:\n"
        "    b.ITEMS.append(1)\n"  # a class body runs at import
        "    f.attr = 1\n"  # an attribute of this module's own function
        "if __name__ == '__main__':\n"
        "    f()\n"
    ),
    "b.py": "TABLE = {}\nITEMS = []\ndef install(): pass\ndef register_hook(f): return f\n"
    "def contribute(name): return lambda f: f\n",
}


def test_the_import_time_checker_reports_every_kind_of_action(tmp_path):
    """On a synthetic package the import-time checker reports each planted action, and only those."""
    for relative, text in ACTING.items():
        (tmp_path / "actpkg" / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "actpkg" / relative).write_text(text)
    assert import_time_actions(module_files(tmp_path / "actpkg")) == [
        ("a", 8, "b.TABLE['f'] = print"),
        ("a", 9, "b.install()"),
        ("a", 10, "HANDLE = b.register_hook(print)"),
        ("a", 16, "c.value = 1"),
        ("a", 18, "@b.contribute('f')"),
        ("a", 21, "b.ITEMS.append(1)"),
    ]


@pytest.mark.slow
def test_the_injected_classes_and_guarantees_do_not_depend_on_the_import_order(tmp_path):
    """The package imported module by module in reverse order, ``__init__`` files last (a fresh interpreter),
    gives its injected classes the same methods as ``import flatten_parametrize`` and keeps its pickling,
    copying, assignment, dead-space and relayout guarantees."""
    repo = Path(__file__).parents[2]
    guarantees = [
        "tests/guarantees/test_serialization.py",
        "tests/guarantees/test_errors_assignment.py",
        "tests/unit/install/test_dead_space.py",
        "tests/unit/install/test_rehost.py",
        "tests/unit/install/test_relayout.py::test_get_parameter_gives_the_view_that_the_attribute_serves",
        "tests/unit/install/test_relayout.py::test_assigning_another_slots_view_ties_as_the_plain_model",
    ]
    path = [str(PACKAGE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    found = {}
    for order, args in (("normal", []), ("reversed", ["-q", "-p", "no:cacheprovider", *guarantees])):
        out = tmp_path / f"{order}.json"
        run = subprocess.run(
            [sys.executable, str(repo / "tests" / "_import_order.py"), order, str(out), *args],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, f"{order} order:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
        assert order == "normal" or " passed" in run.stdout, run.stdout[-4000:]  # the guarantees ran
        found[order] = json.loads(out.read_text())
    assert found["reversed"] == found["normal"]
    assert found["normal"]["a module with a model operation"]["resize_token_embeddings"].endswith(
        "relayout.resize_token_embeddings"
    )
    assert "resize_token_embeddings" not in found["normal"]["a module with slots"]


def test_the_private_read_checker_finds_every_holder():
    """Annotated, ``isinstance``-checked and conventionally named holders are found; dunders, others not."""
    source = (
        "def f(a: ShardedOptimizer, b: 'ShardedOptimizer | None', c, opt, other):\n"
        "    if isinstance(c, ShardedOptimizer):\n"
        "        c._x\n"
        "    d: ShardedOptimizer = a\n"
        "    return a._world, b._pg, opt._shards, d._y, other._fine, a.public, a.__class__\n"
    )
    assert private_reads(source, "ShardedOptimizer") == ["a._world", "b._pg", "c._x", "d._y", "opt._shards"]


GRAD_WRITES = {
    "assign.py": "def f(p):\n    p.grad = None\n",
    "tuple.py": "def f(p, q):\n    p.grad, q.x = 1, 2\n",
    "augment.py": "def f(p):\n    p.grad += 1\n",
    "delete.py": "def f(p):\n    del p.grad\n",
    "setattr.py": "def f(p):\n    setattr(p, 'grad', None)\n",
    "undoable.py": "def f(tx, p):\n    tx.set_attr(p, 'grad', None)\n",
    "descriptor.py": "def f(p):\n    BASE_GRAD.__set__(p, None)\n",
    "clean.py": "class A:\n    def f(self, p):\n        self.grad = p.grad\n        setattr(p, 'data', 1)\n",
    "engine.py": "import torch\nq = torch.autograd.Variable._execution_engine.queue_callback\n",
    "lookup.py": "import torch\nf = getattr(torch._C, '_current_autograd_node', None)\n",
}


def test_the_gradient_checks_find_every_form(tmp_path):
    """On synthetic modules the ``.grad`` write and engine checks find each planted form, and only those."""
    for relative, text in GRAD_WRITES.items():
        (tmp_path / relative).write_text(text)
    modules = module_files(tmp_path)
    planted = ["assign", "augment", "delete", "descriptor", "setattr", "tuple", "undoable"]
    assert grad_writers(modules) == planted
    assert engine_users(modules) == {
        "_current_autograd_node": ["lookup"],
        "_execution_engine": ["engine"],
        "queue_callback": ["engine"],
    }
