"""Deep copy of a flattened model: ``copy.deepcopy(model)`` gives an independent flattened model.

The injected classes' ``__deepcopy__`` (:func:`deepcopy_module`) copies the module as
torch would, then gives the copy a class of its own (changing one copy's class
never changes the other's). For the registered module, a new
:class:`~.coordinator.StorageCore` is put into the memo before the module's
``__dict__`` is copied, so that every reference to the core (the module's own,
each changed submodule's ``ModuleState``) lands on the copy; it is filled
afterwards from the copied flat parameters, views and states, and each feature
decides what its copy keeps (``Feature.copy_for``). A submodule copied on its
own is a standalone plain module (``pickling.copy_alone``).
"""

from __future__ import annotations

import copy
import copyreg
from typing import Any

import torch
from torch import nn

from .._core.names import MODULE_STATE_ATTR, UNFLATTENED, base_of, registered_storage
from .._core.records import ModuleState, Slot
from .._core.transaction import atomically
from . import surgery
from .coordinator import StorageCore
from .module_classes import clone_class, is_shared
from .pickling import copy_alone

__all__ = ["deepcopy_module"]


def deepcopy_module(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """The injected classes' ``__deepcopy__`` (listed in ``injected.py``)."""
    found = memo.get(id(self))
    if found is not None:
        return found
    state: ModuleState | None = self.__dict__.get(MODULE_STATE_ATTR)
    core: StorageCore | None = registered_storage(self)
    new_core: StorageCore | None = None
    if state is not None:
        state.storage.sync_writes()  # a `.data` write not landed yet lives in a cached view only
        root = state.storage.module_unchecked
        if root is not self and id(root) not in memo:
            return copy_alone(self, memo)  # copied on its own: a standalone plain module
    if core is not None and id(core) not in memo:
        new_core = memo[id(core)] = StorageCore.__new__(StorageCore)
    base_copy = getattr(base_of(self), "__deepcopy__", None)
    if base_copy is not None:
        replica = base_copy(self, memo)
    else:
        replica = self.__new__(type(self))
        memo[id(self)] = replica
        replica.__dict__ = copy.deepcopy(self.__dict__, memo)
        for slot in copyreg._slotnames(type(self)):  # type: ignore[attr-defined]
            if hasattr(self, slot):
                setattr(replica, slot, copy.deepcopy(getattr(self, slot), memo))
    # The copy gets a class of its own, so that changing one never changes the other (a shared
    # class holds only methods: the copy keeps it, and stays of the original's class).
    if not is_shared(type(self)):
        replica.__class__ = clone_class(type(self))
    if new_core is not None:
        assert core is not None
        _fill(new_core, core, replica, memo)
    return replica


def _fill(new: StorageCore, old: StorageCore, root: nn.Module, memo: dict[int, Any]) -> None:
    """Make ``new`` (referenced by the copied tree already) the core of ``root``, a copy of ``old``'s."""
    slots = [
        Slot(
            s.name,
            s.aliases,
            s.group_index,
            s.index,
            memo[id(s.param)] if id(s.param) in memo else _placeholder(s.param),
        )
        for s in old.slots()
    ]
    groups = old.groups()
    flats = [copy.deepcopy(group.flat, memo) for group in groups]
    views = [copy.deepcopy(group.views, memo) for group in groups]  # the copied states' own
    names, layouts = [g.name for g in groups], [g.layout for g in groups]
    StorageCore.__init__(new, root, names, flats, layouts, slots, views=views, flattened=old.is_flattened)
    owners = []
    for module, state in old.members():
        if id(module) in memo:
            state_copy = copy.deepcopy(state, memo)
            if (
                state_copy.injected is not None
                and state_copy.injected is state.injected
                and not is_shared(state.injected)
            ):
                state_copy.injected = clone_class(state.injected)  # never share a class with the original
            if module in UNFLATTENED:
                UNFLATTENED[memo[id(module)]] = state_copy
            owners.append((memo[id(module)], state_copy))
    new.adopt_members(owners)
    if not new.is_flattened:
        # The copied leaves alias the copy's flat buffers (the same values: the originals aliased
        # theirs) and keep their gradients in the copy's flat gradients.
        surgery.refresh_originals(new.groups(), new.slots())
        atomically(new.per_tensor.attach)
    new.features = [c for f in old.features if (c := f.copy_for(new, memo)) is not None]
    new.per_tensor.update_hooks()  # per-tensor mode's forward hooks, for the features copied


def _placeholder(param: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=param.dtype, device=param.device), param.requires_grad)
