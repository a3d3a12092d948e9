"""Checkpoints of :class:`~flatten_parametrize.ShardedOptimizer`: gathered and per-rank state dicts.

The gathered form is exactly a single-process optimizer's ``state_dict()``
over the flat parameters; the per-rank form holds this rank's slices with the
world size and layout, and loads back at the same world size or, from the
list of every saving rank's dicts, at any other (each rank copying only the
ranges it owns now).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .._state.optim import check_state_dict
from .shard import Shard, all_gather, copy_value, elementwise
from .sharded_args import hyperparameters


class ShardedOptimizer(Protocol):
    """What the checkpoint code reads of a ``ShardedOptimizer`` (``_sharded.py`` imports this module)."""

    param_groups: list[dict[str, Any]]
    local_optimizer: torch.optim.Optimizer
    _world: int
    _rank: int
    _pg: dist.ProcessGroup | None
    _owners: list[int]
    _by_owner: bool

    @property
    def _optimizer_state_dict_pre_hooks(self) -> Mapping[int, Callable[..., Any]]: ...

    @property
    def _optimizer_state_dict_post_hooks(self) -> Mapping[int, Callable[..., Any]]: ...

    @property
    def _optimizer_load_state_dict_pre_hooks(self) -> Mapping[int, Callable[..., Any]]: ...

    @property
    def _optimizer_load_state_dict_post_hooks(self) -> Mapping[int, Callable[..., Any]]: ...

    def _shard_of(self, flat: Tensor) -> Shard | None: ...

    def _link_state(self) -> None: ...


__all__ = ["SHARDED_FORMAT", "gathered_state_dict", "load_gathered", "load_local_parts", "local_state_dict"]

#: Version tag of the per-rank state dict.
SHARDED_FORMAT = "flatten_parametrize.sharded_optimizer/1"


def gathered_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """Return the whole state of ``opt``, gathered, in a single-process optimizer's format (collective)."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    groups, ids = _packed_groups(opt)
    state: dict[int, dict[str, Any]] = {}
    for index, flat in ids:
        shard = opt._shard_of(flat)
        entry = None if shard is None else opt.local_optimizer.state.get(shard.param)
        if entry:
            state[index] = {key: _gather_value(opt, shard, value) for key, value in entry.items()}  # type: ignore[arg-type]
    result: dict[str, Any] = {"state": state, "param_groups": groups}
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        hooked = post_hook(opt, result)
        if hooked is not None:
            result = hooked
    return result


def load_gathered(opt: ShardedOptimizer, state_dict: Mapping[str, Any]) -> None:
    """Give ``opt`` this rank's slices of a gathered (or single-process) state dict."""
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        hooked = pre_hook(opt, state_dict)
        if hooked is not None:
            state_dict = hooked
    state, groups = check_state_dict(state_dict, "ShardedOptimizer.load_state_dict()")
    saved = _match_groups(opt, groups, "load_state_dict()")

    def piece(shard: Shard, saved_id: Any, key: str, value: Tensor) -> Tensor:
        if value.numel() != shard.numel:
            raise ValueError(
                f"ShardedOptimizer.load_state_dict(): state {key!r} of parameter {saved_id} has "
                f"{value.numel()} elements, but its flat parameter has {shard.numel}; load a state dict "
                "saved for the same layout"
            )
        return shard.assemble([(0, value)], value)

    _load_local(opt, groups, saved, state, piece)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def local_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """Return this rank's slices of ``opt``'s state, with the world size, rank and layout."""
    groups, ids = _packed_groups(opt)
    state: dict[int, dict[str, Any]] = {}
    for index, flat in ids:
        shard = opt._shard_of(flat)
        entry = None if shard is None else opt.local_optimizer.state.get(shard.param)
        if shard is not None and entry:
            state[index] = {
                key: value[: shard.hi - shard.lo] if elementwise(value) else value
                for key, value in entry.items()
            }
    return {
        "format": SHARDED_FORMAT,
        "world_size": opt._world,
        "rank": opt._rank,
        "numels": [flat.numel() for _, flat in ids],
        "state": state,
        "param_groups": groups,
    }


def load_local_parts(
    opt: ShardedOptimizer, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]
) -> None:
    """Give ``opt`` its slices from this rank's sharded dict or from every saving rank's."""
    parts = [state_dict] if isinstance(state_dict, Mapping) else list(state_dict)
    for part in parts:
        if not isinstance(part, Mapping) or part.get("format") != SHARDED_FORMAT:
            raise TypeError(
                "ShardedOptimizer.load_sharded_state_dict() needs what sharded_state_dict() returns "
                f"(or a list of them, one per saving rank); got {type(part).__name__}; for a gathered "
                "state dict call load_state_dict()"
            )
    saved_world = parts[0]["world_size"]
    if isinstance(state_dict, Mapping):
        if saved_world != opt._world or parts[0]["rank"] != opt._rank:
            raise ValueError(
                f"ShardedOptimizer.load_sharded_state_dict(): this dict holds rank {parts[0]['rank']}'s "
                f"slices of a world of {saved_world}; this is rank {opt._rank} of {opt._world}; pass "
                "this rank's own dict, or the list of every saving rank's dicts to reshard (with "
                "torch.load(path, mmap=True) only the needed ranges are read)"
            )
        by_rank = {opt._rank: parts[0]}
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
    _, ids = _packed_groups(opt)
    numels = [flat.numel() for _, flat in ids]
    if parts[0]["numels"] != numels:
        raise ValueError(
            "ShardedOptimizer.load_sharded_state_dict(): the dict was saved for flat parameters of "
            f"{parts[0]['numels']} elements; this optimizer has {numels}; load a state saved for "
            "the same layout and param groups"
        )
    groups = parts[0]["param_groups"]
    saved = _match_groups(opt, groups, "load_sharded_state_dict()")

    def piece(shard: Shard, saved_id: Any, key: str, value: Tensor) -> Tensor:
        chunk = -(-shard.numel // saved_world)
        pieces = []
        for owner, part in by_rank.items():
            lo, hi = min(owner * chunk, shard.numel), min((owner + 1) * chunk, shard.numel)
            if hi > shard.lo and lo < shard.hi:
                pieces.append((lo, part["state"][saved_id][key]))
        return shard.assemble(pieces, value)

    state = parts[opt._rank % len(parts)]["state"]
    _load_local(opt, groups, saved, state, piece)


def _packed_groups(opt: ShardedOptimizer) -> tuple[list[dict[str, Any]], list[tuple[int, Tensor]]]:
    """Return the param groups with integer ids, as torch packs them, and ``(id, flat)`` pairs."""
    groups: list[dict[str, Any]] = []
    ids: list[tuple[int, Tensor]] = []
    for group in opt.param_groups:
        start = len(ids)
        ids += [(start + i, p) for i, p in enumerate(group["params"])]
        groups.append({**hyperparameters(group), "params": list(range(start, len(ids)))})
    return groups, ids


def _gather_value(opt: ShardedOptimizer, shard: Shard, value: Any) -> Any:
    """Return one state value of the whole flat parameter (slices gathered from their owners)."""
    if not elementwise(value):
        return copy_value(value)
    world, pg = opt._world, opt._pg
    if not opt._by_owner:
        out = value.new_empty(shard.chunk * world)
        all_gather(out, value.contiguous(), group=pg)
        return out[: shard.numel].clone()
    full = value.new_zeros(shard.numel)
    full[shard.lo : shard.hi].copy_(value[: shard.hi - shard.lo])
    works = []
    for owner in range(world):
        lo, hi = shard.bounds(owner)
        if hi > lo:
            works.append(dist.broadcast(full[lo:hi], opt._owners[owner], group=pg, async_op=True))
    for work in works:
        work.wait()
    return full


def _match_groups(opt: ShardedOptimizer, groups: list[Mapping[str, Any]], what: str) -> dict[int, Any]:
    """Return ``{id(flat): saved id}`` after checking that the param groups have our sizes."""
    sizes = [len(g["params"]) for g in opt.param_groups]
    saved_sizes = [len(g["params"]) for g in groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"ShardedOptimizer.{what}: the state dict has param groups of {saved_sizes} parameters; this "
            f"optimizer has {sizes}; load a state dict of an optimizer with the same param groups"
        )
    return {
        id(p): saved_id
        for g, s in zip(opt.param_groups, groups)
        for p, saved_id in zip(g["params"], s["params"])
    }


def _load_local(
    opt: ShardedOptimizer,
    groups: list[Mapping[str, Any]],
    saved: dict[int, Any],
    state: Mapping[Any, Any],
    piece: Callable[[Shard, Any, str, Tensor], Tensor],
) -> None:
    """Give the inner optimizer this rank's slices (``piece`` cuts an element-wise value)."""
    inner_state: dict[int, dict[str, Any]] = {}
    inner_groups = []
    index = 0
    for outer, group in zip(opt.param_groups, groups):
        ids = []
        for flat in outer["params"]:
            shard = opt._shard_of(flat)
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
    opt.local_optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})
    for outer, inner in zip(opt.param_groups, opt.local_optimizer.param_groups):
        outer.update(hyperparameters(inner))
    opt._link_state()
