"""Checkpoints of ``ShardedOptimizer(whole_tensors=True)``: one state dict in the plain model's format.

The gathered form is a single-process optimizer's ``state_dict()`` over the
model's tensors: its param groups are the optimizer's, each listing its
tensors (a flat parameter given as a group member stands for its tensors, in
layout order) by position, and each tensor's state has the tensor's shape. So
it does not depend on the world size: every rank gathers it (one
``all_gather_object``), and a load at any world size takes from it what this
rank owns now. A tensor stepped element-wise may be cut between ranks; its
state is put together from (and cut again into) the ranks' parts. A state dict
of one ``torch.optim`` optimizer over the same groups loads too, and the
gathered one loads into such an optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._state.optim import check_state_dict
from .sharded_args import WholeTensorGroup, hyperparameters
from .sharded_collectives import Collectives
from .sharded_local import LocalOptimizers
from .sharded_partition import Partition

__all__ = ["WholeStateView", "gathered_whole_state_dict", "load_whole_state_dict"]

#: A piece's place: ``(flat parameter index, member index)``.
_Key = tuple[int, int]


@dataclass(frozen=True)
class WholeStateView:
    """What the checkpoint of ``ShardedOptimizer(whole_tensors=True)`` reads (built by ``sharded.py``)."""

    #: The outer param groups (hyperparameters; an LR scheduler's changes).
    param_groups: list[dict[str, Any]]
    #: The groups as given: each one's members in order.
    wholes: Sequence[WholeTensorGroup]
    #: The inner optimizers, one per class.
    local: LocalOptimizers
    #: Who owns which range (``TensorShard``s).
    ownership: Partition
    #: The process group's collectives.
    collectives: Collectives
    #: The outer groups of which this rank steps tensors (their entries are its inner optimizers').
    owned: Sequence[int] = ()


def _positions(view: WholeStateView) -> list[tuple[int, _Key]]:
    """Return ``(group index, member)`` of every tensor, in state-dict order (its position is its id)."""
    return [(i, member) for i, whole in enumerate(view.wholes) for member in whole.members]


def _mine(view: WholeStateView) -> dict[_Key, tuple[tuple[int, ...], list[tuple[int, int, dict[str, Any]]]]]:
    """Return this rank's state of each member: ``member -> (its shape, [(flat offset, numel, state)])``."""
    state: dict[int, dict[str, Any]] = {}
    for opt in view.local.optimizers:
        for piece, entry in opt.state.items():
            state[id(piece)] = entry
    out: dict[_Key, tuple[tuple[int, ...], list[tuple[int, int, dict[str, Any]]]]] = {}
    for shard in view.ownership.shards:
        pieces, spans = shard.pieces, shard.spans  # type: ignore[attr-defined]  # TensorShard
        for index, offset, numel, _ in shard.where:  # type: ignore[attr-defined]
            entry = state.get(id(pieces[index]))
            if entry:
                cpu = {k: v.detach().cpu().clone() if isinstance(v, Tensor) else v for k, v in entry.items()}
                out.setdefault((shard.g, index), (spans[index][2], []))[1].append((offset, numel, cpu))
    return out


def gathered_whole_state_dict(view: WholeStateView) -> dict[str, Any]:
    """Return the whole state in a single-process optimizer's format over the model's tensors (collective).

    A param group's entries are those of the first rank that steps tensors of it: what an optimizer
    keeps in its groups (a step count) moves on only where it steps.
    """
    owned = {i: hyperparameters(view.param_groups[i]) for i in view.owned}
    parts: list[Any] = [None] * view.collectives.world
    dist.all_gather_object(parts, (_mine(view), owned), group=view.collectives.group)
    merged: dict[_Key, tuple[tuple[int, ...], list[tuple[int, int, dict[str, Any]]]]] = {}
    for part, _ in parts:
        for key, (shape, pieces) in part.items():
            merged.setdefault(key, (shape, []))[1].extend(pieces)
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for i, group in enumerate(view.param_groups):
        entries = next((own[i] for _, own in parts if i in own), hyperparameters(group))
        groups.append({**entries, "params": []})
    for position, (i, member) in enumerate(_positions(view)):
        groups[i]["params"].append(position)
        if member in merged:
            shape, pieces = merged[member]
            state[position] = _joined(shape, sorted(pieces, key=lambda p: p[0]))
    return {"state": state, "param_groups": groups}


def _joined(shape: tuple[int, ...], pieces: list[tuple[int, int, dict[str, Any]]]) -> dict[str, Any]:
    """Return one tensor's state from its pieces' (element-wise values joined in offset order, reshaped)."""
    if len(pieces) == 1:
        return pieces[0][2]
    out: dict[str, Any] = {}
    for key, value in pieces[0][2].items():
        if isinstance(value, Tensor) and value.dim() >= 1:
            out[key] = torch.cat([p[2][key].reshape(-1) for p in pieces]).reshape(shape)
        else:
            out[key] = value
    return out


def load_whole_state_dict(view: WholeStateView, state_dict: Mapping[str, Any]) -> None:
    """Give each inner optimizer this rank's part of a gathered (or one optimizer's) state dict.

    Checked completely before anything changes.

    Raises:
        TypeError: if ``state_dict`` is not an optimizer state dict.
        ValueError: if its param groups or a tensor's state do not match this optimizer's.
    """
    what = "ShardedOptimizer.load_state_dict()"
    state, groups = check_state_dict(state_dict, what)
    sizes = [len(whole.members) for whole in view.wholes]
    if [len(g["params"]) for g in groups] != sizes:
        raise ValueError(
            f"{what}: the state dict's param groups hold {[len(g['params']) for g in groups]} tensors, "
            f"this optimizer's hold {sizes}; load a state dict saved for the same param groups"
        )
    saved_ids = [pid for g in groups for pid in g["params"]]
    by_member = {member: state.get(saved_ids[pos]) for pos, (_, member) in enumerate(_positions(view))}
    loads: dict[int, dict[str, Any]] = {}
    for shard in view.ownership.shards:
        pieces, spans = shard.pieces, shard.spans  # type: ignore[attr-defined]  # TensorShard
        for index, offset, numel, _ in shard.where:  # type: ignore[attr-defined]
            saved = by_member.get((shard.g, index))
            if saved:
                loads[id(pieces[index])] = _part(saved, offset, numel, spans[index], what)
    _commit(view, groups, loads)


def _part(
    saved: Mapping[str, Any], offset: int, numel: int, span: tuple[int, int, tuple[int, ...]], what: str
) -> dict[str, Any]:
    """Return a piece's state (``numel`` elements from ``offset``) from its whole tensor's ``saved`` state."""
    start, total = offset - span[0], span[1]
    whole = start == 0 and numel == total
    part: dict[str, Any] = {}
    for key, value in saved.items():
        if not isinstance(value, Tensor):
            part[key] = value
        elif whole or value.dim() == 0:
            part[key] = value.clone()
        elif value.numel() == total:
            part[key] = value.reshape(-1)[start : start + numel].clone()
        else:
            raise ValueError(
                f"{what}: state {key!r} of a tensor of {total} elements cut between ranks has "
                f"{value.numel()} elements; load a state dict saved for the same model and param groups"
            )
    return part


def _commit(
    view: WholeStateView, groups: Sequence[Mapping[str, Any]], loads: Mapping[int, dict[str, Any]]
) -> None:
    """Load each inner optimizer's part through its own ``load_state_dict``, then the hyperparameters."""
    for opt in view.local.optimizers:
        own = opt.state_dict()
        pieces = [p for g in opt.param_groups for p in g["params"]]
        ids = [pid for g in own["param_groups"] for pid in g["params"]]
        own["state"] = {pid: loads[id(p)] for pid, p in zip(ids, pieces) if id(p) in loads}
        opt.load_state_dict(own)
    view.local.relink()
    for outer, saved in zip(view.param_groups, groups):  # the inner groups take them at each step
        outer.update(hyperparameters(saved))
