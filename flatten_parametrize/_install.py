"""Registration and removal: the changes ``register_flat_storage`` makes to a module, and their undoing.

Both run as one transaction (see ``_transaction.py``): if anything raises, the
module is exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ._classes import _METHODS, ModuleState, add_property, make_class
from ._names import MODULE_STATE_ATTR, STORAGE_ATTR
from ._storage import FlatStorage, _locate, _reorder, _Slot
from ._transaction import Transaction, atomically
from ._views import HiddenParametrizations, end_trace_split, register_view, trace_split

__all__ = ["install", "uninstall"]


def install(storage: FlatStorage) -> None:
    """Change the module: classes, parametrizations, flat parameters, hooks (atomically)."""
    root = storage.module_unchecked
    modules = dict(root.named_modules(remove_duplicate=False))
    owners: dict[int, nn.Module] = {id(root): root}
    for slot in storage._slots:
        for name in slot.all_names:
            owner, _ = _locate(modules, name)
            owners.setdefault(id(owner), owner)
    classes = {key: make_class(owner) for key, owner in owners.items()}
    grads = _gather_grads(storage)

    def change(tx: Transaction) -> None:
        for key, owner in owners.items():
            order = list(owner._parameters)
            tx.keep_dict(owner.__dict__)
            tx.keep_dict(owner._parameters)
            owner.__dict__[MODULE_STATE_ATTR] = ModuleState(storage, order, type(owner))
            tx.set_attr(owner, "__class__", classes[key])
        for slot in storage._slots:
            views = storage._views[slot.group]
            for name in slot.all_names:
                owner, attr = _locate(modules, name)
                state: ModuleState = owner.__dict__[MODULE_STATE_ATTR]
                if attr in state.slots:  # the same module reached under two paths
                    continue
                original = owner._parameters.pop(attr)
                assert original is not None
                register_view(owner, attr, views, slot.index, name, original, tx.on_undo)
                add_property(type(owner), attr)
                state.slots[attr] = (views, slot.index)
        for name, flat, grad in zip(storage._flat_names, storage._flat, grads):
            root.register_parameter(name, flat)
            flat.grad = grad
        for slot in storage._slots:
            tx.set_attr(slot.param, "grad", None)  # its gradient now lives in the flat gradient
        tx.keep_dict(root._forward_pre_hooks)
        tx.keep_dict(root._forward_hooks)
        hooks = [root.register_forward_pre_hook(trace_split).id]
        hooks.append(root.register_forward_hook(end_trace_split).id)
        tx.set_attr(storage, "_hooks", hooks)
        root.__dict__[STORAGE_ATTR] = storage
        storage._refresh_originals(tx)

    atomically(change)


def _gather_grads(storage: FlatStorage) -> list[Tensor | None]:
    """Return each group's flat gradient built from its members' current gradients."""
    grads: list[Tensor | None] = []
    with torch.no_grad():
        for group, (flat, views) in enumerate(zip(storage._flat, storage._views)):
            members = [slot for slot in storage._slots if slot.group == group]
            if all(slot.param.grad is None for slot in members):
                grads.append(None)
                continue
            grad = torch.zeros_like(flat, memory_format=torch.contiguous_format)
            targets = views.split(grad)
            for slot in members:
                if slot.param.grad is not None:
                    targets[slot.index].copy_(slot.param.grad)
            grads.append(grad)
    return grads


def uninstall(storage: FlatStorage) -> None:
    """Undo the registration: plain parameters with the current values (atomically)."""
    root = storage.module

    def change(tx: Transaction) -> None:
        storage._flatten(tx)
        modules = storage._modules()
        flats, splits = storage._flat, storage._views
        with torch.no_grad():
            values = [views.split(flat.detach()) for flat, views in zip(flats, splits)]
            grads = [None if f.grad is None else v.split(f.grad) for f, v in zip(flats, splits)]
            data = [values[s.group][s.index].clone() for s in storage._slots]
            grad = [None if (g := grads[s.group]) is None else g[s.index].clone() for s in storage._slots]
        for slot, value, slot_grad in zip(storage._slots, data, grad):
            tx.set_attr(slot.param, "data", value)
            tx.set_attr(slot.param, "requires_grad", flats[slot.group].requires_grad)
            tx.set_attr(slot.param, "grad", slot_grad)
        tx.keep_dict(root._parameters)
        for name in storage._flat_names:
            root._parameters.pop(name, None)
        for owner in {id(m): m for m in modules.values() if MODULE_STATE_ATTR in m.__dict__}.values():
            _restore_module(owner, storage._slots, modules, tx)
        tx.keep_dict(root._forward_pre_hooks)
        tx.keep_dict(root._forward_hooks)
        for hook_id in storage._hooks:
            root._forward_pre_hooks.pop(hook_id, None)
            root._forward_hooks.pop(hook_id, None)
        tx.set_attr(storage, "_hooks", [])
        tx.keep_dict(root.__dict__)
        root.__dict__.pop(STORAGE_ATTR, None)
        tx.set_attr(storage, "_flattened", False)

    atomically(change)
    storage._invalidate()
    storage._release_files()  # values are in RAM now: delete the offload files
    storage.disable_grad_sync()  # remove the grad-sync hooks


def _restore_module(
    owner: nn.Module, slots: Sequence[_Slot], modules: dict[str, nn.Module], tx: Transaction
) -> None:
    """Give ``owner`` back its parameters, its container of parametrizations and its class."""
    tx.keep_dict(owner.__dict__)
    tx.keep_dict(owner._parameters)
    tx.keep_dict(owner._modules)
    state: ModuleState = owner.__dict__.pop(MODULE_STATE_ATTR)
    container = owner.__dict__.get("parametrizations", owner._modules.get("parametrizations"))
    if container is not None:
        tx.keep_dict(container._modules)
        for attr in state.slots:
            container._modules.pop(attr, None)
    for slot in slots:
        for name in slot.all_names:
            found, attr = _locate(modules, name)
            if found is owner:
                owner._parameters[attr] = slot.param
    _reorder(owner._parameters, state.order)
    if isinstance(container, HiddenParametrizations):
        if len(container):
            # Another parametrization was registered after ours: keep its property.
            namespace = {
                k: v
                for k, v in type(owner).__dict__.items()
                if k not in ("__dict__", "__weakref__") and k not in state.slots and k not in _METHODS
            }
            tx.set_attr(owner, "__class__", type(state.prev_class.__name__, (state.prev_class,), namespace))
            return
        owner.__dict__.pop("parametrizations", None)
        owner._modules.pop("parametrizations", None)
    tx.set_attr(owner, "__class__", state.prev_class)
