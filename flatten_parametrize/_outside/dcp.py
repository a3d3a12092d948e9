"""``torch.distributed.checkpoint`` state dicts of flattened models, in the plain model's names.

DCP's ``get_state_dict`` / ``set_state_dict`` (and ``get_/set_model_state_dict``,
``get_/set_optimizer_state_dict``) find a model's parameters by walking
``named_parameters()``, which on a flattened model yields the flat parameters:
the model state loads by names its ``state_dict()`` does not have (``Missing
key: flat_param_0`` under DDP), and optimizer state would be keyed
``state.flat_param_0.exp_avg``, one tensor per group, so a checkpoint could
not move between the plain and the flattened model.

:func:`patch` wraps six private functions of
``torch.distributed.checkpoint.state_dict`` so that DCP sees a flattened
storage as the plain model (``flatten_parametrize/_outside/registry.py`` lists it and
runs it when that module is imported, now or later):

* ``_iterate_valid_model_state``: the model's state as the plain model's
  (each flattened name with its ``state_dict()`` value, in place of the flat
  parameters), so loading re-prefixes and checks the plain names (DDP's
  ``module.``, ``strict``, ``full_state_dict``);
* ``_verify_options``: the flat parameters keep their own names in DCP's
  parameter map, which its optimizer code looks up;
* ``_get_optim_state_dict``: optimizer state of a flat parameter is split into
  its members' (``state.<plain name>.exp_avg`` of the plain shape; scalars
  such as ``step`` copied to each) and param groups list the plain names;
  an attached optimizer is read in its own flat format first;
* ``_load_optim_state_dict``: the reverse before torch loads it (members
  joined into the flat tensor, padding zero);
* ``_init_optim_state``: a ``ShardedOptimizer`` creates its slices' state
  itself (torch's zero-gradient step cannot reach them);
* ``_get_fqns``: a flattened name resolves without reading its view. DCP reads
  the attribute at the end of each name it maps (twice per key when loading);
  under FSDP2 a view of the sharded flat ``DTensor`` is an all-gather of the
  whole group, a collective in code that every other model runs without one.

Values stay what DCP would have: plain tensors (views of the live state),
or, under FSDP2, ``DTensor``\\ s sharded like the plain model's (``Shard(0)``
of each member, gathered and re-cut from the flat one). Everything else
(options, ``strict``, resharding, the flattened ``flatten_optimizer_state_dict``
form) is torch's own code. Models without a flattened storage take torch's
path unchanged.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .._core.foreign import is_distributed
from .._core.names import MODULE_STATE_ATTR, flat_param_name, registered_storage
from .._distributed.sharded import ShardedOptimizer, init_state
from .._state.attach_optim import own_format
from .dcp_sharded import (
    is_sharded,
    joined_value,
    member_names,
    missing_state,
    state_by_name,
    state_for,
    tensor_names,
)
from .on_import import is_ours, wrapper_of

__all__ = ["WRAPPED", "patch"]

#: The functions wrapped (all or none).
WRAPPED = (
    "_iterate_valid_model_state",
    "_verify_options",
    "_init_optim_state",
    "_get_optim_state_dict",
    "_load_optim_state_dict",
    "_get_fqns",
)
#: What the wrapped functions use besides.
_USED = ("_flatten_optim_state_dict", "_maybe_full_or_cpu_state_dict")

_raw = threading.local()  # depth of DCP calls that must see the flat names (our own, nested)


@dataclass
class _Flat:
    """One flat parameter of a flattened storage inside the model DCP was given."""

    #: DCP's name of the flat parameter (DDP's ``module.`` and compile's ``_orig_mod.`` dropped).
    fqn: str
    #: Its attribute on the registered module (``flat_param_<group>``).
    attr: str
    #: The flat parameter (under FSDP2, its ``DTensor``).
    flat: Tensor
    #: ``(DCP name, offset, numel, shape)`` of each member, in layout order.
    members: list[tuple[str, int, int, torch.Size]]
    #: The storage's core.
    core: Any

    @property
    def numel(self) -> int:
        return int(self.flat.shape[0])


def _flats(dsd: ModuleType, model: nn.Module) -> list[_Flat]:
    """Return every flat parameter of every flattened storage in ``model``."""
    out: list[_Flat] = []
    for prefix, module in model.named_modules():
        core = registered_storage(module)
        if core is None or not core.is_flattened:
            continue
        infos = core.param_infos
        for group in core.groups():
            attr = flat_param_name(group.name)
            flat = module._parameters.get(attr)
            if not isinstance(flat, Tensor):
                continue
            (fqn,) = dsd._get_fqns(model, f"{prefix}.{attr}" if prefix else attr)
            base = fqn[: len(fqn) - len(attr)]
            members = [
                (base + info.name, info.offset, info.numel, torch.Size(info.shape))
                for info in infos
                if info.group == group.name
            ]
            out.append(_Flat(fqn, attr, flat, members, core))
    return out


@contextmanager
def _flat_names(optimizers: tuple[Any, ...] = ()) -> Iterator[None]:
    """Run DCP's own code with the flat names: no conversion, attached optimizers in their flat format."""
    _raw.depth = getattr(_raw, "depth", 0) + 1
    try:
        with ExitStack() as stack:
            for optim in optimizers:
                stack.enter_context(own_format(optim))
            yield
    finally:
        _raw.depth -= 1


def _converting() -> bool:
    return not getattr(_raw, "depth", 0)


# ------------------------------------------------------------------------------ DTensor helpers
def _full(value: Tensor) -> Tensor:
    return value.full_tensor() if is_distributed(value) else value  # type: ignore[attr-defined]


def _shard_like(full: Tensor, like: Any) -> Tensor:
    """Return ``full`` cut like ``like`` (a DTensor: same mesh, same placements, local cut, no collective)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    placements = like.placements if full.dim() > 0 else [Replicate()] * like.device_mesh.ndim
    return distribute_tensor(full, like.device_mesh, placements, src_data_rank=None)


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else copy.deepcopy(value)


# --------------------------------------------------------------------------- flat -> plain names
def _member_value(value: Any, flat: _Flat, offset: int, numel: int, shape: torch.Size) -> Any:
    """Return a member's part of one state value of a flat parameter (a scalar: a copy)."""
    if not (isinstance(value, Tensor) and value.dim() == 1 and value.shape[0] == flat.numel):
        return _copy(value)
    if is_distributed(value):
        return _shard_like(_full(value).narrow(0, offset, numel).reshape(shape).clone(), value)
    return value.narrow(0, offset, numel).view(shape)  # a view of the live state, as torch gives


def _to_plain(osd: Any, flats: list[_Flat]) -> Any:
    """Key DCP's optimizer state dict (``state`` / ``param_groups`` by fqn) by the plain names."""
    if not isinstance(osd, Mapping) or "state" not in osd:
        return osd
    by_fqn = {f.fqn: f for f in flats}
    state: dict[str, Any] = {}
    for fqn, entry in osd["state"].items():
        flat = by_fqn.get(fqn)
        if flat is None:
            state[fqn] = entry
            continue
        for name, offset, numel, shape in flat.members:
            state[name] = {key: _member_value(v, flat, offset, numel, shape) for key, v in entry.items()}
    groups = []
    for group in osd["param_groups"]:
        params: list[str] = []
        for fqn in group["params"]:
            flat = by_fqn.get(fqn)
            params += [m[0] for m in flat.members] if flat is not None else [fqn]
        groups.append({**group, "params": params})
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------- plain -> flat names
def _flat_value(flat: _Flat, key: str, values: list[tuple[tuple[str, int, int, torch.Size], Any]]) -> Any:
    """Return one state value of ``flat`` from its members' (per-element joined; scalars equal)."""
    value = joined_value(key, values, flat.numel, f", both in {flat.fqn}", _full)
    if isinstance(value, Tensor) and is_distributed(values[0][1]) and is_distributed(flat.flat):
        return _shard_like(value, flat.flat)
    return value


def _to_flat(osd: Any, flats: list[_Flat], strict: bool) -> Any:
    """Key an optimizer state dict in the plain names (``state`` / ``param_groups``) by the flat ones."""
    if not isinstance(osd, Mapping) or "state" not in osd:
        return osd
    state = dict(osd["state"])
    owner: dict[str, _Flat] = {}
    for flat in flats:
        names = [m[0] for m in flat.members]
        owner.update(dict.fromkeys(names, flat))
        found = {name: state.pop(name) for name in names if name in state}
        if not found:
            continue
        missing = [name for name in names if name not in found]
        if missing and strict:
            raise missing_state(missing[0])
        keys: list[str] = []
        for entry in found.values():
            keys += [k for k in entry if k not in keys]
        state[flat.fqn] = {
            key: _flat_value(
                flat, key, [(m, found[m[0]][key]) for m in flat.members if key in found.get(m[0], {})]
            )
            for key in keys
        }
    groups = []
    placed: set[str] = set()
    for group in osd["param_groups"]:
        params: list[str] = []
        for fqn in group["params"]:
            holder = owner.get(fqn)
            if holder is None:
                params.append(fqn)
            elif holder.fqn not in placed:
                placed.add(holder.fqn)
                params.append(holder.fqn)
        if params or not group["params"]:
            groups.append({**group, "params": params})
    return {"state": state, "param_groups": groups}


def _nest(flattened: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """Turn DCP's ``flatten_optimizer_state_dict`` form back into ``state`` / ``param_groups`` by fqn."""
    longest = sorted(names, key=len, reverse=True)
    state: dict[str, Any] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flattened.items():
        section, _, rest = key.partition(".")
        fqn = next((n for n in longest if rest.startswith(n + ".")), None)
        if fqn is None or section not in ("state", "param_groups"):
            continue
        parts = rest[len(fqn) + 1 :].split(".")
        if section == "param_groups":
            hyper.setdefault(fqn, {})[".".join(parts)] = value
            continue
        node = state.setdefault(fqn, {})
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return {"state": state, "param_groups": [{**h, "params": [fqn]} for fqn, h in hyper.items()]}


# ------------------------------------------------------------------------------------ the wrappers
def _iterate_valid_model_state(original: Callable[..., Any], dsd: ModuleType) -> Callable[..., Any]:
    def wrapper(model: nn.Module, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        flats = {id(f.flat): f for f in _flats(dsd, model)}
        done: set[int] = set()
        for name, obj in original(model, *args, **kwargs):
            flat = flats.get(id(obj))
            if flat is None:
                yield name, obj
                continue
            if id(flat.core) in done:
                continue
            done.add(id(flat.core))
            prefix = name[: len(name) - len(flat.attr)]
            names = set(flat.core.view_names(remove_duplicate=False))
            for key, value in flat.core.module.state_dict(keep_vars=True).items():
                if key in names:
                    yield prefix + key, value

    return wrapper


def _is_view_name(model: nn.Module, path: str, attr: str, modifiers: str) -> bool:
    """Return whether ``path.attr`` in ``model`` is a flattened attribute served as a view now."""
    owner: Any = model
    for part in path.split("."):
        owner = getattr(owner, part, None)  # modules only (DDP's ``module``, FSDP's wrapped module)
        if not isinstance(owner, nn.Module):
            return False
    state = owner.__dict__.get(MODULE_STATE_ATTR)
    return (
        state is not None
        and attr in state.slots
        and attr not in owner._parameters  # unflattened mode: a real parameter, read as is
        and not hasattr(owner, modifiers)  # a module that renames its attributes for DCP: torch's path
    )


def _get_fqns(original: Callable[..., Any], dsd: ModuleType) -> Callable[..., Any]:
    def wrapper(
        model: nn.Module, name: str, dsd_fqn_modifiers: str = "_fqn_modifiers", *args: Any, **kwargs: Any
    ) -> Any:
        path, dot, attr = name.rpartition(".")
        if not dot or not _is_view_name(model, path, attr, dsd_fqn_modifiers):
            return original(model, name, dsd_fqn_modifiers, *args, **kwargs)
        # torch's walk of the module path (its prefixes dropped or kept as asked) ending at an
        # attribute every module has and that costs nothing to read, then the attribute's name
        fqns = original(model, f"{path}.training", dsd_fqn_modifiers, *args, **kwargs)
        return {fqn[: len(fqn) - len("training")] + attr for fqn in fqns}

    return wrapper


def _verify_options(original: Callable[..., Any], dsd: ModuleType) -> Callable[..., Any]:
    def wrapper(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        info = original(model, *args, **kwargs)
        for flat in _flats(dsd, model):  # the optimizer code maps its parameters through these
            info.fqn_param_mapping[flat.flat] = {flat.fqn}
            info.fqn_param_mapping[flat.fqn] = flat.flat
        return info

    return wrapper


def _init_optim_state(original: Callable[..., Any], dsd: ModuleType) -> Callable[..., Any]:
    def wrapper(optim: Any) -> None:
        if isinstance(optim, ShardedOptimizer):
            init_state(optim)
            return
        original(optim)

    return wrapper


def _get_optim_state_dict(original: Callable[..., Any], dsd: ModuleType) -> Callable[..., Any]:
    def wrapper(model: nn.Module, optimizers: tuple[Any, ...], info: Any) -> Any:
        if not info.handle_optim:
            return original(model, optimizers, info)
        flats = _flats(dsd, model) if _converting() else []
        sharded = [optim for optim in optimizers if is_sharded(optim)]
        if not flats and not sharded:
            with _flat_names(optimizers):
                return original(model, optimizers, info)
        rest = tuple(optim for optim in optimizers if optim not in sharded)
        flatten = info.flatten_optimizer_state_dict
        info.flatten_optimizer_state_dict = False
        try:
            with _flat_names(rest):
                osd = _to_plain(original(model, rest, info), flats)
        finally:
            info.flatten_optimizer_state_dict = flatten
        for optim in sharded:  # keyed by the plain names by dcp_sharded.py
            own = dsd._maybe_full_or_cpu_state_dict(state_by_name(dsd, model, optim), info)
            if own:
                osd = {
                    "state": {**osd.get("state", {}), **own["state"]},
                    "param_groups": [*osd.get("param_groups", []), *own["param_groups"]],
                }
        if flatten and isinstance(osd, Mapping) and "state" in osd:
            osd = dsd._flatten_optim_state_dict(osd)
        return osd

    return wrapper


def _load_optim_state_dict(original: Callable[..., Any], dsd: ModuleType) -> Callable[..., Any]:
    def wrapper(model: nn.Module, optimizers: tuple[Any, ...], state_dict: Any, info: Any) -> None:
        flats = _flats(dsd, model) if _converting() and info.handle_optim else []
        sharded = [optim for optim in optimizers if is_sharded(optim)] if info.handle_optim else []
        rest = tuple(optim for optim in optimizers if optim not in sharded)
        parts: list[Any] = [None] * len(sharded)
        error: Exception | None = None
        if (flats or sharded) and state_dict:
            try:
                sharded_names = [tensor_names(dsd, model, optim) for optim in sharded]
                if "state" not in state_dict:
                    names = [m[0] for f in flats for m in f.members]
                    names += [n for n, _ in model.named_parameters()]
                    names += [fqn for n, _ in model.named_parameters() for fqn in dsd._get_fqns(model, n)]
                    names += [n for groups in sharded_names for g in member_names(groups) for n in g]
                    state_dict = _nest(state_dict, names)
                parts = [
                    state_for(optim, groups, state_dict, info.strict)
                    for optim, groups in zip(sharded, sharded_names)
                ]
                if flats and rest:
                    state_dict = _to_flat(state_dict, flats, info.strict)
            except (ValueError, RuntimeError) as caught:
                error = caught
        if (flats or sharded) and info.broadcast_from_rank0:
            _agree(error)  # the other ranks would wait in torch's broadcast of rank 0's state
        elif error is not None:
            raise error
        for optim, part in zip(sharded, parts):
            if info.broadcast_from_rank0:
                part = _from_rank0(part)
            if part is not None:
                optim.load_state_dict(part)
        with _flat_names(rest):
            original(model, rest, state_dict, info)

    return wrapper


def _from_rank0(obj: Any) -> Any:
    """Return rank 0's ``obj`` on every rank (a collective: every rank calls it)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _agree(error: Exception | None) -> None:
    """Raise on every rank when the conversion failed on one (a collective: every rank calls it)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else (type(error), str(error)))
    if error is not None:
        raise error
    for rank, found in enumerate(errors):
        if found is not None:
            kind, message = found
            raise kind(f"set_state_dict failed on rank {rank}, so on every rank: {message}")


_WRAPPERS: dict[str, Callable[[Callable[..., Any], ModuleType], Callable[..., Any]]] = {
    "_iterate_valid_model_state": _iterate_valid_model_state,
    "_verify_options": _verify_options,
    "_init_optim_state": _init_optim_state,
    "_get_optim_state_dict": _get_optim_state_dict,
    "_load_optim_state_dict": _load_optim_state_dict,
    "_get_fqns": _get_fqns,
}


def patch(dsd: ModuleType) -> None:
    """Wrap the functions of ``dsd`` (DCP's ``state_dict`` module), once; none if one is missing."""
    if not all(callable(getattr(dsd, name, None)) for name in WRAPPED + _USED):
        return  # another torch: leave DCP as it is rather than half wrapped
    for name in WRAPPED:
        current = getattr(dsd, name)
        if not is_ours(current):
            setattr(dsd, name, wrapper_of(current, _WRAPPERS[name](current, dsd)))
