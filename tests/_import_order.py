"""Import ``flatten_parametrize`` in a given order in a fresh interpreter, then describe its injected classes.

Run by ``tests/guarantees/test_structure.py``:
``python tests/_import_order.py ORDER OUT [PYTEST ARGS...]``, where ORDER is

- ``normal``: ``import flatten_parametrize``, as users do;
- ``reversed``: every package (the top one and each sub-package) is put in
  ``sys.modules`` without running its ``__init__.py``, every other module is
  imported in reverse name order (``_storage`` ... ``_install.relayout``,
  ``_install.pickling`` ... ``_core.attribute``), and only then do the
  ``__init__.py`` files run, the sub-packages' first.

It writes to OUT (JSON) the attributes of the classes injected into a few
models (:func:`injected_attributes`), then runs pytest with the remaining
arguments, if any, and exits with pytest's status.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = "flatten_parametrize"


def import_reversed() -> None:
    """Import every module of the package in reverse name order before any ``__init__.py`` runs."""
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.submodule_search_locations is not None
    root = Path(next(iter(spec.submodule_search_locations)))
    packages: list[tuple[Any, ModuleType]] = []
    for init in sorted(root.rglob("__init__.py")):
        folder = init.parent
        name = ".".join((PACKAGE, *folder.relative_to(root).parts))
        package_spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(folder)]
        )
        assert package_spec is not None and package_spec.loader is not None
        package = importlib.util.module_from_spec(package_spec)
        sys.modules[name] = package  # found by its modules' imports, not run yet
        packages.append((package_spec, package))
    modules = sorted(
        ".".join((PACKAGE, *path.relative_to(root).with_suffix("").parts))
        for path in root.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    )
    for name in reversed(modules):
        importlib.import_module(name)
    assert not hasattr(sys.modules[PACKAGE], "register_flat_storage"), "a package __init__ ran first"
    for package_spec, package in reversed(packages):  # the deepest first, the top package last
        package_spec.loader.exec_module(package)


def _describe(value: Any) -> str:
    if isinstance(value, property):
        return "property"
    if callable(value):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def injected_attributes() -> dict[str, dict[str, str]]:
    """Return, for a few registered models, their injected class's attributes (a function by its path)."""
    from torch import nn

    from flatten_parametrize import register_flat_storage

    class WithModelOperation(nn.Linear):
        def resize_token_embeddings(self, *args: Any) -> None:
            """A framework's model operation: the injected class wraps it (only where the class has it)."""

    linear, container, with_operation = (
        nn.Linear(2, 2),
        nn.Sequential(nn.Linear(2, 2)),
        WithModelOperation(2, 2),
    )
    for model in (linear, container, with_operation):
        register_flat_storage(model)
    models = {
        "a module with slots": linear,
        "a container without slots": container,
        "its submodule": container[0],
        "a module with a model operation": with_operation,
    }
    skipped = ("__module__", "__qualname__", "__doc__")
    return {
        label: {name: _describe(value) for name, value in vars(type(model)).items() if name not in skipped}
        for label, model in models.items()
    }


def main(order: str, out: str, *pytest_args: str) -> int:
    if order == "reversed":
        import_reversed()
    else:
        assert order == "normal", order
        importlib.import_module(PACKAGE)
    Path(out).write_text(json.dumps(injected_attributes(), indent=1, sort_keys=True))
    if not pytest_args:
        return 0
    import pytest

    return int(pytest.main(list(pytest_args)))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
