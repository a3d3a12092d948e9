"""Model operations that change shapes or ties: run on the plain model, then the groups laid out again.

Frameworks change models in ways that a fixed layout cannot hold:
transformers' ``resize_token_embeddings`` gives the embedding (and an untied
head) more or fewer rows; ``tie_weights`` ties the head to the embedding that
``set_input_embeddings`` put in; assigning a new ``nn.Parameter`` to one name of
a tied pair unties it on a plain model. Each of them runs here on the plain
model (:func:`relayout`): the storage is removed (every name an ordinary
parameter again, ties as they were), the operation runs, and the same groups,
by the same names, are registered again with the same alignment. The new
layout has no dead space (``num_parameters()`` is the plain model's); the
``FlatParameter`` objects (holding the new buffers and layouts), the
``FlatStorage`` the user holds and the mode (flat or unflattened) stay.

What the injected classes get from here (listed in ``injected.py``):

* ``get_parameter``: a flattened name gives what the attribute serves (the
  slot's view, in flat mode), not an ``AttributeError``; transformers'
  ``get_parameter_or_buffer`` and ``tie_weights`` use it.
* ``__setattr__``: assigning to a flattened name (flat mode) a tensor that is
  another slot (its view or its original parameter), an ordinary parameter of
  the model, or a new parameter in place of one name of a tied slot changes the
  ties as on the plain model, through :func:`relayout`. Anything else is the
  library's usual write path (``_core/writes.py``, ``_core/attribute.py``).
* ``resize_token_embeddings`` (only where the original class has it):
  the whole operation runs through :func:`relayout`.

An operation is refused before anything changes inside ``using()``, while a
load stages values, and while features hold the layout (disk offload while
offloaded, a live ``ShardedOptimizer``, live stacks of ensembles:
``_core/features.py``): their state would not fit the new layout. Mixed
precision and gradient sync hold nothing: they follow to the new core (its
compute copies cast from the new masters; sync enabled again on its groups,
with the same process group).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import Tensor, nn

from .._core.caller import caller_level
from .._core.features import refuse_held_layout
from .._core.fit import misfit
from .._core.flat_parameter import FlatParameter
from .._core.grad.owner import set_grad
from .._core.names import MODULE_STATE_ATTR, base_of, registered_storage
from .._core.records import ModuleState, Slot
from .._core.transaction import Transaction, atomically
from .._core.view_cache import same_memory
from .._state import relaid_optim
from .._state.relaid_optim import Move
from . import surgery
from .coordinator import StorageCore
from .grouping import resolve_groups
from .leaf_writes import keep_leaf_state
from .lifecycle import build_storage, remove_in, remove_storage

__all__ = [
    "get_parameter",
    "held_names",
    "reassign",
    "relayout",
    "relayout_flat",
    "resize_token_embeddings",
    "set_attribute",
    "slot_names",
]

T = TypeVar("T")


def relayout(core: StorageCore, what: str, change: Callable[[], T]) -> T:
    """Run ``change`` on the plain model, then lay out the same groups again.

    A slot follows its parameter object: where a module swap re-hosted it
    (the new module holds the same ``nn.Parameter``), its new names are the
    slot's. A weight that cannot live in a flat buffer (``_core/fit.py``: a
    quantized tensor, another dtype) leaves the storage, with one warning that
    names it; when nothing is left, the storage is removed.

    Args:
        core: the storage to lay out again.
        what: the operation, for error messages.
        change: the operation; it sees the model as a plain one (ordinary
            parameters, original classes).

    Returns:
        What ``change`` returns.

    Raises:
        RuntimeError: inside ``using()``, during a load, or while features
            hold the layout (nothing changed).
    """
    check_relayout(core, what)
    core.sync_writes()
    leaf_state = None if core.is_flattened else keep_leaf_state(core.module)
    plan = _Plan(core)
    remove_storage(core)
    moved = plan.moved()
    try:
        return change()
    finally:
        # Also when ``change`` raised: the model is flattened again as the operation left it,
        # as a plain model is left by a failed operation.
        new, left = _register_again(plan)
        plan.hand_over(new)
        plan.follow(new)
        if new is not None and leaf_state is not None:
            new.unflatten()
            leaf_state()
        plan.report(what, new, left, moved)


def relayout_flat(core: StorageCore, what: str) -> None:
    """Lay out the groups of ``core`` again as the model is now, in flat mode, all or nothing.

    What :func:`relayout` does with an operation that changes nothing: unflattened
    mode's module swaps, released weights and dead space (``rehost.py``).

    Raises:
        RuntimeError: as :func:`check_relayout` (nothing changed).
    """
    check_relayout(core, what)
    core.sync_writes()
    plan = _Plan(core)

    def change(tx: Transaction) -> tuple[StorageCore | None, _Left, dict[int, Any]]:
        remove_in(core, tx)
        moved = plan.moved()
        new, left = _register_again(plan, tx)
        plan.hand_over(new, tx)
        return new, left, moved

    new, left, moved = atomically(change)
    core.invalidate()
    plan.follow(new)
    plan.report(what, new, left, moved)


class _Plan:
    """What a storage laid out again keeps: its groups by name, their flat parameters and member names."""

    def __init__(self, core: StorageCore) -> None:
        self.core = core
        self.root = core.module
        self.facade = core.facade
        modules = dict(self.root.named_modules(remove_duplicate=False))
        held = held_names(modules)
        self.groups = [
            (g.name, g.flat, [n for slot in g.members for n in slot_names(core, slot, modules, held)])
            for g in core.groups()
        ]
        # The names of slots that nothing serves now: a weight there that cannot live in a flat buffer
        # (a quantized one, put in by the swap that replaced the slot's module) is reported as left.
        self.orphans = [
            n for s in core.slots() if not slot_names(core, s, modules, held) for n in s.all_names
        ]
        self.align = max((group.layout.align for group in core.groups()), default=1)
        self.before = {group.name: group.flat.numel() for group in core.groups()}
        self.where = [(slot, core.groups()[slot.group_index]) for slot in core.slots()]
        #: The features that follow to the new core, with their ``relayout_record()`` (taken now,
        #: before removal disables them): mixed precision, gradient sync while enabled.
        self.followers = [(f, record) for f in core.features if (record := f.relayout_record()) is not None]

    def moved(self) -> dict[int, Any]:
        """Return where each slot's parameter was, by ``id`` (after removal, which may reassign them)."""
        return {
            id(s.param): (g.name, g.layout.offsets[s.index], g.layout.numels[s.index]) for s, g in self.where
        }

    def hand_over(self, new: StorageCore | None, tx: Transaction | None = None) -> None:
        """Make ``new`` the storage behind the user's ``FlatStorage`` and the old core's successor."""
        if new is None:
            return
        new.no_sync_depth = self.core.no_sync_depth
        new.facade = self.facade
        for obj, attr in ((self.core, "replaced_by"), (self.facade, "_held")):
            if obj is None:
                continue
            if tx is None:
                setattr(obj, attr, new)
            else:
                tx.set_attr(obj, attr, new)

    def follow(self, new: StorageCore | None) -> None:
        """Compose on ``new`` the features that follow a new layout (after the change is committed)."""
        for feature, (function, args) in self.followers:
            feature.on_removed()  # the old groups' copies and hooks (again after remove_storage: a no-op)
            if new is not None:
                function(new, *args)

    def report(self, what: str, new: StorageCore | None, left: _Left, moved: dict[int, Any]) -> None:
        """After the change: record where optimizer state moves, warn about the tensors that left."""
        if new is not None:
            _record_moves(new, moved, self.before)
        if left.released:
            _warn_released(what, left.released, _after(self.before, new))
        if new is None:
            self.core.removed_why = (
                f"{what} removed it, as no tensor it held was left in the model; "
                "register_flat_storage(model) flattens the parameters the model has now"
            )
            if not left.released:  # else that warning says it
                warnings.warn(
                    f"{what}: no tensor of the flat storage is left in the model ({', '.join(left.gone)}: "
                    "their modules were replaced, or the names deleted or renamed), so the flat storage was "
                    "removed (get_flat_storage(model) is None). The model's parameters are ordinary ones, "
                    "as on the plain model; register_flat_storage(model) flattens them again",
                    UserWarning,
                    stacklevel=caller_level(),
                )


@dataclass
class _Left:
    """What left a storage laid out again (:func:`_register_again`)."""

    #: ``(name, why)`` of each tensor that cannot live in its group's buffer (it stays on its module).
    released: list[tuple[str, str]] = field(default_factory=list)
    #: Each name whose slot's tensor is gone from the model (its module replaced, the name deleted or
    #: renamed).
    gone: list[str] = field(default_factory=list)


def _record_moves(new: StorageCore, old_at: dict[int, tuple[str, int, int]], before: dict[str, int]) -> None:
    """Record where each slot of each group of ``new`` was, so that optimizer state follows it."""
    for group in new.groups():
        if group.name not in before:
            continue
        segments = []
        resized = False
        for slot in group.members:
            found = old_at.get(id(slot.param))
            if found is not None and found[0] == group.name:
                resized = resized or found[2] != group.layout.numels[slot.index]
                segments.append((found[1], group.layout.offsets[slot.index], found[2]))
        if resized:
            # resize_token_embeddings: that slot's state fits no more, as on the plain model (whose
            # optimizer then raises for it); the group's state is left as it is.
            continue
        move = Move(group.flat_name, before[group.name], group.flat.numel(), segments)
        relaid_optim.record(group.flat, move)


def held_names(modules: dict[str, nn.Module]) -> dict[int, list[str]]:
    """Return, by parameter ``id``, every name under which a module of ``modules`` holds it."""
    held: dict[int, list[str]] = {}
    for path, module in modules.items():
        for attr, param in module._parameters.items():
            if param is not None:
                held.setdefault(id(param), []).append(f"{path}.{attr}" if path else attr)
    return held


def slot_names(
    core: StorageCore, slot: Slot, modules: dict[str, nn.Module], held: dict[int, list[str]]
) -> list[str]:
    """Return the names of ``slot`` now: the live ones, then where a module swap re-hosted its parameter."""
    names = list(surgery.live_names(core, slot, modules))
    return names + [name for name in held.get(id(slot.param), ()) if name not in names]


def _after(before: dict[str, int], new: StorageCore | None) -> str:
    """Return what became of the groups (``before``: group name -> its flat parameter's numel)."""
    if new is None:
        return "nothing was left in it, so the flat storage was removed (get_flat_storage(model) is None)"
    sizes = {group.name: group.flat.numel() for group in new.groups()}
    return "; ".join(
        f"group '{name}' was laid out again ({numel:,} -> {sizes.get(name, 0):,} elements)"
        for name, numel in before.items()
    )


def _warn_released(what: str, released: list[tuple[str, str]], after: str) -> None:
    listed = ", ".join(f"{name} ({why})" for name, why in released)
    warnings.warn(
        f"{what}: {len(released)} tensor(s) cannot live in a flat buffer and left the flat storage: "
        f"{listed}. They are ordinary parameters of their modules now, as on the plain model; {after}",
        UserWarning,
        stacklevel=caller_level(),
    )


def check_relayout(core: StorageCore, what: str) -> None:
    """Raise if ``core`` cannot be laid out again now (see :func:`relayout`)."""
    if core.using_depth:
        raise RuntimeError(
            f"cannot run {what} inside storage.using(...): it changes the layout of the flat "
            "storage; leave the using() block first"
        )
    if core.pending is not None:
        raise RuntimeError(
            f"cannot run {what} while load_state_dict stages values; let the load finish first"
        )
    refuse_held_layout(core, what)


def _register_again(plan: _Plan, tx: Transaction | None = None) -> tuple[StorageCore | None, _Left]:
    """Register the groups of ``plan`` over its module's parameters now (as part of ``tx`` if given).

    Returns:
        The new core (``None`` when no group has a parameter left), and what
        left the storage: each name whose tensor cannot live in its group's
        buffer, with the reason (also a slot's old name that nothing served
        before: anything else there is a new module's own, left ordinary);
        each name whose slot's tensor is gone from the model (its module
        replaced, the name deleted or renamed).
    """
    root = plan.root
    seen: set[int] = set()
    groups: dict[str, list[nn.Parameter]] = {}
    left = _Left()
    released = left.released
    for name, flat, names in plan.groups:
        params = []
        for qualified in names:
            param = _registered(root, qualified)
            if param is None:  # the operation deleted it (or set it to None)
                left.gone.append(qualified)
                continue
            why = misfit(param, flat)
            if why is not None:
                released.append((qualified, why))
                continue
            if id(param) not in seen:  # tied by the operation to a parameter of an earlier group
                seen.add(id(param))
                params.append(param)
                if param.grad is not None and param.grad.shape != param.shape:
                    set_grad(param, None)  # resized: its old gradient has no place in the new layout
        # Leaves of per-tensor mode have flags of their own: the group trains while one of them does
        # (:func:`.leaf_writes.keep_leaf_state` puts each leaf's own back after the layout).
        trains = any(param.requires_grad for param in params)
        for param in params:
            if param.requires_grad != trains:
                if tx is None:
                    param.requires_grad_(trains)
                else:
                    tx.set_attr(param, "requires_grad", trains)
        if params:
            groups[name] = params
    flats = [flat for _, flat, _ in plan.groups]
    for qualified in plan.orphans:
        param = _registered(root, qualified)
        reasons = [] if param is None else [misfit(param, flat) for flat in flats]
        if reasons and all(reasons):  # no group could hold it
            released.append((qualified, str(reasons[0])))
        else:  # none there, or a new module's own parameter: the slot's tensor is gone
            left.gone.append(qualified)
    if not groups:
        return None, left
    specs = resolve_groups(root, groups)
    reuse = {name: flat for name, flat, _ in plan.groups}
    return build_storage(root, specs, plan.align, reuse, tx), left


def _registered(root: nn.Module, qualified: str) -> nn.Parameter | None:
    """Return the parameter registered as ``qualified``, or ``None``, without reading the attribute.

    ``get_parameter`` reads it: a name that a torch parametrization now serves would be computed,
    and ``spectral_norm``'s computation in training mode runs a power iteration (it moves its
    vectors ``_u`` and ``_v``), which the plain model would not run.
    """
    path, _, attr = qualified.rpartition(".")
    try:
        owner = root.get_submodule(path)
    except AttributeError:
        return None
    param = owner._parameters.get(attr)
    return param if isinstance(param, nn.Parameter) else None


# ------------------------------------------------------------ the injected methods
def get_parameter(self: nn.Module, target: str) -> Any:
    """Return parameter ``target``; a flattened name gives what its attribute serves (flat mode: the view)."""
    path, _, attr = target.rpartition(".")
    owner = self.get_submodule(path)
    state = owner.__dict__.get(MODULE_STATE_ATTR)
    if isinstance(state, ModuleState) and attr in state.slots and attr not in owner._parameters:
        return getattr(owner, attr)
    base: Any = base_of(self)
    return base.get_parameter(self, target)


def set_attribute(self: nn.Module, name: str, value: Any) -> None:
    """Set attribute ``name``; a tensor for a flattened name may change ties (:func:`reassign`)."""
    if isinstance(value, Tensor):  # anything else (flags, modules) goes straight to nn.Module
        state = self.__dict__.get(MODULE_STATE_ATTR)
        if state is not None and name in state.slots and reassign(self, state, name, value):
            return
    base: Any = base_of(self)
    base.__setattr__(self, name, value)


def resize_token_embeddings(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run transformers' ``resize_token_embeddings`` on the plain model, then lay the storage out again."""
    base = base_of(self).resize_token_embeddings  # type: ignore[attr-defined]
    state = self.__dict__.get(MODULE_STATE_ATTR)
    core: Any = registered_storage(self) or (state.storage if isinstance(state, ModuleState) else None)
    new_num_tokens = args[0] if args else kwargs.get("new_num_tokens")
    multiple = args[1] if len(args) > 1 else kwargs.get("pad_to_multiple_of")
    if core is None or (new_num_tokens is None and multiple is None):  # changes nothing
        return base(self, *args, **kwargs)
    return relayout(core, "resize_token_embeddings", lambda: base(self, *args, **kwargs))


def reassign(module: nn.Module, state: ModuleState, attr: str, value: Tensor) -> bool:
    """Change the ties as on the plain model when ``module.<attr> = value`` asks for it (flat mode).

    Returns ``False`` (nothing done) unless ``value`` is another slot (its view
    or its original parameter), an ordinary parameter of the model, or a new
    ``nn.Parameter`` for one name of a tied slot; then the assignment runs on the
    plain model and the storage is laid out again (:func:`relayout`).

    Raises:
        RuntimeError: for a parameter whose dtype, device or ``requires_grad``
            differs from the slot's group, or as :func:`check_relayout` (nothing changed).
    """
    core = state.storage
    if not core.is_flattened or core.pending is not None or core.using_depth:
        return False
    root = core.module_unchecked
    if registered_storage(root) is not core or not isinstance(core, StorageCore):
        return False
    views, index = state.slots[attr]
    group = next(g for g in core.groups() if g.views is views)
    target = group.members[[s.index for s in group.members].index(index)]
    source = _slot_holding(core, value)
    if source is target:
        return False  # the slot itself: a no-op (or the usual landing of its values)
    modules = dict(root.named_modules(remove_duplicate=False))
    names = surgery.live_names(core, target, modules)
    path = next((p for p, m in modules.items() if m is module), "")
    qualified = f"{path}.{attr}" if path else attr
    if source is not None:
        tied = source

        def tie() -> None:
            module.register_parameter(attr, tied.param)  # plain now: the slot's own parameter

        relayout(core, f"tying {qualified} to {source.name}", tie)
        return True
    if not isinstance(value, nn.Parameter) or isinstance(value, FlatParameter):
        return False
    ordinary = any(p is value for p in root.parameters())
    if not ordinary and len(names) < 2:
        return False  # a new parameter for an untied slot: its values land in the slot
    flat = group.flat
    found = (value.dtype, value.device, value.requires_grad)
    if found != (flat.dtype, flat.device, flat.requires_grad):
        raise RuntimeError(
            f"cannot set {qualified} to a parameter of {found[0]} on {found[1]} with "
            f"requires_grad={found[2]}: its group '{group.name}' holds {flat.dtype} on "
            f"{flat.device} with requires_grad={flat.requires_grad}; nothing was changed. Convert "
            "the parameter first, or change it on the plain model (inside storage.unflattened(), "
            "or after remove_flat_storage)"
        )
    how = "tying" if ordinary else "untying"

    def assign() -> None:
        module.register_parameter(attr, value)

    relayout(core, f"{how} {qualified}", assign)
    return True


def _slot_holding(core: StorageCore, value: Tensor) -> Slot | None:
    """Return the slot that ``value`` is (its original parameter, or a view of it), or ``None``."""
    for group in core.groups():
        values = group.value_views()
        for slot in group.members:
            if value is slot.param or (values[slot.index].numel() and same_memory(value, values[slot.index])):
                return slot
            served = group.views.view(slot.index)
            if value is served:
                return slot
    return None
