"""Keep the API reference complete and public: gaps become build warnings (errors under ``-W``).

* Every name of ``flatten_parametrize.__all__`` is documented as ``flatten_parametrize.<name>``,
  and so is every public (non-underscore) attribute that a public class defines itself
  (inherited ``torch.optim.Optimizer`` or ``nn.Parameter`` members are torch's to document).
* Every documented public object has a docstring.
* No documented object has a private path (``flatten_parametrize._core...``): a type hint
  naming a private module's class is linked to the public name instead.
"""

from __future__ import annotations

import inspect
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging

import flatten_parametrize

logger = logging.getLogger(__name__)
PACKAGE = "flatten_parametrize"


def _public_names() -> list[str]:
    return list(flatten_parametrize.__all__)


#: Public attributes that instances get in ``__init__`` (``vars(cls)`` cannot list them).
INSTANCE_ATTRIBUTES = {"ShardedOptimizer": ["local_optimizer"]}


def _required_objects() -> list[str]:
    """Every dotted name that the API reference must document."""
    required = [f"{PACKAGE}.{cls}.{attr}" for cls, attrs in INSTANCE_ATTRIBUTES.items() for attr in attrs]
    for name in _public_names():
        required.append(f"{PACKAGE}.{name}")
        obj = getattr(flatten_parametrize, name)
        if inspect.isclass(obj):
            required += [f"{PACKAGE}.{name}.{attr}" for attr in vars(obj) if not attr.startswith("_")]
    return required


def _is_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return any(part.startswith("_") and not (part.startswith("__") and part.endswith("__")) for part in parts)


def _public_target(target: str) -> str | None:
    """``flatten_parametrize._storage.FlatStorage.using`` -> ``flatten_parametrize.FlatStorage.using``."""
    parts = target.split(".")
    if parts[0] != PACKAGE or not _is_private(target):
        return None
    for index, part in enumerate(parts[1:], start=1):
        if part in _public_names():
            return ".".join([PACKAGE, *parts[index:]])
    return None


def _resolve_public(
    app: Sphinx, env: BuildEnvironment, node: Any, contnode: nodes.Element
) -> nodes.Element | None:
    """Link a reference to a private module's object to the object's public name."""
    if node.get("refdomain") != "py":
        return None
    public = _public_target(node["reftarget"])
    if public is None:
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], public, node, contnode)


def _check_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    if not name.startswith(PACKAGE + ".") or what == "module":
        return
    if not any(line.strip() for line in lines):
        logger.warning("public name without a docstring: %s", name, type="public_api", subtype="docstring")


def _check_coverage(app: Sphinx, env: BuildEnvironment) -> None:
    # Aliased entries are the ``:canonical:`` paths that autodoc records so that a reference to
    # a private module's object still resolves; they are not shown.
    objects = env.get_domain("py").objects
    documented = {name for name, entry in objects.items() if not entry.aliased}
    for dotted in _required_objects():
        if dotted not in documented:
            logger.warning(
                "public name missing from the API reference: %s (add it to a page in docs/api/)",
                dotted,
                type="public_api",
                subtype="coverage",
            )
    for dotted in sorted(documented):
        if _is_private(dotted):
            logger.warning(
                "private name in the API reference: %s (document the public name flatten_parametrize.<name>)",
                dotted,
                type="public_api",
                subtype="private",
            )


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", _resolve_public)
    app.connect("autodoc-process-docstring", _check_docstring)
    app.connect("env-check-consistency", _check_coverage)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
