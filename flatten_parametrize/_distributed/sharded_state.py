"""Checkpoints of :class:`~flatten_parametrize.ShardedOptimizer`: gathered and per-rank state dicts.

The gathered form is exactly a single-process optimizer's ``state_dict()``
over the flat parameters; the per-rank form holds this rank's slices with the
world size and layout, and loads back at the same world size or, from the
list of every saving rank's dicts, at any other (each rank copying only the
ranges it owns now).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .._state.optim import check_state_dict
from .shard import Shard, copy_value, elementwise
from .sharded_args import hyperparameters
from .sharded_collectives import Collectives
from .sharded_partition import Partition

__all__ = [
    "SHARDED_FORMAT",
    "StateView",
    "gathered_state_dict",
    "load_gathered",
    "load_local_parts",
    "local_state_dict",
]


@dataclass(frozen=True)
class StateView:
    """What the state conversion reads of a ``ShardedOptimizer``: its seam (built by ``sharded.py``).

    The state-dict hooks and relinking ``state`` after a load stay with the
    optimizer; everything here is read, and a load writes the inner
    optimizer's state and the outer groups' hyperparameters.
    """

    #: The outer param groups (over the flat parameters).
    param_groups: list[dict[str, Any]]
    #: The inner optimizer over this rank's shards.
    local_optimizer: torch.optim.Optimizer
    #: Who owns which part of each flat parameter.
    ownership: Partition
    #: The process group's collectives (for the gathered state).
    collectives: Collectives


#: Version tag of the per-rank state dict.
SHARDED_FORMAT = "flatten_parametrize.sharded_optimizer/1"


def gathered_state_dict(view: StateView) -> dict[str, Any]:
    """Return the whole optimizer state, gathered, in a single-process optimizer's format (collective)."""
    groups, ids = _packed_groups(view)
    state: dict[int, dict[str, Any]] = {}
    for index, flat in ids:
        shard = view.ownership.shard_of(flat)
        entry = None if shard is None else view.local_optimizer.state.get(shard.param)
        if entry:
            state[index] = {key: _gather_value(view, shard, value) for key, value in entry.items()}  # type: ignore[arg-type]
    return {"state": state, "param_groups": groups}


def load_gathered(view: StateView, state_dict: Mapping[str, Any]) -> None:
    """Give the inner optimizer this rank's slices of a gathered (or single-process) state dict."""
    state, groups = check_state_dict(state_dict, "ShardedOptimizer.load_state_dict()")
    saved = _match_groups(view, groups, "load_state_dict()")

    def piece(shard: Shard, saved_id: Any, key: str, value: Tensor) -> Tensor:
        if value.numel() != shard.numel:
            raise ValueError(
                f"ShardedOptimizer.load_state_dict(): state {key!r} of parameter {saved_id} has "
                f"{value.numel()} elements, but its flat parameter has {shard.numel}; load a state dict "
                "saved for the same layout"
            )
        return shard.assemble([(0, value)], value)

    _load_local(view, groups, saved, state, piece)


def local_state_dict(view: StateView) -> dict[str, Any]:
    """Return this rank's slices of the optimizer state, with the world size, rank and layout."""
    groups, ids = _packed_groups(view)
    state: dict[int, dict[str, Any]] = {}
    for index, flat in ids:
        shard = view.ownership.shard_of(flat)
        entry = None if shard is None else view.local_optimizer.state.get(shard.param)
        if shard is not None and entry:
            state[index] = {
                key: value[: shard.hi - shard.lo] if elementwise(value) else value
                for key, value in entry.items()
            }
    return {
        "format": SHARDED_FORMAT,
        "world_size": view.ownership.world,
        "rank": view.ownership.rank,
        "numels": [flat.numel() for _, flat in ids],
        "state": state,
        "param_groups": groups,
    }


def load_local_parts(view: StateView, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
    """Give the inner optimizer its slices from this rank's sharded dict or from every saving rank's."""
    parts = [state_dict] if isinstance(state_dict, Mapping) else list(state_dict)
    for part in parts:
        if not isinstance(part, Mapping) or part.get("format") != SHARDED_FORMAT:
            raise TypeError(
                "ShardedOptimizer.load_sharded_state_dict() needs what sharded_state_dict() returns "
                f"(or a list of them, one per saving rank); got {type(part).__name__}; for a gathered "
                "state dict call load_state_dict()"
            )
    saved_world = parts[0]["world_size"]
    world, rank = view.ownership.world, view.ownership.rank
    if isinstance(state_dict, Mapping):
        if saved_world != world or parts[0]["rank"] != rank:
            raise ValueError(
                f"ShardedOptimizer.load_sharded_state_dict(): this dict holds rank {parts[0]['rank']}'s "
                f"slices of a world of {saved_world}; this is rank {rank} of {world}; pass "
                "this rank's own dict, or the list of every saving rank's dicts to reshard (with "
                "torch.load(path, mmap=True) only the needed ranges are read)"
            )
        by_rank = {rank: parts[0]}
    else:
        ranks = [p["rank"] for p in parts]
        if ranks != list(range(saved_world)) or any(p["world_size"] != saved_world for p in parts):
            raise ValueError(
                "ShardedOptimizer.load_sharded_state_dict(): a list must hold the dicts of every saving "
                f"rank in rank order; got ranks {ranks} of world sizes "
                f"{[p['world_size'] for p in parts]}; "
                "pass [dict of rank 0, dict of rank 1, ...]"
            )
        by_rank = dict(enumerate(parts))
    _, ids = _packed_groups(view)
    numels = [flat.numel() for _, flat in ids]
    if parts[0]["numels"] != numels:
        raise ValueError(
            "ShardedOptimizer.load_sharded_state_dict(): the dict was saved for flat parameters of "
            f"{parts[0]['numels']} elements; this optimizer has {numels}; load a state saved for "
            "the same layout and param groups"
        )
    groups = parts[0]["param_groups"]
    saved = _match_groups(view, groups, "load_sharded_state_dict()")

    def piece(shard: Shard, saved_id: Any, key: str, value: Tensor) -> Tensor:
        chunk = -(-shard.numel // saved_world)
        pieces = []
        for owner, part in by_rank.items():
            lo, hi = min(owner * chunk, shard.numel), min((owner + 1) * chunk, shard.numel)
            if hi > shard.lo and lo < shard.hi:
                pieces.append((lo, part["state"][saved_id][key]))
        return shard.assemble(pieces, value)

    state = parts[rank % len(parts)]["state"]
    _load_local(view, groups, saved, state, piece)


def _packed_groups(view: StateView) -> tuple[list[dict[str, Any]], list[tuple[int, Tensor]]]:
    """Return the param groups with integer ids, as torch packs them, and ``(id, flat)`` pairs."""
    groups: list[dict[str, Any]] = []
    ids: list[tuple[int, Tensor]] = []
    for group in view.param_groups:
        start = len(ids)
        ids += [(start + i, p) for i, p in enumerate(group["params"])]
        groups.append({**hyperparameters(group), "params": list(range(start, len(ids)))})
    return groups, ids


def _gather_value(view: StateView, shard: Shard, value: Any) -> Any:
    """Return one state value of the whole flat parameter (slices gathered from their owners)."""
    return view.collectives.gather_value(shard, value) if elementwise(value) else copy_value(value)


def _match_groups(view: StateView, groups: list[Mapping[str, Any]], what: str) -> dict[int, Any]:
    """Return ``{id(flat): saved id}`` after checking that the param groups have our sizes."""
    sizes = [len(g["params"]) for g in view.param_groups]
    saved_sizes = [len(g["params"]) for g in groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"ShardedOptimizer.{what}: the state dict has param groups of {saved_sizes} parameters; this "
            f"optimizer has {sizes}; load a state dict of an optimizer with the same param groups"
        )
    return {
        id(p): saved_id
        for g, s in zip(view.param_groups, groups)
        for p, saved_id in zip(g["params"], s["params"])
    }


def _load_local(
    view: StateView,
    groups: list[Mapping[str, Any]],
    saved: dict[int, Any],
    state: Mapping[Any, Any],
    piece: Callable[[Shard, Any, str, Tensor], Tensor],
) -> None:
    """Give the inner optimizer this rank's slices (``piece`` cuts an element-wise value)."""
    inner_state: dict[int, dict[str, Any]] = {}
    inner_groups = []
    index = 0
    for outer, group in zip(view.param_groups, groups):
        ids = []
        for flat in outer["params"]:
            shard = view.ownership.shard_of(flat)
            if shard is None:
                continue
            saved_id = saved[id(flat)]
            entry = state.get(saved_id)
            if entry:
                inner_state[index] = {
                    key: piece(shard, saved_id, key, value) if elementwise(value) else copy_value(value)
                    for key, value in entry.items()
                }
            ids.append(index)
            index += 1
        inner_groups.append({**hyperparameters(group), "params": ids})
    view.local_optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})
    for outer, inner in zip(view.param_groups, view.local_optimizer.param_groups):
        outer.update(hyperparameters(inner))
