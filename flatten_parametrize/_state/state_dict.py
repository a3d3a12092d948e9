"""State dicts: the unflattened form with the plain module's keys, the flat form, and staged loading.

Saving: each changed module emits its flattened attributes at their original
position (zero copy: the flat buffer's memory, each through a storage of its own,
see ``_alias``); the registered module drops its ``flat_param_*`` entries.

Loading: the registered module first turns a flat-form dict into the
unflattened form (after checking its layout record); then each module runs
torch's own ``_load_from_state_dict`` with a *staging* parameter in place of
each flattened attribute. Staging parameters record what torch would copy
instead of copying, so that the registered module's ``load_state_dict`` can
commit every value after torch has checked everything (atomic loading). Where
FSDP2 registered its ``DTensor`` in a flat parameter's place, staging
parameters are stand-ins of the slots' shapes and the commit writes the part of
each slot that this rank's shard holds (``_core/foreign.py``).
"""

from __future__ import annotations

import json
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .._core.foreign import is_distributed, is_foreign, local_shard
from .._core.names import flat_layout_name, registered_storage
from .._core.records import Coordinator, Group, ModuleState, StagedValue
from .._core.view_cache import GroupViews
from .._core.writes import land_direct_writes
from .alias import own_storage_alias
from .sharded_slots import local_writes, sharded_flat, slot_values

__all__ = [
    "Snapshot",
    "alias_unflattened",
    "StagingSlot",
    "load_atomically",
    "layout_record",
    "load_module",
    "save_module",
    "unflatten_flat_form",
]

_FORMAT = 1


class StagingSlot(nn.Parameter):
    """Stands in for a flattened attribute while torch loads a state dict.

    It shares memory with the slot's view (so shape, dtype, device and
    ``is_meta`` are right) but ``copy_`` and ``module_load`` only record the
    source; the owner commits it later.
    """

    _source: Tensor | None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (Tensor.copy_, Tensor.module_load) and isinstance(args[0], StagingSlot):
            target, source = args[0], args[1]
            if not isinstance(source, Tensor):
                raise TypeError(f"expected a Tensor to load, got {type(source).__name__}")
            if source.is_meta and not target.is_meta:
                raise NotImplementedError("Cannot copy out of meta tensor; it holds no values")
            target._source = source
            return target if func is Tensor.copy_ else source.detach()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _staging(views: GroupViews, index: int, requires_grad: bool) -> StagingSlot:
    current = views.current()
    shard = local_shard(current) if is_foreign(current) else None
    if shard is None:
        memory = views.master_view(index).detach()
    else:  # FSDP2's DTensor: a stand-in of the slot's shape (the values go to the local shard)
        local = shard[0]
        memory = torch.empty((), dtype=local.dtype, device=local.device).expand(views.layout.shapes[index])
    slot = torch.Tensor._make_subclass(StagingSlot, memory, requires_grad)
    slot._source = None
    return slot


def save_module(
    module: nn.Module,
    state: ModuleState | None,
    base_save: Callable[[Any, str, bool], None],
    destination: Any,
    prefix: str,
    keep_vars: bool,
) -> None:
    """Save ``module``'s own entries in the plain module's keys and order."""
    if state is None or not state.storage.is_flattened:
        base_save(destination, prefix, keep_vars)  # unflattened: see alias_unflattened
        return
    if registered_storage(module) is state.storage:
        state.storage.sync_writes()  # the whole tree's pending writes, once per state_dict()
    else:
        land_direct_writes([(module, state)])
    own: OrderedDict[str, Any] = OrderedDict()
    root: Coordinator | None = registered_storage(module)
    _save_without_dtensor_flats(module, root, base_save, own, prefix, keep_vars)
    if root is not None:
        for group in root.groups():
            own.pop(prefix + group.flat_name, None)
    for name in state.order:
        key = prefix + name
        slot = state.slots.get(name)
        if slot is not None:
            sharded = _sharded_value(destination, slot)
            if sharded is not None:
                destination[key] = sharded
                continue
            view = slot[0].master_view(slot[1])
            destination[key] = view if keep_vars else _alias(destination, slot, view.detach())
        elif key in own:
            destination[key] = own.pop(key)
    destination.update(own)


def _save_without_dtensor_flats(
    module: nn.Module,
    root: Coordinator | None,
    base_save: Callable[[Any, str, bool], None],
    own: Any,
    prefix: str,
    keep_vars: bool,
) -> None:
    """Run torch's save of ``module``'s own entries without FSDP2's flat ``DTensor`` parameters.

    Their entries are dropped anyway (the slots are saved instead), and a
    ``DTensor`` refuses ``detach()`` under ``inference_mode``.
    """
    params = module._parameters
    flats = (
        ()
        if root is None
        else [g.flat_name for g in root.groups() if is_distributed(params.get(g.flat_name))]
    )
    if not flats:
        base_save(own, prefix, keep_vars)
        return
    saved = list(params.items())
    try:
        for name in flats:
            del params[name]
        base_save(own, prefix, keep_vars)
    finally:
        params.clear()
        params.update(saved)


#: Per state dict being built (by id, with a weak reference: dicts are unhashable), the alias of
#: each slot, so that the names of a tied slot share one tensor.
_ALIASES: dict[int, tuple[weakref.ref[Any], dict[tuple[int, int], Tensor]]] = {}


def _aliases_of(destination: Any) -> dict[tuple[int, int], Tensor]:
    key = id(destination)
    entry = _ALIASES.get(key)
    if entry is not None and entry[0]() is destination:
        return entry[1]

    def forget(_: Any) -> None:
        _ALIASES.pop(key, None)

    try:
        ref = weakref.ref(destination, forget)
    except TypeError:  # a destination that takes no weak reference: tied names get one alias each
        return {}
    _ALIASES[key] = (ref, {})
    return _ALIASES[key][1]


#: Per group whose flat parameter FSDP2 sharded, the per-slot values of the state dict being built
#: (a weak reference to it, the flat ``DTensor`` and its local version then, the values).
_SHARDED: weakref.WeakKeyDictionary[GroupViews, tuple[Any, Tensor, int, list[Tensor]]] = (
    weakref.WeakKeyDictionary()
)


def _sharded_value(destination: Any, slot: tuple[GroupViews, int]) -> Tensor | None:
    """Return the slot's ``DTensor`` value if FSDP2 sharded its group's flat parameter, else ``None``.

    The group's values are made once per state dict being built (one collective
    per group, see ``sharded_slots.py``), and again for the next state dict or
    after the flat parameter changed.
    """
    views, index = slot
    current = views.current()
    if not is_foreign(current):
        return None
    flat = sharded_flat(current, views.layout.numel)
    if flat is None:
        return None
    version = flat.local._version
    made = _SHARDED.get(views)
    if made is not None and made[0]() is destination and made[1] is current and made[2] == version:
        return made[3][index]
    values = slot_values(flat, views.layout)
    group = weakref.ref(views)

    def forget(ref: Any) -> None:  # the state dict is gone: so are its values
        live = group()
        if live is not None and live in _SHARDED and _SHARDED[live][0] is ref:
            del _SHARDED[live]

    try:
        ref: Any = weakref.ref(destination, forget)
    except TypeError:  # a destination without weak references: made again for each slot
        return values[index]
    _SHARDED[views] = (ref, current, version, values)
    return values[index]


def _alias(destination: Any, slot: tuple[Any, int], value: Tensor) -> Tensor:
    """Return ``value`` (a slot's memory) through a storage of its own, one per slot and state dict.

    Savers that keep one tensor per storage then keep every slot (see
    ``_alias.py``); the names of a tied slot get the same tensor, as the plain
    module's state dict gives them the same memory.
    """
    if type(value) is not Tensor or value.is_meta:
        return value  # a tensor subclass (FSDP2's DTensor, ...) has no storage of ours to split
    storage = value.untyped_storage()
    if value.data_ptr() == storage.data_ptr() and value.nbytes == storage.nbytes():
        return value  # already covers its storage (a reassigned parameter in unflattened mode)
    cache = _aliases_of(destination)
    key = (id(slot[0]), slot[1])
    alias = cache.get(key)
    if alias is None or alias.data_ptr() != value.data_ptr():
        alias = cache[key] = own_storage_alias(value)
    return alias


def alias_unflattened(storage: Coordinator, destination: Any, prefix: str) -> None:
    """Give each flattened entry of an unflattened-mode state dict a storage of its own.

    In unflattened mode the modules hold leaf parameters that share the flat
    buffer's storage; the registered module's ``state_dict()`` passes their
    values through :func:`_alias` afterwards, as flat mode does while saving.
    """
    groups = storage.groups()
    for slot, names in zip(storage.slots(), storage.current_names()):
        key = (groups[slot.group_index].views, slot.index)
        for name in names:
            value = destination.get(prefix + name)
            if isinstance(value, Tensor):
                destination[prefix + name] = _alias(destination, key, value)


def load_module(
    module: nn.Module,
    state: ModuleState | None,
    base_load: Callable[..., None],
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load ``module``'s own entries, staging the flattened ones."""
    args = (state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    root: Coordinator | None = registered_storage(module)
    if root is not None:
        unflatten_flat_form(root, state_dict, prefix)
    if state is None or not state.storage.is_flattened:
        base_load(*args)
        return
    params = module._parameters
    saved = list(params.items())
    hidden = {group.flat_name for group in root.groups()} if root is not None else set()
    staged = {
        name: _staging(group, index, group.current().requires_grad)
        for name, (group, index) in state.slots.items()
    }
    try:
        params.clear()
        by_name = dict(saved)
        for name in state.order:
            if name in staged:
                params[name] = staged[name]
            elif name in by_name:
                params[name] = by_name.pop(name)
        for name, value in by_name.items():
            if name not in hidden:
                params[name] = value
        base_load(*args)
        loaded: list[StagedValue] = []
        for name, placeholder in staged.items():
            current = params.get(name)
            if current is placeholder and type(current) is StagingSlot:
                source = placeholder._source
            else:  # assign=True replaced it, or the swap path changed it in place
                source = current
            if source is not None:
                group, index = state.slots[name]
                loaded.append((group, index, source))
    finally:
        kept = {name: value for name, value in params.items() if name not in staged}
        params.clear()
        for name, value in saved:
            params[name] = kept.pop(name, value)
        params.update(kept)
    _stage(state.storage, loaded)


def layout_record(group: Group) -> Tensor:
    """Return the layout record of ``group`` as a uint8 tensor (UTF-8 JSON)."""
    data = json.dumps(_layout_dict(group), separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _layout_dict(group: Group) -> dict[str, Any]:
    layout = group.layout
    return {
        "format": _FORMAT,
        "group": group.name,
        "numel": layout.numel,
        "slots": [
            [slot.name, list(slot.aliases), layout.offsets[slot.index], list(layout.shapes[slot.index])]
            for slot in group.members
        ],
    }


def _read_record(record: Any, key: str) -> dict[str, Any]:
    try:
        if not isinstance(record, Tensor) or record.dtype != torch.uint8 or record.dim() != 1:
            raise ValueError
        loaded = json.loads(bytes(record.tolist()).decode())
        if not isinstance(loaded, dict):
            raise ValueError
        return loaded
    except ValueError:
        raise ValueError(
            f"flat state dict entry '{key}' is not a layout record (a uint8 tensor written by "
            "storage.flat_state_dict()); got "
            f"{type(record).__name__ if not isinstance(record, Tensor) else f'a {record.dtype} tensor'}"
        ) from None


def _first_difference(expected: dict[str, Any], found: dict[str, Any]) -> str:
    if expected.get("numel") != found.get("numel"):
        return f"the buffer holds {found.get('numel')} elements, here {expected['numel']}"
    ours, theirs = expected["slots"], found.get("slots", [])
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return (
                f"slot {i} is {b[0]} at offset {b[2]} with shape {tuple(b[3])} in the checkpoint, "
                f"{a[0]} at offset {a[2]} with shape {tuple(a[3])} here"
            )
    return f"the checkpoint has {len(theirs)} tensors, here {len(ours)}"


def unflatten_flat_form(storage: Coordinator, state_dict: dict[str, Any], prefix: str) -> None:
    """Replace the flat entries of ``state_dict`` (in place) by views under the original names.

    A flat entry without its layout record (DeepSpeed's ``zero_to_fp32``,
    fairscale's wrapper) loads when its size and dtype are the group's, with a
    ``UserWarning`` (one per load) that the layout could not be checked.

    Raises:
        ValueError: if the dict mixes both forms, a layout record differs
            from this storage's layout, or a flat tensor has the wrong size (or,
            without its layout record, the wrong dtype).
        TypeError: if a flat entry is not a tensor.
    """
    groups = storage.groups()
    by_key = {prefix + group.flat_name: group for group in groups}
    ours = [k for k in by_key if k in state_dict]
    if not ours:
        return
    live = storage.live_names()
    original = next((prefix + n for n in sorted(live) if prefix + n in state_dict), None)
    if original is not None:
        # The flat parameter itself beside the plain names: what set_model_state_dict(...,
        # full_state_dict=True) adds from named_parameters(); it carries nothing to load.
        for key in [
            k for k in ours if state_dict[k] is by_key[k].views.current() or state_dict[k] is by_key[k].flat
        ]:
            state_dict.pop(key)
            state_dict.pop(prefix + flat_layout_name(by_key[key].name), None)
            ours.remove(key)
        if not ours:
            return
        raise ValueError(
            f"state dict mixes the flat form ('{ours[0]}') and the unflattened form "
            f"('{original}') for one flat storage; load one form: module.state_dict() "
            "or storage.flat_state_dict()"
        )
    unchecked: list[str] = []
    for key in ours:
        group = by_key[key]
        gname = group.name
        record_key = prefix + flat_layout_name(gname)
        flat = state_dict[key]
        if not isinstance(flat, Tensor):
            raise TypeError(f"flat state dict entry '{key}' must be a tensor; got {type(flat).__name__}")
        if record_key not in state_dict:
            _check_recordless(key, flat, group)
            unchecked.append(key)
            continue
        expected = _layout_dict(group)
        found = _read_record(state_dict[record_key], record_key)
        if found.get("numel") != expected["numel"] or found.get("slots") != expected["slots"]:
            raise ValueError(
                f"flat state dict for group '{gname}' was written for another layout: "
                f"{_first_difference(expected, found)}; load the unflattened form "
                "(module.state_dict()) instead, or register with the same groups and align"
            )
        numel = group.layout.numel
        if flat.shape != (numel,):
            raise ValueError(
                f"flat state dict entry '{key}' has shape {tuple(flat.shape)}; group "
                f"'{gname}' needs a one-dimensional tensor of {numel} elements"
            )
    if unchecked:
        entries = ", ".join(f"'{key}'" for key in unchecked)
        warnings.warn(
            f"flat state dict entr{'ies' if len(unchecked) > 1 else 'y'} {entries} "
            f"{'come' if len(unchecked) > 1 else 'comes'} without a layout record (as DeepSpeed's "
            "zero_to_fp32 and fairscale write flat checkpoints): the size and dtype match this "
            "model, but the layout could not be checked; the values are loaded in this model's "
            "layout. Save with storage.flat_state_dict() or module.state_dict() to keep the check",
            UserWarning,
            stacklevel=2,
        )
    # The names the tree reaches each slot by now: a replaced submodule loads its own entries, a moved
    # one (peft's merge_and_unload puts the wrapped layer where its adapter was) its slots' values.
    current = {id(slot): names for slot, names in zip(storage.slots(), storage.current_names())}
    for key in ours:
        group = by_key[key]
        flat = state_dict.pop(key)
        state_dict.pop(prefix + flat_layout_name(group.name), None)
        views = group.split(flat)
        for slot in group.members:
            for name in current[id(slot)]:
                state_dict[prefix + name] = views[slot.index]


def _check_recordless(key: str, flat: Tensor, group: Group) -> None:
    """Refuse a flat entry without layout record unless its size and dtype are the group's.

    Raises:
        ValueError: naming the entry, what the group needs and what was found.
    """
    numel, dtype = group.layout.numel, group.flat.dtype
    if flat.shape != (numel,) or flat.dtype != dtype:
        raise ValueError(
            f"flat state dict entry '{key}' comes without its layout record and does not match "
            f"group '{group.name}': expected a one-dimensional {dtype} tensor of {numel} elements, "
            f"found shape {tuple(flat.shape)}, {flat.dtype}; a flat entry without layout record "
            "loads only into a model whose group has its exact size and dtype (convert it with "
            f".to({dtype}) if only the dtype differs), or load the unflattened form"
        )


class Snapshot:
    """The parameters and buffers of a module tree outside the flat buffers, for rollback.

    Records each module's ``_parameters`` and ``_buffers`` entries (so that
    ``assign=True`` can be undone) and a copy of each tensor's values.
    """

    def __init__(self, root: nn.Module, skip: set[int]) -> None:
        self._entries: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]] = []
        self._values: dict[int, tuple[Tensor, Tensor]] = {}
        with torch.no_grad():
            for module in root.modules():
                params, buffers = dict(module._parameters), dict(module._buffers)
                self._entries.append((module, params, buffers))
                for tensor in (*params.values(), *buffers.values()):
                    if isinstance(tensor, Tensor) and id(tensor) not in skip:
                        self._values.setdefault(id(tensor), (tensor, tensor.detach().clone()))

    def restore(self) -> None:
        """Put every entry and value back."""
        for module, params, buffers in self._entries:
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
        with torch.no_grad():
            for tensor, value in self._values.values():
                if tensor.shape == value.shape:
                    tensor.copy_(value)


def _stage(core: Coordinator, loaded: list[StagedValue]) -> None:
    """Take values read by a module's ``_load_from_state_dict``: staged during a load, else written."""
    if core.pending is not None:
        core.pending.extend(loaded)
    else:
        _commit_staged(core.groups(), loaded)


def load_atomically(
    core: Coordinator, base: Callable[..., Any], state_dict: Any, strict: bool, assign: bool
) -> Any:
    """Load through torch's machinery (``base``, the root's ``load_state_dict``), then commit: all or nothing.

    In flat mode each module's ``_load_from_state_dict`` stages the values of
    its flattened attributes (:func:`load_module`) and nothing is written until
    torch's load returned without error: then the staged values go into the
    flat buffers in one native call. Everything else torch loaded (buffers,
    ordinary parameters, ``assign=True`` replacements, unflattened-mode
    parameters) is put back from a snapshot if anything raised.

    Raises:
        TypeError: if ``state_dict`` is not a mapping.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
    flat_mode = core.is_flattened
    core.sync_writes()
    snapshot = Snapshot(core.module, {id(group.flat) for group in core.groups()} if flat_mode else set())
    core.pending = [] if flat_mode else None
    try:
        result = base(state_dict, strict=strict, assign=assign)
        _commit_staged(core.groups(), core.pending or [])
    except BaseException:
        snapshot.restore()
        raise
    finally:
        core.pending = None
    return result


def _commit_staged(groups: Sequence[Group], loaded: list[StagedValue]) -> None:
    """Write staged values into the flat buffers with one native call.

    Everything that can fail (casts, device moves, allocation) happens
    before that call, and a single call cannot be interrupted half-way by
    a Python exception, so the commit needs no copy of the old values.
    """
    if not loaded:
        return
    with torch.no_grad():
        splits: dict[int, list[Tensor]] = {}
        targets, sources = [], []
        foreign: dict[int, tuple[GroupViews, list[tuple[int, Tensor]]]] = {}
        for views, index, source in loaded:
            current = views.current()
            if is_foreign(current) and sharded_flat(current, views.layout.numel) is not None:
                foreign.setdefault(id(views), (views, []))[1].append((index, source))
                continue
            shard = local_shard(current) if is_foreign(current) else None
            if shard is not None:  # another DTensor: the part of the slot that this rank holds
                part = _local_part(views, index, source, *shard)
                if part is not None:
                    targets.append(part[0])
                    sources.append(part[1])
                continue
            if id(views) not in splits:
                group = next(group for group in groups if group.views is views)
                splits[id(views)] = group.value_views()
            target = splits[id(views)][index]
            if source.dtype != target.dtype or source.device != target.device:
                source = source.to(dtype=target.dtype, device=target.device)
            targets.append(target)
            sources.append(source)
        for views, items in foreign.values():  # FSDP2's sharded flat parameter: this rank's shard
            flat = sharded_flat(views.current(), views.layout.numel)
            for target, source in local_writes(flat, views.layout, items):  # type: ignore[arg-type]
                targets.append(target)
                sources.append(source)
        if targets:
            torch._foreach_copy_(targets, sources)


def _local_part(
    views: GroupViews, index: int, source: Tensor, local: Tensor, start: int
) -> tuple[Tensor, Tensor] | None:
    """Return (target, source) for the elements of slot ``index`` in a local shard starting at ``start``.

    A ``DTensor`` source is gathered first (``full_tensor()``: a collective that
    every rank runs, in the same order, whatever part of the slot it holds).
    """
    full_tensor = getattr(source, "full_tensor", None)
    if callable(full_tensor):
        source = full_tensor()
    offset = views.layout.offsets[index]
    lo, hi = max(offset, start), min(offset + views.layout.numels[index], start + local.numel())
    if lo >= hi:
        return None
    values = source.reshape(-1)[lo - offset : hi - offset].to(dtype=local.dtype, device=local.device)
    return local.detach()[lo - start : hi - start], values
