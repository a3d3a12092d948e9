"""Every public function and method says what it takes, what it returns and shows a run example.

The API reference (``docs/api/``) is generated from these docstrings (Google style): each
argument under ``Args:``, what comes back under ``Returns:`` (``Yields:`` for a context
manager that hands something out), and a ``>>>`` example, which ``--doctest-modules`` runs.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import flatten_parametrize

#: Public names whose docstrings are not held to these rules, and why.
EXEMPT = {
    # torch's own methods, overridden to keep the layout: torch documents them.
    "FlatParameter.detach": "torch.Tensor.detach",
    "FlatParameter.requires_grad_": "torch.Tensor.requires_grad_",
    # Classes users get from the library and never construct (the API reference shows no constructor).
    "FlatStorage": "returned by register_flat_storage",
    "OptimizerAttachment": "returned by FlatStorage.attach_optimizer",
    # A record: its fields are documented under Attributes.
    "ParamInfo": "a dataclass of documented attributes",
}
SECTION = re.compile(r"^(Args|Keyword args|Returns|Yields|Raises|Example|Examples):\s*$")
NOTHING = {"None", "Iterator[None]", inspect.Signature.empty}


def _public_callables() -> Iterator[tuple[str, Callable[..., Any]]]:
    for name in flatten_parametrize.__all__:
        obj = getattr(flatten_parametrize, name)
        yield name, obj
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(value):
                    yield f"{name}.{attr}", getattr(obj, attr)


def _sections(doc: str) -> dict[str, str]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in doc.splitlines():
        match = SECTION.match(line.strip())
        if match and not line.startswith(" "):
            current = match.group(1)
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return {key: "\n".join(lines) for key, lines in sections.items()}


CALLABLES = [(name, obj) for name, obj in _public_callables() if name not in EXEMPT]


@pytest.mark.parametrize(("name", "obj"), CALLABLES, ids=[name for name, _ in CALLABLES])
def test_public_docstring_names_every_argument_the_result_and_has_an_example(
    name: str, obj: Callable[..., Any]
) -> None:
    """Args names every parameter, Returns (or Yields) is there when something comes back, and >>> runs."""
    doc = inspect.getdoc(obj) or ""
    sections = _sections(doc)
    signature = inspect.signature(obj)
    documented = sections.get("Args", "") + "\n" + sections.get("Keyword args", "")
    missing = [
        parameter.name
        for parameter in signature.parameters.values()
        if parameter.name not in ("self", "cls")
        and not re.search(rf"^\s*\**{parameter.name}\b[^:\n]*:", documented, re.M)
    ]
    assert not missing, f"{name}: Args does not describe {missing}"
    returns = signature.return_annotation
    if inspect.isclass(obj) or returns in NOTHING:
        return_ok = True
    else:
        return_ok = "Returns" in sections or "Yields" in sections
    assert return_ok, f"{name}: returns {returns} but has no Returns/Yields section"
    assert ">>>" in doc, f"{name}: no runnable example (>>>)"


def test_the_rules_see_the_public_surface() -> None:
    """The walk reaches the entry points and the methods of the classes users hold (so it can fail)."""
    names = {name for name, _ in CALLABLES}
    assert {"register_flat_storage", "FlatStorage.named_grads", "ShardedOptimizer.no_sync"} <= names
    assert len(names) > 35
