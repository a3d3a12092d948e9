"""Names in one place: what the library adds to modules and state dicts, and how it shows dtypes and ties."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

#: Attribute (in ``module.__dict__``) of the module that owns a storage.
STORAGE_ATTR = "_flat_storage"
#: Attribute (in ``module.__dict__``) of every module the library changed.
MODULE_STATE_ATTR = "_flat_parametrize"
#: Prefix of the flat parameters registered on the module.
FLAT_PARAM_PREFIX = "flat_param_"
#: Prefix of the layout records in a flat state dict.
FLAT_LAYOUT_PREFIX = "flat_layout_"


def flat_param_name(group: str) -> str:
    """Return the attribute name of ``group``'s flat parameter."""
    return FLAT_PARAM_PREFIX + group


def flat_layout_name(group: str) -> str:
    """Return the state-dict key of ``group``'s layout record."""
    return FLAT_LAYOUT_PREFIX + group


#: The library's state of modules that unflattened mode made plain (original class, no state in
#: ``__dict__``). Only ``register_flat_storage`` reads it (:func:`library_state`), to refuse a new
#: storage over parameters that an unflattened storage still owns: a submodule cannot tell which
#: storage of an enclosing module owns it otherwise. A storage finds the state of its own members
#: in its own records (``FlatStorage.state_of``); nothing on a hot path consults this registry.
UNFLATTENED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def library_state(module: nn.Module) -> Any:
    """Return the library's state of ``module`` (a ``ModuleState``) in either mode, or ``None``.

    For the registration check; a storage asks ``FlatStorage.state_of`` instead.
    """
    state = module.__dict__.get(MODULE_STATE_ATTR)
    return state if state is not None else UNFLATTENED.get(module)


def registered_storage(module: nn.Module) -> Any:
    """Return the flat storage registered on ``module`` (the coordinator), or ``None``."""
    return module.__dict__.get(STORAGE_ATTR)


def core_behind(storage: Any, what: str) -> Any:
    """Return the coordinator core behind ``storage``, a public ``FlatStorage`` (or the core itself).

    The core is found through the storage's public ``module``: the module holds it.

    Raises:
        TypeError: if ``storage`` is not a ``FlatStorage``.
        RuntimeError: if it is detached (its module was removed or collected).
    """
    module = getattr(storage, "module", None) if not isinstance(storage, nn.Module) else None
    core = registered_storage(module) if isinstance(module, nn.Module) else None
    if core is None or (core is not storage and core.facade is not storage):
        raise TypeError(
            f"{what} needs a FlatStorage; got {type(storage).__name__}; pass the result of "
            "register_flat_storage(model)"
        )
    return core


def dtype_name(dtype: torch.dtype) -> str:
    """Return the short name of ``dtype``, e.g. ``'float32'``."""
    return str(dtype).replace("torch.", "")


def alias_label(name: str, aliases: tuple[str, ...]) -> str:
    """Return ``name`` followed by the other names of a tied parameter, for tables and plots."""
    return name + (f" (= {', '.join(aliases)})" if aliases else "")


#: The attribute that marks the class the library injects (``_install/module_classes.py``).
CLASS_MARKER = "_flat_parametrize_class"


def base_of(module: nn.Module) -> type:
    """Return the class just above the library's injected class in ``module``'s MRO."""
    mro = type(module).__mro__
    for i, klass in enumerate(mro):
        if klass.__dict__.get(CLASS_MARKER, False):
            return mro[i + 1]
    return type(module)
