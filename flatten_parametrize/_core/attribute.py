"""The property that serves each flattened attribute (``layer.weight``) of a module the library changed.

In flat mode it returns the slot's view from the group's cache
(``view_cache.py``); a parameter that outside code put into ``_parameters``
under the attribute's name is landed in the slot first (``writes.py``).
Assigning anything but the slot's own view raises, since a parametrization
would drop it silently.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.jit import _trace as _jit_trace

from .names import MODULE_STATE_ATTR
from .view_cache import same_memory
from .writes import served_parameter

__all__ = ["make_property"]

_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_is_grad_enabled = torch.is_grad_enabled


def _assignment_error(module: nn.Module, name: str) -> RuntimeError:
    return RuntimeError(
        f"cannot assign to {type(module).__name__}.{name}: it is a view of a flat "
        f"storage and assigning a new tensor would be lost. To write values use "
        f"`with torch.no_grad(): module.{name}.copy_(value)`; to run with other weights "
        f"use storage.using(...), storage.unflattened(), or functional_call with the "
        f"flat parameter's name (flat_param_<group>)"
    )


def make_property(name: str) -> property:
    """Return the class property that serves attribute ``name`` of a flattened module.

    In unflattened mode the attribute is a real parameter in ``_parameters``
    and is returned as is; in flat mode it is the slot's view.
    """

    def fget(module: nn.Module) -> Tensor:
        attrs = module.__dict__
        state = attrs[MODULE_STATE_ATTR]
        params = attrs["_parameters"]
        if name in params:  # unflattened mode, or a parameter put there around the view
            return served_parameter(module, state, name, params[name])
        group, index = state.slots[name]
        # The cache hit of GroupViews.view, inlined (one Python call less per read); every
        # other case (tracers, a first read, another grad mode, stale views) goes there.
        if _jit_trace._trace_module_map is None and not _is_dynamo_compiling():
            flat = group.params[group.flat_name]
            entry = group._tls.current
            if (
                entry is not None
                and entry.flat is flat
                # A FlatParameter's views, not frozen or unfrozen since (see CacheEntry.trusted).
                and entry.trusted
                # A source's views: fresh, and read inside the registered module's forward
                # (outside it the source is shown the view, see GroupViews.view).
                and (entry.version < 0 or (entry.version == flat._version and group.forward_depth))
            ):
                view = entry.views[index]
                if entry.grad:
                    if _is_grad_enabled() and view.grad_fn is entry.node:
                        return view
                elif view is not None and not _is_grad_enabled():
                    return view
        return group.view(index)

    def fset(module: nn.Module, value: Any) -> None:
        group, index = module.__dict__[MODULE_STATE_ATTR].slots[name]
        if isinstance(value, Tensor) and same_memory(value, group.view(index)):
            return
        raise _assignment_error(module, name)

    def fdel(module: nn.Module) -> None:
        raise RuntimeError(
            f"cannot delete {type(module).__name__}.{name}: it is a view of a flat storage, whose "
            "layout keeps a slot for it. Delete it inside storage.unflattened() (flattening again "
            "then asks for a parameter of its shape), or call remove_flat_storage first"
        )

    return property(fget, fset, fdel, doc=f"View of '{name}' in the flat storage.")
