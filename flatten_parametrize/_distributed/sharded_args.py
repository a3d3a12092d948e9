"""Argument checks of ShardedOptimizer: the optimizer class, the param groups, one layout on all ranks."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from .sharded_rules import ALLOWED_OPTIMIZERS

if TYPE_CHECKING:
    from .._core.records import Coordinator
    from .sharded_collectives import Collectives

__all__ = [
    "ALLOWED_OPTIMIZERS",
    "CLASS_KEY",
    "check_class",
    "check_same_layout",
    "hyperparameters",
    "items_of",
    "not_in_storage",
    "param_groups",
]

#: The key of a param group that names its own optimizer class (``whole_tensors=True``).
CLASS_KEY = "optimizer_class"

#: Optimizers that are never element-wise: refused even with ``allow_unlisted=True``.
_NEVER = (torch.optim.LBFGS, torch.optim.SparseAdam)


def check_class(optimizer_class: Any, allow_unlisted: bool, whole_tensors: bool = False) -> None:
    """Refuse anything but an element-wise ``torch.optim.Optimizer`` class (any class but LBFGS's kind
    with ``whole_tensors``)."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"ShardedOptimizer: optimizer_class must be a torch.optim.Optimizer subclass; got "
            f"{type(optimizer_class).__name__} {optimizer_class!r}; pass the class, e.g. torch.optim.AdamW"
        )
    allowed = ", ".join(c.__name__ for c in ALLOWED_OPTIMIZERS)
    if issubclass(optimizer_class, _NEVER):
        raise ValueError(
            f"ShardedOptimizer: {optimizer_class.__name__} is not element-wise and its math reads across "
            "tensors (LBFGS: all parameters as one vector; SparseAdam: sparse gradients), so no rank can "
            f"step a part of the model alone; use one of {allowed}, or any optimizer whose update of a "
            "tensor uses that tensor only (Muon, Adafactor) with whole_tensors=True"
        )
    if not whole_tensors and optimizer_class not in ALLOWED_OPTIMIZERS and not allow_unlisted:
        raise ValueError(
            f"ShardedOptimizer steps slices cut through parameters, so it takes element-wise optimizers "
            f"only: {allowed}; got {optimizer_class.__qualname__}; pass whole_tensors=True (per-tensor "
            "mode) to give each rank whole tensors, or allow_unlisted=True if you know that its update of "
            "each element uses only that element's gradient and state"
        )


def items_of(flats: Sequence[Tensor], params: Any, kinds: str, example: str) -> list[Any]:
    """Return ``params`` as a list of param-group items (``None``: one group of every flat parameter)."""
    if params is None:
        return [{"params": list(flats)}]
    if isinstance(params, (Tensor, Mapping)) or not isinstance(params, Iterable):
        raise TypeError(
            f"ShardedOptimizer: params must be None or an iterable of {kinds} or of param-group dicts; "
            f"got {type(params).__name__}; pass e.g. {example}"
        )
    items = list(params)
    items = [{"params": items}] if items and not isinstance(items[0], Mapping) else items
    for i, item in enumerate(items):
        if not isinstance(item, Mapping) or "params" not in item:
            raise TypeError(
                f"ShardedOptimizer: param group {i} must be a dict with a 'params' list; got "
                f"{type(item).__name__}; pass e.g. {example}"
            )
    return items


def not_in_storage(storage: Coordinator, p: Any, i: int) -> ValueError:
    """Return the error for ``p`` in param group ``i``: not a tensor of the storage (why, and what to do)."""
    what = f"{type(p).__name__} of shape {tuple(p.shape)}" if isinstance(p, Tensor) else repr(p)
    start = (
        "ShardedOptimizer(whole_tensors=True): every parameter must be a flat parameter of the storage or, "
        "in per-tensor mode, one of the model's parameters that it holds"
    )
    name = next((n for n, q in storage.module.named_parameters() if q is p), None)
    if name is not None:
        return ValueError(
            f"{start}; {name} in param group {i} is a parameter of the model that no group of the storage "
            "holds (left out at registration, or put in after it), so no rank owns it; step it with an "
            "optimizer of its own (ShardedOptimizer averages its gradient over the ranks when backward ends, "
            "as DDP does), or register it: remove_flat_storage(model), then register_flat_storage(model) and "
            "build the optimizer again"
        )
    return ValueError(
        f"{start}; got {what} in param group {i}; in flat mode the model's attributes are views: call "
        "storage.unflatten() before building the optimizer and pass model.parameters()"
    )


def param_groups(storage: Coordinator, params: Any, taken: Sequence[Tensor] = ()) -> list[dict[str, Any]]:
    """Return ``params`` as param-group dicts over flat parameters of ``storage`` (checked)."""
    flats = storage.flat_params
    items = items_of(flats, params, "flat parameters", "[{'params': [storage['0']]}]")
    groups, seen = [], list(taken)
    for i, item in enumerate(items):
        members = item["params"]
        members = [members] if isinstance(members, Tensor) else list(members)
        for p in members:
            if not any(p is f for f in flats):
                what = f"{type(p).__name__} of shape {tuple(p.shape)}" if isinstance(p, Tensor) else repr(p)
                raise ValueError(
                    f"ShardedOptimizer: every parameter must be a flat parameter of the storage (one of "
                    f"{['flat_param_' + n for n in storage.group_names]}); got {what} in param group {i}; "
                    "pass storage[group name] or storage.flat_params"
                )
            if any(p is q for q in seen):
                name = storage.group_names[next(g for g, f in enumerate(flats) if f is p)]
                raise ValueError(
                    f"ShardedOptimizer: flat parameter of group {name!r} appears in more than one "
                    "param group (or is already optimized); list each flat parameter once"
                )
            seen.append(p)
        groups.append({**item, "params": members})
    return groups


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """Return a param group's hyperparameters (everything but ``params``)."""
    return {k: v for k, v in group.items() if k != "params"}


class _Fingerprinted(Protocol):
    """What the layout check reads of a checked param group (``sharded_strategies.ShardedGroup``)."""

    @property
    def entries(self) -> Sequence[Any]:
        """Its tensors in the gathered state dict."""

    @property
    def optimizer_class(self) -> type:
        """Its optimizer class."""


def check_same_layout(
    storage: Coordinator,
    groups: Sequence[_Fingerprinted],
    optimizer_class: type,
    shard_gradients: bool,
    comm: Collectives,
) -> None:
    """Compare a fingerprint of this rank's layout with every rank's, in one collective.

    Raises:
        ValueError: on every rank, if any rank's layout, param groups, optimizer class or
            ``shard_gradients`` differ from rank 0's.
    """
    flats = storage.flat_params
    layout = repr(
        (
            [(n, f.numel(), str(f.dtype), f.requires_grad) for n, f in zip(storage.group_names, flats)],
            [(i.name, i.group, i.offset, i.numel, tuple(i.shape)) for i in storage.param_infos],
            [(group.entries, group.optimizer_class.__qualname__) for group in groups],
            optimizer_class.__qualname__,
            shard_gradients,
        )
    )
    mine = int.from_bytes(hashlib.sha256(layout.encode()).digest()[:7], "little")
    prints = comm.all_gather_ints(mine, comm.device(flats))
    if len(set(prints)) > 1:
        differ = [r for r, p in enumerate(prints) if p != prints[0]]
        raise ValueError(
            "ShardedOptimizer needs the same flat layout, param groups, optimizer class and "
            f"shard_gradients on every rank; ranks {differ} differ from rank 0 (layout fingerprints "
            f"{prints}); register the same model with the same groups on every rank"
        )
