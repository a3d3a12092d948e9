"""Mixed precision on the flat buffers: float32 masters, one low-precision compute copy per group.

``register_flat_storage(..., mixed_precision=policy)`` composes a
:class:`MixedPrecision` feature on the core. For each group whose policy has a
``param_dtype`` other than the flat parameter's dtype, it keeps a **compute
copy**: one flat tensor of ``param_dtype`` with the group's layout, from which
the group's views are served (the ``GroupViews.source`` seam). The
``FlatParameter`` stays the master: the optimizer steps it, state dicts save
it, loads write it.

When the copy is cast: the view cache asks the source only when it rebuilds a
group's views, and rebuilds them when the flat tensor was replaced (``.data``
swap, ``module.to()``) or its ``_version`` moved (optimizer steps, in-place
updates, loads); the source casts again (one ``copy_`` per group, into the
same memory) only if the master's identity, memory, dtype or ``_version``
differs from what it cast last. A forward after which nothing changed casts
nothing. Under ``torch.compile``, jit tracing and vmap the views are split
from ``flat.to(param_dtype)`` inside the traced graph instead (``GroupViews.cast``):
no version check in compiled code.

Gradients: the views are outputs of the group's split node whose input is the
master, so backward builds the flat gradient in the master's dtype (the view
gradients are converted while they are copied together) and micro-batches
accumulate in ``flat_param.grad`` in that dtype. The group's ``reduce_dtype``
(``None``: ``param_dtype``, as FSDP2) is put on its ``GroupGrad`` for gradient
sync and ``ShardedOptimizer``. ``cast_forward_inputs`` and ``output_dtype``
are forward hooks of the registered module, inactive in unflattened mode.

Fused optimizers (``fused=True``: ``_fused_adamw_`` & co., torch 2.13) update
their parameters in place without moving ``_version``; a global optimizer
step post-hook (registered with the first policy) moves the version of every
master with a compute copy that an optimizer just stepped, so that their
views and compute copies see the step like any other in-place update.

Writes (the table of ``docs/mixed-precision.md``). Into the compute copy
(``with torch.no_grad(): layer.weight.mul_(2)`` in flat mode): found at the
next sync point or recast by the copy's own ``_version``, they land in the
master element by element where the copy and the master's cast differ (values
rounded to ``param_dtype``, as written). Through ``.data`` of a view, which
moves no version counter: a view served outside the registered module's
forward is *exposed* (:meth:`MixedPrecision.expose` keeps a snapshot of its
slot); at each sync point the slot is compared with it and the elements that
differ land the same way. Exposures live while their views do (outside code
may keep one); after an optimizer step their copy is cast at once, so that
such views show the stepped values. Through ``.data`` of the master (EMA
libraries, hand-written steps): reading it moves the master's ``_version``
(``GroupViews.aliased``), so the copy is cast after the write. A copy write
that meets an in-place change of the master before any sync point raises.
Nothing is compared or cast in a forward when nothing was written.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as _field
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_map_only

from ..._core.features import Coordinator, Feature, Record, storage_of
from ..._core.foreign import is_fsdp2_compute_param
from ..._core.names import registered_storage
from ..._core.records import Group
from ..._core.transaction import Transaction, atomically
from ..._core.view_cache import WRITE_SCANS
from .compute_views import LeafCompute
from .master_leaf import DIRTY, WATCHED

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["MixedPrecision", "MixedPrecisionArg", "resolve_policies"]

#: What ``register_flat_storage(mixed_precision=...)`` accepts.
MixedPrecisionArg = Union["MixedPrecisionPolicy", Mapping[str, Union["MixedPrecisionPolicy", None]], None]

_FIX = "pass e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16) from torch.distributed.fsdp"


def _check_dtype(field: str, value: Any, where: str) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"mixed_precision: {field} must be a floating-point torch.dtype or None; got "
            f"{type(value).__name__} {value!r}{where}; {_FIX}"
        )
    if not value.is_floating_point:
        raise ValueError(
            f"mixed_precision: {field} must be a floating-point dtype; got {value}{where}; "
            "use torch.bfloat16, torch.float16 or torch.float32"
        )


def _policy_class() -> type[MixedPrecisionPolicy]:
    # Imported on first use: torch.distributed.fsdp costs about 0.7 s to import.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy


def _check_policy(policy: Any, where: str) -> MixedPrecisionPolicy:
    if not isinstance(policy, _policy_class()):
        raise TypeError(
            "mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy, or a mapping "
            f"group name -> MixedPrecisionPolicy or None; got {type(policy).__name__} {policy!r}{where}; "
            f"{_FIX}"
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        _check_dtype(field, getattr(policy, field), where)
    if not isinstance(policy.cast_forward_inputs, bool):
        raise TypeError(
            f"mixed_precision: cast_forward_inputs must be a bool; got "
            f"{type(policy.cast_forward_inputs).__name__} {policy.cast_forward_inputs!r}{where}"
        )
    return policy


def resolve_policies(
    value: MixedPrecisionArg, group_names: list[str]
) -> dict[str, MixedPrecisionPolicy | None]:
    """Return the policy of every group (``None``: it computes in its own dtype), checked.

    Args:
        value: one policy for every group, or a mapping ``group name -> policy or None``
            (groups not named get ``None``).
        group_names: the storage's group names.

    Raises:
        TypeError: for anything but a policy or a mapping of them, or a policy
            field of a wrong type.
        ValueError: for an unknown group name, a non-floating dtype, or
            policies that disagree on the registered module's input or output casts.
    """
    if isinstance(value, _policy_class()):
        policies: dict[str, MixedPrecisionPolicy | None] = {
            name: _check_policy(value, "") for name in group_names
        }
    elif isinstance(value, Mapping):
        policies = dict.fromkeys(group_names)
        for name, policy in value.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"mixed_precision: a mapping is keyed by group name (str); got "
                    f"{type(name).__name__} {name!r}; groups are {group_names}"
                )
            if name not in policies:
                raise ValueError(
                    f"mixed_precision names group {name!r}, which this storage does not have; "
                    f"groups are {group_names}"
                )
            policies[name] = None if policy is None else _check_policy(policy, f" for group {name!r}")
    else:
        _check_policy(value, "")
        raise AssertionError  # unreachable: _check_policy raised
    _module_casts(policies)
    return policies


def _module_casts(
    policies: Mapping[str, MixedPrecisionPolicy | None],
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """Return the registered module's input and output dtypes (``None``: no cast); refuse disagreement."""
    inputs = {
        p.param_dtype for p in policies.values() if p is not None and p.param_dtype and p.cast_forward_inputs
    }
    outputs = {p.output_dtype for p in policies.values() if p is not None and p.output_dtype is not None}
    for what, found in (("cast_forward_inputs to param_dtype", inputs), ("output_dtype", outputs)):
        if len(found) > 1:
            raise ValueError(
                f"mixed_precision: the groups' policies disagree on {what} for the registered "
                f"module's forward: {sorted(map(str, found))}; give them one dtype, or set "
                "cast_forward_inputs=False / output_dtype=None on all but one"
            )
    return next(iter(inputs), None), next(iter(outputs), None)


@dataclass
class _Exposure:
    """A slot of a compute copy served outside the forward: what it held then, and the views served."""

    snapshot: Tensor
    views: list[weakref.ref[Tensor]]

    def alive(self) -> bool:
        """Return whether outside code (or the view cache) still holds one of the views served."""
        return any(ref() is not None for ref in self.views)


@dataclass
class _ComputeCopy:
    """One group's compute copy and what it was cast from."""

    dtype: torch.dtype
    tensor: Tensor | None = None
    master: Tensor | None = None  # the flat tensor cast last (held: its identity is compared)
    ptr: int = -1
    version: int = -1  # the master's ``_version`` when cast
    own_version: int = -1  # the copy's ``_version`` after the cast (a write into it moves it)
    #: Slots served outside the registered module's forward, by slot index: their ``.data`` may be
    #: written (init helpers), which moves no version counter, so each is compared with its snapshot.
    exposed: dict[int, _Exposure] = _field(default_factory=dict)


#: A float32 -> param_dtype conversion of a whole group (tests count them).
CASTS = {"groups": 0}

#: Every master that has a compute copy, by ``id`` (for :func:`_after_step`; a ``WeakSet`` would
#: compare tensors with ``==``).
_MASTERS: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
_STEP_HOOK: list[Any] = []
#: Masters (by ``id``) whose compute copy has views held outside the forward (see
#: ``MixedPrecision.expose``): the feature and group to cast again right after a step.
_HELD: dict[int, tuple[weakref.ref[MixedPrecision], int]] = {}


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: move the ``_version`` of every stepped master with a compute copy.

    A fused step (``fused=True``) updates parameters in place without moving
    their version counters; the views and compute copies watch them. A compute
    copy whose views outside code holds is cast at once: those views show the
    stepped values before anything writes through them (weight clipping after
    the step), as views of the master itself would.
    """
    if not _MASTERS:
        return
    masters = _MASTERS
    for group in optimizer.param_groups:
        for param in group["params"]:
            if WATCHED and id(param) in WATCHED:  # a leaf of per-tensor mode: cast again before a forward
                DIRTY.add(id(param))
            master = masters.get(id(param))
            if master is not None and master is param:
                torch.autograd.graph.increment_version(master)
                held = _HELD.get(id(param))
                feature = None if held is None else held[0]()
                if feature is not None:
                    feature.cast_held(held[1], master)  # type: ignore[index]


def _watch(master: Tensor) -> None:
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(_after_step))
    _MASTERS[id(master)] = master


class MixedPrecision(Feature):
    """The mixed-precision feature of a storage: ``FlatStorage.mixed_precision`` reads its policies.

    Args:
        storage: the coordinator (held weakly).
        policies: the policy of every group, by group name (see :func:`resolve_policies`).
    """

    def __init__(self, storage: Coordinator, policies: Mapping[str, MixedPrecisionPolicy | None]) -> None:
        self._storage_ref = weakref.ref(storage)
        self.policies = dict(policies)
        self.input_dtype, self.output_dtype = _module_casts(self.policies)
        #: Group index -> its compute copy (groups that compute in another dtype only).
        self._copies: dict[int, _ComputeCopy] = {}
        for group in storage.groups():
            policy = self.policies.get(group.name)
            group.grads.reduce_dtype = None
            if policy is None or policy.param_dtype is None:
                continue
            group.grads.reduce_dtype = policy.reduce_dtype or policy.param_dtype
            if policy.param_dtype != group.flat.dtype:
                self._copies[group.index] = _ComputeCopy(policy.param_dtype)
                group.views.source = self._source_for(group.index)
                group.views.cast = policy.param_dtype
                group.views.invalidate()
        self._hook(storage.module_unchecked)
        #: Per-tensor mode's part: the leaves swapped for their compute views around each forward.
        self._leaves = LeafCompute(self._recast, list(self._copies)) if self._copies else None
        if self._leaves is not None and not storage.is_flattened:  # a copy or a load of per-tensor mode
            leaves = self._leaves
            atomically(lambda tx: leaves.begin(storage, tx))

    @property
    def _storage(self) -> Coordinator:
        return storage_of(self._storage_ref)

    # ---------------------------------------------------------------- views
    def _source_for(self, g: int) -> _GroupSource:
        return _GroupSource(weakref.ref(self), g)

    def compute_copy(self, g: int, flat: Tensor) -> Tensor:
        """Return the tensor that group ``g``'s views are served from when its flat tensor is ``flat``.

        The group's own flat parameter is served from the cached compute copy,
        cast again only if it changed; another tensor in its place (``using()``,
        ``functional_call``, FSDP2's unsharded parameter) from a cast of it.

        Raises:
            RuntimeError: if that tensor is FSDP2's unsharded parameter gathered
                in another ``param_dtype`` (``fully_shard(mp_policy=...)``).
        """
        copy = self._copies[g]
        storage = self._storage
        group = storage.groups()[g]
        if flat is not group.flat:
            root = storage.module_unchecked
            if flat.dtype != copy.dtype and is_fsdp2_compute_param(root, group.flat, flat):
                raise RuntimeError(
                    f"mixed_precision: group '{group.name}' computes in {copy.dtype} "
                    "(register_flat_storage(mixed_precision=...)) but fully_shard's mp_policy gathers "
                    f"{group.flat_name} in {flat.dtype}; two policies that disagree would compute in "
                    "neither dtype. Give one policy: drop mixed_precision= from register_flat_storage "
                    "(FSDP2's mp_policy then casts), or give both the same param_dtype"
                )
            with torch.no_grad():
                return flat.detach().to(copy.dtype)
        self._land_written(group, copy)
        ptr = flat.data_ptr()
        tensor = copy.tensor
        if tensor is None or copy.master is not flat or copy.ptr != ptr or tensor.device != flat.device:
            with torch.inference_mode(False):
                tensor = copy.tensor = torch.empty(flat.shape, dtype=copy.dtype, device=flat.device)
            copy.master, copy.ptr, copy.version = flat, ptr, -1
            _watch(flat)
        if copy.version != flat._version:
            self._land_exposed(group, copy)  # before the cast overwrites what was written
            with torch.inference_mode(False), torch.no_grad():
                tensor.copy_(flat.detach())
                CASTS["groups"] += 1
                copy.version = flat._version
                copy.own_version = tensor._version
                if copy.exposed:  # views outside code still holds: compared with the new values
                    slots = group.views.split(tensor)
                    for index, exposure in list(copy.exposed.items()):
                        if exposure.alive():
                            exposure.snapshot.copy_(slots[index])
                        else:
                            del copy.exposed[index]
        return tensor

    def expose(self, g: int, index: int, view: Tensor) -> None:
        """Keep what slot ``index`` of group ``g``'s compute copy holds, served as ``view`` outside a forward.

        Writes through ``view.data`` move no version counter; :meth:`land_exposed`
        compares the slot with this snapshot. Once per slot until it is landed;
        a view served again later is added to the slot's record.
        """
        copy = self._copies[g]
        exposure = copy.exposed.get(index)
        if exposure is None:
            with torch.inference_mode(False), torch.no_grad():
                snapshot = view.detach().clone()
            copy.exposed[index] = _Exposure(snapshot, [weakref.ref(view)])
            if copy.master is not None:
                _HELD[id(copy.master)] = (weakref.ref(self), g)
        elif not any(ref() is view for ref in exposure.views):
            exposure.views.append(weakref.ref(view))

    def watching(self, g: int) -> bool:
        """Return whether views of group ``g``'s compute copy served outside the forward are watched."""
        return bool(self._copies[g].exposed)

    def land_exposed(self, g: int) -> None:
        """Land what was written into group ``g``'s compute copy through views it served (tracked or not)."""
        copy = self._copies.get(g)
        if copy is None:
            return
        group = self._storage.groups()[g]
        self._land_written(group, copy)
        self._land_exposed(group, copy)

    def cast_held(self, g: int, master: Tensor) -> None:
        """Cast group ``g``'s compute copy now if ``master`` changed and views of it are held (a step)."""
        group = self._storage.groups()[g]
        copy = self._copies[g]
        if group.flat is master and copy.master is master:
            self.compute_copy(g, master)
        if not copy.exposed:
            _HELD.pop(id(master), None)

    def _land_exposed(self, group: Group, copy: _ComputeCopy) -> None:
        """Land the values written through ``.data`` of views served outside the forward (see :meth:`expose`).

        Each exposed slot is compared with its snapshot: the elements that differ
        were written into the copy, rounded to ``param_dtype``, and land in the
        master, unless the master changed since the copy was cast (then the
        write cannot be told apart from that change: refused). Slots whose
        views nobody holds any more are forgotten. Nothing is compared while
        a cast is due anyway (after a refused write, or re-backed buffers): the
        cast takes new snapshots of the slots whose views are still held.

        Raises:
            RuntimeError: if a slot was written and the master changed in place
                since the copy was cast (the write is dropped).
        """
        if not copy.exposed or copy.version < 0:  # a cast is due: what the copy holds is dropped anyway
            return
        tensor, flat = copy.tensor, copy.master
        if tensor is None or flat is None or flat is not group.flat or copy.ptr != flat.data_ptr():
            copy.exposed.clear()  # the master was replaced since: it wins
            return
        slots = group.views.split(tensor)
        written: list[tuple[int, Tensor]] = []
        with torch.inference_mode(False), torch.no_grad():
            for index, exposure in list(copy.exposed.items()):
                WRITE_SCANS["exposed"] += 1
                changed = slots[index] != exposure.snapshot
                if bool(changed.any()):
                    written.append((index, changed))
                    exposure.snapshot.copy_(slots[index])
                if not exposure.alive():
                    del copy.exposed[index]
            if not written:
                return
            if copy.version != flat._version:
                copy.version = -1  # cast again: the writes are dropped
                names = [group.views.names[i] for i, _ in written]
                raise RuntimeError(
                    f"a write through `.data` of {', '.join(names)} (a {copy.dtype} view of group "
                    f"'{group.name}''s compute copy) and an in-place change of the master "
                    f"{group.flat_name} happened between two uses of the views, so the write cannot "
                    "be told apart from the master's change and was dropped; write values with "
                    "`with torch.no_grad(): layer.weight.copy_(value)`, through the master "
                    "(`storage.views_of(storage.flat_params)[name]`), or inside storage.unflattened()"
                )
            masters = group.views.split(flat.detach())
            for index, changed in written:
                masters[index][changed] = slots[index][changed].to(flat.dtype)  # moves _version
        copy.version = flat._version  # the copy holds the written values already

    def _land_written(self, group: Group, copy: _ComputeCopy) -> None:
        """Land values written into the compute copy (through a view, in place) in the master."""
        tensor, flat = copy.tensor, copy.master
        if tensor is None or flat is None or tensor._version == copy.own_version:
            return
        if flat is not group.flat or copy.ptr != flat.data_ptr() or flat.dtype == copy.dtype:
            copy.own_version = tensor._version  # the master was replaced since: it wins
            return
        if copy.version != flat._version:
            copy.version, copy.own_version = -1, tensor._version  # cast again: the write is dropped
            raise RuntimeError(
                f"an in-place write into a {copy.dtype} view of group '{group.name}' (its compute "
                f"copy) and a change of the master {group.flat_name} happened between two uses of "
                "the views, so the write cannot be told apart from the master's change and was "
                "dropped; write values through the master instead: "
                "`with torch.no_grad(): storage.views_of(storage.flat_params)[name].copy_(value)`, "
                "or inside storage.unflattened()"
            )
        with torch.no_grad():
            written = tensor != flat.detach().to(copy.dtype)
            if bool(written.any()):
                flat.detach()[written] = tensor[written].to(flat.dtype)  # moves the master's _version
        copy.own_version = tensor._version
        copy.version = flat._version  # the copy holds the written values already

    def _recast(self, g: int) -> Tensor:
        """Cast group ``g``'s compute copy from its master now; return it (per-tensor mode's forward)."""
        self._copies[g].version = -1
        return self.compute_copy(g, self._storage.groups()[g].flat)

    # ------------------------------------------------------- per-tensor mode
    def forward_sync(self) -> bool:
        """Return whether per-tensor mode's forward needs this feature: while a group has a compute copy."""
        return self._leaves is not None

    def per_tensor_began(self, tx: Transaction) -> None:
        """Per-tensor mode began: forwards compute with the compute copies (``compute_views.py``)."""
        if self._leaves is not None:
            self._leaves.begin(self._storage, tx)

    def per_tensor_ended(self, tx: Transaction) -> None:
        """Per-tensor mode ends: the leaves are ordinary again, their modules unhooked."""
        if self._leaves is not None:
            self._leaves.end(tx)

    def before_forward(self) -> None:
        """The registered module's forward in per-tensor mode begins: compute views in the leaves' places."""
        if self._leaves is not None:
            self._leaves.before_forward()

    def after_forward(self) -> None:
        """The registered module's forward in per-tensor mode ended: the leaves back."""
        if self._leaves is not None:
            self._leaves.after_forward()

    # ------------------------------------------------------------- lifecycle
    def on_rebacked(self) -> None:
        """Cast every compute copy again at its next use (the buffers changed behind their counters)."""
        if self._leaves is not None:
            self._leaves.rebacked()
        for copy in self._copies.values():
            copy.version = -1
            if copy.tensor is not None:
                copy.own_version = copy.tensor._version

    def refresh(self) -> None:
        """Land writes made into a compute copy since the last sync point."""
        storage = self._storage_ref()
        if storage is None or not storage.is_flattened:
            return
        groups = storage.groups()
        for g, copy in self._copies.items():
            if copy.tensor is not None and copy.tensor._version != copy.own_version:
                self._land_written(groups[g], copy)
            self._land_exposed(groups[g], copy)

    def on_removed(self) -> None:
        """Forget the compute copies and remove the forward hooks."""
        if self._leaves is not None:
            self._leaves.end(None)
        storage = self._storage_ref()
        if storage is not None:
            for group in storage.groups():
                group.views.source = None
                group.views.cast = None
                group.grads.reduce_dtype = None
            module = storage.module_unchecked
            if registered_storage(module) is None:  # else the core that took its place keeps the hooks
                _unhook(module)
        for copy in self._copies.values():
            if copy.master is not None:
                _HELD.pop(id(copy.master), None)
        self._copies.clear()

    def copy_for(self, storage: Coordinator, memo: dict[int, Any]) -> MixedPrecision:
        """The copy keeps the policies; its compute copies are cast from its own masters."""
        return MixedPrecision(storage, self.policies)

    def holds_layout(self) -> None:
        """Never: it follows a new layout (:meth:`relayout_record`), its copies cast from the new masters."""
        return None

    def relayout_record(self) -> Record:
        """Return ``(function, args)`` that composes this feature on the core laid out again."""
        return self.pickle_record()

    def pickle_record(self) -> Record:
        """Return ``(function, args)`` that composes this feature again on a loaded core."""
        return restore_mixed_precision, (self.policies,)

    # -------------------------------------------------------------- hooks
    def _hook(self, module: nn.Module) -> None:
        _set_hooks(module, inputs=self.input_dtype is not None, output=self.output_dtype is not None)


class _GroupSource:
    """One group's ``GroupViews.source``: its compute copy, and the writes made into its views."""

    __slots__ = ("_feature", "_g")

    def __init__(self, feature: weakref.ref[MixedPrecision], g: int) -> None:
        self._feature = feature
        self._g = g

    def __call__(self, flat: Tensor) -> Tensor:
        feature = self._feature()
        if feature is None:  # pragma: no cover - the feature lives as long as its core
            return flat
        return feature.compute_copy(self._g, flat)

    def exposed(self, index: int, view: Tensor) -> None:
        feature = self._feature()
        if feature is not None:
            feature.expose(self._g, index, view)

    def watching(self) -> bool:
        feature = self._feature()
        return feature is not None and feature.watching(self._g)

    def land(self) -> None:
        feature = self._feature()
        if feature is not None:
            feature.land_exposed(self._g)


def restore_mixed_precision(
    storage: Coordinator, policies: Mapping[str, MixedPrecisionPolicy | None]
) -> None:
    """Compose the mixed-precision feature on ``storage``, a core registered again by unpickling."""
    storage.add_feature(MixedPrecision(storage, policies))


def _set_hooks(module: nn.Module, *, inputs: bool, output: bool) -> None:
    """Give ``module`` the cast hooks asked for, once each; a hook already there stays under its key.

    The groups laid out again at per-tensor mode's forward sync point (a forward pre-hook,
    ``_install/per_tensor.py``) hand the hooks from the old core's feature to the new one's while
    torch runs that forward's pre-hooks from a list it took before: a hook removed and registered
    again there would be called without its kwargs (torch looks its key up in
    ``_forward_pre_hooks_with_kwargs``), so the feature that takes over keeps them as they are.
    """
    for hooks, with_kwargs, hook, wanted in (
        (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs, _cast_inputs, inputs),
        (module._forward_hooks, module._forward_hooks_with_kwargs, _cast_output, output),
    ):
        keys = [key for key, found in hooks.items() if found is hook]
        if wanted and not keys:
            if hook is _cast_inputs:
                module.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
            else:
                module.register_forward_hook(_cast_output)
        for key in keys[1:] if wanted else keys:
            del hooks[key]
            with_kwargs.pop(key, None)


def _unhook(module: nn.Module) -> None:
    _set_hooks(module, inputs=False, output=False)


def _feature_of(module: nn.Module) -> MixedPrecision | None:
    storage = registered_storage(module)
    return None if storage is None else storage.feature(MixedPrecision)


def _cast_to(dtype: torch.dtype, tree: Any) -> Any:
    return tree_map_only(
        Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t, tree
    )


def _needs_cast(dtype: torch.dtype, value: Any) -> bool:
    """Return whether ``value`` may hold a floating-point tensor of another dtype (containers: maybe)."""
    if isinstance(value, Tensor):
        return torch.is_floating_point(value) and value.dtype != dtype
    return not isinstance(value, (int, float, bool, str, type(None)))  # containers and others: maybe


def _cast_inputs(module: nn.Module, args: Any, kwargs: Any) -> Any:
    """Forward pre-hook: floating-point inputs to ``param_dtype`` (FSDP2's ``cast_forward_inputs``).

    Inputs that need no cast (token ids, tensors already in ``param_dtype``,
    flags) are left as they are without walking them as a pytree.
    """
    feature = _feature_of(module)
    if feature is None or feature.input_dtype is None:
        return None
    dtype = feature.input_dtype
    if not any(_needs_cast(dtype, a) for a in args) and not any(
        _needs_cast(dtype, v) for v in kwargs.values()
    ):
        return None
    return _cast_to(dtype, args), _cast_to(dtype, kwargs)


def _cast_output(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: floating-point outputs to ``output_dtype``."""
    feature = _feature_of(module)
    if feature is None or feature.output_dtype is None:
        return None
    return _cast_to(feature.output_dtype, output)
