"""Said once: user code asks a submodule for parameters that are slices (``parameters()`` &c.).

In flat mode the flattened attributes of a submodule are slices of the
registered module's flat parameters: ``model.fc1.parameters()`` yields none of
them, so ``model.fc1.requires_grad_(False)``, a clip over it or an optimizer
group built from it changes nothing. The injected class of every module with
flattened attributes wraps those three methods: a call made by user code on
such a submodule warns once per storage and method with the per-tensor recipe.

Nothing is said for the registered module itself (its walk yields the flat
parameters), in unflattened (per-tensor) mode (the attributes are the
submodule's own leaves there), or for calls made by the library, the standard
library or an installed package (torch, transformers, Lightning, accelerate,
DDP and FSDP2 walk submodules for their own bookkeeping);
``_core/caller.called_from_user_code`` tells them apart. What cannot be told:
a call on a module without flattened attributes of its own (an
``nn.Sequential`` or a block of layers: its class is not the library's), and
the parameters reached without a call (``module.weight``). A walk over every
module (``m.parameters(recurse=False)`` for each ``m``) is said too, although in
flat mode it yields the flat parameters: it cannot be told from one that picks
modules by type (``docs/per-tensor.md``, "Per-submodule code").
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

from .._core.caller import called_from_user_code
from .._core.names import MODULE_STATE_ATTR, base_of, registered_storage
from .._core.records import Coordinator, ModuleState

__all__ = ["named_parameters", "parameters", "requires_grad_"]

#: The methods already said, per storage.
_said: weakref.WeakKeyDictionary[Coordinator, set[str]] = weakref.WeakKeyDictionary()


def parameters(self: nn.Module, recurse: bool = True) -> Iterator[nn.Parameter]:
    """torch's ``parameters()``; said once when user code asks a submodule whose parameters are slices."""
    _say(self, "parameters")
    return base_of(self).parameters(self, recurse)  # type: ignore[attr-defined]


def named_parameters(self: nn.Module, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
    """torch's ``named_parameters()``; said as :func:`parameters`."""
    _say(self, "named_parameters")
    return base_of(self).named_parameters(self, *args, **kwargs)  # type: ignore[attr-defined]


def requires_grad_(self: nn.Module, requires_grad: bool = True) -> nn.Module:
    """torch's ``requires_grad_()``; said as :func:`parameters`."""
    _say(self, "requires_grad_")
    return base_of(self).requires_grad_(self, requires_grad)  # type: ignore[attr-defined]


def _say(module: nn.Module, method: str) -> None:
    state: ModuleState | None = module.__dict__.get(MODULE_STATE_ATTR)
    if state is None or not state.slots or registered_storage(module) is not None:
        return  # not changed, or the registered module: its walk yields the flat parameters
    core = state.storage
    if not core.is_flattened or not called_from_user_code(2):
        return
    said = _said.setdefault(core, set())
    if method in said:
        return
    said.add(method)
    warnings.warn(_message(core, module, method, sorted(state.slots)), UserWarning, stacklevel=3)


def _message(core: Coordinator, module: nn.Module, method: str, attributes: list[str]) -> str:
    name = next((n for n, m in core.module.named_modules(remove_duplicate=False) if m is module), "")
    reach = "sees" if method != "requires_grad_" else "reaches"
    return (
        f"a submodule's {method}() in flat mode {reach} none of its flattened parameters: "
        f"'{name}' ({type(module).__name__}: {', '.join(attributes)}) holds slices of the flat parameters "
        "of the registered module, so freezing it, clipping it or optimizer groups built from it change "
        "nothing there; for per-submodule tools train in per-tensor mode (storage.unflatten() before "
        "building the optimizer, or inside `with storage.unflattened():`), where each submodule owns its "
        "parameters as on the plain model; or name groups at registration and use storage[group]"
    )
