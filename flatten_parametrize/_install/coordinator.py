"""The private coordinator core of a flat storage: its state, its modes and the write paths it owns.

One :class:`StorageCore` per registered module. It holds the group and slot
records, the mode, the staging list of a load in progress and the features
composed on it; it implements ``_core.records.Coordinator``, the only
interface the rest of the library sees of it. The injected classes, the view
cache, the surgery and every feature talk to this object; users hold the
public facade ``flatten_parametrize.FlatStorage``, which delegates here. The
module surgery is in ``surgery.py``, registration and removal in
``lifecycle.py``, pickling in ``pickling.py``, deep copy in ``copying.py``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, Union

import torch
from torch import Tensor, nn

from .._core.features import Feature
from .._core.flat_parameter import FlatParameter
from .._core.foreign import (
    detached_dtensor,
    is_distributed,
    is_foreign,
    is_fsdp2_compute_param,
    is_stale_batched,
)
from .._core.grad.owner import GroupGrad
from .._core.layout import GroupLayout
from .._core.names import (
    MODULE_STATE_ATTR,
    flat_layout_name,
    flat_param_name,
    registered_storage,
)
from .._core.per_group import per_group
from .._core.records import Group, ModuleState, ParamInfo, Slot, StagedValue
from .._core.transaction import Transaction, atomically
from .._core.view_cache import GroupViews, same_memory
from .._core.writes import check_flat_replacement, land_direct_writes
from .._state.state_dict import layout_record
from . import surgery
from .per_tensor import PerTensorMode

__all__ = ["FlatTensors", "FlattenStep", "StorageCore", "use_flatten_steps"]

#: One tensor per group: a list in group order, a dict by group name, or (for a
#: storage with one group) a single tensor.
FlatTensors = Union[Tensor, Sequence[Tensor], Mapping[str, Tensor]]

F = TypeVar("F")

#: A step of the user's ``flatten()`` in unflattened mode, run before it flattens as usual: ``True``
#: when it flattened the core itself (by laying the groups out again).
FlattenStep = Callable[["StorageCore"], bool]

#: The steps :meth:`StorageCore.flatten` runs, set by :func:`use_flatten_steps` (``injected.assemble``:
#: ``leaf_writes.flatten_relaid``, ``rehost.flatten_changed``).
_flatten_steps: tuple[FlattenStep, ...] = ()


def use_flatten_steps(steps: tuple[FlattenStep, ...]) -> None:
    """Make the user's ``flatten()`` run ``steps`` (``injected.assemble`` calls it once)."""
    global _flatten_steps
    _flatten_steps = steps


class StorageCore:
    """The coordinator of a module's flat parameters (private: users hold ``FlatStorage``).

    Args:
        module: the registered module (held weakly).
        group_names: the group names, in group order.
        flats: the flat parameter of each group.
        layouts: the layout of each group.
        slots: one record per flattened parameter object.
        views: each group's view cache (default: new ones over ``module._parameters``;
            a deep copy passes the copied ones, which its modules' states hold).
        flattened: the mode (a deep copy of an unflattened model starts unflattened).
    """

    def __init__(
        self,
        module: nn.Module,
        group_names: Sequence[str],
        flats: Sequence[FlatParameter],
        layouts: Sequence[GroupLayout],
        slots: Sequence[Slot],
        *,
        views: Sequence[GroupViews] | None = None,
        flattened: bool = True,
    ) -> None:
        self._root_ref = weakref.ref(module)
        self._slots = tuple(slots)
        groups = []
        for index, (name, flat, layout) in enumerate(zip(group_names, flats, layouts)):
            flat_name = flat_param_name(name)
            members = tuple(slot for slot in self._slots if slot.group_index == index)
            if views is None:  # a new storage: each group owns a new gradient, its views build into it
                grads = GroupGrad(layout)
                names = tuple(slot.name for slot in members)
                group_views = GroupViews(module._parameters, flat_name, layout, grads, names)
            else:  # a copy's groups: the views were copied with the gradient owner they build into
                group_views = views[index]
                grads = group_views.grads
            groups.append(Group(index, name, flat_name, layout, group_views, flat, members, grads))
        self._groups = tuple(groups)
        self._flattened = flattened
        #: Depth of nested ``using()`` blocks.
        self.using_depth = 0
        #: Depth of nested ``no_sync()`` blocks: gradient sync (the storage's or a
        #: ``ShardedOptimizer``'s) reduces nothing while it is not 0.
        self.no_sync_depth = 0
        #: Values staged by a ``load_state_dict`` in progress (``None``: none, or unflattened mode).
        self.pending: list[StagedValue] | None = None
        #: The modules this storage changed, with their state (recorded at registration).
        self._owners: list[tuple[weakref.ref[nn.Module], ModuleState]] | None = None
        #: ``_owners`` by module id, for ``state_of``.
        self._owner_ids: dict[int, tuple[weakref.ref[nn.Module], ModuleState]] | None = None
        #: The features composed on this core, in the order the lifecycle notifies them.
        self.features: list[Feature] = []
        #: The public ``FlatStorage`` handed out for this core (made by the public layer).
        self.facade: Any = None
        #: The core that took this one's place when the groups were laid out again (``relayout.py``).
        self.replaced_by: StorageCore | None = None
        #: Why the storage removed itself (nothing it held was left in the model), with the way on,
        #: for the error of a later call on it (``None``: not removed so).
        self.removed_why: str | None = None
        #: Switches the groups' gradient owners into and out of per-tensor mode (unflattened mode).
        self.per_tensor = PerTensorMode(self)

    # --------------------------------------------------------------- read API
    @property
    def module(self) -> nn.Module:
        """Return the registered module.

        Raises:
            RuntimeError: if the module was garbage collected or the storage removed.
        """
        module = self._root_ref()
        if module is None or registered_storage(module) is not self:
            raise RuntimeError(
                f"this flat storage is detached: {self.removed_why}"
                if self.removed_why
                else "this flat storage is detached: its module was garbage collected or "
                "remove_flat_storage was called; use get_flat_storage(module) for the current one"
            )
        return module

    @property
    def is_attached(self) -> bool:
        """Return whether the module is alive and this storage is registered on it."""
        module = self._root_ref()
        return module is not None and registered_storage(module) is self

    def module_or_none(self) -> nn.Module | None:
        """Return the registered module, or ``None`` once it was garbage collected."""
        return self._root_ref()

    @property
    def module_unchecked(self) -> nn.Module:
        """Return the registered module, also while registration is still under way."""
        module = self._root_ref()
        if module is None:
            raise RuntimeError("the module of this flat storage was garbage collected")
        return module

    def groups(self) -> tuple[Group, ...]:
        """Return the record of each group, in group order."""
        return self._groups

    def slots(self) -> tuple[Slot, ...]:
        """Return the record of each flattened slot, in group and layout order."""
        return self._slots

    @property
    def is_flattened(self) -> bool:
        """Return whether the module is in flat mode."""
        return self._flattened

    @property
    def flat_params(self) -> list[FlatParameter]:
        """Return the flat parameters, one per group, in group order (pending writes landed)."""
        self.sync_writes()
        return [group.flat for group in self._groups]

    @property
    def group_names(self) -> list[str]:
        """Return the group names, in group order."""
        return [group.name for group in self._groups]

    def flat_of(self, group: str) -> FlatParameter:
        """Return the flat parameter of group ``group`` (see ``FlatStorage.__getitem__``)."""
        if not isinstance(group, str):
            raise TypeError(
                f"flat storage groups are named by str; got {type(group).__name__} {group!r}; "
                f"groups are {self.group_names}"
            )
        for record in self._groups:
            if record.name == group:
                self.sync_writes()
                return self._groups[record.index].flat
        raise KeyError(f"no group {group!r} in this flat storage; groups are {self.group_names}")

    @property
    def param_infos(self) -> list[ParamInfo]:
        """Return one :class:`ParamInfo` per flattened slot, in group and buffer order."""
        return [
            ParamInfo(
                name=slot.name,
                aliases=slot.aliases,
                group=group.name,
                offset=group.layout.offsets[slot.index],
                numel=group.layout.numels[slot.index],
                shape=torch.Size(group.layout.shapes[slot.index]),
                dtype=group.flat.dtype,
            )
            for group in self._groups
            for slot in group.members
        ]

    def members(self) -> list[tuple[nn.Module, ModuleState]]:
        """Return every module this storage changed (still alive), with its state.

        Recorded at registration; in unflattened mode the modules other than the
        registered one are plain (original class, no library state in ``__dict__``).
        """
        if self._owners is None:
            self._owners = [
                (weakref.ref(module), state)
                for module in {id(m): m for m in self.module_unchecked.modules()}.values()
                if isinstance(state := module.__dict__.get(MODULE_STATE_ATTR), ModuleState)
                and state.storage is self
            ]
            self._owner_ids = {id(ref()): (ref, state) for ref, state in self._owners}
        return [(module, state) for ref, state in self._owners if (module := ref()) is not None]

    def adopt_members(self, owners: list[tuple[nn.Module, ModuleState]]) -> None:
        """Take ``owners`` as the modules this storage changed (a deep copy's)."""
        self._owners = [(weakref.ref(module), state) for module, state in owners]
        self._owner_ids = {id(ref()): (ref, state) for ref, state in self._owners}

    def state_of(self, module: nn.Module) -> ModuleState | None:
        """Return the library's state of ``module`` if this storage changed it, in either mode.

        In unflattened mode the modules other than the registered one keep no state in
        their ``__dict__``: it is found among the members this storage recorded.
        """
        state = module.__dict__.get(MODULE_STATE_ATTR)
        if state is None and self._owner_ids is not None:
            found = self._owner_ids.get(id(module))
            state = found[1] if found is not None and found[0]() is module else None
        return state if isinstance(state, ModuleState) and state.storage is self else None

    def current_names(self) -> list[tuple[str, ...]]:
        """Return the names by which the tree reaches each slot now, in ``param_infos`` order (none: dead).

        A module moved in the tree (fused into a container, put back by an adapter's merge) gives its
        slots' current names.
        """
        modules = dict(self.module.named_modules(remove_duplicate=False))
        return [surgery.live_names(self, slot, modules) for group in self._groups for slot in group.members]

    def live_names(self) -> set[str]:
        """Return every flattened name whose module is still where registration found it.

        A submodule replaced or deleted after registration leaves its names dead.
        """
        return {name for names in self.current_names() for name in names}

    # ---------------------------------------------------------------- features
    def feature(self, kind: type[F]) -> F | None:
        """Return the feature of type ``kind`` composed on this core, or ``None``."""
        return next((f for f in self.features if type(f) is kind), None)

    def add_feature(self, feature: Feature) -> None:
        """Drive ``feature``'s lifecycle from now on."""
        self.features.append(feature)
        self.per_tensor.update_hooks()

    def remove_feature(self, feature: Feature) -> None:
        """Stop driving ``feature``'s lifecycle (nothing happens if it was not added)."""
        self.features = [f for f in self.features if f is not feature]
        self.per_tensor.update_hooks()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Have gradient sync skip the backward passes inside the block (``FlatStorage.no_sync``)."""
        self.no_sync_depth += 1
        try:
            yield
        finally:
            self.no_sync_depth -= 1

    def flat_buffers_replaced(self) -> None:
        """Re-point the originals and views after flat buffers were swapped; notify every feature.

        The "flat buffer replaced" notification: features call it after they
        swap a flat parameter's ``.data`` (the disk backing does), and the
        core runs it after ``module.to()`` & co. re-back or replace the flat
        parameters.
        """
        surgery.refresh_originals(self._groups, self._slots)
        self._tell_rebacked()

    def _tell_rebacked(self) -> None:
        self.per_tensor.rebacked()
        for feature in list(self.features):
            feature.on_rebacked()

    # ------------------------------------------------------------------- views
    def _live(self, slot: Slot, modules: dict[str, nn.Module], remove_duplicate: bool) -> tuple[str, ...]:
        names = surgery.live_names(self, slot, modules)
        return names[:1] if remove_duplicate else names

    def view_names(self, remove_duplicate: bool = True) -> list[str]:
        """Return every live flattened name, without reading a view (no cast, no collective)."""
        modules = dict(self.module.named_modules(remove_duplicate=False))
        return [name for slot in self._slots for name in self._live(slot, modules, remove_duplicate)]

    def named_views(self, remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(name, tensor)`` for every live flattened name, as the module serves it."""
        self.sync_writes()
        modules = dict(self.module.named_modules(remove_duplicate=False))
        for slot in self._slots:
            for name in self._live(slot, modules, remove_duplicate):
                owner, attr = surgery.locate(modules, name)
                yield name, getattr(owner, attr)

    def named_grads(self, remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor | None]]:
        """Yield ``(name, gradient view or None)`` for every live flattened name."""
        if not self._flattened:
            for name, param in self.named_views(remove_duplicate):
                yield name, param.grad
            return
        self.sync_writes()
        grads = [group.grad_views() for group in self._groups]
        modules = dict(self.module.named_modules(remove_duplicate=False))
        for slot in self._slots:
            split = grads[slot.group_index]
            for name in self._live(slot, modules, remove_duplicate):
                yield name, None if split is None else split[slot.index]

    def per_group_tensors(self, tensors: FlatTensors, what: str, exact: bool) -> list[Tensor]:
        """Return one flat-shaped tensor per group from ``tensors`` (checked; see ``views_of``)."""
        groups = self.group_names
        items = per_group(tensors, groups, what, "tensor", "flat-shaped tensor")
        for group, item, flat in zip(groups, items, self.flat_params):
            if item.shape != flat.shape:
                raise ValueError(
                    f"{what}: group '{group}' needs a one-dimensional tensor of "
                    f"{flat.numel()} elements; got shape {tuple(item.shape)}"
                )
            if exact and (item.dtype != flat.dtype or item.device != flat.device):
                raise ValueError(
                    f"{what}: group '{group}' needs a {flat.dtype} tensor on {flat.device}; "
                    f"got {item.dtype} on {item.device}; convert it with "
                    f".to(device={str(flat.device)!r}, dtype={flat.dtype})"
                )
        return items

    def views_of(self, tensors: FlatTensors, remove_duplicate: bool = True) -> dict[str, Tensor]:
        """Return ``{name: view}`` over tensors shaped like the flat parameters."""
        items = self.per_group_tensors(tensors, "views_of()", exact=False)
        for group, t in zip(self._groups, items):
            group.views.aliased(t)  # views of a master go to outside code, which may write their `.data`
        splits = [group.split(t) for group, t in zip(self._groups, items)]
        modules = dict(self.module.named_modules(remove_duplicate=False))
        return {
            name: splits[slot.group_index][slot.index]
            for slot in self._slots
            for name in self._live(slot, modules, remove_duplicate)
        }

    # ------------------------------------------------------------ mode toggles
    def flatten(self, *, relayout: bool = False) -> None:
        """Switch to flat mode (a no-op in flat mode), all or nothing.

        Args:
            relayout: the user's ``flatten()`` (and the end of ``unflattened()``):
                module swaps, weights that left the storage and dead space of
                unflattened mode lay the groups out again first (``rehost.py``,
                one of the steps of :func:`use_flatten_steps`); this core is then replaced
                (:meth:`current`). The library's own switches keep the core.
        """
        if not self._flattened:
            if relayout and any(step(self) for step in _flatten_steps):
                return
            atomically(self.flatten_in)
            # The leaf parameters of unflattened mode have version counters of their own: their
            # in-place updates changed the flat buffers without bumping the flat parameters' counters.
            self._tell_rebacked()

    def flatten_in(self, tx: Transaction) -> None:
        """Flatten as part of ``tx`` (a no-op in flat mode)."""
        if self._flattened:
            return
        self.per_tensor.detach(tx)
        surgery.flatten_module(self, tx)
        tx.set_attr(self, "_flattened", True)
        gone = surgery.released(self)  # parameters a module kept after leaving the storage
        surgery.refresh_originals(self._groups, [s for s in self._slots if id(s) not in gone], tx)

    def unflatten(self) -> None:
        """Switch to unflattened mode (a no-op there), all or nothing.

        Raises:
            RuntimeError: inside ``using()``.
        """
        if not self._flattened:
            return
        if self.using_depth:
            raise RuntimeError(
                "cannot unflatten inside storage.using(...): the views are served from the "
                "given tensors; leave the using() block first"
            )
        self.sync_writes()
        atomically(self._unflatten)
        self.invalidate()

    def _unflatten(self, tx: Transaction) -> None:
        surgery.unflatten_module(self, tx)
        tx.set_attr(self, "_flattened", False)
        self.per_tensor.attach(tx)

    def mark_removed(self, tx: Transaction) -> None:
        """Record, as part of ``tx``, that the module no longer has this storage's views."""
        tx.set_attr(self, "_flattened", False)

    @contextmanager
    def unflattened(self) -> Iterator[StorageCore]:
        """Run a block in unflattened mode, then restore the previous mode (also on error)."""
        was_flat = self._flattened
        self.unflatten()
        try:
            yield self
        finally:
            current = self.current()
            if was_flat and current.is_attached:  # not removed (every weight left it)
                current.flatten(relayout=True)

    def current(self) -> StorageCore:
        """Return the core now registered in this one's place (itself, unless it was laid out again)."""
        core = self
        while core.replaced_by is not None:
            core = core.replaced_by
        return core

    @contextmanager
    def using(self, flat_tensors: FlatTensors) -> Iterator[None]:
        """Serve every view from ``flat_tensors`` instead of the flat parameters (``FlatStorage.using``)."""
        if not self._flattened:
            raise RuntimeError(
                "storage.using(...) needs flat mode; it was called in unflattened mode "
                "(inside unflattened() or after unflatten()); call flatten() first"
            )
        items = [t.contiguous() for t in self.per_group_tensors(flat_tensors, "using()", exact=True)]
        params: dict[str, Any] = self.module._parameters
        flat_names = [group.flat_name for group in self._groups]
        saved = [params[name] for name in flat_names]
        for name, tensor in zip(flat_names, items):
            params[name] = tensor
        self.using_depth += 1
        try:
            yield
        finally:
            for name, tensor in zip(flat_names, saved):
                params[name] = tensor
            self.using_depth -= 1
            self.invalidate()

    def invalidate(self) -> None:
        """Drop every cached view (landing pending `.data` writes first)."""
        surgery.invalidate(self._groups)

    def release_buffers(self) -> None:
        """After removal: let go of the flat buffers, gradients and reused gradient memory.

        The parameters own their values by then; a ``FlatStorage`` the user
        still holds raises when used (detached), and keeps no second copy of
        the weights alive. A flat parameter object an optimizer still holds is
        empty (a storage laid out again refills the ones it reuses).
        """
        for group in self._groups:
            group.grads.assign(group.flat, None)
            group.grads.forget_memory()
            group.flat.data = torch.empty(0, dtype=group.flat.dtype, device=group.flat.device)

    # ------------------------------------------------------------ write paths
    def sync_writes(self, *, forward: bool = False) -> None:
        """Land the writes made around the views since the last call, or refuse them; refresh the features.

        A replaced flat parameter (``module.flat_param_0 = p``,
        ``module._parameters["flat_param_0"] = p``) is adopted, parameters put
        into a flattened module's ``_parameters`` and tensors assigned to a
        view's ``.data`` are copied into their slots (see ``_core/writes.py``).
        Then every feature's ``refresh()`` runs (see ``_core/features.py``).
        State dicts, toggles, loading, copying and removal call it. Does
        nothing in unflattened mode.

        Args:
            forward: the registered module's forward (its pre-hook): only an
                identity check per group, and a scan of the views of a group
                whose cache switched entries since the last forward. Parameters
                put into ``_parameters`` land when their attribute is read.

        Raises:
            RuntimeError: for a write that cannot land (it is undone).
        """
        root = self._root_ref()
        if root is None or registered_storage(root) is not self:
            return  # detached
        if not self._flattened or self.pending is not None:
            return
        if not self.using_depth:
            params = root._parameters
            replaced: list[tuple[Group, Any]] = []
            for group in self._groups:
                current = params.get(group.flat_name)
                if current is group.flat:
                    continue
                if is_stale_batched(current):  # left by a vmap that failed to restore the module
                    params[group.flat_name] = group.flat
                    continue
                if is_foreign(current) or is_fsdp2_compute_param(root, group.flat, current):
                    continue  # functional_call's substitute, FSDP2's DTensor or unsharded one: left alone
                try:
                    check_flat_replacement(group, current)
                except RuntimeError:
                    params[group.flat_name] = group.flat  # refused: the flat parameter is back
                    raise
                replaced.append((group, current))
            if replaced:
                self.adopt_replacements(replaced)
        if forward:
            for group in self._groups:
                group.views.land_flagged()
        else:
            land_direct_writes(self.members())
            for group in self._groups:
                group.views.sync()
        for feature in list(self.features):
            feature.refresh()

    def adopt_replacements(self, replaced: list[tuple[Group, Any]]) -> None:
        """Adopt parameters registered in flat parameters' places, all or nothing.

        Each becomes its group's ``FlatParameter`` (re-classed in place, with the
        layout); on failure the old flat parameters are back and the new ones
        keep their class.
        """
        classes = [type(param) for _, param in replaced]
        try:
            self.adopt_flat_params()
        except BaseException:
            params = self.module._parameters
            for (group, param), cls in zip(replaced, classes):
                params[group.flat_name] = group.flat
                self._set_group(group)
                if type(param) is not cls:
                    param.__class__ = cls
            surgery.refresh_originals(self._groups, self._slots)
            raise

    def adopt_flat_params(self) -> None:
        """Re-wrap flat parameters that ``module.to()`` & co. replaced or re-classed.

        Another engine's tensor in a flat parameter's place (FSDP2's DTensor) is
        left to that engine; only the padding of its local shard is zeroed.
        """
        root = self.module
        for group in self._groups:
            flat = surgery.rewrap_flat_param(root, group)
            if flat is not group.flat:
                self._set_group(dataclasses.replace(group, flat=flat))
        for group in self._groups:
            surgery.zero_padding(group.flat, group.layout)  # e.g. to_empty() leaves garbage there
            registered = root._parameters.get(group.flat_name)
            if registered is not None and registered is not group.flat and is_foreign(registered):
                surgery.zero_padding(registered, group.layout)  # FSDP2's DTensor: its local shard
        self.flat_buffers_replaced()  # a converted or moved buffer left its offload file, say

    def _set_group(self, group: Group) -> None:
        groups = list(self._groups)
        groups[group.index] = group
        self._groups = tuple(groups)

    # ------------------------------------------------------------ state dicts
    def flat_state_dict(self) -> OrderedDict[str, Any]:
        """Return the module's state dict in flat form (see ``FlatStorage.flat_state_dict``)."""
        plain = self.module.state_dict()
        out: OrderedDict[str, Any] = OrderedDict()
        out._metadata = getattr(plain, "_metadata", OrderedDict())  # type: ignore[attr-defined]
        for group in self._groups:
            out[group.flat_name] = self._current_flat(group, plain)
            out[flat_layout_name(group.name)] = layout_record(group)
        flattened = self.live_names()  # a replaced submodule's entries are its own, ordinary ones
        for key, value in plain.items():
            if key not in flattened:
                out[key] = value
        return out

    def _current_flat(self, group: Group, plain: Mapping[str, Tensor]) -> Tensor:
        """Return group's values as one tensor: the flat buffer, or a synced copy if unflattened
        parameters were reassigned (without changing anything)."""
        flat = group.flat.detach()
        if self._flattened:
            registered = self.module._parameters.get(group.flat_name)
            if is_distributed(registered):  # FSDP2's DTensor holds the values (sharded like the buffer)
                return detached_dtensor(registered)
            return flat
        targets = group.split(flat)
        live = self.live_names()
        stale = [
            s for s in group.members if s.name in live and not same_memory(plain[s.name], targets[s.index])
        ]
        if not stale:
            return flat
        with torch.no_grad():
            synced = flat.clone()
            synced_targets = group.split(synced)
            for slot in stale:
                synced_targets[slot.index].copy_(plain[slot.name])
        return synced

    def __getstate__(self) -> None:
        # The registered module pickles itself with a record of its storage (``pickling.py``).
        raise RuntimeError(
            "a FlatStorage cannot be pickled on its own; pickle the registered module "
            "(torch.save(model)), or save module.state_dict() or storage.flat_state_dict()"
        )
