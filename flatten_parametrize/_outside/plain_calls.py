"""Run a call of outside code that changes a model's modules on the plain model: inside ``unflattened()``.

Outside code that takes a weight off its module and puts it (or new ones) back
under other names or in new modules (torchao's module swaps, torch's
hook-based reparametrizations) needs the model's weights to be ``nn.Parameter``
objects in the modules' ``_parameters``. In flat mode they are views of the flat
buffers. :func:`on_plain_model` wraps such an entry point: called on a module
that holds a flattened storage in flat mode (registered on it, on a module
inside it, or wrapping it), it runs inside ``storage.unflattened()``, where
the model is a plain one; when the block ends the groups are laid out as the
model now is (``_install/rehost.py``, ``_install/relayout.py``). While a
feature holds the layout (``features.refuse_held_layout``: disk offload, a
``ShardedOptimizer``, live ensemble stacks) the call is refused before the
model changes; mixed precision and gradient sync follow the new layout. A call
nested in a wrapped one runs as is.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from contextlib import ExitStack
from types import ModuleType
from typing import Any, Callable

from torch import nn

from .._core import outside_call
from .._core.features import refuse_held_layout
from .._core.names import library_state, registered_storage
from .on_import import is_ours, wrapper_of

__all__ = ["Methods", "flat_storages_in", "on_plain_model", "wrap_methods"]

#: module -> ``(class or "" for the module itself, function, the entry point as users call it)`` of each
#: function to run on the plain model.
Methods = Mapping[str, tuple[tuple[str, str, str], ...]]

#: The start of the dead-space warning of ``_install/dead_space.py``.
_DEAD_SPACE = "a submodule replaced after registration leaves"


def flat_storages_in(model: Any) -> list[Any]:
    """Return the storages in flat mode that hold parameters of ``model`` (registered, wrapping or inner)."""
    if not isinstance(model, nn.Module):
        return []
    found: dict[int, Any] = {}
    for module in model.modules():
        state = library_state(module)
        for core in (registered_storage(module), None if state is None else state.storage):
            if core is not None and core.is_flattened:
                found[id(core)] = core
    return list(found.values())


def on_plain_model(
    original: Callable[..., Any],
    model_at: int,
    what: str,
    check: Callable[..., None] | None = None,
) -> Callable[..., Any]:
    """Wrap ``original``, whose argument ``model_at`` is the module it changes, to run on the plain model.

    Args:
        original: the outside entry point.
        model_at: the position of the module among its arguments (else its ``model`` or ``module``
            keyword).
        what: the entry point as the user calls it, for the refusal of a held layout.
        check: called with the call's arguments first, on a model in flat mode; it raises for a call
            that the plain model would refuse too, before anything changes.

    Returns:
        The wrapper, with the original's name, docstring and signature (``on_import.wrapper_of``).
    """

    def on_the_plain_model(*args: Any, **kwargs: Any) -> Any:
        model = args[model_at] if len(args) > model_at else kwargs.get("model", kwargs.get("module"))
        storages = [] if outside_call.depth() else flat_storages_in(model)
        if storages and check is not None:
            check(*args, **kwargs)
        for storage in storages:  # before the call changes anything (flatten() would refuse after it)
            refuse_held_layout(storage, what)
        with outside_call.running(what), ExitStack() as stack:
            for storage in storages:
                stack.enter_context(storage.unflattened())
            if storages:  # what a swap leaves dead is reclaimed when the block ends
                stack.enter_context(warnings.catch_warnings())
                warnings.filterwarnings("ignore", message=_DEAD_SPACE)
            return original(*args, **kwargs)

    return wrapper_of(original, on_the_plain_model)


def wrap_methods(
    module: ModuleType, methods: Methods, checks: Mapping[str, Callable[..., None]] | None = None
) -> None:
    """Wrap ``module``'s functions listed in ``methods`` with :func:`on_plain_model`, once.

    A static or class method stays one; the model is the first argument after ``cls`` or ``self``
    (the first of a static method or a module's function).

    Args:
        module: the outside module, just imported.
        methods: the functions to wrap, by module name.
        checks: function name -> the ``check`` of :func:`on_plain_model` for it.
    """
    for cls_name, name, what in methods.get(module.__name__, ()):
        owner: Any = getattr(module, cls_name, None) if cls_name else module
        raw: Any = None if owner is None else vars(owner).get(name)
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        function = raw.__func__ if kind is not None else raw
        if not callable(function) or is_ours(function):
            continue
        model_at = 0 if kind is staticmethod or not cls_name else 1  # after ``cls`` or ``self``
        wrapped = on_plain_model(function, model_at, what, (checks or {}).get(name))
        setattr(owner, name, kind(wrapped) if kind is not None else wrapped)
