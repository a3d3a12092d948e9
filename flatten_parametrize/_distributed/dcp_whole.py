"""DCP's optimizer state of ``ShardedOptimizer(whole_tensors=True)``, keyed by the plain model's names.

torch's ``get_state_dict`` / ``set_state_dict`` name an optimizer's state
through the tensors of its param groups, looked up in
``model.named_parameters()``. A whole-tensor optimizer's state is per tensor
of the storage while its groups may hold flat parameters (each standing for
its tensors, in layout order), and in flat mode the model yields no tensor of
its own: ``dcp.py`` hands such optimizers here instead. Saving takes the
gathered state (:meth:`ShardedOptimizer.state_dict`, one ``torch.optim``
optimizer's format over the model's tensors, the same on every rank) and keys
each tensor's entry by its DCP name; loading picks those names out of the
checkpoint, with the hyperparameters of the checkpoint's group that holds
them, and hands the result to :meth:`ShardedOptimizer.load_state_dict`, which
keeps this rank's part. The values are whole tensors of the plain shapes, so
a checkpoint moves between world sizes, modes and the plain model.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from torch import nn

from .sharded import ShardedOptimizer, init_state, whole_tensor_members
from .sharded_args import hyperparameters

__all__ = ["is_whole", "missing_state", "state_by_name", "state_for", "tensor_names"]


def is_whole(optimizer: Any) -> bool:
    """Return whether ``optimizer`` is a ``ShardedOptimizer(whole_tensors=True)``."""
    return isinstance(optimizer, ShardedOptimizer) and whole_tensor_members(optimizer) is not None


def tensor_names(dsd: ModuleType, model: nn.Module, opt: ShardedOptimizer) -> list[list[str]]:
    """Return the DCP name of every tensor of each of ``opt``'s param groups, in state-dict order."""
    found = whole_tensor_members(opt)
    assert found is not None  # is_whole(opt)
    core, groups = found
    prefix = next((p for p, m in model.named_modules() if m is core.module), None)
    if prefix is None:
        raise ValueError(
            "get_state_dict / set_state_dict need the optimizer's model: the ShardedOptimizer steps the "
            f"flattened {type(core.module).__name__}, which is not a submodule of the "
            f"{type(model).__name__} given; pass the model it was built for"
        )
    slots = {(g, slot.index): slot.name for g, group in enumerate(core.groups()) for slot in group.members}
    out = []
    for members in groups:
        names = []
        for member in members:
            (fqn,) = dsd._get_fqns(model, f"{prefix}.{slots[member]}" if prefix else slots[member])
            names.append(fqn)
        out.append(names)
    return out


def state_by_name(dsd: ModuleType, model: nn.Module, opt: ShardedOptimizer) -> dict[str, Any]:
    """Return ``opt``'s gathered state keyed by DCP names (collective; a fresh one's state made first)."""
    init_state(opt)  # what DCP does to a fresh optimizer, so that a load finds every entry
    osd = opt.state_dict()
    names = [name for group in tensor_names(dsd, model, opt) for name in group]
    return {
        "state": {names[pid]: entry for pid, entry in osd["state"].items()},
        "param_groups": [{**g, "params": [names[pid] for pid in g["params"]]} for g in osd["param_groups"]],
    }


def state_for(
    opt: ShardedOptimizer, names: list[list[str]], osd: Mapping[str, Any], strict: bool
) -> dict[str, Any]:
    """Return the part of ``osd`` (keyed by DCP names) that is ``opt``'s, for its ``load_state_dict``.

    ``names`` are ``opt``'s tensors' (:func:`tensor_names`).

    Raises:
        ValueError: if no param group of ``osd`` holds one of ``opt``'s tensors.
        RuntimeError: with ``strict``, if a tensor has no state in ``osd`` (torch's message).
    """
    state, saved_groups = osd.get("state", {}), osd.get("param_groups", [])
    group_of = {name: g for g in saved_groups for name in g["params"]}
    out_state: dict[str, Any] = {}
    groups = []
    for own, mine in zip(opt.param_groups, names):
        saved = next((group_of[name] for name in mine if name in group_of), None)
        if saved is None and mine:
            raise ValueError(
                f"set_state_dict: no param group of the checkpoint holds {mine[0]}, a tensor of this "
                "ShardedOptimizer(whole_tensors=True); load a checkpoint of this model's optimizer"
            )
        groups.append({**hyperparameters(own if saved is None else saved), "params": mine})
        for name in mine:
            if name in state:
                out_state[name] = state[name]
            elif strict:
                raise missing_state(name)
    return {"state": out_state, "param_groups": groups}


def missing_state(name: str) -> RuntimeError:
    """Return torch's error for a tensor without state in a checkpoint loaded with ``strict``."""
    return RuntimeError(
        f"Missing optimizer state for parameter '{name}' in checkpoint. The parameter requires gradients "
        "but has no saved optimizer state. To load anyway, use StateDictOptions(strict=False)."
    )
