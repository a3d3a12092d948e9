"""Whole-model pickling of a flattened model: ``torch.save(model)``, ``pickle``, ``spawn``, submodule copies.

The classes the library injects are generated at registration and cannot be
found by name, so every module it changed is reduced to its original class and
a cleaned ``__dict__`` (without the library's state, its parametrization
container and its hooks):

* The registered module is reduced with a record of its storage (group names,
  layouts, the flat parameters, the slots' names, the mode); loading rebuilds
  the module tree with ordinary parameters that are views of the loaded flat
  parameters and registers the storage again over them, so the loaded object is
  a flattened model with the same groups, layout, ties, ``requires_grad`` and
  mode, sharing one storage. The pickler reduces the children after the root's
  reduction returns, so the root's reduction wraps them in :class:`_ModuleRef`
  objects (one per module: shared submodules stay shared) that reduce them as
  members, and each slot in a :class:`_SlotRef` (one per slot: ties stay ties)
  that becomes a view of the loaded flat parameter, never a copy of its data.
* Any other module the library changed, pickled or deep-copied on its own, is
  a standalone plain module: its original class with ordinary parameters
  holding copies of its values (ties inside it kept).

Nothing here needs more than ``import flatten_parametrize`` to load: the
rebuild functions live in this module.
"""

from __future__ import annotations

import copy
import copyreg
from typing import Any

from torch import Tensor, nn

from .._core.flat_parameter import FlatParameter
from .._core.layout import shape_numel
from .._core.names import MODULE_STATE_ATTR, STORAGE_ATTR, registered_storage
from .._core.parametrize_interop import FlatViewList, HiddenParametrizations
from .._core.records import Coordinator, ModuleState, Slot
from .coordinator import StorageCore
from .lifecycle import install_storage
from .surgery import locate

__all__ = ["StorageRecord", "copy_alone", "reduce_ex", "reduce_flattened"]

_PACKAGE = __name__.split(".")[0]
_NEWOBJ = getattr(copyreg, "__newobj__")  # noqa: B009 (missing from the type stubs)


class _Context:
    """One reduction of (part of) a flattened tree: one reference per module and per slot.

    Args:
        storage: the coordinator whose modules are reduced.
        member: ``True`` when the registered module is reduced (slots become
            views of the flat parameters on load); ``False`` for a standalone
            copy of a submodule (slots become parameters holding their values).
    """

    def __init__(self, storage: Coordinator, member: bool) -> None:
        self.storage = storage
        self.member = member
        self.modules: dict[int, _ModuleRef] = {}
        self.slot_refs: dict[int, _SlotRef] = {}
        values = storage.flat_state_dict()
        self.values = [values[group.flat_name].detach() for group in storage.groups()]
        self.flats = [_flat_of(group.flat, value) for group, value in zip(storage.groups(), self.values)]
        modules = dict(storage.module.named_modules(remove_duplicate=False))
        self.slot_of: dict[tuple[int, str], int] = {}
        for position, slot in enumerate(storage.slots()):
            for name in slot.all_names:
                path, _, attr = name.rpartition(".")
                self.slot_of[(id(modules[path]), attr)] = position

    def wrap(self, module: Any) -> Any:
        """Return the reference that reduces ``module`` within this context (``None`` stays ``None``)."""
        if not isinstance(module, nn.Module):
            return module
        ref = self.modules.get(id(module))
        if ref is None:
            ref = self.modules[id(module)] = _ModuleRef(module, self)
        return ref

    def slot_ref(self, module: nn.Module, attr: str) -> _SlotRef:
        """Return the reference of the slot served as ``module.<attr>``."""
        position = self.slot_of[(id(module), attr)]
        ref = self.slot_refs.get(position)
        if ref is None:
            ref = self.slot_refs[position] = _SlotRef(self, self.storage.slots()[position])
        return ref


def _flat_of(flat: FlatParameter, values: Tensor) -> FlatParameter:
    """Return the flat parameter to pickle: ``flat``, or a copy holding ``values`` if they differ.

    They differ in unflattened mode after a parameter was reassigned there.
    """
    if values.data_ptr() == flat.data_ptr():
        return flat
    names, shapes, numels = flat.metadata()
    return FlatParameter(
        values.clone(), flat.requires_grad, names=names, shapes=shapes, numels=numels, offsets=flat.offsets
    )


class _ModuleRef:
    """Stands for a module inside a reduction; pickles (and deep-copies) as the rebuilt module."""

    def __init__(self, module: nn.Module, context: _Context) -> None:
        self.module = module
        self.context = context

    def __reduce_ex__(self, proto: Any) -> Any:
        return _reduce_module(self.module, self.context, proto)


class _SlotRef:
    """Stands for a flattened slot inside a reduction; pickles as its parameter."""

    def __init__(self, context: _Context, slot: Slot) -> None:
        self.context = context
        self.slot = slot

    def __reduce_ex__(self, proto: Any) -> Any:
        context, slot = self.context, self.slot
        group = context.storage.groups()[slot.group_index]
        layout = group.layout
        requires_grad = group.flat.requires_grad
        if context.member:
            return (
                _slot_view,
                (context.flats[slot.group_index], layout.offsets[slot.index], layout.shapes[slot.index]),
            )
        # The group's values (one tensor object per context, so pickled once), copied out on load:
        # a clone made here would be a temporary, and a process boundary shares tensors by
        # their storage's file descriptor, closed as soon as the temporary is freed.
        values = context.values[slot.group_index]
        return (_slot_copy, (values, layout.offsets[slot.index], layout.shapes[slot.index], requires_grad))


def _slot_view(flat: FlatParameter, offset: int, shape: tuple[int, ...]) -> nn.Parameter:
    """Rebuild a slot's parameter as a view of its loaded flat parameter (no copy)."""
    view = flat.detach().narrow(0, offset, shape_numel(shape)).view(shape)
    return nn.Parameter(view, requires_grad=flat.requires_grad)


def _slot_copy(values: Tensor, offset: int, shape: tuple[int, ...], requires_grad: bool) -> nn.Parameter:
    """Rebuild a standalone module's parameter: a copy of its slot in ``values`` (a group's values)."""
    return nn.Parameter(
        values.narrow(0, offset, shape_numel(shape)).view(shape).clone(), requires_grad=requires_grad
    )


def _new_module(cls: type, *args: Any) -> nn.Module:
    """Create an empty instance of ``cls`` (its state is set by the unpickler), as ``copyreg.__newobj__``."""
    return cls.__new__(cls, *args)


def _ours(hook: Any) -> bool:
    function = getattr(hook, "__func__", hook)
    owner = getattr(function, "__module__", None) or type(function).__module__
    return isinstance(owner, str) and owner.startswith(_PACKAGE + ".")


def _clean_dict(module: nn.Module, state: ModuleState, context: _Context) -> dict[str, Any]:
    """Return ``module.__dict__`` as the plain module had it, children and slots as references."""
    name = type(module).__name__
    container = module.__dict__.get("parametrizations", module._modules.get("parametrizations"))
    ours = isinstance(container, HiddenParametrizations) and all(
        isinstance(plist, FlatViewList) for plist in container.values()
    )
    if container is not None and not ours:
        raise RuntimeError(
            f"cannot pickle {name}: it has parametrizations besides the flat storage, and "
            "torch.nn.utils.parametrize supports serialization only through state_dict(); save "
            "module.state_dict() (or storage.flat_state_dict()) instead"
        )
    cleaned = {
        key: value
        for key, value in module.__dict__.items()
        if key not in (MODULE_STATE_ATTR, STORAGE_ATTR, "parametrizations")
    }
    params: dict[str, Any] = {}
    current = module._parameters
    flat_names = {group.flat_name for group in context.storage.groups()}
    for attr in state.order:
        if attr in state.slots:
            params[attr] = context.slot_ref(module, attr)
        elif attr in current:
            params[attr] = current[attr]
    for attr, value in current.items():
        if attr not in params and attr not in flat_names:
            params[attr] = value
    cleaned["_parameters"] = params
    cleaned["_modules"] = {key: context.wrap(child) for key, child in module._modules.items()}
    for key in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = module.__dict__.get(key)
        if hooks:
            cleaned[key] = type(hooks)((k, h) for k, h in hooks.items() if not _ours(h))
    return cleaned


def _reduce_module(module: nn.Module, context: _Context, proto: Any) -> Any:
    """Reduce ``module`` within ``context``: its original class and a cleaned ``__dict__``."""
    state = context.storage.state_of(module)
    if state is None:
        # A module the storage did not change: its own reduction, with its children wrapped.
        reduced = module.__reduce_ex__(max(proto, 2))
        if not isinstance(reduced, tuple) or len(reduced) < 3 or not isinstance(reduced[2], dict):
            return reduced  # a reduction of its own: its children reduce themselves
        func, args, own, *rest = reduced
        if func is _NEWOBJ:  # pickle checks that __newobj__ builds the pickled object's class
            func = _new_module
        own = dict(own)
        if "_modules" in own:
            own["_modules"] = {key: context.wrap(child) for key, child in own["_modules"].items()}
        return (func, args, own, *rest)
    cls = state.prev_class
    if cls.__module__ == "torch.nn.utils.parametrize":
        raise RuntimeError(
            f"cannot pickle {cls.__name__}: it was parametrized before register_flat_storage, "
            "and torch.nn.utils.parametrize supports serialization only through state_dict(); "
            "save module.state_dict() (or storage.flat_state_dict()) instead"
        )
    return (_new_module, (cls,), _clean_dict(module, state, context))


class StorageRecord:
    """What the registered module's reduction carries to register its storage again on load.

    :func:`_restore` reads it.
    """

    def __init__(self, context: _Context) -> None:
        storage = context.storage
        self.group_names = [group.name for group in storage.groups()]
        self.flats = context.flats
        self.layouts = [group.layout for group in storage.groups()]
        self.slots = [(slot.name, slot.aliases, slot.group_index, slot.index) for slot in storage.slots()]
        self.flattened = storage.is_flattened
        #: ``(function, args)`` per feature that survives pickling (its ``pickle_record()``), each
        #: called as ``function(core, *args)`` once the storage is registered again.
        self.features = [record for f in storage.features if (record := f.pickle_record()) is not None]


def reduce_flattened(module: nn.Module, proto: Any) -> Any:
    """Return the pickle reduction of a module the library changed.

    The registered module is rebuilt as a flattened model; any other is rebuilt
    as a standalone plain module (see the module docstring).

    Raises:
        RuntimeError: for a module with other parametrizations (torch pickles
            those only through ``state_dict()``).
    """
    state: ModuleState = module.__dict__[MODULE_STATE_ATTR]
    storage = state.storage
    storage.sync_writes()
    if registered_storage(module) is storage:
        live = storage.live_names()
        dead = [name for slot in storage.slots() for name in slot.all_names if name not in live]
        if dead:
            raise RuntimeError(
                f"cannot pickle {type(module).__name__}: {dead[0]} was replaced or deleted after "
                "register_flat_storage, and a pickled model is registered again with its original "
                "layout; call remove_flat_storage(model) and register_flat_storage(model) again "
                "before pickling, or save model.state_dict()"
            )
        context = _Context(storage, member=True)
        func, args, own = _reduce_module(module, context, proto)
        return (func, args, (own, StorageRecord(context)), None, None, _restore)
    return _reduce_module(module, _Context(storage, member=False), proto)


def _restore(root: nn.Module, state: tuple[dict[str, Any], StorageRecord]) -> None:
    """Give an unpickled registered module its state, then register its storage again.

    ``state`` is the module's cleaned ``__dict__`` (its slots already
    parameters viewing the loaded flat parameters) and the record of its
    storage. The unpickler calls it (the reduction's state setter).
    """
    own, record = state
    root.__setstate__(own)
    modules = dict(root.named_modules(remove_duplicate=False))
    slots = []
    for name, aliases, group_index, index in record.slots:
        owner, attr = locate(modules, name)
        param = owner._parameters[attr]
        assert param is not None
        slots.append(Slot(name, aliases, group_index, index, param))
    core = StorageCore(root, record.group_names, record.flats, record.layouts, slots)
    install_storage(core)
    for function, args in getattr(record, "features", ()):
        function(core, *args)
    if not record.flattened:
        core.unflatten()


def reduce_ex(self: nn.Module, proto: Any) -> Any:
    """The injected classes' ``__reduce_ex__`` (listed in ``injected.py``): :func:`reduce_flattened`."""
    return reduce_flattened(self, proto)


def copy_alone(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """Deep-copy a submodule of a flattened model on its own: a standalone plain module."""
    state: ModuleState = module.__dict__[MODULE_STATE_ATTR]
    # One context per deepcopy call (kept in its memo), so that a tie between two submodules
    # copied alone in one call (siblings in a container) stays a tie.
    key = (__name__, id(state.storage))
    context = memo.get(key)  # type: ignore[call-overload]
    if context is None:
        context = memo[key] = _Context(state.storage, member=False)  # type: ignore[index]
    func, args, own = _reduce_module(module, context, 4)
    return copy._reconstruct(module, memo, func, args, own)  # type: ignore[attr-defined]
