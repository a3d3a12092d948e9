"""DCP's optimizer state of a :class:`~flatten_parametrize.ShardedOptimizer`, keyed by the plain names.

torch's ``get_state_dict`` / ``set_state_dict`` name an optimizer's state
through the tensors of its param groups, looked up in
``model.named_parameters()``. A ``ShardedOptimizer``'s gathered state is over
its entries (``sharded_strategies.py``): each flat parameter (ZeRO's slices)
or each of the model's tensors (whole tensors), while in flat mode the model
yields no tensor of its own; ``dcp.py`` hands every such optimizer here, one
conversion for every ownership rule. Saving takes the gathered state
(:meth:`ShardedOptimizer.state_dict`, the same on every rank) and gives each
model tensor inside an entry its part under its DCP name (per-element values
cut and reshaped, the rest copied); loading picks those names out of the
checkpoint, with the hyperparameters of the checkpoint's group that holds
them, puts each entry together (a flat parameter's members joined, scalars
equal) and hands the result to :meth:`ShardedOptimizer.load_state_dict`,
which keeps this rank's part. The values are whole tensors of the plain
shapes, so a checkpoint moves between world sizes, ownership rules, modes
and the plain model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from .._distributed.shard import copy_value
from .._distributed.sharded import ShardedOptimizer, entries_of, init_state
from .._distributed.sharded_args import hyperparameters

__all__ = [
    "is_sharded",
    "joined_value",
    "member_names",
    "missing_state",
    "state_by_name",
    "state_for",
    "tensor_names",
]

#: One model tensor inside an entry: its DCP name, where it starts in the entry, its numel and shape.
_NamedTensor = tuple[str, int, int, tuple[int, ...]]


def is_sharded(optimizer: Any) -> bool:
    """Return whether ``optimizer`` is a ``ShardedOptimizer``."""
    return isinstance(optimizer, ShardedOptimizer)


def tensor_names(dsd: ModuleType, model: nn.Module, opt: ShardedOptimizer) -> list[list[list[_NamedTensor]]]:
    """Return, per param group and entry, the model tensors inside the entry (DCP names), in layout order."""
    core, groups = entries_of(opt)
    prefix = next((p for p, m in model.named_modules() if m is core.module), None)
    if prefix is None:
        raise ValueError(
            "get_state_dict / set_state_dict need the optimizer's model: the ShardedOptimizer steps the "
            f"flattened {type(core.module).__name__}, which is not a submodule of the "
            f"{type(model).__name__} given; pass the model it was built for"
        )
    layouts = [(group.layout, group.members) for group in core.groups()]
    out = []
    for entries in groups:
        named = []
        for entry in entries:
            layout, slots = layouts[entry.g]
            members = []
            for slot in slots:
                offset, numel = layout.offsets[slot.index], layout.numels[slot.index]
                if entry.offset <= offset < entry.offset + entry.numel:
                    (fqn,) = dsd._get_fqns(model, f"{prefix}.{slot.name}" if prefix else slot.name)
                    members.append((fqn, offset - entry.offset, numel, tuple(layout.shapes[slot.index])))
            named.append(sorted(members, key=lambda m: m[1]))
        out.append(named)
    return out


def member_names(groups: Sequence[Sequence[Sequence[_NamedTensor]]]) -> list[list[str]]:
    """Return each param group's model tensors' DCP names (of :func:`tensor_names`)."""
    return [[m[0] for entry in entries for m in entry] for entries in groups]


def state_by_name(dsd: ModuleType, model: nn.Module, opt: ShardedOptimizer) -> dict[str, Any]:
    """Return ``opt``'s gathered state keyed by DCP names (collective; a fresh one's state made first)."""
    init_state(opt)  # what DCP does to a fresh optimizer, so that a load finds every entry
    osd = opt.state_dict()
    groups = tensor_names(dsd, model, opt)
    entries = [entry for named in groups for entry in named]
    state: dict[str, Any] = {}
    for position, saved in osd["state"].items():
        for name, start, numel, shape in entries[position]:
            state[name] = {key: _part(value, start, numel, shape) for key, value in saved.items()}
    params = member_names(groups)
    return {
        "state": state,
        "param_groups": [
            {**hyperparameters(g), "params": names} for g, names in zip(osd["param_groups"], params)
        ],
    }


def _part(value: Any, start: int, numel: int, shape: tuple[int, ...]) -> Any:
    """Return a model tensor's part of one state value of its entry (a per-element tensor), or a copy."""
    if isinstance(value, Tensor) and value.dim() >= 1 and value.numel() >= start + numel and numel > 0:
        if value.shape == torch.Size(shape):
            return value
        return value.reshape(-1)[start : start + numel].view(shape)
    return copy_value(value)


def state_for(
    opt: ShardedOptimizer,
    groups: Sequence[Sequence[Sequence[_NamedTensor]]],
    osd: Mapping[str, Any],
    strict: bool,
) -> dict[str, Any]:
    """Return the part of ``osd`` (keyed by DCP names) that is ``opt``'s, for its ``load_state_dict``.

    ``groups`` are ``opt``'s entries' model tensors (:func:`tensor_names`).

    Raises:
        ValueError: if no param group of ``osd`` holds one of ``opt``'s tensors, or a flat parameter's
            members' scalar state differs.
        RuntimeError: with ``strict``, if a tensor has no state in ``osd`` (torch's message).
    """
    state, saved_groups = osd.get("state", {}), osd.get("param_groups", [])
    group_of = {name: g for g in saved_groups for name in g["params"]}
    _, entries = entries_of(opt)
    out_state: dict[int, Any] = {}
    out_groups = []
    position = 0
    for own, named, own_entries in zip(opt.param_groups, groups, entries):
        names = [m[0] for entry in named for m in entry]
        saved = next((group_of[name] for name in names if name in group_of), None)
        if saved is None and names:
            raise ValueError(
                f"set_state_dict: no param group of the checkpoint holds {names[0]}, a tensor of this "
                "ShardedOptimizer; load a checkpoint of this model's optimizer"
            )
        ids = []
        for entry, members in zip(own_entries, named):
            found = {m[0]: state[m[0]] for m in members if m[0] in state}
            missing = [m[0] for m in members if m[0] not in found]
            if missing and strict:
                raise missing_state(missing[0])
            if found:
                out_state[position] = _joined(entry.numel, entry.shape, members, found)
            ids.append(position)
            position += 1
        out_groups.append({**hyperparameters(own if saved is None else saved), "params": ids})
    return {"state": out_state, "param_groups": out_groups}


def _joined(
    numel: int,
    shape: tuple[int, ...],
    members: Sequence[_NamedTensor],
    found: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """Return an entry's state from its model tensors' (per-element values joined, scalars equal)."""
    if len(members) == 1 and members[0][2] == numel:
        return dict(found[members[0][0]])
    out: dict[str, Any] = {}
    keys = [k for entry in found.values() for k in entry]
    for key in dict.fromkeys(keys):
        values = [(m, found[m[0]][key]) for m in members if key in found.get(m[0], {})]
        value = joined_value(key, values, numel, "")
        out[key] = value.reshape(shape) if isinstance(value, Tensor) and value.dim() == 1 else value
    return out


def joined_value(
    key: str,
    values: Sequence[tuple[_NamedTensor, Any]],
    numel: int,
    where: str,
    full: Callable[[Tensor], Tensor] = Tensor.detach,
) -> Any:
    """Return one state value of ``numel`` elements from its members' (``(member, value)`` pairs).

    Per-element values (each of its member's shape) are joined into one new flat tensor, zeros
    between them; a scalar (a number, a zero-dimensional tensor) must be the same for every member.

    Args:
        key: the state's name (for the errors).
        values: each member ``(name, offset, numel, shape)`` and its value.
        numel: the size of the joined tensor.
        where: what holds the members (for the error), e.g. ``", both in flat_param_0"``.
        full: gives a value's whole tensor (a ``DTensor``'s ``full_tensor()``).

    Raises:
        ValueError: for a per-element value of another shape than its member's, or unequal scalars.
    """
    if any(isinstance(v, Tensor) and v.dim() > 0 and v.shape == torch.Size(m[3]) for m, v in values):
        first = values[0][1]  # a DTensor's device and dtype are its local tensor's
        buffer = torch.zeros(numel, dtype=first.dtype, device=first.device)
        for (name, start, n, member_shape), value in values:
            if not isinstance(value, Tensor) or value.shape != torch.Size(member_shape):
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"set_state_dict of a flattened model needs per-element optimizer state of the "
                    f"parameter's shape; state {key!r} of {name} is {got}, the parameter "
                    f"{tuple(member_shape)}; load a checkpoint of this model's optimizer"
                )
            buffer[start : start + n].copy_(full(value).detach().reshape(-1))
        return buffer
    (first_name, *_), first = values[0]
    for (name, *_), value in values[1:]:
        same = (
            isinstance(value, Tensor)
            and isinstance(first, Tensor)
            and value.shape == first.shape
            and bool(torch.equal(full(value).detach().cpu(), full(first).detach().cpu()))
        ) or (not isinstance(value, Tensor) and not isinstance(first, Tensor) and value == first)
        if not same:
            raise ValueError(
                f"set_state_dict of a flattened model needs equal scalar optimizer state within a flat "
                f"group; state {key!r} is {first!r} for {first_name} and {value!r} for {name}{where}; load "
                "a checkpoint whose parameters were stepped together, or give them groups of their own "
                "(register_flat_storage(model, groups=...))"
            )
    return copy_value(first)


def missing_state(name: str) -> RuntimeError:
    """Return torch's error for a tensor without state in a checkpoint loaded with ``strict``."""
    return RuntimeError(
        f"Missing optimizer state for parameter '{name}' in checkpoint. The parameter requires gradients "
        "but has no saved optimizer state. To load anyway, use StateDictOptions(strict=False)."
    )
