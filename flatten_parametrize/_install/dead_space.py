"""Dead space said when it happens: a submodule replaced after registration leaves its slots unused.

A submodule replaced or set to ``None`` after registration (a new classifier
head, a LoRA layer merged away by peft's ``merge_and_unload``, a quantized
module that holds buffers instead of parameters) leaves the slots of its
parameters in the flat buffer, where nothing reads them any more. torch calls
a global module-registration hook at every such assignment
(``register_module_module_registration_hook``): here it works out, before the
assignment lands, which slots the new tree will no longer serve, and warns once
per assignment with their names and bytes and how to reclaim them (the next
``flatten()`` lays the groups out again, ``rehost.py``; ``remove_flat_storage``). A swap that
re-hosts the same parameter objects (unflattened mode: torchao's QAT, float8
training) leaves nothing dead and says nothing. ``del module.child`` calls no
hook of torch's: the library's classes (of the registered module and of every
module with flattened attributes) say it at the deletion; a deletion from
another module (an ``nn.Sequential`` without parameters of its own, say) is
only marked by ``storage.summary()``, and reclaimed by the next ``flatten()``.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from .._core.caller import caller_level
from .._core.names import library_state
from .._core.records import Coordinator, Slot
from . import surgery
from .module_classes import delete_attribute
from .relayout import held_names

__all__ = ["delete_saying_dead_space", "install", "newly_dead"]

_installed: list[Any] = []


def install() -> None:
    """Register the global module-registration hook (once)."""
    if not _installed:
        _installed.append(nn.modules.module.register_module_module_registration_hook(_on_module_set))


def delete_saying_dead_space(self: nn.Module, name: str) -> None:
    """The injected classes' ``__delattr__`` (listed in ``injected.py``).

    ``del module.child`` on a module the library changed is said as an
    assignment of ``None``; then :func:`.module_classes.delete_attribute`.
    """
    if name in self.__dict__.get("_modules", ()):
        _on_module_set(self, name, None)
    delete_attribute(self, name)


def _on_module_set(parent: nn.Module, name: str, new: nn.Module | None) -> None:
    old = parent._modules.get(name) if "_modules" in parent.__dict__ else None
    if old is None or old is new:
        return
    storages: dict[int, Any] = {}
    for module in old.modules():
        state = library_state(module)
        if state is not None and getattr(state.storage, "is_attached", False):
            storages[id(state.storage)] = state.storage
    for storage in storages.values():
        try:
            dead = newly_dead(storage, parent, name, new)
        except Exception:  # never in the way of the assignment
            continue
        if dead:
            warnings.warn(_message(storage, dead), UserWarning, stacklevel=caller_level())


def newly_dead(
    storage: Coordinator, parent: nn.Module, name: str, new: nn.Module | None
) -> list[tuple[Slot, str]]:
    """Return the slots (with a name) that ``parent.<name> = new`` leaves unserved, before it lands."""
    root = storage.module
    modules = dict(root.named_modules(remove_duplicate=False))
    prefixes = [f"{path}.{name}" if path else name for path, module in modules.items() if module is parent]
    if not prefixes:
        return []
    after = {
        path: module
        for path, module in modules.items()
        if not any(path == p or path.startswith(p + ".") for p in prefixes)
    }
    if new is not None:
        for prefix in prefixes:
            for sub, module in new.named_modules(remove_duplicate=False):
                after[f"{prefix}.{sub}" if sub else prefix] = module
    held = held_names(after)
    dead = []
    for slot in storage.slots():
        names = surgery.live_names(storage, slot, modules)
        if not any(n == p or n.startswith(p + ".") for n in names for p in prefixes):
            continue  # not served from under the replaced module
        if surgery.live_names(storage, slot, after) or id(slot.param) in held:
            continue
        dead.append((slot, names[0]))
    return dead


def _message(storage: Coordinator, dead: list[tuple[Slot, str]]) -> str:
    groups = storage.groups()
    nbytes = 0
    listed = []
    for slot, name in dead:
        group = groups[slot.group_index]
        numel = group.layout.numels[slot.index]
        nbytes += numel * group.flat.element_size()
        listed.append(f"{name} ({numel:,} elements, group '{group.name}')")
    head = (
        f"a submodule replaced after registration leaves {len(dead)} slot(s) of the flat storage unused: "
        f"{', '.join(listed)}; {nbytes:,} bytes of dead space in the flat buffer"
    )
    if not storage.is_flattened:
        return (
            f"{head}, until the next call on the storage (or flatten()) lays the groups out again without it"
        )
    return (
        f"{head} (storage.summary() marks it). Reclaim it with `storage.unflatten(); storage.flatten()` "
        "(the groups are laid out again, the flat parameters kept) or remove_flat_storage(model)"
    )
