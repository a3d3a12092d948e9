"""``FlatStorage``: the coordinator that owns the flat buffers of one module.

It holds the state (group records, slot records, mode) and composes its
features (``GradSync``, ``DiskOffload``, ``Functional``; see ``_features.py``);
the changes to the module tree are done by ``_surgery.py``, state-dict work by
``_state_dict.py``, inspection by ``_inspect.py`` and ``_plot.py``. Those
modules read the coordinator through its internal read API
(:meth:`FlatStorage.groups`, :meth:`FlatStorage.slots`) and never import it.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Union

import torch
from torch import Tensor, nn

from . import _surgery as surgery
from ._attach_optim import OptimizerAttachment, attach_optimizer
from ._distributed import GradSync
from ._features import Feature, in_flat_mode
from ._flat_parameter import FlatParameter
from ._functional import Functional, StackedTensors
from ._inspect import storage_html, storage_repr, summary_table
from ._layout import GroupLayout
from ._module_classes import clone_class
from ._names import (
    MODULE_STATE_ATTR,
    UNFLATTENED,
    flat_layout_name,
    flat_param_name,
    registered_storage,
)
from ._offload import DiskOffload
from ._per_group import per_group
from ._plot import plot_layout
from ._records import Group, ModuleState, ParamInfo, Slot, StagedValue
from ._state_dict import Snapshot, commit_staged, layout_record
from ._transaction import Transaction, atomically
from ._view_cache import GroupViews, same_memory
from ._writes import check_flat_replacement, land_direct_writes, land_parameter

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["FlatStorage", "ParamInfo", "FlatTensors", "install_storage", "remove_storage"]

#: One tensor per group: a list in group order, a dict by group name, or (for a
#: storage with one group) a single tensor.
FlatTensors = Union[Tensor, Sequence[Tensor], Mapping[str, Tensor]]


class FlatStorage:
    """The coordinator of a module's flat parameters, returned by ``register_flat_storage``.

    It owns one :class:`FlatParameter` per group (registered on the module as
    ``flat_param_<group>``), serves every flattened attribute as a view of it,
    and switches between flat and unflattened mode. It holds the module weakly.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from flatten_parametrize import register_flat_storage
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> storage = register_flat_storage(model)
        >>> storage.group_names, storage["0"].numel()
        (['0'], 26)
        >>> [name for name, _ in model.named_parameters()]
        ['flat_param_0']
    """

    def __init__(
        self,
        module: nn.Module,
        group_names: Sequence[str],
        flats: Sequence[FlatParameter],
        layouts: Sequence[GroupLayout],
        slots: Sequence[Slot],
    ) -> None:
        self._root_ref = weakref.ref(module)
        self._slots = tuple(slots)
        groups = []
        for index, (name, flat, layout) in enumerate(zip(group_names, flats, layouts)):
            flat_name = flat_param_name(name)
            members = tuple(slot for slot in self._slots if slot.group_index == index)
            views = GroupViews(module._parameters, flat_name, layout, tuple(slot.name for slot in members))
            groups.append(Group(index, name, flat_name, layout, views, flat, members))
        self._groups = tuple(groups)
        self._flattened = True
        #: Depth of nested ``using()`` blocks.
        self._using_depth = 0
        #: Values staged by a ``load_state_dict`` in progress (``None``: none, or unflattened mode).
        self._pending: list[StagedValue] | None = None
        #: The modules this storage changed, with their state (recorded at registration).
        self._owners: list[tuple[weakref.ref[nn.Module], ModuleState]] | None = None
        #: ``_owners`` by module id, for ``state_of``.
        self._owner_ids: dict[int, tuple[weakref.ref[nn.Module], ModuleState]] | None = None
        self._grad_sync = GradSync(self)
        self._disk = DiskOffload(self)
        self._functional = Functional(self)
        #: Features added after registration (``add_feature``).
        self._added: list[Feature] = []

    @property
    def _features(self) -> tuple[Feature, ...]:
        """Every feature, in the order the lifecycle notifies them."""
        return (self._disk, self._grad_sync, self._functional, *self._added)

    # ------------------------------------------------------------------ basics
    @property
    def module(self) -> nn.Module:
        """Return the registered module.

        Raises:
            RuntimeError: if the module was garbage collected or the storage removed.
        """
        module = self._root_ref()
        if module is None or registered_storage(module) is not self:
            raise RuntimeError(
                "this flat storage is detached: its module was garbage collected or "
                "remove_flat_storage was called; use get_flat_storage(module) for the current one"
            )
        return module

    @property
    def flat_params(self) -> list[FlatParameter]:
        """Return the flat parameters, one per group, in group order."""
        self.sync_writes()
        return [group.flat for group in self._groups]

    @property
    def group_names(self) -> list[str]:
        """Return the group names, in group order."""
        return [group.name for group in self._groups]

    # --------------------------------------------------- internal read API
    def groups(self) -> tuple[Group, ...]:
        """Return the record of each group, in group order (internal read API of the library)."""
        return self._groups

    def slots(self) -> tuple[Slot, ...]:
        """Return the record of each flattened slot, in group and layout order (internal read API)."""
        return self._slots

    def grad_sync(self) -> GradSync:
        """Return the data-parallel feature: ``state`` (``None``: sync off), ``no_sync_depth`` (internal)."""
        return self._grad_sync

    def add_feature(self, feature: Feature) -> None:
        """Have the coordinator drive ``feature``'s lifecycle (internal: see ``_features.py``)."""
        self._added.append(feature)

    def remove_feature(self, feature: Feature) -> None:
        """Stop driving ``feature``'s lifecycle (nothing happens if it was not added)."""
        self._added = [f for f in self._added if f is not feature]

    def __getitem__(self, group: str) -> FlatParameter:
        """Return the flat parameter of ``group``.

        Raises:
            TypeError: if ``group`` is not a str.
            KeyError: if there is no such group.
        """
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

    def __len__(self) -> int:
        return len(self._groups)

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

    @property
    def is_flattened(self) -> bool:
        """Return whether the module is in flat mode (attributes are views)."""
        return self._flattened

    # ------------------------------------------------------------------- views
    def _live(self, slot: Slot, modules: dict[str, nn.Module], remove_duplicate: bool) -> tuple[str, ...]:
        names = surgery.live_names(self, slot, modules)
        return names[:1] if remove_duplicate else names

    def live_names(self) -> set[str]:
        """Return every flattened name whose module is still where registration found it.

        A submodule replaced or deleted after registration leaves its names dead
        (internal read API: state dicts and inspection use it).
        """
        modules = dict(self.module.named_modules(remove_duplicate=False))
        return {name for slot in self._slots for name in surgery.live_names(self, slot, modules)}

    def named_views(self, remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(name, tensor)`` for every flattened parameter, as the module serves it.

        In flat mode the tensors are views of the flat storage currently in use
        (the flat parameters, or the tensors given to :meth:`using`); in
        unflattened mode they are the leaf parameters.

        Args:
            remove_duplicate: yield a tied parameter once, under its first
                name (as ``named_parameters`` does). Default: ``True``.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 3)
            >>> storage = register_flat_storage(layer)
            >>> [(name, tuple(view.shape)) for name, view in storage.named_views()]
            [('weight', (3, 2)), ('bias', (3,))]
        """
        self.sync_writes()
        modules = dict(self.module.named_modules(remove_duplicate=False))
        for slot in self._slots:
            for name in self._live(slot, modules, remove_duplicate):
                owner, attr = surgery.locate(modules, name)
                yield name, getattr(owner, attr)

    def named_grads(self, remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor | None]]:
        """Yield ``(name, gradient)`` for every flattened parameter.

        In flat mode each gradient is a view of its flat parameter's ``.grad``
        (``None`` while that is ``None``); in unflattened mode it is the leaf
        parameter's ``.grad``.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 1)
            >>> storage = register_flat_storage(layer)
            >>> layer(torch.ones(1, 2)).sum().backward()
            >>> dict(storage.named_grads())["bias"]
            tensor([1.])
        """
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

    def _per_group(self, tensors: FlatTensors, what: str, exact: bool) -> list[Tensor]:
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
        """Return ``{name: view}`` over tensors shaped like the flat parameters.

        Useful for anything kept per flat parameter: an optimizer's
        ``exp_avg``, an EMA copy, a gradient. Views share memory with (and
        carry autograd from) the given tensors; dtypes and devices may differ.

        Args:
            tensors: one tensor per group: a list in group order, a dict by
                group name, or a single tensor when there is one group.
            remove_duplicate: list a tied parameter once. Default: ``True``.

        Returns:
            A dict from parameter name to view.

        Raises:
            TypeError: if ``tensors`` or an entry has a wrong type.
            ValueError: if the count, group names or sizes do not match.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 3)
            >>> storage = register_flat_storage(layer)
            >>> ema = storage["0"].detach().clone()
            >>> {k: tuple(v.shape) for k, v in storage.views_of([ema]).items()}
            {'weight': (3, 2), 'bias': (3,)}
        """
        items = self._per_group(tensors, "views_of()", exact=False)
        splits = [group.split(t) for group, t in zip(self._groups, items)]
        modules = dict(self.module.named_modules(remove_duplicate=False))
        return {
            name: splits[slot.group_index][slot.index]
            for slot in self._slots
            for name in self._live(slot, modules, remove_duplicate)
        }

    # ------------------------------------------------------------ mode toggles
    def flatten(self) -> None:
        """Switch to flat mode: attributes become views of the flat buffers again.

        Values, ``.data`` swaps, reassigned same-shaped parameters and
        gradients set in unflattened mode are written into the flat buffers
        (a slot whose ``.grad`` is ``None`` while others have one gets zeros).
        Does nothing in flat mode.

        Raises:
            RuntimeError: if a parameter was reassigned with another shape, set
                to ``None``, or a tie was broken; the module is left unchanged.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 2)
            >>> storage = register_flat_storage(layer)
            >>> storage.unflatten(); storage.flatten()
            >>> storage.is_flattened
            True
        """
        if not self._flattened:
            atomically(self._flatten)

    def _flatten(self, tx: Transaction) -> None:
        """Flatten as part of ``tx`` (a no-op in flat mode)."""
        if self._flattened:
            return
        surgery.flatten_module(self, tx)
        tx.set_attr(self, "_flattened", True)
        surgery.refresh_originals(self._groups, self._slots, tx)

    def unflatten(self) -> None:
        """Switch to unflattened mode: every attribute is a real leaf ``nn.Parameter``.

        The parameters share memory with the flat buffers (no copy) and their
        ``.grad`` are views of the flat gradients when those exist;
        ``module.parameters()`` yields them instead of the flat parameters.
        Does nothing in unflattened mode.

        Raises:
            RuntimeError: inside :meth:`using`.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 2)
            >>> storage = register_flat_storage(layer)
            >>> storage.unflatten()
            >>> [name for name, _ in layer.named_parameters()]
            ['weight', 'bias']
        """
        if not self._flattened:
            return
        if self._using_depth:
            raise RuntimeError(
                "cannot unflatten inside storage.using(...): the views are served from the "
                "given tensors; leave the using() block first"
            )
        self.sync_writes()
        atomically(self._unflatten)
        self._invalidate()

    def _unflatten(self, tx: Transaction) -> None:
        surgery.unflatten_module(self, tx)
        tx.set_attr(self, "_flattened", False)

    @contextmanager
    def unflattened(self) -> Iterator[FlatStorage]:
        """Run a block in unflattened mode, then restore the previous mode (also on error).

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 2)
            >>> storage = register_flat_storage(layer)
            >>> with storage.unflattened():
            ...     isinstance(layer.weight, nn.Parameter)
            True
            >>> isinstance(layer.weight, nn.Parameter)
            False
        """
        was_flat = self._flattened
        self.unflatten()
        try:
            yield self
        finally:
            if was_flat:
                self.flatten()

    @contextmanager
    def using(self, flat_tensors: FlatTensors) -> Iterator[FlatStorage]:
        """Serve every view from ``flat_tensors`` instead of the flat parameters.

        Autograd flows into the given tensors (functional calls,
        hypernetworks, evaluating an EMA copy). The substitution is visible to
        all threads, as with ``torch.func.functional_call``.

        Args:
            flat_tensors: one tensor per group, each of its flat parameter's
                shape, dtype and device: a list in group order, a dict by
                group name, or a single tensor when there is one group.

        Raises:
            TypeError: if ``flat_tensors`` or an entry has a wrong type.
            ValueError: if the count, group names, sizes, dtypes or devices
                do not match.
            RuntimeError: in unflattened mode.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 1)
            >>> storage = register_flat_storage(layer)
            >>> with storage.using([torch.zeros(3)]):
            ...     layer(torch.ones(1, 2))
            tensor([[0.]])
        """
        if not self._flattened:
            raise RuntimeError(
                "storage.using(...) needs flat mode; it was called in unflattened mode "
                "(inside unflattened() or after unflatten()); call flatten() first"
            )
        items = [t.contiguous() for t in self._per_group(flat_tensors, "using()", exact=True)]
        params: dict[str, Any] = self.module._parameters
        flat_names = [group.flat_name for group in self._groups]
        saved = [params[name] for name in flat_names]
        for name, tensor in zip(flat_names, items):
            params[name] = tensor
        self._using_depth += 1
        try:
            yield self
        finally:
            for name, tensor in zip(flat_names, saved):
                params[name] = tensor
            self._using_depth -= 1
            self._invalidate()

    # ------------------------------------------------------------- internals
    def _invalidate(self) -> None:
        surgery.invalidate(self._groups)

    # ------------------------------------------------------------ write paths
    def members(self) -> list[tuple[nn.Module, ModuleState]]:
        """Return every module this storage changed (still alive), with its state (internal read API).

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

    def sync_writes(self, *, forward: bool = False) -> None:
        """Land the writes made around the views since the last call, or refuse them.

        A replaced flat parameter (``module.flat_param_0 = p``,
        ``module._parameters["flat_param_0"] = p``) is adopted, parameters put
        into a flattened module's ``_parameters`` and tensors assigned to a
        view's ``.data`` are copied into their slots (see ``_writes.py``).
        Internal: state dicts, toggles, loading, copying and removal call it.
        Does nothing in unflattened mode.

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
        if not self._flattened or self._pending is not None:
            return
        if not self._using_depth:
            params = root._parameters
            replaced: list[tuple[Group, Any]] = []
            for group in self._groups:
                current = params.get(group.flat_name)
                if current is group.flat:
                    continue
                # A plain tensor there is functional_call's substitute; a tensor subclass is
                # another engine's (FSDP2 registers DTensor parameters): both are left alone.
                if isinstance(current, Tensor) and type(current) not in (nn.Parameter, FlatParameter):
                    continue
                try:
                    check_flat_replacement(group, current)
                except RuntimeError:
                    params[group.flat_name] = group.flat  # refused: the flat parameter is back
                    raise
                replaced.append((group, current))
            if replaced:
                self._adopt_replacements(replaced)
        if forward:
            for group in self._groups:
                group.views.land_flagged()
            return
        land_direct_writes(self.members())
        for group in self._groups:
            group.views.sync()

    def _adopt_replacements(self, replaced: list[tuple[Group, Any]]) -> None:
        """Adopt parameters registered in flat parameters' places, all or nothing.

        Each becomes its group's ``FlatParameter`` (re-classed in place, with the
        layout); on failure the old flat parameters are back and the new ones
        keep their class.
        """
        classes = [type(param) for _, param in replaced]
        try:
            self._adopt_flat_params()
        except BaseException:
            params = self.module._parameters
            for (group, param), cls in zip(replaced, classes):
                params[group.flat_name] = group.flat
                self._set_group(group)
                if type(param) is not cls:
                    param.__class__ = cls
            surgery.refresh_originals(self._groups, self._slots)
            raise

    def parameter_found(self, module: nn.Module, attr: str, param: Any) -> Any:
        """Return what ``module.<attr>`` serves when its ``_parameters`` holds ``attr``.

        In unflattened mode (and while a load stages values) that parameter; in
        flat mode it was put there around the view: it lands in the slot (or is
        refused) and the view is served. Internal: the attribute's property calls it.
        """
        if not self._flattened or self._pending is not None:
            return param
        state: ModuleState = module.__dict__[MODULE_STATE_ATTR]
        land_parameter(module, state, attr, param)
        views, index = state.slots[attr]
        return views.view(index)

    def register_via(
        self, module: nn.Module, base: Callable[[str, Any], None], name: str, param: Any
    ) -> None:
        """Run ``module.register_parameter(name, param)`` (``base``) on a module this storage changed.

        A flat parameter's name adopts ``param`` as the group's flat parameter;
        a flattened attribute's name (flat mode) copies the values into its
        slot; anything else is torch's. Internal: the injected class calls it.

        Raises:
            RuntimeError: if ``param`` cannot take that place (nothing changed).
        """
        group = next((g for g in self._groups if g.flat_name == name), None)
        if group is not None and registered_storage(module) is self:
            if not self._flattened or self._using_depth:
                raise RuntimeError(
                    f"cannot replace {name} in unflattened mode or inside using(): the flat "
                    "parameter is not served there; call storage.flatten() (or leave using()) first"
                )
            check_flat_replacement(group, param)
            base(name, param)
            self._adopt_replacements([(group, param)])
            return
        state = module.__dict__.get(MODULE_STATE_ATTR)
        if (
            self._flattened
            and self._pending is None
            and isinstance(state, ModuleState)
            and name in state.slots
            and name not in module._parameters
        ):
            land_parameter(module, state, name, param)
            return
        base(name, param)

    def flat_buffers_replaced(self) -> None:
        """Re-point the originals and views after flat buffers were swapped; notify every feature.

        The "flat buffer replaced" notification: features call it after they
        swap a flat parameter's ``.data`` (the disk backing does), and the
        coordinator runs it after ``module.to()`` & co. re-back or replace the
        flat parameters.
        """
        surgery.refresh_originals(self._groups, self._slots)
        for feature in self._features:
            feature.on_rebacked()

    def _adopt_flat_params(self) -> None:
        """Re-wrap flat parameters that ``module.to()`` & co. replaced or re-classed."""
        root = self.module
        for group in self._groups:
            flat = surgery.rewrap_flat_param(root, group)
            if flat is not group.flat:
                self._set_group(dataclasses.replace(group, flat=flat))
        for group in self._groups:
            surgery.zero_padding(group.flat, group.layout)  # e.g. to_empty() leaves garbage there
        self.flat_buffers_replaced()  # a converted or moved buffer left its offload file, say

    def _set_group(self, group: Group) -> None:
        groups = list(self._groups)
        groups[group.index] = group
        self._groups = tuple(groups)

    def apply_via(self, base: Callable[..., nn.Module], fn: Callable[..., Any], recurse: bool) -> nn.Module:
        """Run the module's ``_apply`` (``base``) in flat mode, then re-adopt the flat parameters.

        Internal: the root module's injected ``_apply`` calls it.
        """
        if self._using_depth:
            raise RuntimeError("cannot convert or move the module inside storage.using(...); leave it first")

        def convert(tensor: Tensor) -> Any:
            # A no-op conversion returns the FlatParameter itself, which torch cannot
            # re-wrap in a Parameter when it replaces parameters; hand it a plain view.
            out = fn(tensor)
            return out.detach() if type(out) is FlatParameter else out

        self.sync_writes()
        with in_flat_mode(self):
            try:
                return base(convert, recurse)
            finally:
                self._adopt_flat_params()

    def stage_loaded(self, loaded: list[StagedValue]) -> None:
        """Take values read by a module's ``_load_from_state_dict``: staged during a load, else written.

        Internal: ``_state_dict.load_module`` calls it.
        """
        if self._pending is not None:
            self._pending.extend(loaded)
        else:
            commit_staged(self._groups, loaded)

    def load_via(self, base: Callable[..., Any], state_dict: Any, strict: bool, assign: bool) -> Any:
        """Load through torch's machinery (``base``), then commit the staged slots: all or nothing.

        Internal: the root module's injected ``load_state_dict`` calls it.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
        flat_mode = self._flattened
        self.sync_writes()
        snapshot = Snapshot(self.module, {id(group.flat) for group in self._groups} if flat_mode else set())
        self._pending = [] if flat_mode else None
        try:
            result = base(state_dict, strict=strict, assign=assign)
            commit_staged(self._groups, self._pending or [])
        except BaseException:
            snapshot.restore()
            raise
        finally:
            self._pending = None
        return result

    # ------------------------------------------------------------ state dicts
    def flat_state_dict(self) -> OrderedDict[str, Any]:
        """Return the module's state dict in flat form.

        The flat parameters (``flat_param_<group>``, zero copy) and a layout
        record per group (``flat_layout_<group>``, a small uint8 tensor) take
        the place of the flattened parameters; every other entry is as in
        ``module.state_dict()``. ``module.load_state_dict`` accepts it, and
        refuses it for a module with another layout.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
            >>> storage = register_flat_storage(model)
            >>> list(storage.flat_state_dict())[:3]
            ['flat_param_0', 'flat_layout_0', '1.running_mean']
        """
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

    @property
    def module_unchecked(self) -> nn.Module:
        """Return the registered module, also while registration is still under way."""
        module = self._root_ref()
        if module is None:
            raise RuntimeError("the module of this flat storage was garbage collected")
        return module

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatStorage:
        new = FlatStorage.__new__(FlatStorage)
        memo[id(self)] = new
        root = self._root_ref()
        new_root: nn.Module | None = memo.get(id(root), root)
        new._root_ref = weakref.ref(new_root) if new_root is not None else self._root_ref
        views = [copy.deepcopy(group.views, memo) for group in self._groups]
        flats = [copy.deepcopy(group.flat, memo) for group in self._groups]
        new._slots = tuple(
            Slot(
                s.name,
                s.aliases,
                s.group_index,
                s.index,
                memo[id(s.param)] if id(s.param) in memo else _placeholder(s.param),
            )
            for s in self._slots
        )
        new._groups = tuple(
            dataclasses.replace(
                group,
                views=views[group.index],
                flat=flats[group.index],
                members=tuple(slot for slot in new._slots if slot.group_index == group.index),
            )
            for group in self._groups
        )
        new._flattened = self._flattened
        new._using_depth = 0
        new._pending = None
        new._owners = []
        for module, state in self.members():
            if id(module) in memo:
                state_copy = copy.deepcopy(state, memo)
                if state_copy.injected is not None and state_copy.injected is state.injected:
                    state_copy.injected = clone_class(state.injected)  # never share a class with the original
                if module in UNFLATTENED:
                    UNFLATTENED[memo[id(module)]] = state_copy
                new._owners.append((weakref.ref(memo[id(module)]), state_copy))
        new._owner_ids = {id(ref()): (ref, state) for ref, state in new._owners}
        new._grad_sync = self._grad_sync.copy_for(new, memo)
        new._disk = self._disk.copy_for(new, memo)
        new._functional = self._functional.copy_for(new, memo)
        new._added = [c for f in self._added if (c := f.copy_for(new, memo)) is not None]
        return new

    @staticmethod
    def restore_pickled(root: nn.Module, state: tuple[dict[str, Any], Any]) -> None:
        """Give an unpickled registered module its state, then register its storage again.

        ``state`` is the module's cleaned ``__dict__`` (its slots already
        parameters viewing the loaded flat parameters) and the
        ``_pickling.StorageRecord`` of its storage. Internal: the unpickler calls
        it (see ``_pickling.py``).
        """
        own, record = state
        root.__setstate__(own)
        modules = dict(root.named_modules(remove_duplicate=False))
        slots = []
        for name, aliases, group_index, index in record.slots:
            owner, attr = surgery.locate(modules, name)
            param = owner._parameters[attr]
            assert param is not None
            slots.append(Slot(name, aliases, group_index, index, param))
        storage = FlatStorage(root, record.group_names, record.flats, record.layouts, slots)
        install_storage(storage)
        if not record.flattened:
            storage.unflatten()

    def __getstate__(self) -> None:
        # The registered module pickles itself with a record of its storage (``_pickling.py``).
        raise RuntimeError(
            "a FlatStorage cannot be pickled on its own; pickle the registered module "
            "(torch.save(model)), or save module.state_dict() or storage.flat_state_dict()"
        )

    def __repr__(self) -> str:
        return storage_repr(self)

    def summary(self) -> str:
        """Return a text table of every flattened parameter: name, group, offset, numel, shape, dtype.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 3)
            >>> print(register_flat_storage(layer).summary())
            name    group  offset  numel  shape   dtype
            ------  -----  ------  -----  ------  -------
            weight  0           0      6  (3, 2)  float32
            bias    0           6      3  (3,)    float32
        """
        return summary_table(self)

    # -------------------------------------------------------------- frameworks
    def attach_optimizer(self, optimizer: Any) -> OptimizerAttachment:
        """Make ``optimizer`` save and load the plain model's per-parameter format.

        Afterwards ``optimizer.state_dict()`` is what the same optimizer of the
        plain model returns (one entry per original parameter, names, order,
        ``step`` and param groups; converted with
        :func:`plain_optim_state_dict`), and ``optimizer.load_state_dict()``
        accepts that format as well as its own flat one (converted with
        :func:`flat_optim_state_dict`). So training checkpoints (Trainer,
        Lightning, Fabric, accelerate) resume across the plain and the
        flattened model in both directions. A plain state dict must come from an
        optimizer built the same way (the same param groups, each in
        ``module.parameters()`` order, as frameworks build them). Attaching the
        same optimizer again returns the existing attachment.

        Args:
            optimizer: a ``torch.optim.Optimizer`` over the flattened module's
                parameters, or a framework's wrapper of one (accelerate's
                ``AcceleratedOptimizer``, Lightning's and Fabric's).

        Returns:
            The attachment; its ``remove()`` detaches the optimizer again.

        Raises:
            TypeError: if ``optimizer`` is not an optimizer.
            ValueError: if it holds parameters that are not the module's.
            RuntimeError: if it is already attached to another storage.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(2, 2)
            >>> storage = register_flat_storage(model)
            >>> optimizer = torch.optim.Adam(model.parameters())
            >>> _ = storage.attach_optimizer(optimizer)
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> optimizer.step()
            >>> [tuple(s["exp_avg"].shape) for s in optimizer.state_dict()["state"].values()]
            [(2, 2), (2,)]
        """
        return attach_optimizer(self, optimizer)

    def _repr_html_(self) -> str:
        return storage_html(self)

    def plot_layout(self, **kwargs: Any) -> Any:
        """Draw the flat buffers: which parameter occupies which range (needs matplotlib).

        See :func:`flatten_parametrize._plot.plot_layout` for the arguments.

        Returns:
            A ``matplotlib.figure.Figure``.
        """
        return plot_layout(self, **kwargs)

    # ------------------------------------------------ data parallel (GradSync)
    def all_reduce_grads(self, group: dist.ProcessGroup | None = None, op: str = "mean") -> None:
        """All-reduce the gradient of every flat parameter across ranks, one collective per group.

        Call it on every rank of ``group`` after backward (instead of, or
        without, :meth:`enable_grad_sync`). Groups whose flat parameter does
        not require grad are skipped; one that requires grad but has no
        ``.grad`` on this rank contributes zeros and receives the result, so
        every rank issues the same collectives. In unflattened mode the
        parameters' gradients are written to the flat buffers first and are
        views of the reduced gradients afterwards.

        Args:
            group (ProcessGroup, optional): the ranks to reduce over.
                Default: ``None``, the default process group.
            op (str): ``"mean"`` (average over ranks, as DDP does) or ``"sum"``.
                Default: ``"mean"``.

        Raises:
            TypeError: if ``op`` is not a str or ``group`` not a process group.
            ValueError: if ``op`` is not one of ``"mean"``, ``"sum"``, or this
                rank is not a member of ``group``.
            RuntimeError: if no default process group is initialized.

        Example:
            >>> import torch
            >>> import torch.distributed as dist
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500",
            ...                         rank=0, world_size=1)  # doctest: +SKIP
            >>> layer = nn.Linear(2, 1)
            >>> storage = register_flat_storage(layer)
            >>> layer(torch.ones(1, 2)).sum().backward()
            >>> storage.all_reduce_grads()  # doctest: +SKIP
            >>> storage["0"].grad  # doctest: +SKIP
            tensor([1., 1., 1.])
        """
        self._grad_sync.all_reduce(group, op)

    def broadcast_params(self, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
        """Copy the flat parameters of rank ``src`` to every rank, one collective per group.

        Use it once after building the model so that every rank starts from
        the same weights (DDP does this in its constructor). Every group is
        broadcast, frozen ones included; buffers (e.g. BatchNorm running
        statistics) are not part of the flat storage and are left alone.

        Args:
            src (int): global rank whose values every rank receives. Default: ``0``.
            group (ProcessGroup, optional): the ranks to broadcast to.
                Default: ``None``, the default process group.

        Raises:
            TypeError: if ``src`` is not an int or ``group`` not a process group.
            ValueError: if ``src`` is not a rank of ``group``, or this rank is
                not a member of ``group``.
            RuntimeError: if no default process group is initialized.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> storage = register_flat_storage(nn.Linear(2, 1))
            >>> storage.broadcast_params(src=0)  # doctest: +SKIP
        """
        self._grad_sync.broadcast(src, group)

    def enable_grad_sync(self, group: dist.ProcessGroup | None = None) -> None:
        """Average every flat gradient across ranks during each backward, as DDP does.

        Once enabled, every flat gradient is averaged over ``group`` by the
        time ``loss.backward()`` returns. The collective of a group starts as
        soon as its flat gradient is final for this backward (a
        post-accumulate-grad hook), so, with the model split into several
        groups (``register_flat_storage(..., bucket_cap_mb=25)``, or one group
        per block), communication overlaps the rest of backward; an
        autograd-engine callback waits for all of them at the end of backward.

        Semantics:

        * Collectives start in one order shared by all ranks: group order in
          the first synced backward, then the order in which rank 0's first
          synced backward finished the groups.
        * A group that this rank's backward did not reach (an unused branch)
          is still reduced at the end of backward, contributing zeros, so
          ranks never wait on each other (like DDP's
          ``find_unused_parameters=True``). Its ``.grad`` is then set, to zeros
          if no rank produced one. Every rank's backward must reach at least
          one flat parameter.
        * Groups that do not require grad are never reduced.
        * Inside :meth:`no_sync` nothing is reduced; gradients accumulate
          locally and the next synced backward averages the sum.
        * Only backward passes in flat mode that reach the flat parameters
          are synced: not ``using()`` substitutes, not the leaf parameters of
          unflattened mode (call :meth:`all_reduce_grads` there).
        * Call ``backward`` once per step outside ``no_sync`` (a second
          synced backward reduces the already averaged gradient again).
          Reentrant activation checkpointing (``use_reentrant=True``) runs a
          nested backward and is refused with a ``RuntimeError`` from
          ``backward``; use ``use_reentrant=False``.
        * A flat parameter replaced by ``module.to()`` gets its hook again at
          the next forward of the registered module.
        * Where the backend cannot average inside the collective (gloo),
          backward divides a flat gradient by the world size while copying it
          together and the collective only sums, saving a pass over the
          gradient (DDP divides while copying into its buckets). A tensor
          hook on a flat parameter still sees the local, undivided gradient.

        A rank that fails or stops makes the others' collectives fail after
        the process group's timeout (``init_process_group(timeout=...)``),
        raised from ``backward``; they never wait forever.

        Args:
            group (ProcessGroup, optional): the ranks to average over.
                Default: ``None``, the default process group.

        Raises:
            TypeError: if ``group`` is not a process group.
            ValueError: if this rank is not a member of ``group``.
            RuntimeError: if no default process group is initialized, or grad
                sync is already enabled on this storage.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
            >>> storage = register_flat_storage(model, bucket_cap_mb=25)
            >>> storage.broadcast_params()  # doctest: +SKIP
            >>> storage.enable_grad_sync()  # doctest: +SKIP
            >>> model(torch.randn(8, 4)).pow(2).mean().backward()  # grads averaged here
        """
        self._grad_sync.enable(group)

    def disable_grad_sync(self) -> None:
        """Stop syncing gradients in backward and remove every hook that sync added.

        Does nothing if grad sync is not enabled. A backward already in
        flight still completes its collectives.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> storage = register_flat_storage(nn.Linear(2, 1))
            >>> storage.disable_grad_sync()
        """
        self._grad_sync.disable()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient sync inside the block, for gradient accumulation (like DDP's ``no_sync``).

        Backward passes inside only accumulate local gradients; the first
        synced backward after the block averages the accumulated sum. Nests;
        without :meth:`enable_grad_sync` it changes nothing.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(2, 1)
            >>> storage = register_flat_storage(model)
            >>> micro_batches = torch.randn(4, 3, 2).unbind()
            >>> with storage.no_sync():
            ...     for x in micro_batches[:-1]:
            ...         model(x).sum().backward()
            >>> model(micro_batches[-1]).sum().backward()  # syncs the sum, if enabled
        """
        with self._grad_sync.paused():
            yield

    # --------------------------------------------------- disk (DiskOffload)
    @property
    def is_offloaded(self) -> bool:
        """Return whether flat buffers are file-backed (by :meth:`offload_to_disk`).

        ``False`` again after :meth:`load_to_memory`, ``remove_flat_storage``,
        or a ``module.to()`` that converted or moved the buffers.
        """
        return bool(self._disk.backed())

    @property
    def offload_files(self) -> dict[str, Path]:
        """Return the file backing each offloaded group's flat buffer, by group name.

        Each file holds the raw bytes of the flat parameter (padding included)
        in native byte order. Empty when nothing is offloaded.
        """
        return self._disk.files()

    def offload_to_disk(self, directory: str | os.PathLike[str]) -> None:
        """Move the flat buffers to memory-mapped files in ``directory``, releasing their RAM.

        Each group's buffer is written to its own file (named after the group
        and a random tag, so several storages can share a directory) with
        ordinary writes, fsynced, then mapped back with
        ``torch.from_file(..., shared=True)`` and swapped in as the flat
        parameter's ``.data``. The flat parameters stay the same objects, so
        an optimizer built before keeps working. Pages are read from the file
        on access; in-place updates (optimizer steps, ``load_state_dict``,
        ``copy_``) write through to the file. Forward, backward and state dicts
        work as before.

        Gradients and optimizer state stay in RAM. Resident memory drops by the
        buffers' size only if nothing else holds the old buffers: an autograd
        graph kept from an earlier forward, a ``state_dict()`` or
        ``named_views()`` result, or your own views do.

        What moves the weights back to RAM (and deletes the files):
        :meth:`load_to_memory`, ``remove_flat_storage`` (ordinary parameters
        in RAM), and a ``module.to()`` / ``.double()`` / ``.cuda()`` that
        converts or moves a buffer (a no-op ``.to()`` keeps it offloaded).
        ``copy.deepcopy`` of the module gives a copy in RAM. Calling this again
        with the same directory offloads only groups that are in RAM.

        Args:
            directory (str or os.PathLike): an existing, writable directory,
                ideally on a fast local disk.

        Raises:
            TypeError: if ``directory`` is not a path.
            RuntimeError: if a flat buffer is not on the CPU, or the buffers
                are already offloaded to another directory.
            FileNotFoundError: if ``directory`` does not exist.
            NotADirectoryError: if ``directory`` is not a directory.
            OSError: if the disk has too little free space (``errno.ENOSPC``)
                or a file cannot be written (``PermissionError`` for a
                read-only directory). In every case the weights stay in
                memory, unchanged, and no file is left behind.

        Example:
            >>> import os, tempfile, torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(4, 2)
            >>> storage = register_flat_storage(model)
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     storage.offload_to_disk(directory)
            ...     print(storage.is_offloaded, len(os.listdir(directory)))
            ...     print(model(torch.ones(1, 4)).shape)
            ...     storage.load_to_memory()
            ...     print(storage.is_offloaded, os.listdir(directory))
            True 1
            torch.Size([1, 2])
            False []
        """
        self._disk.offload(directory)

    def load_to_memory(self, keep_files: bool = False) -> None:
        """Bring offloaded flat buffers back into RAM.

        The values (including every update made while offloaded) are copied
        into fresh RAM buffers, swapped in as the flat parameters' ``.data``
        (the same objects, so optimizers keep working), and the files are
        deleted. Does nothing if nothing is offloaded.

        Args:
            keep_files (bool): keep the files (fsynced, holding the current
                values) instead of deleting them; see :attr:`offload_files`
                for their paths, read before this call. Default: ``False``.

        Raises:
            TypeError: if ``keep_files`` is not a bool.
            RuntimeError: if the RAM for the buffers cannot be allocated; the
                buffers then stay offloaded, unchanged.

        Example:
            >>> import tempfile, torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(4, 2)
            >>> storage = register_flat_storage(model)
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     storage.offload_to_disk(directory)
            ...     with torch.no_grad():
            ...         _ = model.bias.fill_(7.0)  # writes through to the file
            ...     [path] = storage.offload_files.values()
            ...     storage.load_to_memory(keep_files=True)
            ...     print(storage.is_offloaded, model.bias.tolist())
            ...     print(torch.from_file(str(path), size=10)[-2:])
            False [7.0, 7.0]
            tensor([7., 7.])
        """
        self._disk.load(keep_files)

    # -------------------------------------------------- ensembles (Functional)
    def stack(self, k: int, *, requires_grad: bool = False) -> list[Tensor]:
        """Return ``k`` copies of every flat parameter, stacked: one ``(k, numel)`` tensor per group.

        The copies are independent of the module (perturb them, train them,
        average them) and :meth:`call_stacked` evaluates the module once per row.

        Args:
            k: number of weight sets (``>= 1``).
            requires_grad: make the stacks leaves that require grad. Default: ``False``.

        Returns:
            A list in group order.

        Raises:
            ValueError: if ``k`` is smaller than 1.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(3, 2)
            >>> storage = register_flat_storage(layer)
            >>> [tuple(s.shape) for s in storage.stack(4)]
            [(4, 8)]
        """
        return self._functional.stack(k, requires_grad)

    def call_stacked(self, stacked: StackedTensors, *args: Any, **kwargs: Any) -> Any:
        """Evaluate the module once per row of ``stacked``, in one vectorized call.

        ``torch.vmap`` over ``torch.func.functional_call`` with the flat
        parameters replaced by each row: an ensemble of ``k`` weight sets on
        the same inputs. Gradients flow to ``stacked``.

        Args:
            stacked: one ``(k, numel)`` tensor per group (see :meth:`stack`).
            *args: positional inputs of the module's forward (shared by all rows).
            **kwargs: keyword inputs of the module's forward.

        Returns:
            The module's output with a leading dimension of size ``k``.

        Raises:
            TypeError: if ``stacked`` or an entry has a wrong type.
            ValueError: if counts, group names or shapes do not match.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(3, 2)
            >>> storage = register_flat_storage(layer)
            >>> out = storage.call_stacked(storage.stack(5), torch.randn(7, 3))
            >>> out.shape
            torch.Size([5, 7, 2])
        """
        return self._functional.call_stacked(stacked, args, kwargs)


def _placeholder(param: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=param.dtype, device=param.device), param.requires_grad)


def install_storage(storage: FlatStorage) -> None:
    """Make ``storage`` take over its module (classes, parametrizations, flat parameters), atomically."""
    atomically(lambda tx: surgery.install(storage, tx))
    storage.members()  # recorded now: unflattened mode takes the state out of the modules


def remove_storage(storage: FlatStorage) -> None:
    """Undo the registration of ``storage``: plain parameters with the current values (atomically)."""

    storage.sync_writes()

    def change(tx: Transaction) -> None:
        storage._flatten(tx)
        surgery.uninstall(storage, tx)
        tx.set_attr(storage, "_flattened", False)

    atomically(change)
    storage._invalidate()
    for feature in storage._features:
        feature.on_removed()  # delete the offload files (values are in RAM now), remove grad-sync hooks
