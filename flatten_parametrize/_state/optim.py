"""Optimizer state across the switch: convert ``optimizer.state_dict()`` between plain and flat.

An optimizer of the plain model keeps state per parameter (an ``exp_avg`` of
``layer.weight``'s shape, a ``step`` per parameter, ...); the optimizer of the
flattened model keeps it per flat parameter. :func:`flat_optim_state_dict`
turns the first into the second and :func:`plain_optim_state_dict` does the
reverse, so that training moves between the two without losing optimizer
state (a checkpoint of the plain model resumed on the flattened one, say).

Parameters are identified by name. A state dict saved by an optimizer built
from ``module.named_parameters()`` carries the names (``param_names`` in each
param group); otherwise the optimizer's parameters are taken to be the
module's, in ``module.parameters()`` order, or their names are given with
``param_names=``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import Tensor

from .._core.names import core_behind, flat_param_name

if TYPE_CHECKING:
    from .._core.records import Coordinator, ParamInfo, PublicStorage

__all__ = ["flat_optim_state_dict", "plain_optim_state_dict", "plain_parameter_names"]


class _Flat:
    """The flat parameter of one group, as an optimizer of the flattened model holds it."""

    def __init__(self, group: str, numel: int) -> None:
        self.group = group
        self.numel = numel


#: What an optimizer parameter is: a flattened parameter of the plain model (its
#: ``ParamInfo``), a flat parameter, or an ordinary parameter that is in no group.
_Target = Union["ParamInfo", _Flat, Tensor]


class _Model:
    """Both sides of one flat storage: parameter names and order of the plain and flattened model."""

    def __init__(self, storage: Coordinator) -> None:
        self.storage = storage
        self.infos = storage.param_infos
        self.flats = [_Flat(g, f.numel()) for g, f in zip(storage.group_names, storage.flat_params)]
        self.plain = self._walk(flat=False)
        self.flat = self._walk(flat=True)
        self.rank = {id(target): i for i, (_, target) in enumerate(self.plain)}

    def _walk(self, flat: bool) -> list[tuple[str, _Target]]:
        """Return ``(name, target)`` in ``module.named_parameters()`` order of one side.

        ``flat=False``: the plain model (the order inside ``storage.unflattened()``);
        ``flat=True``: the flattened model. Works in either mode and changes nothing.
        """
        storage = self.storage
        root = storage.module
        groups = storage.groups()
        info_of = {
            (id(groups[slot.group_index].views), slot.index): info
            for slot, info in zip(storage.slots(), self.infos)
        }
        flat_names = {flat_param_name(f.group) for f in self.flats}
        out: list[tuple[str, _Target]] = []
        seen: set[int] = set()
        for prefix, module in root.named_modules():
            state = storage.state_of(module)  # also in unflattened mode, where it is kept aside
            slots = state.slots if state is not None else {}
            names = list(state.order) if state is not None else []
            names += [
                n for n in module._parameters if n not in names and not (module is root and n in flat_names)
            ]
            found: list[tuple[str, _Target]] = []
            for name in names:
                if name in slots:
                    if not flat:
                        views, index = slots[name]
                        found.append((name, info_of[(id(views), index)]))
                    continue
                param = module._parameters.get(name)
                if isinstance(param, Tensor):
                    found.append((name, param))
            if flat and module is root:
                found += [(flat_param_name(f.group), f) for f in self.flats]
            for name, target in found:
                if id(target) not in seen:
                    seen.add(id(target))
                    out.append((f"{prefix}.{name}" if prefix else name, target))
        return out


def plain_parameter_names(storage: Coordinator) -> list[str]:
    """Return the names that the plain model's ``named_parameters()`` yields under ``storage.module``."""
    return [name for name, _ in _Model(storage).plain]


def _shape(target: _Target) -> tuple[int, ...]:
    if isinstance(target, _Flat):
        return (target.numel,)
    return tuple(target.shape)  # a parameter or a ParamInfo


# ------------------------------------------------------------------ state-dict side
def check_state_dict(state_dict: Any, what: str) -> tuple[Mapping[Any, Any], list[Mapping[str, Any]]]:
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise TypeError(
            f"{what} needs an optimizer state dict (a dict with 'state' and 'param_groups', as "
            f"optimizer.state_dict() returns); got {type(state_dict).__name__}; pass optimizer.state_dict()"
        )
    state, groups = state_dict["state"], state_dict["param_groups"]
    if not isinstance(state, Mapping) or isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise TypeError(
            f"{what} needs 'state' to be a dict and 'param_groups' a list; got "
            f"{type(state).__name__} and {type(groups).__name__}; pass optimizer.state_dict()"
        )
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), Sequence):
            raise TypeError(
                f"{what} needs every param group to be a dict with a 'params' list; param group {i} "
                f"is {type(group).__name__}; pass optimizer.state_dict()"
            )
    ids = {pid for group in groups for pid in group["params"]}
    stray = [pid for pid in state if pid not in ids]
    if stray:
        raise ValueError(
            f"{what} needs state for parameters of the param groups only; the state has entries "
            f"for ids {stray[:5]} that no param group holds; pass optimizer.state_dict()"
        )
    return state, list(groups)


def _names(
    model: _Model, groups: list[Mapping[str, Any]], param_names: Sequence[str] | None, flat: bool, what: str
) -> list[str]:
    """Return the name of every optimizer parameter, param group by param group."""
    count = sum(len(group["params"]) for group in groups)
    side = "flattened" if flat else "plain"
    if param_names is not None:
        if isinstance(param_names, (str, bytes)) or not isinstance(param_names, Sequence):
            raise TypeError(
                f"{what} needs param_names to be a list of parameter names; got "
                f"{type(param_names).__name__}; pass e.g. [name for name, _ in module.named_parameters()]"
            )
        names, source = [str(n) for n in param_names], "param_names"
    elif groups and all("param_names" in group for group in groups):
        names = [str(n) for group in groups for n in group["param_names"]]
        source = "the state dict's param_names"
    else:
        names = [name for name, _ in (model.flat if flat else model.plain)]
        if len(names) != count:
            raise ValueError(
                f"{what} needs the names of the optimizer's parameters: without names, the optimizer "
                f"must hold the {side} module's parameters in module.parameters() order; it holds "
                f"{count} parameters, the {side} module has {len(names)}; pass param_names=[...] in "
                "the optimizer's order, or build the optimizer from module.named_parameters()"
            )
        return names
    if len(names) != count:
        raise ValueError(
            f"{what} needs one name per optimizer parameter; {source} has {len(names)} names for "
            f"{count} parameters; give the names in the order of the param groups"
        )
    return names


def _resolve(
    model: _Model,
    groups: list[Mapping[str, Any]],
    param_names: Sequence[str] | None,
    flat: bool,
    what: str,
) -> list[list[tuple[Any, str, _Target]]]:
    """Return ``(id, name, target)`` of every optimizer parameter, one list per param group."""
    names = iter(_names(model, groups, param_names, flat, what))
    known: dict[str, _Target] = dict(model.flat if flat else model.plain)
    if not flat:
        for info in model.infos:
            for alias in info.aliases:
                known[alias] = info
    other = {name for name, _ in (model.plain if flat else model.flat)}
    side = "flattened" if flat else "plain"
    taken: dict[int, str] = {}
    resolved = []
    for group in groups:
        members = []
        for pid in group["params"]:
            name = next(names)
            target = known.get(name)
            if target is None:
                hint = (
                    f"it is a state dict of the {'plain' if flat else 'flattened'} model's optimizer: "
                    f"convert it with {'flat' if flat else 'plain'}_optim_state_dict"
                    if name in other
                    else "pass the state dict of this model's optimizer, or its names with param_names=[...]"
                )
                raise ValueError(
                    f"{what} needs parameters of the {side} module; optimizer parameter {pid!r} is "
                    f"named {name!r}, which is not one; {hint}"
                )
            if id(target) in taken:
                raise ValueError(
                    f"{what} needs each parameter once; {taken[id(target)]!r} and {name!r} name the "
                    "same parameter; build the optimizer from module.parameters(), which lists a "
                    "tied parameter once"
                )
            taken[id(target)] = name
            members.append((pid, name, target))
        resolved.append(members)
    return resolved


# ------------------------------------------------------------------------ values
def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else copy.deepcopy(value)


def _clone_state(entry: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if entry is None else {key: _clone(value) for key, value in entry.items()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape:
            return False
        return bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _elementwise_keys(state: Mapping[Any, Any], resolved: list[list[tuple[Any, str, _Target]]]) -> set[Any]:
    """Return the keys whose value has its parameter's shape (of at least one dimension) somewhere."""
    keys: set[Any] = set()
    for members in resolved:
        for pid, _, target in members:
            shape = _shape(target)
            for key, value in state.get(pid, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) == shape:
                    keys.add(key)
    return keys


def _new_group(group: Mapping[str, Any], names: list[str], with_names: bool) -> dict[str, Any]:
    out = {key: copy.deepcopy(value) for key, value in group.items() if key not in ("params", "param_names")}
    out["params"] = []
    if with_names:
        out["param_names"] = names
    return out


def _finish(groups: list[dict[str, Any]], states: list[list[dict[str, Any] | None]]) -> dict[str, Any]:
    """Number the parameters 0, 1, ... over the param groups, as ``optimizer.state_dict()`` does."""
    state: dict[int, dict[str, Any]] = {}
    pid = 0
    for group, group_states in zip(groups, states):
        group["params"] = list(range(pid, pid + len(group_states)))
        for entry in group_states:
            if entry is not None:
                state[pid] = entry
            pid += 1
    return {"state": state, "param_groups": groups}


def _has_names(groups: list[Mapping[str, Any]], param_names: Sequence[str] | None) -> bool:
    return param_names is None and bool(groups) and all("param_names" in group for group in groups)


# -------------------------------------------------------------------- plain -> flat
def flat_optim_state_dict(
    storage: PublicStorage,
    optim_state_dict: Mapping[str, Any],
    param_names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Convert the state dict of the plain model's optimizer for the flattened model's optimizer.

    Per-element state (a tensor of the parameter's shape, like Adam's
    ``exp_avg``) is concatenated into one tensor per flat parameter, with
    zeros for the padding and for members that have no state yet.
    Per-parameter scalars (numbers and zero-dimensional tensors, like Adam's
    ``step``) must agree between the members of a flat parameter and are kept
    once. Parameters left out of every group keep their state. Param groups
    keep their hyperparameters; each flat parameter joins the param group of
    its members, and one none of whose members the optimizer holds is left
    out (as its members were).

    The result shares no memory with ``optim_state_dict``. Load it into an
    optimizer of the flattened model whose param groups hold the flat
    parameters (and left-out parameters) in ``module.parameters()`` order:
    ``torch.optim.Adam(module.parameters())`` for one param group, or
    ``[{"params": [storage["decay"]], ...}, {"params": [storage["no_decay"]], ...}]``.

    Args:
        storage: the flat storage of the flattened model.
        optim_state_dict: ``optimizer.state_dict()`` of an optimizer of the
            plain model (this module before registering, or a plain model of
            the same architecture).
        param_names: the qualified names of the optimizer's parameters, in
            its order (param group by param group). Default: the
            ``param_names`` saved in the state dict (an optimizer built from
            ``module.named_parameters()``), else the plain module's
            parameters in ``module.parameters()`` order.

    Returns:
        A state dict for the flattened model's optimizer; its param groups
        carry ``param_names`` if the input's did.

    Raises:
        TypeError: if ``optim_state_dict`` is not an optimizer state dict or
            ``param_names`` not a list.
        ValueError: if its parameters are not the plain module's (another
            model, or a flattened model's state dict), the members of a flat
            parameter are in different param groups or only some are in the
            optimizer, their scalar state differs, or a state tensor is
            neither per-element nor a scalar.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from flatten_parametrize import register_flat_storage
        >>> model = nn.Linear(2, 2)
        >>> plain_opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> plain_opt.step()
        >>> storage = register_flat_storage(model)
        >>> flat_opt = torch.optim.Adam(model.parameters())
        >>> flat_opt.load_state_dict(flat_optim_state_dict(storage, plain_opt.state_dict()))
        >>> flat_opt.state[storage["0"]]["exp_avg"].shape
        torch.Size([6])
    """
    what = "flat_optim_state_dict()"
    state, groups = check_state_dict(optim_state_dict, what)
    model = _Model(core_behind(storage, what))
    resolved = _resolve(model, groups, param_names, flat=False, what=what)
    elementwise = _elementwise_keys(state, resolved)

    # Which param group holds each flat group, and its members' (id, name) by slot.
    holder: dict[str, int] = {}
    members: dict[str, dict[int, tuple[Any, str]]] = {}
    position = {id(info): i for i, info in enumerate(model.infos)}
    for i, group_members in enumerate(resolved):
        for pid, name, target in group_members:
            if isinstance(target, Tensor):
                continue
            info: ParamInfo = target  # type: ignore[assignment]
            found = members.setdefault(info.group, {})
            if holder.setdefault(info.group, i) != i:
                other = next(iter(found.values()))[1]
                raise ValueError(
                    f"{what} needs each flat group in one param group; {other} is in param group "
                    f"{holder[info.group]} and {name} in param group {i}, both in flat group "
                    f"'{info.group}'; register the flat storage with groups that follow the "
                    "optimizer's param groups, e.g. {'decay': [...], 'no_decay': [...]}"
                )
            found[position[id(info)]] = (pid, name)
    for flat_group, found in members.items():
        missing = [
            info.name for i, info in enumerate(model.infos) if info.group == flat_group and i not in found
        ]
        if missing:
            raise ValueError(
                f"{what} needs all or none of a flat group's parameters in the optimizer, since the "
                f"flat parameter is updated as a whole; it holds {next(iter(found.values()))[1]} but "
                f"not {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''} of flat group "
                f"'{flat_group}'; register the flat storage with groups of parameters the optimizer updates"
            )

    out_groups: list[dict[str, Any]] = []
    out_states: list[list[dict[str, Any] | None]] = []
    for i, (group, group_members) in enumerate(zip(groups, resolved)):
        left_out = {id(target): pid for pid, _, target in group_members if isinstance(target, Tensor)}
        names: list[str] = []
        entries: list[dict[str, Any] | None] = []
        for name, target in model.flat:
            if isinstance(target, _Flat):
                if holder.get(target.group) != i:
                    continue
                entry = _flat_state(model, target, members[target.group], state, elementwise, what)
            elif id(target) in left_out:
                entry = _clone_state(state.get(left_out[id(target)]))
            else:
                continue
            names.append(name)
            entries.append(entry)
        out_groups.append(_new_group(group, names, _has_names(groups, param_names)))
        out_states.append(entries)
    return _finish(out_groups, out_states)


def _flat_state(
    model: _Model,
    flat: _Flat,
    members: dict[int, tuple[Any, str]],
    state: Mapping[Any, Any],
    elementwise: set[Any],
    what: str,
) -> dict[str, Any] | None:
    """Return the state of one flat parameter, built from its members' states."""
    entries = [(model.infos[i], state.get(pid), name) for i, (pid, name) in sorted(members.items())]
    if all(entry is None for _, entry, _ in entries):
        return None
    keys: list[Any] = []
    for _, entry, _ in entries:
        keys += [key for key in entry or {} if key not in keys]
    out: dict[str, Any] = {}
    for key in keys:
        values = [(info, entry[key], name) for info, entry, name in entries if entry and key in entry]
        if key in elementwise:
            first = values[0][1]
            buffer = torch.zeros(flat.numel, dtype=first.dtype, device=first.device)
            for info, value, name in values:
                if not isinstance(value, Tensor) or value.shape != info.shape:
                    got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                    raise ValueError(
                        f"{what} needs per-element state of the parameter's shape; state {key!r} of "
                        f"{name} is {got}, the parameter {tuple(info.shape)}; pass the state dict "
                        "of this model's optimizer"
                    )
                buffer.narrow(0, info.offset, info.numel).copy_(value.detach().reshape(-1))
            out[key] = buffer
            continue
        _, first, first_name = values[0]
        for _, value, name in values:
            if isinstance(value, Tensor) and value.dim() > 0:
                raise ValueError(
                    f"{what} needs state that is per-element (the parameter's shape) or a scalar; "
                    f"state {key!r} of {name} has shape {tuple(value.shape)}, which flat group "
                    f"'{flat.group}' cannot hold; leave that parameter out of the flat storage"
                )
            if not _same(value, first):
                raise ValueError(
                    f"{what} needs equal scalar state within a flat group; state {key!r} is "
                    f"{first!r} for {first_name} and {value!r} for {name}, both in flat group "
                    f"'{flat.group}'; convert a state dict whose parameters were stepped together"
                )
        out[key] = _clone(first)
    return out


# -------------------------------------------------------------------- flat -> plain
def plain_optim_state_dict(
    storage: PublicStorage,
    optim_state_dict: Mapping[str, Any],
    param_names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Convert the state dict of the flattened model's optimizer for the plain model's optimizer.

    The inverse of :func:`flat_optim_state_dict`: per-element state (a tensor
    of the flat parameter's shape) is split with
    :meth:`FlatStorage.views_of` into one tensor of each member's shape,
    scalars (numbers and zero-dimensional tensors, like Adam's ``step``) are
    copied to every member, and parameters left out of every group keep
    their state. Each param group keeps its hyperparameters and holds the
    members of its flat parameters and its left-out parameters in the plain
    model's ``module.parameters()`` order; a tied parameter appears once,
    under its first name.

    The result shares no memory with ``optim_state_dict``. Load it into an
    optimizer of the plain model built the same way, e.g.
    ``torch.optim.Adam(plain.parameters())``.

    Args:
        storage: the flat storage of the flattened model.
        optim_state_dict: ``optimizer.state_dict()`` of an optimizer of the
            flattened model.
        param_names: the names of the optimizer's parameters, in its order
            (``"flat_param_<group>"`` for a flat parameter). Default: the
            ``param_names`` saved in the state dict, else the flattened
            module's parameters in ``module.parameters()`` order.

    Returns:
        A state dict for the plain model's optimizer; its param groups carry
        ``param_names`` if the input's did.

    Raises:
        TypeError: if ``optim_state_dict`` is not an optimizer state dict or
            ``param_names`` not a list.
        ValueError: if its parameters are not the flattened module's (another
            model, or a plain model's state dict), or a state tensor is
            neither of the flat parameter's shape nor a scalar.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from flatten_parametrize import register_flat_storage
        >>> model = nn.Linear(2, 2)
        >>> storage = register_flat_storage(model)
        >>> flat_opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> flat_opt.step()
        >>> plain = plain_optim_state_dict(storage, flat_opt.state_dict())
        >>> [tuple(s["exp_avg"].shape) for s in plain["state"].values()]
        [(2, 2), (2,)]
    """
    what = "plain_optim_state_dict()"
    state, groups = check_state_dict(optim_state_dict, what)
    model = _Model(core_behind(storage, what))
    resolved = _resolve(model, groups, param_names, flat=True, what=what)
    out_groups: list[dict[str, Any]] = []
    out_states: list[list[dict[str, Any] | None]] = []
    for group, group_members in zip(groups, resolved):
        entries: list[tuple[int, str, dict[str, Any] | None]] = []
        for pid, name, target in group_members:
            if isinstance(target, _Flat):
                split = _split_state(model, target, state.get(pid), what)
                for info in model.infos:
                    if info.group == target.group:
                        entries.append((model.rank[id(info)], info.name, split[info.name]))
            else:
                entries.append((model.rank[id(target)], name, _clone_state(state.get(pid))))
        entries.sort(key=lambda entry: entry[0])
        out_groups.append(
            _new_group(group, [name for _, name, _ in entries], _has_names(groups, param_names))
        )
        out_states.append([entry for _, _, entry in entries])
    return _finish(out_groups, out_states)


def _split_state(
    model: _Model, flat: _Flat, entry: Mapping[str, Any] | None, what: str
) -> dict[str, dict[str, Any] | None]:
    """Return the state of each member of a flat parameter (by name), split from ``entry``."""
    names = [info.name for info in model.infos if info.group == flat.group]
    if entry is None:
        return dict.fromkeys(names)
    out: dict[str, dict[str, Any] | None] = {name: {} for name in names}
    for key, value in entry.items():
        if isinstance(value, Tensor) and value.dim() > 0:
            if value.shape != (flat.numel,):
                raise ValueError(
                    f"{what} needs flat-parameter state that is a scalar or of the flat parameter's "
                    f"shape ({flat.numel},); state {key!r} of flat_param_{flat.group} has shape "
                    f"{tuple(value.shape)}; pass the state dict of this model's optimizer"
                )
            # Other groups get empty meta stand-ins: views_of splits every group at once.
            tensors = {
                other.group: value.detach() if other is flat else torch.empty(other.numel, device="meta")
                for other in model.flats
            }
            views = model.storage.views_of(tensors)
            for name in names:
                out[name][key] = views[name].clone()  # type: ignore[index]
        else:
            for name in names:
                out[name][key] = _clone(value)  # type: ignore[index]
    return out
