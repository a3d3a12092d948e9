"""``FlatStorage``: the coordinator that owns the flat buffers of one module."""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from torch import Tensor, nn

from ._attach_optim import OptimizerAttachment, attach_optimizer
from ._distributed import DistributedMixin
from ._flat_parameter import FlatParameter, _as_flat_parameter
from ._functional import FunctionalMixin
from ._layout import GroupLayout
from ._names import MODULE_STATE_ATTR, STORAGE_ATTR, flat_layout_name, flat_param_name
from ._offload import OffloadMixin
from ._per_group import per_group
from ._state_dict import Snapshot, layout_record
from ._transaction import Transaction, atomically
from ._views import GroupViews, same_memory

__all__ = ["FlatStorage", "ParamInfo", "FlatTensors"]

#: One tensor per group: a list in group order, a dict by group name, or (for a
#: storage with one group) a single tensor.
FlatTensors = Union[Tensor, Sequence[Tensor], Mapping[str, Tensor]]


@dataclass(frozen=True)
class ParamInfo:
    """Where one flattened parameter lives.

    Attributes:
        name: qualified name, relative to the registered module.
        aliases: the other names of a tied parameter (empty if not tied).
        group: name of the group whose flat buffer holds it.
        offset: element offset in that buffer.
        numel: number of elements.
        shape: shape of the parameter.
        dtype: dtype of the buffer.
    """

    name: str
    aliases: tuple[str, ...]
    group: str
    offset: int
    numel: int
    shape: torch.Size
    dtype: torch.dtype


@dataclass
class _Slot:
    name: str
    aliases: tuple[str, ...]
    group: int
    index: int
    param: nn.Parameter

    @property
    def all_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def _locate(modules: dict[str, nn.Module], qualified: str) -> tuple[nn.Module, str]:
    path, _, attr = qualified.rpartition(".")
    return modules[path], attr


def _reorder(params: dict[str, Any], order: Sequence[str]) -> None:
    """Put the keys of ``params`` in ``order`` (unknown keys last), keeping the dict object."""
    items = dict(params)
    params.clear()
    for name in order:
        if name in items:
            params[name] = items.pop(name)
    params.update(items)


class FlatStorage(DistributedMixin, OffloadMixin, FunctionalMixin):
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
        slots: Sequence[_Slot],
        align: int,
    ) -> None:
        self._root_ref = weakref.ref(module)
        self._group_names = list(group_names)
        self._flat_names = [flat_param_name(g) for g in group_names]
        self._flat = list(flats)
        self._views = [
            GroupViews(module._parameters, name, layout) for name, layout in zip(self._flat_names, layouts)
        ]
        self._slots = list(slots)
        self._align = align
        self._flattened = True
        self._using = 0
        self._pending: list[tuple[GroupViews, int, Tensor]] | None = None
        self._hooks: list[int] = []

    # ------------------------------------------------------------------ basics
    @property
    def module(self) -> nn.Module:
        """Return the registered module.

        Raises:
            RuntimeError: if the module was garbage collected or the storage removed.
        """
        module = self._root_ref()
        if module is None or module.__dict__.get(STORAGE_ATTR) is not self:
            raise RuntimeError(
                "this flat storage is detached: its module was garbage collected or "
                "remove_flat_storage was called; use get_flat_storage(module) for the current one"
            )
        return module

    @property
    def flat_params(self) -> list[FlatParameter]:
        """Return the flat parameters, one per group, in group order."""
        return list(self._flat)

    @property
    def group_names(self) -> list[str]:
        """Return the group names, in group order."""
        return list(self._group_names)

    def __getitem__(self, group: str) -> FlatParameter:
        """Return the flat parameter of ``group``.

        Raises:
            TypeError: if ``group`` is not a str.
            KeyError: if there is no such group.
        """
        if not isinstance(group, str):
            raise TypeError(
                f"flat storage groups are named by str; got {type(group).__name__} {group!r}; "
                f"groups are {self._group_names}"
            )
        try:
            return self._flat[self._group_names.index(group)]
        except ValueError:
            raise KeyError(
                f"no group {group!r} in this flat storage; groups are {self._group_names}"
            ) from None

    def __len__(self) -> int:
        return len(self._group_names)

    @property
    def param_infos(self) -> list[ParamInfo]:
        """Return one :class:`ParamInfo` per flattened slot, in group and buffer order."""
        return [
            ParamInfo(
                name=slot.name,
                aliases=slot.aliases,
                group=self._group_names[slot.group],
                offset=self._views[slot.group].layout.offsets[slot.index],
                numel=self._views[slot.group].layout.numels[slot.index],
                shape=torch.Size(self._views[slot.group].layout.shapes[slot.index]),
                dtype=self._flat[slot.group].dtype,
            )
            for slot in self._slots
        ]

    @property
    def is_flattened(self) -> bool:
        """Return whether the module is in flat mode (attributes are views)."""
        return self._flattened

    # ------------------------------------------------------------------- views
    def _modules(self) -> dict[str, nn.Module]:
        return dict(self.module.named_modules(remove_duplicate=False))

    def _names(self, slot: _Slot, remove_duplicate: bool) -> tuple[str, ...]:
        return (slot.name,) if remove_duplicate else slot.all_names

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
        modules = self._modules()
        for slot in self._slots:
            for name in self._names(slot, remove_duplicate):
                owner, attr = _locate(modules, name)
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
        grads = [None if f.grad is None else v.split(f.grad) for f, v in zip(self._flat, self._views)]
        for slot in self._slots:
            split = grads[slot.group]
            for name in self._names(slot, remove_duplicate):
                yield name, None if split is None else split[slot.index]

    def _per_group(self, tensors: FlatTensors, what: str, exact: bool) -> list[Tensor]:
        groups = self._group_names
        items = per_group(tensors, groups, what, "tensor", "flat-shaped tensor")
        for group, item, flat in zip(groups, items, self._flat):
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
        splits = [views.split(t) for views, t in zip(self._views, items)]
        return {
            name: splits[slot.group][slot.index]
            for slot in self._slots
            for name in self._names(slot, remove_duplicate)
        }

    # ------------------------------------------------------------ mode toggles
    def _current_params(self, modules: dict[str, nn.Module]) -> list[nn.Parameter]:
        """Return the parameter each slot holds in unflattened mode, after checking it."""
        current = []
        for slot in self._slots:
            found: list[Any] = []
            shape = self._views[slot.group].layout.shapes[slot.index]
            for name in slot.all_names:
                owner, attr = _locate(modules, name)
                param = owner._parameters.get(attr)
                if not isinstance(param, Tensor):
                    raise RuntimeError(
                        f"cannot flatten: {name} is {type(param).__name__}, not a parameter; "
                        "assign an nn.Parameter of its shape before flattening"
                    )
                if tuple(param.shape) != shape:
                    raise RuntimeError(
                        f"cannot flatten: {name} has shape {tuple(param.shape)} but its slot "
                        f"in the flat storage holds {shape}; assign a parameter of shape {shape}"
                    )
                flat = self._flat[slot.group]
                for what, tensor in (("its value", param), ("its gradient", param.grad)):
                    if tensor is not None and tensor.is_meta and not flat.is_meta:
                        raise RuntimeError(
                            f"cannot flatten: {what} of {name} is on the meta device and holds "
                            f"no data to write into group '{self._group_names[slot.group]}'; "
                            "assign a parameter with values (or load a state dict) first"
                        )
                if found and param is not found[0]:
                    raise RuntimeError(
                        f"cannot flatten: tied parameter {slot.name} and {name} were "
                        "reassigned separately and no longer share one tensor; assign the "
                        "same nn.Parameter to every name of a tied parameter"
                    )
                found.append(param)
            current.append(found[0])
        return current

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
        root = self.module
        modules = self._modules()
        current = self._current_params(modules)
        groups = [
            [(slot, current[i]) for i, slot in enumerate(self._slots) if slot.group == g]
            for g in range(len(self._flat))
        ]
        new_grads: list[Tensor | None] = []
        for flat, views, members in zip(self._flat, self._views, groups):
            grads = [param.grad for _, param in members]
            if all(grad is None for grad in grads):
                new_grads.append(None)
                continue
            flat_grad = flat.grad
            fresh = flat_grad is None
            if flat_grad is None:
                flat_grad = torch.zeros_like(flat, memory_format=torch.contiguous_format)
            targets = views.split(flat_grad)
            for (slot, _), grad in zip(members, grads):
                target = targets[slot.index]
                if fresh and grad is not None:
                    target.copy_(grad)  # a new buffer: nothing to undo
                elif not fresh and (grad is None or not same_memory(grad, target)):
                    tx.write(target, grad)
            new_grads.append(flat_grad)
        for flat, views, members in zip(self._flat, self._views, groups):
            targets = views.split(flat.detach())
            for slot, param in members:
                if not same_memory(param, targets[slot.index]):
                    tx.write(targets[slot.index], param.detach())
        for flat, grad in zip(self._flat, new_grads):
            tx.set_attr(flat, "grad", grad)
        for i, slot in enumerate(self._slots):
            param = current[i]
            tx.set_attr(param, "grad", None)
            tx.set_attr(slot, "param", param)
            for name in slot.all_names:
                owner, attr = _locate(modules, name)
                tx.keep_dict(owner._parameters)
                owner._parameters.pop(attr, None)
        tx.keep_dict(root._parameters)
        for name, flat in zip(self._flat_names, self._flat):
            root._parameters[name] = flat
        tx.set_attr(self, "_flattened", True)
        self._refresh_originals(tx)

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
        if self._using:
            raise RuntimeError(
                "cannot unflatten inside storage.using(...): the views are served from the "
                "given tensors; leave the using() block first"
            )
        atomically(self._unflatten)
        self._invalidate()

    def _unflatten(self, tx: Transaction) -> None:
        root = self.module
        modules = self._modules()
        self._refresh_originals(tx)
        grads = [None if f.grad is None else v.split(f.grad) for f, v in zip(self._flat, self._views)]
        for slot in self._slots:
            flat, split = self._flat[slot.group], grads[slot.group]
            tx.set_attr(slot.param, "requires_grad", flat.requires_grad)
            tx.set_attr(slot.param, "grad", None if split is None else split[slot.index])
        tx.keep_dict(root._parameters)
        for name in self._flat_names:
            root._parameters.pop(name, None)
        touched = {}
        for slot in self._slots:
            for name in slot.all_names:
                owner, attr = _locate(modules, name)
                tx.keep_dict(owner._parameters)
                owner._parameters[attr] = slot.param
                touched[id(owner)] = owner
        for owner in touched.values():
            _reorder(owner._parameters, owner.__dict__[MODULE_STATE_ATTR].order)
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
        saved = [params[name] for name in self._flat_names]
        for name, tensor in zip(self._flat_names, items):
            params[name] = tensor
        self._using += 1
        try:
            yield self
        finally:
            for name, tensor in zip(self._flat_names, saved):
                params[name] = tensor
            self._using -= 1
            self._invalidate()

    # ------------------------------------------------------------- internals
    def _invalidate(self) -> None:
        for views in self._views:
            views.invalidate()

    def _refresh_originals(self, tx: Transaction | None = None) -> None:
        """Point the original parameter objects at their slots (frees any old buffer)."""
        tx = tx if tx is not None else Transaction()
        with torch.no_grad():
            splits = [views.split(flat.detach()) for flat, views in zip(self._flat, self._views)]
        for slot in self._slots:
            target = splits[slot.group][slot.index]
            if same_memory(slot.param, target):
                continue
            if torch._has_compatible_shallow_copy_type(slot.param, target):
                tx.set_attr(slot.param, "data", target)
            else:  # e.g. meta -> cpu after to_empty(): .data cannot change the tensor type
                tx.swap_tensors(slot.param, nn.Parameter(target, requires_grad=slot.param.requires_grad))
        self._invalidate()

    def _zero_padding(self) -> None:
        with torch.no_grad():
            for flat, views in zip(self._flat, self._views):
                layout = views.layout
                if layout.padding and not flat.is_meta:
                    slot_segments = set(layout.segments)
                    chunks = flat.detach().split(layout.split_sizes)
                    for segment, chunk in enumerate(chunks):
                        if segment not in slot_segments:
                            chunk.zero_()

    def _layout_of(self, group: int) -> dict[str, Any]:
        layout = self._views[group].layout
        members = [slot for slot in self._slots if slot.group == group]
        return {
            "names": [slot.name for slot in members],
            "shapes": [layout.shapes[slot.index] for slot in members],
            "numels": [layout.numels[slot.index] for slot in members],
            "offsets": [layout.offsets[slot.index] for slot in members],
        }

    def _adopt_flat_params(self) -> None:
        """Re-wrap flat parameters that ``module.to()`` & co. replaced or re-classed."""
        params = self.module._parameters
        for g, name in enumerate(self._flat_names):
            param = params.get(name)
            if isinstance(param, Tensor) and (param is not self._flat[g] or type(param) is not FlatParameter):
                flat = _as_flat_parameter(param, **self._layout_of(g))
                params[name] = self._flat[g] = flat
        self._zero_padding()  # e.g. to_empty() leaves garbage there
        self._refresh_originals()
        self._forget_stale_files()  # a converted or moved buffer left its offload file

    def _apply(self, base: Callable[..., nn.Module], fn: Callable[..., Any], recurse: bool) -> nn.Module:
        if self._using:
            raise RuntimeError("cannot convert or move the module inside storage.using(...); leave it first")
        was_flat = self._flattened
        self.flatten()

        def convert(tensor: Tensor) -> Any:
            # A no-op conversion returns the FlatParameter itself, which torch cannot
            # re-wrap in a Parameter when it replaces parameters; hand it a plain view.
            out = fn(tensor)
            return out.detach() if type(out) is FlatParameter else out

        try:
            return base(convert, recurse)
        finally:
            self._adopt_flat_params()
            if not was_flat:
                self.unflatten()

    def _stage(self, loaded: list[tuple[GroupViews, int, Tensor]]) -> None:
        if self._pending is not None:
            self._pending.extend(loaded)
        else:
            self._commit(loaded)

    def _commit(self, loaded: list[tuple[GroupViews, int, Tensor]]) -> None:
        """Write staged values into the flat buffers with one native call.

        Everything that can fail (casts, device moves, allocation) happens
        before that call, and a single call cannot be interrupted half-way by
        a Python exception, so the commit needs no copy of the old values.
        """
        if not loaded:
            return
        with torch.no_grad():
            splits = {id(v): v.split(f.detach()) for f, v in zip(self._flat, self._views)}
            targets, sources = [], []
            for views, index, source in loaded:
                target = splits[id(views)][index]
                if source.dtype != target.dtype or source.device != target.device:
                    source = source.to(dtype=target.dtype, device=target.device)
                targets.append(target)
                sources.append(source)
            torch._foreach_copy_(targets, sources)

    def _load_state_dict(self, base: Callable[..., Any], state_dict: Any, strict: bool, assign: bool) -> Any:
        """Load through torch's machinery, then commit the staged slots: all or nothing."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
        flat_mode = self._flattened
        snapshot = Snapshot(self.module, set(map(id, self._flat)) if flat_mode else set())
        self._pending = [] if flat_mode else None
        try:
            result = base(state_dict, strict=strict, assign=assign)
            self._commit(self._pending or [])
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
        for g, group in enumerate(self._group_names):
            out[flat_param_name(group)] = self._current_flat(g, plain)
            out[flat_layout_name(group)] = layout_record(self, g)
        flattened = {name for slot in self._slots for name in slot.all_names}
        for key, value in plain.items():
            if key not in flattened:
                out[key] = value
        return out

    def _current_flat(self, group: int, plain: Mapping[str, Tensor]) -> Tensor:
        """Return group's values as one tensor: the flat buffer, or a synced copy if unflattened
        parameters were reassigned (without changing anything)."""
        flat = self._flat[group].detach()
        if self._flattened:
            return flat
        targets = self._views[group].split(flat)
        members = [slot for slot in self._slots if slot.group == group]
        stale = [s for s in members if not same_memory(plain[s.name], targets[s.index])]
        if not stale:
            return flat
        with torch.no_grad():
            synced = flat.clone()
            synced_targets = self._views[group].split(synced)
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
        new._group_names = list(self._group_names)
        new._flat_names = list(self._flat_names)
        new._views = copy.deepcopy(self._views, memo)
        new._flat = [copy.deepcopy(f, memo) for f in self._flat]
        new._slots = [
            _Slot(
                s.name,
                s.aliases,
                s.group,
                s.index,
                memo[id(s.param)] if id(s.param) in memo else _placeholder(s.param),
            )
            for s in self._slots
        ]
        new._align = self._align
        new._flattened = self._flattened
        new._using = 0
        new._pending = None
        new._hooks = list(self._hooks)
        return new

    def __getstate__(self) -> None:
        raise RuntimeError(
            "a FlatStorage cannot be pickled; save module.state_dict() or storage.flat_state_dict() instead"
        )

    def __repr__(self) -> str:
        from ._inspect import storage_repr

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
        from ._inspect import summary_table

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
        from ._inspect import storage_html

        return storage_html(self)

    def plot_layout(self, **kwargs: Any) -> Any:
        """Draw the flat buffers: which parameter occupies which range (needs matplotlib).

        See :func:`flatten_parametrize._plot.plot_layout` for the arguments.

        Returns:
            A ``matplotlib.figure.Figure``.
        """
        from ._plot import plot_layout

        return plot_layout(self, **kwargs)


def _placeholder(param: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=param.dtype, device=param.device), param.requires_grad)
