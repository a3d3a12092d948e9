"""Checkpoints of :class:`~flatten_parametrize.ShardedOptimizer`: gathered and per-rank state dicts.

One conversion for every ownership rule, from what the rule says (``sharded_strategies.py``): the
**entries**, the tensors of a single-process optimizer's ``state_dict()`` over the optimizer's param
groups (ZeRO's flat parameters; whole tensors' model tensors, a flat parameter given as a group member
standing for its tensors), and this rank's **pieces** of them (a piece lies inside one entry).

* Gathered (:func:`gathered_state_dict`, collective): exactly that single-process ``state_dict()``,
  on every rank: the per-element values are put together from their owners (one flat-sized buffer per
  flat parameter and state key, each owner's ranges filled by the collectives of the gradient path),
  the rest copied from the first rank that has them, and each param group's entries from the first
  rank that steps it (what an optimizer keeps in its groups moves on only where it steps). It does not
  depend on the world size: :func:`load_gathered` takes, at any world size, what this rank owns now.
* Per rank (:func:`local_state_dict`, no collective): this rank's pieces with where they lie; one rank's
  dict loads back at the same world size, the list of every saving rank's dicts at any other
  (:func:`load_local_parts`: each rank copies only what it owns now, so with ``torch.load(path,
  mmap=True)`` it reads only those ranges).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._state.optim import check_state_dict
from .shard import Piece, copy_value, elementwise
from .sharded_args import hyperparameters
from .sharded_collectives import Collectives
from .sharded_local import LocalStep
from .sharded_partition import Partition
from .sharded_strategies import Entry, ShardedGroup

__all__ = [
    "SHARDED_FORMAT",
    "StateView",
    "gathered_state_dict",
    "load_gathered",
    "load_local_parts",
    "local_state_dict",
]

#: Version tag of the per-rank state dict.
SHARDED_FORMAT = "flatten_parametrize.sharded_optimizer/2"


@dataclass(frozen=True)
class StateView:
    """What the state conversion reads of a ``ShardedOptimizer`` (built by ``sharded.py``)."""

    #: The outer param groups (an LR scheduler's changes, what the inner optimizers keep in theirs).
    param_groups: list[dict[str, Any]]
    #: The checked groups: each one's entries.
    groups: Sequence[ShardedGroup]
    #: The inner optimizers and their links to the outer groups.
    local: LocalStep
    #: This rank's shards.
    ownership: Partition
    #: The process group's collectives.
    collectives: Collectives


class _Mine(NamedTuple):
    """One of this rank's pieces of an entry: the entry's position, where in the entry, the tensor."""

    position: int
    start: int
    spec: Piece
    tensor: Tensor
    #: Whether its optimizer's math is element-wise: each tensor of state has one element per element.
    elementwise: bool


def _entries(view: StateView) -> list[Entry]:
    return [entry for group in view.groups for entry in group.entries]


def _mine(view: StateView) -> list[_Mine]:
    """Return this rank's pieces of every entry, in entry order."""
    shards = {shard.g: shard for shard in view.ownership.shards}
    out = []
    entries = [(entry, group.elementwise) for group in view.groups for entry in group.entries]
    for position, (entry, exact) in enumerate(entries):
        shard = shards.get(entry.g)
        if shard is None:
            continue
        for spec in shard.specs:
            if spec.numel and entry.offset <= spec.offset < entry.offset + entry.numel:
                tensor = shard.pieces[spec.key]
                out.append(_Mine(position, spec.offset - entry.offset, spec, tensor, exact))
    return out


def _packed_groups(view: StateView, entries: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Return the param groups with their entries' positions, as torch packs them (``entries``: by group)."""
    groups, start = [], 0
    for i, (outer, group) in enumerate(zip(view.param_groups, view.groups)):
        stop = start + len(group.entries)
        groups.append({**entries.get(i, hyperparameters(outer)), "params": list(range(start, stop))})
        start = stop
    return groups


# ------------------------------------------------------------------------------------------ gathered
def gathered_state_dict(view: StateView) -> dict[str, Any]:
    """Return the whole optimizer state in a single-process optimizer's format (collective: every rank)."""
    comm, state = view.collectives, view.local.optimizer.state
    mine = _mine(view)
    shapes: dict[
        tuple[int, str], tuple[str, Any]
    ] = {}  # (position, key) -> ("elements", dtype) | ("value", v)
    for piece in mine:
        for key, value in (state.get(piece.tensor) or {}).items():
            if elementwise(value, piece.spec.numel):
                shapes[(piece.position, key)] = ("elements", value.dtype)
            else:
                shapes.setdefault((piece.position, key), ("value", copy_value(value)))
    owned = {i: hyperparameters(view.param_groups[i]) for i in view.local.owned_groups()}
    parts: list[Any] = [None] * comm.world
    dist.all_gather_object(parts, (shapes, owned), group=comm.group)
    merged: dict[tuple[int, str], tuple[str, Any]] = {}  # a per-element kind wins over a rank's copy
    for found, _ in parts:
        for where, kind in found.items():
            if where not in merged or (kind[0] == "elements" and merged[where][0] != "elements"):
                merged[where] = kind
    entries = _entries(view)
    values = _gather_elements(view, mine, merged, entries)
    by_position: dict[int, dict[str, Any]] = {}  # keys in the order the optimizer made them
    for (position, key), (kind, value) in merged.items():
        by_position.setdefault(position, {})[key] = values[(position, key)] if kind == "elements" else value
    out = {position: by_position[position] for position in sorted(by_position)}
    group_entries: dict[int, dict[str, Any]] = {}
    for _, own in parts:
        for i, entry in own.items():
            group_entries.setdefault(i, entry)
    return {"state": out, "param_groups": _packed_groups(view, group_entries)}


def _gather_elements(
    view: StateView,
    mine: Sequence[_Mine],
    merged: Mapping[tuple[int, str], tuple[str, Any]],
    entries: Sequence[Entry],
) -> dict[tuple[int, str], Tensor]:
    """Return every per-element value, whole, put together from its owners (one buffer per flat and key)."""
    comm, state = view.collectives, view.local.optimizer.state
    shards = {shard.g: shard for shard in view.ownership.shards}
    by_flat: dict[tuple[int, str, Any], list[int]] = {}
    for (position, key), (kind, dtype) in sorted(merged.items(), key=lambda item: item[0]):
        if kind == "elements":
            by_flat.setdefault((entries[position].g, key, dtype), []).append(position)
    buffers: dict[tuple[int, str, Any], Tensor] = {}
    started = []
    for (g, key, dtype), _ in sorted(by_flat.items(), key=lambda item: (item[0][0], item[0][1])):
        shard = shards[g]
        buffer = torch.zeros(shard.numel, dtype=dtype, device=shard.device)
        for piece in mine:
            value = (state.get(piece.tensor) or {}).get(key)
            if entries[piece.position].g == g and value is not None and elementwise(value, piece.spec.numel):
                buffer[piece.spec.offset : piece.spec.offset + piece.spec.numel].copy_(value.reshape(-1))
        buffers[(g, key, dtype)] = buffer
        started += comm.gather_ranges(shard, buffer)
    comm.finish(started)
    out = {}
    for (g, key, dtype), positions in by_flat.items():
        for position in positions:
            entry = entries[position]
            out[(position, key)] = (
                buffers[(g, key, dtype)][entry.offset : entry.offset + entry.numel]
                .reshape(entry.shape)
                .clone()
            )
    return out


def load_gathered(view: StateView, state_dict: Mapping[str, Any]) -> None:
    """Give the inner optimizers this rank's pieces of a gathered (or single-process) state dict.

    Checked completely before anything changes; ``state_dict`` is not modified.

    Raises:
        TypeError: if ``state_dict`` is not an optimizer state dict.
        ValueError: if its param groups or a tensor's state do not match this optimizer's.
    """
    what = "ShardedOptimizer.load_state_dict()"
    state, groups = check_state_dict(state_dict, what)
    _check_groups(view, groups, what)
    saved_ids = [pid for group in groups for pid in group["params"]]
    entries = _entries(view)
    loads: dict[int, dict[str, Any]] = {}
    for piece in _mine(view):
        saved = state.get(saved_ids[piece.position])
        if saved:
            loads[id(piece.tensor)] = _cut(saved, piece, entries[piece.position], what)
    _commit(view, groups, loads)


def _cut(saved: Mapping[str, Any], piece: _Mine, entry: Entry, what: str) -> dict[str, Any]:
    """Return a piece's state from its entry's whole ``saved`` state."""
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if not isinstance(value, Tensor) or value.dim() == 0:
            out[key] = copy_value(value)
        elif value.numel() == entry.numel:
            part = value.reshape(-1)[piece.start : piece.start + piece.spec.numel]
            out[key] = part.reshape(piece.spec.shape).clone()
        elif not piece.elementwise:
            out[key] = value.clone()  # a state of the tensor's own make (factored moments), stepped whole
        else:
            raise ValueError(
                f"{what}: state {key!r} of parameter {piece.position} has {value.numel()} elements, but the "
                f"tensor has {entry.numel} and its optimizer keeps one element of state per element; load a "
                "state dict saved for the same model and param groups"
            )
    return out


def _check_groups(view: StateView, groups: Sequence[Mapping[str, Any]], what: str) -> None:
    sizes = [len(group.entries) for group in view.groups]
    saved = [len(group["params"]) for group in groups]
    if saved != sizes:
        raise ValueError(
            f"{what}: the state dict's param groups hold {saved} tensors, this optimizer's hold {sizes}; "
            "load a state dict saved for the same param groups"
        )


def _commit(
    view: StateView, groups: Sequence[Mapping[str, Any]], loads: Mapping[int, dict[str, Any]]
) -> None:
    """Load each inner optimizer's state through its own ``load_state_dict``; the groups' entries after."""
    for opt in view.local.optimizers():
        own = opt.state_dict()
        pieces = [p for group in opt.param_groups for p in group["params"]]
        ids = [pid for group in own["param_groups"] for pid in group["params"]]
        own["state"] = {pid: loads[id(p)] for pid, p in zip(ids, pieces) if id(p) in loads}
        opt.load_state_dict(own)
    view.local.optimizer.relink()
    for outer, saved in zip(view.param_groups, groups):
        outer.update(hyperparameters(saved))
    view.local.push(view.param_groups)


# ------------------------------------------------------------------------------------------- per rank
def local_state_dict(view: StateView) -> dict[str, Any]:
    """Return this rank's pieces of the state, with the world size, this rank and where they lie."""
    state = view.local.optimizer.state
    pieces: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
    for piece in _mine(view):
        entry = state.get(piece.tensor)
        if entry:
            pieces.setdefault(piece.position, []).append((piece.start, piece.spec.numel, dict(entry)))
    return {
        "format": SHARDED_FORMAT,
        "world_size": view.ownership.world,
        "rank": view.ownership.rank,
        "entries": [tuple(entry) for entry in _entries(view)],
        "state": pieces,
        "param_groups": _packed_groups(view, {}),
        "stepped_groups": view.local.owned_groups(),
    }


def load_local_parts(view: StateView, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
    """Give the inner optimizers their pieces from this rank's per-rank dict, or from every saving rank's.

    Raises:
        TypeError: if it is not what :func:`local_state_dict` returns.
        ValueError: if the world size, rank or entries do not match.
    """
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
                f"part of a world of {saved_world}; this is rank {rank} of {world}; pass "
                "this rank's own dict, or the list of every saving rank's dicts to reshard (with "
                "torch.load(path, mmap=True) only the needed ranges are read)"
            )
    else:
        ranks = [p["rank"] for p in parts]
        if ranks != list(range(saved_world)) or any(p["world_size"] != saved_world for p in parts):
            raise ValueError(
                "ShardedOptimizer.load_sharded_state_dict(): a list must hold the dicts of every saving "
                f"rank in rank order; got ranks {ranks} of world sizes {[p['world_size'] for p in parts]}; "
                "pass [dict of rank 0, dict of rank 1, ...]"
            )
    entries = [tuple(entry) for entry in _entries(view)]
    if [tuple(e) for e in parts[0]["entries"]] != entries:
        raise ValueError(
            "ShardedOptimizer.load_sharded_state_dict(): the dict was saved for the tensors "
            f"{[tuple(e) for e in parts[0]['entries']][:4]}...; this optimizer has {entries[:4]}...; load a "
            "state saved for the same layout and param groups"
        )
    _check_groups(view, parts[0]["param_groups"], "load_sharded_state_dict()")
    loads: dict[int, dict[str, Any]] = {}
    for piece in _mine(view):
        found = [
            saved for part in parts for saved in part["state"].get(piece.position, ())
            if saved[0] < piece.start + piece.spec.numel and piece.start < saved[0] + saved[1]
        ]  # fmt: skip
        if found:
            loads[id(piece.tensor)] = _assembled(piece, found)
    groups = [  # each group's entries from a rank that stepped it
        next((p["param_groups"][i] for p in parts if i in p["stepped_groups"]), group)
        for i, group in enumerate(parts[0]["param_groups"])
    ]
    _commit(view, groups, loads)


def _assembled(piece: _Mine, found: Sequence[tuple[int, int, Mapping[str, Any]]]) -> dict[str, Any]:
    """Return a piece's state from the saved pieces that overlap it (per-element values put together)."""
    out: dict[str, Any] = {}
    for key, value in found[0][2].items():
        if not elementwise(value, found[0][1]):
            out[key] = copy_value(value)
            continue
        whole = torch.zeros(piece.spec.numel, dtype=value.dtype, device=piece.tensor.device)
        for start, numel, saved in found:
            lo, hi = max(start, piece.start), min(start + numel, piece.start + piece.spec.numel)
            whole[lo - piece.start : hi - piece.start].copy_(saved[key].reshape(-1)[lo - start : hi - start])
        out[key] = whole.reshape(piece.spec.shape)
    return out
