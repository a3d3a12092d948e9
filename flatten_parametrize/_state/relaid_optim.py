"""Optimizer state follows a group laid out again: each slot's state moves with it at the next step.

When a storage lays a group out again (a weight left it, a module swap
re-hosted a slot, dead space was reclaimed, a framework resized an embedding
and every other ``relayout.py`` operation) its ``FlatParameter`` object stays,
so optimizers keep it; their per-element state (SGD's momentum, Adam's moments:
one tensor of the flat parameter's old size) does not fit the new layout. The
storage records, per flat parameter, where each slot that stayed moved
(:func:`record`); a global optimizer step pre-hook then rewrites the state of
every optimizer holding that flat parameter once, before its first step after
the change: each remaining slot keeps its state, a new slot starts from zeros
(as a new parameter's state would), a slot that left takes its state with it.
So the step that follows gives the plain model's result (whose optimizer
steps the parameters that stayed with their state). A state tensor that cannot
be rewritten (a tensor subclass, such as the quantized state of torchao's
low-bit optimizers) makes the step raise with the fix. Nothing is done while
no group was ever laid out again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["Move", "follow", "install", "record"]


@dataclass
class Move:
    """One change of a flat parameter's layout: its old size, its new size, the slots that stayed.

    Attributes:
        name: the flat parameter's name (for messages).
        old_numel: its number of elements before.
        new_numel: after.
        segments: ``(old offset, new offset, numel)`` of each slot that stayed.
        done: ids of the optimizers whose state was moved already (or that had none).
    """

    name: str
    old_numel: int
    new_numel: int
    segments: list[tuple[int, int, int]]
    done: set[int] = field(default_factory=set)


#: ``id(flat parameter) -> (weak reference to it, its moves in order)``.
_MOVES: dict[int, tuple[weakref.ref[Tensor], list[Move]]] = {}
_handle: list[RemovableHandle] = []


def record(flat: Tensor, move: Move) -> None:
    """Record that ``flat`` was laid out again as ``move`` says (nothing to do for an unchanged layout)."""
    kept = sum(numel for _, _, numel in move.segments)
    unchanged = all(old == new for old, new, _ in move.segments)
    if move.old_numel == move.new_numel == kept and unchanged:
        return
    key = id(flat)
    entry = _MOVES.get(key)
    if entry is None or entry[0]() is not flat:
        entry = (weakref.ref(flat, lambda _: _MOVES.pop(key, None)), [])
        _MOVES[key] = entry
    entry[1].append(move)
    install()


def install() -> None:
    """Register the global step pre-hook that moves the state (once).

    Registered ahead of time by a step pre-hook that may lay groups out again
    (``_install/leaf_writes.py``): torch runs the global pre-hooks from their
    dict, so none may be registered while they run.
    """
    if not _handle:
        _handle.append(register_optimizer_step_pre_hook(_before_step))


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    follow(optimizer)


def follow(optimizer: torch.optim.Optimizer) -> None:
    """Move ``optimizer``'s state of every flat parameter laid out again since its last step."""
    if not _MOVES:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = _MOVES.get(id(param))
            if entry is None or entry[0]() is not param or not isinstance(param, Tensor):
                continue
            for move in entry[1]:
                if id(optimizer) not in move.done:
                    _move_state(optimizer, param, move)
                    move.done.add(id(optimizer))


def _move_state(optimizer: torch.optim.Optimizer, param: Tensor, move: Move) -> None:
    state = optimizer.state.get(param)
    if not state:
        return
    moved: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(value, Tensor) or value.dim() == 0 or value.numel() != move.old_numel:
            continue
        if type(value) is not Tensor or value.dim() != 1:
            raise RuntimeError(
                f"{type(optimizer).__name__}'s state '{key}' of {move.name} was made for its old layout "
                f"({move.old_numel:,} elements) and is a {type(value).__name__}, which cannot be moved to "
                f"the group's new layout ({move.new_numel:,} elements; it was laid out again when tensors "
                "left the flat storage or dead space was reclaimed); build the optimizer again after "
                "changing the model"
            )
        new = torch.zeros(move.new_numel, dtype=value.dtype, device=value.device)
        for old_offset, new_offset, numel in move.segments:
            new[new_offset : new_offset + numel] = value[old_offset : old_offset + numel]
        moved[key] = new
    state.update(moved)
