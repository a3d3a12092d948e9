"""Per-tensor mode's write paths: what outside code changed on the plain modules reaches the flat buffers.

In unflattened mode the modules are plain (their original classes): outside
code writes to them as to the plain model, and nothing intercepts it:
``layer.weight = nn.Parameter(t)`` (nanoGPT's ``crop_block_size``),
``layer._parameters[name] = p``, ``register_parameter``, ``layer.weight.data = t``,
``module.to()`` of a submodule, ``del layer.weight``, a submodule replaced. The
whole-buffer features (a clip over ``flat_params``, ``flat_state_dict``,
``named_grads``, gradient sync, ``broadcast_params``, ``ShardedOptimizer``,
checkpoints) would then miss the new parameter, or read values the model no
longer has.

:class:`LeafWatch` remembers, when per-tensor mode begins, each slot's names
(owning module and attribute), its leaf and the leaf's data pointer, and each
module edge on the way to them. :func:`settle` compares them at every sync
point: an identity check per name and per module edge and a data pointer per
leaf, no tensor op. Where anything differs, the groups are laid out again as
the model now is (``relayout.relayout_flat``, all or nothing), and per-tensor
mode begins again: the values written are in the flat buffers, a new parameter is
its slot's leaf (its gradient, if any, in the flat gradient), optimizer state
over ``flat_params`` follows its slots, and a tensor that cannot live in a flat
buffer (another dtype, a quantized one) leaves the storage with a warning that
names it. The leaf that was replaced is no longer the model's, as on the plain
model.

The sync points: every call on the ``FlatStorage`` that works on the buffers
(``_storage.py``), the user's ``flatten()`` (:func:`flatten_relaid`, for what it
cannot land itself), the registered module's forward while a feature works on the flat buffers during
training (gradient sync, a ``ShardedOptimizer``, mixed precision's compute
copies: ``per_tensor.py``), so that no parameter that trains is skipped by
gradient sync, and the step of an optimizer over ``flat_params`` (a global step
pre-hook, :func:`_before_step`), so that it steps the parameters the model has.
A forward run by ``torch.func.functional_call`` is no sync point: the
tensors in the parameters' places are that call's, put back when it returns
(nothing lands; the model and the storage stay as they were). A layout held by
a feature (``_core/features.py``) cannot follow: that is refused with the holder
named and the ways out.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import stateless
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .._core.compiling import never_traced
from .._core.features import layout_holders, refuse_held_layout
from .._core.fit import misfit
from .._core.grad.owner import set_grad
from .._core.leaves import EPOCH
from .._core.names import dtype_name, registered_storage
from .._core.records import Coordinator
from .._state import relaid_optim
from . import surgery

__all__ = ["LeafWatch", "flatten_relaid", "keep_leaf_state", "settle", "use_relayout"]

#: ``relayout.relayout_flat``, handed down by ``injected.assemble`` (relayout.py imports the
#: coordinator, which imports this module).
_RELAYOUT: list[Callable[[Any, str], None]] = []


def use_relayout(relayout_flat: Callable[[Any, str], None]) -> None:
    """Lay groups out again with ``relayout_flat(core, what)`` from now on (``injected.assemble``)."""
    _RELAYOUT[:] = [relayout_flat]


@dataclass(frozen=True)
class _Name:
    """One name of a slot: where it lives, the leaf it must hold, and that leaf's memory, dtype and shape."""

    qualified: str
    owner: weakref.ref[nn.Module]
    attr: str
    leaf: Tensor
    ptr: int
    dtype: torch.dtype
    shape: torch.Size
    tied: bool  # the slot has other names


#: What :meth:`LeafWatch.changed` found: ``flatten()`` lands these itself (values copied into the slot;
#: module swaps and misfits laid out again by ``rehost.py``), but not the others.
LANDS, REHOSTS, RELAYS = "lands", "rehosts", "relays"


class LeafWatch:
    """What per-tensor mode's modules held when it began (or after the buffers were re-backed).

    Args:
        storage: the coordinator, in unflattened mode.
    """

    __slots__ = ("_edges", "_names", "_quick")

    def __init__(self, storage: Coordinator) -> None:
        _watch_steps(storage)
        modules = dict(storage.module_unchecked.named_modules(remove_duplicate=False))
        self._names: list[_Name] = []
        edges: dict[tuple[int, str], tuple[str, weakref.ref[nn.Module], weakref.ref[nn.Module]]] = {}
        for slot in storage.slots():
            names = surgery.live_names(storage, slot, modules)
            for qualified in names:
                owner, attr = surgery.locate(modules, qualified)
                self._names.append(
                    _Name(
                        qualified,
                        weakref.ref(owner),
                        attr,
                        slot.param,
                        _ptr(slot.param),
                        slot.param.dtype,
                        slot.param.shape,
                        len(names) > 1,
                    )
                )
                parts = qualified.split(".")[:-1]
                for depth in range(len(parts)):
                    parent_path, path = ".".join(parts[:depth]), ".".join(parts[: depth + 1])
                    parent = modules[parent_path]
                    key = (id(parent), parts[depth])
                    edges[key] = (path, weakref.ref(parent), weakref.ref(modules[path]))
        self._edges = list(edges.items())
        #: What :meth:`_unchanged` compares at each sync point, grouped so that each module's dicts are
        #: looked up once: per owner ``(owner, its parameter dict, ((attribute, leaf, data pointer, dtype,
        #: shape), ...))``, per parent ``(parent, its module dict, ((key, child), ...))``.
        owners: dict[int, tuple[weakref.ref[nn.Module], Any, list[tuple[Any, ...]]]] = {}
        for n in self._names:
            entry = owners.setdefault(id(n.owner()), (n.owner, _dict(n.owner, "_parameters"), []))
            entry[2].append((n.attr, n.leaf, n.ptr, n.dtype, n.shape))
        parents: dict[int, tuple[weakref.ref[nn.Module], Any, list[tuple[Any, ...]]]] = {}
        for (_, child_key), (_, parent, child) in self._edges:
            entry = parents.setdefault(id(parent()), (parent, _dict(parent, "_modules"), []))
            entry[2].append((child_key, child))
        self._quick = (
            tuple((owner, params, tuple(names)) for owner, params, names in owners.values()),
            tuple((parent, modules, tuple(children)) for parent, modules, children in parents.values()),
        )

    def _unchanged(self) -> bool:
        """Return whether every name holds its leaf, with its memory and shape, under the same modules (fast).

        The shape is compared too: ``.data = w.data[:8]`` keeps the data pointer.
        """
        owners, parents = self._quick
        try:
            for owner, params, names in owners:
                if _dict(owner, "_parameters") is not params:
                    return False
                for attr, leaf, ptr, dtype, shape in names:
                    if (
                        params.get(attr) is not leaf
                        or leaf.data_ptr() != ptr
                        or leaf.dtype is not dtype
                        or leaf.shape != shape
                    ):
                        return False
        except RuntimeError:  # a leaf without storage (functorch wrappers): the full comparison says what
            return False
        for parent, modules, children in parents:
            if _dict(parent, "_modules") is not modules:
                return False
            for key, child in children:
                module = child()  # a module deleted and gone: its key may be gone too (None is None)
                if module is None or modules.get(key) is not module:
                    return False
        return True

    def changed(self) -> tuple[str, str] | None:
        """Return what outside code changed since, as ``(kind, sentence naming it)``, or ``None``.

        The kind is :data:`RELAYS` when only laying the groups out again can
        take it (another shape, a name set to ``None`` or deleted, a tie
        broken), :data:`REHOSTS` for a submodule replaced or a tensor that cannot
        live in a flat buffer, :data:`LANDS` for values that fit the slot.
        """
        if self._unchanged():
            return None
        found: tuple[str, str] | None = None
        for (_, key), (path, parent_ref, child_ref) in self._edges:
            parent, child = parent_ref(), child_ref()
            if parent is None or child is None or parent._modules.get(key) is not child:
                found = (REHOSTS, f"submodule {path} was replaced or deleted")
                break
        for name in self._names:
            owner = name.owner()
            if owner is None:
                continue  # its module is gone: an edge above says so
            current = owner._parameters.get(name.attr, _MISSING)
            change = _change(name, current)
            if change is not None and (found is None or change[0] == RELAYS):
                found = change
                if found[0] == RELAYS:
                    break
        return found


def _change(name: _Name, current: Any) -> tuple[str, str] | None:
    """Return what happened to ``name``, which holds ``current`` now (see :meth:`LeafWatch.changed`)."""
    if current is name.leaf:
        if current.dtype != name.dtype:
            return REHOSTS, f"{name.qualified} was converted to {dtype_name(current.dtype)}"
        if current.shape != name.shape:
            return RELAYS, (
                f"{name.qualified} was given a tensor of shape {tuple(current.shape)} through `.data` (its "
                f"slot holds {tuple(name.shape)})"
            )
        return (
            None
            if _ptr(current) == name.ptr
            else (LANDS, f"{name.qualified} was given other memory (`.data = t`)")
        )
    if current is _MISSING or current is None:
        return RELAYS, f"{name.qualified} was deleted or set to None"
    if not isinstance(current, Tensor):
        return RELAYS, f"{name.qualified} was replaced by a {type(current).__name__}"
    if current.shape != name.leaf.shape:
        return RELAYS, (
            f"{name.qualified} was replaced by a parameter of shape {tuple(current.shape)} (its slot holds "
            f"{tuple(name.leaf.shape)})"
        )
    if misfit(current, name.leaf) is not None:
        return REHOSTS, f"{name.qualified} was replaced by {misfit(current, name.leaf)}"
    if name.tied:
        return RELAYS, f"{name.qualified}, one name of a tied parameter, was given a parameter of its own"
    return LANDS, f"{name.qualified} was replaced by another parameter"


_MISSING: Any = object()


def _dict(ref: weakref.ref[nn.Module], which: str) -> Any:
    """Return the ``_parameters`` or ``_modules`` dict of ``ref``'s module (``None`` once it is gone)."""
    module = ref()
    return None if module is None else module.__dict__[which]


def _ptr(tensor: Tensor) -> int:
    try:
        return tensor.data_ptr()
    except RuntimeError:  # tensors without storage (functorch wrappers)
        return -1


def settle(core: Any, what: str | None = None) -> Any:
    """Lay out ``core``'s groups again if outside code changed the modules in per-tensor mode; return it.

    Args:
        core: the storage core.
        what: the operation that asks (for messages; ``None``: what changed, said in the message).

    Returns the core in use afterwards (a new one when the groups were laid
    out again, ``core`` otherwise). A no-op in flat mode, for a detached core,
    and while the groups are being laid out already.

    Raises:
        RuntimeError: if a feature holds the layout (nothing is changed: the
            model keeps what was written, the storage its old layout).
    """
    watch = core.per_tensor.watch
    if watch is None or core.is_flattened or core.per_tensor.settling or not core.is_attached:
        return core
    found = watch.changed()
    if found is None and what != "flatten()":
        found = _flag_to_follow(core)
    if found is None or (what == "flatten()" and found[0] != RELAYS):  # flatten() lands the rest itself
        return core
    if what is None and _in_functional_call():  # its substitutes, for the length of that call only
        return core
    change = found[1]
    holders = layout_holders(core)
    if holders and what is not None:
        refuse_held_layout(core, what)
    if holders:
        raise RuntimeError(
            f"outside code changed the model in per-tensor mode ({change}), but "
            f"{', '.join(sorted(holders))} hold(s) the flat "
            "storage's layout, so the flat buffers cannot take the change and whole-buffer features "
            "would miss it. Release it first "
            f"({'; '.join(fix for _, fix in sorted(holders.items()))}): the next call on the storage "
            "lays the groups out again; or undo the change on the model"
        )
    leaf_state = keep_leaf_state(core.module_unchecked)
    core.per_tensor.settling = True
    try:
        _RELAYOUT[0](core, what or f"per-tensor mode ({change})")
    finally:
        core.per_tensor.settling = False
    new = core.current()
    if registered_storage(core.module_unchecked) is not new:
        return core  # every weight left: the storage was removed
    if what != "flatten()":
        new.unflatten()
        leaf_state()
    return new


def _flag_to_follow(core: Any) -> tuple[str, str] | None:
    """Return the change to lay out if a group's flat parameter does not require grad as its leaves do.

    In per-tensor mode each leaf has its own ``requires_grad``, as on the plain model (a frozen
    submodule; every weight trained again after peft's ``merge_and_unload`` left only the frozen
    base group). A group trains while any of its leaves does: its flat parameter must then require
    grad, so that its gradient hooks (gradient sync, ``ShardedOptimizer``, the leaves' landing)
    run, and not otherwise. Compared with the flags themselves, not with a watch, so that nothing
    (a watch renewed when the buffers were re-backed, say) can hide it; a group that trains stops
    at its first leaf that does.
    """
    for group in core.groups():
        trains = group.flat.requires_grad
        if trains != any(slot.param.requires_grad for slot in group.members):
            first = group.members[0] if trains else next(s for s in group.members if s.param.requires_grad)
            return RELAYS, f"{first.name} was set to requires_grad={not trains}"
    return None


def keep_leaf_state(module: nn.Module) -> Callable[[], None]:
    """Note each parameter's ``requires_grad`` and whether it has a gradient; return what puts them back.

    Laying the groups out again in per-tensor mode passes through flat mode, which has one flag per
    group (a group's flat parameter requires grad while any of its leaves does,
    ``relayout._register_again``) and one gradient (zeros where a leaf had none), and back: this
    gives each leaf its own flag again, and ``None`` where it had no gradient (an optimizer skips
    it, as on the plain model, instead of stepping zeros).
    """
    state = [(param, param.requires_grad, param.grad is None) for param in module.parameters()]

    def put_back() -> None:
        for param, flag, no_grad in state:
            if param.requires_grad != flag and param.is_leaf:
                param.requires_grad_(flag)
            if no_grad and param.grad is not None:
                set_grad(param, None)

    return put_back


#: The code of ``torch.func.functional_call``'s body (``torch.nn.utils.stateless``): a forward run inside it
#: computes with the tensors it was given, put in the parameters' places for that call and put back after.
_FUNCTIONAL_CALL = getattr(stateless, "_functional_call", None)
_FUNCTIONAL_CODE = None if _FUNCTIONAL_CALL is None else _FUNCTIONAL_CALL.__code__


def _in_functional_call() -> bool:
    """Return whether ``torch.func.functional_call`` is running the forward that asks."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _FUNCTIONAL_CODE:
            return True
        frame = frame.f_back
    return False


#: Every storage that entered per-tensor mode (held weakly), for :func:`_before_step`.
_PER_TENSOR: weakref.WeakSet[Any] = weakref.WeakSet()
#: ``id(optimizer) -> ((number of param groups, EPOCH), the storages whose flat parameters it steps)``,
#: looked up again after a registration, a mode change or a layout change (entries leave with it).
_STEPPED: dict[int, tuple[tuple[int, int], list[weakref.ref[Any]]]] = {}
_STEP_HOOK: list[RemovableHandle] = []


def _watch_steps(storage: Coordinator) -> None:
    """Make an optimizer step over ``storage``'s flat parameters a sync point (the hook: once)."""
    _PER_TENSOR.add(storage)
    if not _STEP_HOOK:
        relaid_optim.install()  # torch runs the global pre-hooks from their dict: none may come during ours
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_before_step))


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: land outside changes of the storages whose flat parameters it steps.

    An optimizer over ``storage.flat_params`` in per-tensor mode, stepped after outside code changed
    the model and with no call on the storage since (a parameter replaced or given another shape
    through ``.data``, the forward no sync point), would step the old layout: the new parameter's
    gradient is not in the flat gradient and it would not train. The groups are laid out again
    first and the optimizer's state follows its slots (``relaid_optim``). After the first step of
    an optimizer it costs a dict lookup (traceable: a compiled step of any other optimizer does not
    break here), and one :func:`settle` per storage it steps the flat parameters of.
    """
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return
    found = _STEPPED.get(id(optimizer))
    if found is None or found[0] != (len(groups), EPOCH[0]):
        found = _look_up(optimizer, groups)
    if found[1]:
        _land_before_step(optimizer, found[1])


@never_traced  # weakref.finalize is not traceable
def _look_up(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> tuple[tuple[int, int], list[weakref.ref[Any]]]:
    """Find (and remember) the storages in per-tensor mode whose flat parameters ``optimizer`` steps."""
    if id(optimizer) not in _STEPPED:
        weakref.finalize(optimizer, _STEPPED.pop, id(optimizer), None)
    ids = {id(p) for group in groups for p in group.get("params", ())}
    stepped = [
        weakref.ref(core)
        for core in list(_PER_TENSOR)
        if core.is_attached and any(id(group.flat) in ids for group in core.groups())
    ]
    found = _STEPPED[id(optimizer)] = ((len(groups), EPOCH[0]), stepped)
    return found


@never_traced
def _land_before_step(optimizer: torch.optim.Optimizer, stepped: list[weakref.ref[Any]]) -> None:
    """Settle each storage of ``stepped``; where one was laid out again, move ``optimizer``'s state now."""
    relaid = False
    for ref in stepped:
        core = ref()
        if core is not None and settle(core) is not core:
            relaid = True
    if relaid:
        relaid_optim.follow(optimizer)


def flatten_relaid(core: Any) -> bool:
    """A step of the user's ``flatten()``: what only laying out again takes (another shape) is laid out first.

    Returns whether the flatten is done (by the core laid out again, or the
    storage was removed because every weight left it).

    Raises:
        RuntimeError: for a detached storage, or as :func:`settle`.
    """
    _ = core.module  # raises for a detached storage
    new = settle(core, "flatten()")
    if new is core and core.is_attached:
        return False
    if new.is_attached:
        new.flatten(relayout=True)
    return True
