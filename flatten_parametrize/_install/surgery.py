"""Module surgery: every change the library makes to a module tree, and its undoing.

Registration (:func:`install`) and removal (:func:`uninstall`), the two mode
switches (:func:`flatten_module`, :func:`unflatten_module`), pointing the
original parameter objects at their slots (:func:`refresh_originals`),
re-wrapping flat parameters that ``module.to()`` & co. replaced
(:func:`rewrap_flat_param`; another engine's tensor there is left to it, see
``_core/foreign.py``) and zeroing padding (:func:`zero_padding`). Each
takes a :class:`~._transaction.Transaction` where it can fail half-way, so
that the coordinator can run it all or nothing. The coordinator keeps its own
state (mode, group records); these functions see it through its read API.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._core.caller import caller_level
from .._core.fit import misfit
from .._core.flat_parameter import FlatParameter, as_flat_parameter, serve
from .._core.foreign import is_distributed, is_foreign, local_shard
from .._core.layout import GroupLayout
from .._core.names import MODULE_STATE_ATTR, STORAGE_ATTR, UNFLATTENED
from .._core.parametrize_interop import HiddenParametrizations, register_view
from .._core.records import Coordinator, Group, ModuleState, Slot
from .._core.transaction import Transaction
from .._core.view_cache import end_trace_split, same_memory, trace_split
from .module_classes import library_names, make_class

__all__ = [
    "flatten_module",
    "install",
    "invalidate",
    "live_names",
    "locate",
    "put_back",
    "refresh_originals",
    "rewrap_flat_param",
    "set_aside_replacements",
    "uninstall",
    "unflatten_module",
    "zero_padding",
]


def locate(modules: dict[str, nn.Module], qualified: str) -> tuple[nn.Module, str]:
    """Return the module that owns parameter ``qualified`` and the attribute name there."""
    path, _, attr = qualified.rpartition(".")
    return modules[path], attr


def live_names(storage: Coordinator, slot: Slot, modules: dict[str, nn.Module]) -> tuple[str, ...]:
    """Return the names by which the tree reaches ``slot`` now (none once its module was replaced or deleted).

    A name is live while the module at its path is one that ``storage`` changed
    and that serves the attribute from its slot; a module that serves it from
    another path (moved in the tree) gives its current names. A submodule
    replaced after registration (a new head) holds ordinary parameters; the
    slot it replaced is dead space in the flat buffer.
    """
    names = []
    for name in slot.all_names:
        path, _, attr = name.rpartition(".")
        owner = modules.get(path)
        state = None if owner is None else storage.state_of(owner)
        if state is not None and attr in state.slots:
            names.append(name)
    if names:
        return tuple(names)
    # No registered path leads to it: the module that serves it may have moved (peft's
    # merge_and_unload puts the wrapped layer where its adapter was). Its current names.
    views = storage.groups()[slot.group_index].views
    for path, owner in modules.items():
        state = storage.state_of(owner)
        if state is None:
            continue
        for attr, (group_views, index) in state.slots.items():
            if group_views is views and index == slot.index:
                names.append(f"{path}.{attr}" if path else attr)
    return tuple(names)


def _reorder(params: dict[str, Any], order: Sequence[str]) -> None:
    """Put the keys of ``params`` in ``order`` (unknown keys last), keeping the dict object."""
    items = dict(params)
    params.clear()
    for name in order:
        if name in items:
            params[name] = items.pop(name)
    params.update(items)


def _modules(root: nn.Module) -> dict[str, nn.Module]:
    return dict(root.named_modules(remove_duplicate=False))


def zero_padding(flat: Tensor, layout: GroupLayout) -> None:
    """Write zeros into the padding of ``flat`` (a tensor laid out by ``layout``), leaving the slots.

    A ``DTensor`` sharded along its only dimension (FSDP2's) gets zeros in the
    padding its local shard holds; any other tensor subclass is left alone.
    """
    if not layout.padding or flat.is_meta:
        return
    start = 0
    if type(flat) not in (Tensor, nn.Parameter, FlatParameter):
        local = local_shard(flat)
        if local is None:
            return
        flat, start = local
        if flat.is_meta:
            return
    end = start + flat.numel()
    slot_segments = set(layout.segments)
    cursor = 0
    with torch.no_grad():
        data = flat.detach()
        for segment, size in enumerate(layout.split_sizes):
            lo, hi = max(cursor, start), min(cursor + size, end)
            if segment not in slot_segments and lo < hi:
                data[lo - start : hi - start].zero_()
            cursor += size


def invalidate(groups: Sequence[Group]) -> None:
    """Drop every cached view of every group."""
    for group in groups:
        group.views.invalidate()


def refresh_originals(groups: Sequence[Group], slots: Sequence[Slot], tx: Transaction | None = None) -> None:
    """Point the original parameter objects at their slots (frees any old buffer)."""
    tx = tx if tx is not None else Transaction()
    with torch.no_grad():
        splits = [group.value_views() for group in groups]
    for slot in slots:
        target = splits[slot.group_index][slot.index]
        if same_memory(slot.param, target):
            continue
        if torch._has_compatible_shallow_copy_type(slot.param, target):
            tx.set_attr(slot.param, "data", target)
        else:  # e.g. meta -> cpu after to_empty(): .data cannot change the tensor type
            tx.swap_tensors(slot.param, nn.Parameter(target, requires_grad=slot.param.requires_grad))
    for group in groups:
        serve(group.flat, group.views)  # again: `swap_tensors` moves a tensor's `__dict__`
    invalidate(groups)


def rewrap_flat_param(root: nn.Module, group: Group) -> FlatParameter:
    """Return ``group``'s flat parameter, re-wrapped if ``module.to()`` & co. replaced or re-classed it."""
    param = root._parameters.get(group.flat_name)
    if not isinstance(param, Tensor) or (param is group.flat and type(param) is FlatParameter):
        return group.flat
    if is_foreign(param):  # e.g. FSDP2's DTensor after .to(): FSDP2 converts and keeps it
        return _follow(group, param)
    flat = as_flat_parameter(param, **_layout_of(group))
    root._parameters[group.flat_name] = flat
    return flat


def _layout_of(group: Group) -> dict[str, Any]:
    layout, members = group.layout, group.members
    return {
        "names": [slot.name for slot in members],
        "shapes": [layout.shapes[slot.index] for slot in members],
        "numels": [layout.numels[slot.index] for slot in members],
        "offsets": [layout.offsets[slot.index] for slot in members],
    }


def _follow(group: Group, foreign: Tensor) -> FlatParameter:
    """Return ``group``'s flat parameter, or a copy with the dtype and device of ``foreign``.

    Another engine holds ``foreign`` in the flat parameter's place and converted
    it (``.double()``, ``.to(device)``); the group's flat parameter, which that
    engine's own parameter (FSDP2's unsharded one) must match when it comes
    back, follows. One whose memory the engine freed, or on the meta device,
    gets uninitialized memory: the values are the engine's.
    """
    flat = group.flat
    if flat.dtype == foreign.dtype and flat.device == foreign.device:
        return flat
    needed = (flat.storage_offset() + flat.numel()) * flat.element_size()
    with torch.no_grad():
        if flat.is_meta or flat.untyped_storage().nbytes() < needed:
            data = torch.empty(flat.shape, dtype=foreign.dtype, device=foreign.device)
        else:
            data = flat.detach().to(dtype=foreign.dtype, device=foreign.device)
    return FlatParameter(data, flat.requires_grad, **_layout_of(group))


# ------------------------------------------------------------------ registration
def install(storage: Coordinator, tx: Transaction) -> None:
    """Change the module: classes, parametrizations, flat parameters, hooks."""
    root = storage.module_unchecked
    groups, slots = storage.groups(), storage.slots()
    modules = _modules(root)
    owners: dict[int, nn.Module] = {id(root): root}
    attrs: dict[int, dict[str, None]] = {id(root): {}}  # each owner's flattened attributes, in order
    for slot in slots:
        for name in slot.all_names:
            owner, attr = locate(modules, name)
            owners.setdefault(id(owner), owner)
            attrs.setdefault(id(owner), {})[attr] = None
    classes = {key: make_class(owner, attrs[key]) for key, owner in owners.items()}
    grads = _gather_grads(groups)
    for key, owner in owners.items():
        order = list(owner._parameters)
        tx.keep_dict(owner.__dict__)
        tx.keep_dict(owner._parameters)
        owner.__dict__[MODULE_STATE_ATTR] = ModuleState(storage, order, type(owner))
        tx.set_attr(owner, "__class__", classes[key])
    for slot in slots:
        views = groups[slot.group_index].views
        for name in slot.all_names:
            owner, attr = locate(modules, name)
            state: ModuleState = owner.__dict__[MODULE_STATE_ATTR]
            if attr in state.slots:  # the same module reached under two paths
                continue
            original = owner._parameters.pop(attr)
            assert original is not None
            register_view(owner, attr, views, slot.index, name, original, tx.on_undo)
            state.slots[attr] = (views, slot.index)
    for group, grad in zip(groups, grads):
        root.register_parameter(group.flat_name, group.flat)
        # The members' gradients now live in the flat gradient.
        group.grads.take_back(group.flat, grad, [slot.param for slot in group.members], tx)
    _add_trace_hooks(root, tx)
    root.__dict__[STORAGE_ATTR] = storage
    refresh_originals(groups, slots, tx)


def _gather_grads(groups: Sequence[Group]) -> list[Tensor | None]:
    """Return each group's flat gradient built from its members' gradients; warn about those dropped.

    A gradient of another shape than its parameter (left from before a
    resize on the plain model: ``resize_token_embeddings`` swaps the
    parameter's ``.data``) has no place in a flat gradient: the gradient
    owner drops it, as the plain model's next ``zero_grad()`` would, and one
    warning names each.
    """
    stale: list[str] = []
    grads = [group.grads.gather(group.flat, group.members, stale) for group in groups]
    if stale:
        warnings.warn(
            f"a flat gradient holds each parameter's gradient in the parameter's shape; "
            f"{len(stale)} gradient(s) of another shape, left from before a shape change, were dropped: "
            f"{', '.join(stale)}; as on the plain model, whose next zero_grad() drops them. Call "
            "zero_grad() before changing shapes to keep this warning away",
            UserWarning,
            stacklevel=caller_level(),
        )
    return grads


def uninstall(storage: Coordinator, tx: Transaction) -> None:
    """Undo the registration of a flattened module: plain parameters with the current values."""
    root = storage.module
    groups, slots = storage.groups(), storage.slots()
    modules = _modules(root)
    with torch.no_grad():
        values = [group.value_views() for group in groups]
        data = [values[s.group_index][s.index].clone() for s in slots]
    gone = released(storage, modules, values)
    for slot, value in zip(slots, data):
        if id(slot) in gone:
            continue
        tx.set_attr(slot.param, "data", value)
        tx.set_attr(slot.param, "requires_grad", groups[slot.group_index].flat.requires_grad)
    for group in groups:  # the parameters own their gradients again
        group.grads.hand_out(group.flat, group.members, tx, copy=True)
    tx.keep_dict(root._parameters)
    for group in groups:
        root._parameters.pop(group.flat_name, None)
    params = {(id(groups[s.group_index].views), s.index): s.param for s in slots}
    for owner in {id(m): m for m in modules.values() if MODULE_STATE_ATTR in m.__dict__}.values():
        _restore_module(owner, params, tx)
    _remove_trace_hooks(root, tx)
    tx.keep_dict(root.__dict__)
    root.__dict__.pop(STORAGE_ATTR, None)


def _add_trace_hooks(root: nn.Module, tx: Transaction) -> None:
    """Have the registered module's forward split each group once when compiled or traced."""
    tx.keep_dict(root._forward_pre_hooks)
    tx.keep_dict(root._forward_hooks)
    tx.keep_dict(root._forward_hooks_always_called)
    root.register_forward_pre_hook(trace_split)
    root.register_forward_hook(end_trace_split, always_call=True)  # it counts the running forwards


def _remove_trace_hooks(root: nn.Module, tx: Transaction) -> None:
    tx.keep_dict(root._forward_hooks_always_called)
    for hooks in (root._forward_pre_hooks, root._forward_hooks):
        tx.keep_dict(hooks)
        for hook_id, hook in list(hooks.items()):
            if hook is trace_split or hook is end_trace_split:
                del hooks[hook_id]
                root._forward_hooks_always_called.pop(hook_id, None)


def _restore_module(owner: nn.Module, params: dict[tuple[int, int], nn.Parameter], tx: Transaction) -> None:
    """Give ``owner`` back its parameters, its container of parametrizations and its class.

    ``params`` maps (id of a group's views, index) to the slot's parameter: each
    attribute ``owner`` serves gets its slot's, wherever ``owner`` now sits in
    the tree (peft's unload moves wrapped layers).
    """
    tx.keep_dict(owner.__dict__)
    tx.keep_dict(owner._parameters)
    tx.keep_dict(owner._modules)
    state: ModuleState = owner.__dict__.pop(MODULE_STATE_ATTR)
    container = owner.__dict__.get("parametrizations", owner._modules.get("parametrizations"))
    if container is not None:
        tx.keep_dict(container._modules)
        for attr in state.slots:
            container._modules.pop(attr, None)
    for attr, (views, index) in state.slots.items():
        owner._parameters[attr] = params[(id(views), index)]
    _reorder(owner._parameters, state.order)
    if isinstance(container, HiddenParametrizations):
        if len(container):
            # Another parametrization was registered after ours: keep its property.
            dropped = {"__dict__", "__weakref__", *state.slots, *library_names()}
            namespace = {k: v for k, v in type(owner).__dict__.items() if k not in dropped}
            tx.set_attr(owner, "__class__", type(state.prev_class.__name__, (state.prev_class,), namespace))
            return
        owner.__dict__.pop("parametrizations", None)
        owner._modules.pop("parametrizations", None)
    elif container is not None and not len(container):
        # torch's own, emptied while registered (remove_parametrizations in per-tensor mode): torch
        # would have put the class before its parametrizations back, as here.
        owner._modules.pop("parametrizations", None)
        tx.set_attr(owner, "__class__", state.prev_class.__bases__[0])
        return
    tx.set_attr(owner, "__class__", state.prev_class)


Aside = list[tuple[nn.Module, str, Any]]
#: An attribute that a module's ``_parameters`` no longer has (``del layer.weight``).
MISSING: Any = object()


def set_aside_replacements(storage: Coordinator, tx: Transaction) -> Aside:
    """Unflattened mode: put each slot's leaf back where something that cannot take its place replaced it.

    A weight quantized inside ``unflattened()`` (a tensor subclass) or converted
    to another dtype has no place in the flat buffer (``_core/fit.py``); nor has
    a parameter of another shape (nanoGPT's ``crop_block_size``), one of two
    names of a tied slot given a parameter of its own, or a name set to ``None``
    or deleted. While the storage is removed or laid out again, the slot's leaf
    (which holds the slot's values) stands in for it, and :func:`put_back`
    returns it to its module afterwards (the model then holds what outside code
    put there, as the plain model would). Undone with ``tx``.

    Returns:
        ``(module, attribute, tensor)`` of each replaced entry (``MISSING``: deleted).
    """
    if storage.is_flattened:
        return []
    modules = _modules(storage.module)
    groups = storage.groups()
    aside: Aside = []
    for slot in storage.slots():
        group = groups[slot.group_index]
        names = live_names(storage, slot, modules)
        for name in names:
            owner, attr = locate(modules, name)
            value = owner._parameters.get(attr, MISSING)
            if is_distributed(value):
                continue
            if value is slot.param:
                fits = tuple(value.shape) == group.layout.shapes[slot.index]
                if fits and misfit(value, group.flat) is None:
                    continue
                # Converted in place (``module.to(torch.float64)``) or given another shape through
                # ``.data``: a stand-in with the slot's values.
                stand_in = nn.Parameter(group.value_views()[slot.index].detach().clone(), value.requires_grad)
                tx.keep_dict(owner._parameters)
                owner._parameters[attr] = stand_in
                tx.set_attr(slot, "param", stand_in)
                aside.append((owner, attr, value))
                continue
            lands = (
                isinstance(value, Tensor)
                and misfit(value, group.flat) is None
                and tuple(value.shape) == group.layout.shapes[slot.index]
                and len(names) == 1
            )
            if not lands:  # a same-shaped parameter of an untied slot lands in the slot instead
                tx.keep_dict(owner._parameters)
                owner._parameters[attr] = slot.param
                aside.append((owner, attr, value))
    return aside


def put_back(aside: Aside, tx: Transaction) -> None:
    """Give each module the tensor that :func:`set_aside_replacements` took from it (undone with ``tx``)."""
    for owner, attr, value in aside:
        tx.keep_dict(owner._parameters)
        if value is MISSING:
            owner._parameters.pop(attr, None)
        else:
            owner._parameters[attr] = value


# ------------------------------------------------------------------ mode switches
def _current_params(storage: Coordinator, modules: dict[str, nn.Module]) -> list[nn.Parameter | None]:
    """Return the parameter each slot holds in unflattened mode (``None``: a dead slot), after checking it."""
    groups = storage.groups()
    current: list[nn.Parameter | None] = []
    for slot in storage.slots():
        found: list[Any] = []
        group = groups[slot.group_index]
        shape = group.layout.shapes[slot.index]
        for name in live_names(storage, slot, modules):
            owner, attr = locate(modules, name)
            param = owner._parameters.get(attr)
            if not isinstance(param, Tensor):
                raise RuntimeError(
                    f"cannot flatten: {name} is {type(param).__name__}, not a parameter; "
                    "assign an nn.Parameter of its shape before flattening"
                )
            if is_distributed(param) and not is_distributed(group.flat):
                raise RuntimeError(
                    f"cannot flatten: {name} is a sharded {type(param).__name__} (fully_shard sharded the "
                    "per-tensor parameters) and the flat storage holds whole tensors; FSDP2 owns these "
                    "weights now: keep training in per-tensor mode, or shard the flat parameters instead "
                    "(register_flat_storage, then fully_shard, in flat mode)"
                )
            why = misfit(param, group.flat)
            if why is not None:
                raise RuntimeError(
                    f"cannot flatten: {name} holds {why}, which cannot live in a flat buffer; "
                    "storage.flatten() (or the end of a storage.unflattened() block) releases it from the "
                    "flat storage and lays its group out again"
                )
            if tuple(param.shape) != shape:
                raise RuntimeError(
                    f"cannot flatten: {name} has shape {tuple(param.shape)} but its slot "
                    f"in the flat storage holds {shape}; assign a parameter of shape {shape}"
                )
            flat = group.flat
            for what, tensor in (("its value", param), ("its gradient", param.grad)):
                if tensor is not None and tensor.is_meta and not flat.is_meta:
                    raise RuntimeError(
                        f"cannot flatten: {what} of {name} is on the meta device and holds "
                        f"no data to write into group '{group.name}'; "
                        "assign a parameter with values (or load a state dict) first"
                    )
            if found and param is not found[0]:
                raise RuntimeError(
                    f"cannot flatten: tied parameter {slot.name} and {name} were "
                    "reassigned separately and no longer share one tensor; assign the "
                    "same nn.Parameter to every name of a tied parameter"
                )
            found.append(param)
        current.append(found[0] if found else None)
    return current


def flatten_module(storage: Coordinator, tx: Transaction) -> None:
    """Write unflattened-mode values and gradients into the flat buffers; views serve the attributes again."""
    root = storage.module
    for owner, state in storage.members():
        _take_back_class(owner, state, tx)
    _add_trace_hooks(root, tx)
    groups, slots = storage.groups(), storage.slots()
    modules = _modules(root)
    current = _current_params(storage, modules)
    live = [(slot, param) for slot, param in zip(slots, current) if param is not None]
    by_group = [[(slot, param) for slot, param in live if slot.group_index == g.index] for g in groups]
    new_grads: list[Tensor | None] = []
    for group, members in zip(groups, by_group):
        flat = group.flat
        grads = [param.grad for _, param in members]
        if all(grad is None for grad in grads):
            new_grads.append(None)
            continue
        flat_grad = flat.grad
        fresh = flat_grad is None
        if flat_grad is None:
            flat_grad = torch.zeros_like(flat, memory_format=torch.contiguous_format)
        targets = group.split(flat_grad)
        for (slot, _), grad in zip(members, grads):
            target = targets[slot.index]
            if fresh and grad is not None:
                target.copy_(grad)  # a new buffer: nothing to undo
            elif not fresh and (grad is None or not same_memory(grad, target)):
                tx.write(target, grad)
        new_grads.append(flat_grad)
    for group, members in zip(groups, by_group):
        targets = group.value_views()
        for slot, param in members:
            if not same_memory(param, targets[slot.index]):
                tx.write(targets[slot.index], param.detach())
    for group, grad, members in zip(groups, new_grads, by_group):  # not the dead slots
        group.grads.take_back(group.flat, grad, [param for _, param in members], tx)
    for slot, param in live:  # not the dead slots: their modules were replaced or deleted
        tx.set_attr(slot, "param", param)
        for name in live_names(storage, slot, modules):
            owner, attr = locate(modules, name)
            tx.keep_dict(owner._parameters)
            owner._parameters.pop(attr, None)
    tx.keep_dict(root._parameters)
    for group in groups:
        root._parameters[group.flat_name] = group.flat


def unflatten_module(storage: Coordinator, tx: Transaction) -> None:
    """Make every attribute a real leaf parameter again, sharing memory with the flat buffers."""
    root = storage.module
    groups, slots = storage.groups(), storage.slots()
    modules = _modules(root)
    refresh_originals(groups, slots, tx)
    for slot in slots:
        tx.set_attr(slot.param, "requires_grad", groups[slot.group_index].flat.requires_grad)
    for group in groups:
        group.grads.hand_out(group.flat, group.members, tx, copy=False)
    tx.keep_dict(root._parameters)
    for group in groups:
        root._parameters.pop(group.flat_name, None)
    touched = {}
    for slot in slots:
        for name in live_names(storage, slot, modules):
            owner, attr = locate(modules, name)
            tx.keep_dict(owner._parameters)
            owner._parameters[attr] = slot.param
            touched[id(owner)] = owner
    for owner in touched.values():
        _reorder(owner._parameters, owner.__dict__[MODULE_STATE_ATTR].order)
    for owner, state in storage.members():
        if owner is not root:
            _give_back_class(owner, state, tx)
    _remove_trace_hooks(root, tx)  # plain forward (torch.jit.script compiles hooks)


def _give_back_class(owner: nn.Module, state: ModuleState, tx: Transaction) -> None:
    """Unflattened mode: ``owner`` becomes its original class with a plain ``__dict__`` (state kept aside)."""
    if MODULE_STATE_ATTR not in owner.__dict__:
        return
    tx.keep_dict(owner.__dict__)
    tx.set_attr(state, "injected", type(owner))
    container = owner.__dict__.get("parametrizations")
    if isinstance(container, HiddenParametrizations):
        tx.set_attr(state, "hidden", owner.__dict__.pop("parametrizations"))
    del owner.__dict__[MODULE_STATE_ATTR]
    UNFLATTENED[owner] = state
    tx.on_undo(lambda: UNFLATTENED.pop(owner, None))
    tx.set_attr(owner, "__class__", state.prev_class)


def released(
    storage: Coordinator,
    modules: dict[str, nn.Module] | None = None,
    values: Sequence[Sequence[Tensor]] | None = None,
) -> set[int]:
    """Return the ids of the dead slots whose parameter lives on with memory of its own.

    A module that torch parametrized in per-tensor mode (:func:`_disown`) keeps
    the parameter its slot had, which ``orthogonal``'s ``right_inverse`` gave
    other memory and values (torch's ``set_``): pointing it at the slot again, or
    writing the slot's values into it, would undo torch's work. ``modules`` and
    each group's value views are computed unless the caller has them.
    """
    modules = _modules(storage.module_unchecked) if modules is None else modules
    gone: set[int] = set()
    groups = storage.groups()
    for slot in storage.slots():
        if live_names(storage, slot, modules):
            continue
        if values is None:
            with torch.no_grad():
                values = [group.value_views() for group in groups]
        if not same_memory(slot.param, values[slot.group_index][slot.index]):
            gone.add(id(slot))
    return gone


def _disown(owner: nn.Module, state: ModuleState, tx: Transaction) -> None:
    """``owner`` was parametrized by torch in per-tensor mode: it leaves the storage as torch left it.

    ``weight_norm``, ``orthogonal`` or ``register_parametrization`` on a leaf gave
    ``owner`` torch's class and container. Putting the library's class back would
    drop them, so the storage lets the module go (undoably with ``tx``): its slots
    are dead from here on, as a replaced module's, and what follows (the groups
    laid out again, or the storage removed) finds its parameters as torch holds them
    now: the same parameter under ``parametrizations.<name>.original`` keeps its slot,
    one the module kept (``bias``) joins its group again, new ones (``original0``,
    ``original1``) are ordinary parameters of their module.
    """
    core = state.storage
    owners = core.members()
    core.adopt_members([(module, kept) for module, kept in owners if module is not owner])
    tx.on_undo(lambda: core.adopt_members(owners))
    UNFLATTENED.pop(owner, None)
    tx.on_undo(lambda: UNFLATTENED.__setitem__(owner, state))


def _sync_torch_properties(state: ModuleState, tx: Transaction) -> None:
    """Give the library's class the torch properties that torch's class has now (undoably with ``tx``).

    The class of a module parametrized before registration holds a copy of
    torch's properties (``module_classes.make_class``). In per-tensor mode torch
    changes its own class only: ``remove_parametrizations`` deletes a property
    (the copy would keep serving a parametrization that is gone),
    ``register_parametrization`` on a buffer adds one.
    """
    injected, torch_class = state.injected, state.prev_class
    for name, value in list(vars(injected).items()):
        if isinstance(value, property) and name not in state.slots and name not in vars(torch_class):
            delattr(injected, name)
            tx.on_undo(functools.partial(setattr, injected, name, value))
    for name, value in list(vars(torch_class).items()):
        if isinstance(value, property) and name not in vars(injected):
            setattr(injected, name, value)
            tx.on_undo(functools.partial(delattr, injected, name))


def _take_back_class(owner: nn.Module, state: ModuleState, tx: Transaction) -> None:
    """Flat mode again: ``owner`` gets the library's class, state and container back.

    A module that torch parametrized in per-tensor mode leaves the storage instead (:func:`_disown`).
    """
    if state.injected is None:
        return
    if type(owner) is not state.prev_class and parametrize.is_parametrized(owner):
        _disown(owner, state, tx)
        return
    if parametrize.is_parametrized(owner):
        _sync_torch_properties(state, tx)
    # The plain module's order now (torch's remove_parametrizations re-registers a weight last): the
    # order that flat mode's state dicts and removal give back.
    tx.set_attr(state, "order", list(owner._parameters))
    tx.keep_dict(owner.__dict__)
    owner.__dict__[MODULE_STATE_ATTR] = state
    UNFLATTENED.pop(owner, None)
    tx.on_undo(lambda: UNFLATTENED.__setitem__(owner, state))
    if state.hidden is not None:
        owner.__dict__["parametrizations"] = state.hidden
        tx.set_attr(state, "hidden", None)
    tx.set_attr(owner, "__class__", state.injected)
    tx.set_attr(state, "injected", None)
