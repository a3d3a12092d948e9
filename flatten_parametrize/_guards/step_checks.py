"""Before an optimizer steps: the other mode's parameters, per-tensor math in flat mode, memory stepped twice.

Run by the global optimizer step pre-hook of ``decay_check.py``:

* :func:`check_modes` (at an optimizer's first step and again after any mode
  change): an optimizer over the leaf parameters of unflattened mode (built
  inside ``storage.unflattened()``, or over ``model.parameters()`` taken before
  registering) stepped while that storage is in flat mode would step nothing,
  since the leaves get no gradient there: it raises, with the fix. (The other
  way round works: in unflattened mode a flat parameter's ``.grad`` is its
  leaves' gradients, and its values are their memory.)
* :func:`elementwise_warning` (once per optimizer): in flat mode each group is
  one 1-D tensor holding many of the model's tensors; an optimizer whose math
  is per tensor (factored second moments, trust ratios, orthogonalized
  updates, per-matrix fallbacks by ``p.ndim``) computes something else there
  than on the plain model. Element-wise optimizers (``ELEMENTWISE``, and their
  subclasses that do not override ``step``) never warn; any other optimizer
  over a flat parameter warns once, naming the fix. Silence it with
  ``warnings.filterwarnings("ignore", message="flat mode: ")``.
* :func:`twice_warning` (once per optimizer): the flat parameters and the
  leaves of per-tensor mode are the same memory, so an element reachable
  through two optimizers (one over ``storage.flat_params``, one over leaves;
  two over leaves; one built in each mode) is stepped twice. What each
  optimizer steps is recorded at its first step (held weakly: an optimizer
  that is gone counts no more) and compared with the others'; an optimizer
  stepped inside another's ``step`` (ZeRO's, ``ShardedOptimizer``'s or
  Lookahead's inner one) or sharing its param groups (a framework's wrapper)
  is part of it. Silence it with
  ``warnings.filterwarnings("ignore", message="two optimizers: ")``.
"""

from __future__ import annotations

import gc
import sys
import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from .._core.leaves import slot_of_leaf, storage_of_leaf

__all__ = ["ELEMENTWISE", "check_modes", "elementwise_warning", "forget_optimizer", "twice_warning"]

#: Optimizers whose update of each element depends only on that element's own state (and on scalars
#: shared by the whole step), by the module and name of the class that defines ``step``; a flat
#: parameter gives them the plain model's math. LBFGS works on all parameters as one vector anyway.
ELEMENTWISE = frozenset(
    {
        # torch
        "torch.optim.sgd.SGD",
        "torch.optim.adam.Adam",
        "torch.optim.adamw.AdamW",
        "torch.optim.adamax.Adamax",
        "torch.optim.nadam.NAdam",
        "torch.optim.radam.RAdam",
        "torch.optim.adagrad.Adagrad",
        "torch.optim.adadelta.Adadelta",
        "torch.optim.rmsprop.RMSprop",
        "torch.optim.asgd.ASGD",
        "torch.optim.rprop.Rprop",
        "torch.optim.sparse_adam.SparseAdam",
        "torch.optim.lbfgs.LBFGS",
        # timm
        "timm.optim.adabelief.AdaBelief",
        "timm.optim.adamw.AdamWLegacy",
        "timm.optim.adan.Adan",
        "timm.optim.adopt.Adopt",
        "timm.optim.laprop.LaProp",
        "timm.optim.lion.Lion",
        "timm.optim.madgrad.MADGRAD",
        "timm.optim.nadam.NAdamLegacy",
        "timm.optim.nadamw.NAdamW",
        "timm.optim.radam.RAdamLegacy",
        "timm.optim.rmsprop_tf.RMSpropTF",
        "timm.optim.sgdw.SGDW",
        # torchao's low-bit optimizers (block-wise quantized state of element-wise math)
        "torchao.optim.adam._AdamBase",
        # this library's ZeRO optimizer (its inner optimizer steps plain slices)
        "flatten_parametrize._distributed.sharded.ShardedOptimizer",
        # schedule-free
        "schedulefree.adamw_schedulefree.AdamWScheduleFree",
        "schedulefree.sgd_schedulefree.SGDScheduleFree",
        "schedulefree.radam_schedulefree.RAdamScheduleFree",
    }
)


def _step_owner(optimizer: Any) -> str:
    """Return ``module.name`` of the class in ``type(optimizer)``'s MRO that defines ``step``."""
    for cls in type(optimizer).__mro__:
        if "step" in vars(cls):
            return f"{cls.__module__}.{cls.__qualname__}"
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def is_elementwise(optimizer: Any) -> bool:
    """Return whether ``optimizer`` is known to update each element from that element alone."""
    return _step_owner(optimizer) in ELEMENTWISE


def _params(groups: list[dict[str, Any]]) -> list[Any]:
    return [p for group in groups for p in group.get("params", ())]


def check_modes(optimizer: Any, groups: list[dict[str, Any]]) -> None:
    """Raise if ``optimizer`` holds leaf parameters of a storage that is in flat mode now.

    Raises:
        RuntimeError: naming the optimizer, the parameter and the fix.
    """
    for param in _params(groups):
        found = storage_of_leaf(param)
        if found is None:
            continue
        storage, name = found
        if not storage.is_flattened or not _attached(storage):
            continue
        raise RuntimeError(
            f"{type(optimizer).__name__} steps '{name}', a leaf parameter of the flat storage's "
            "unflattened (per-tensor) mode, but the storage is in flat mode now, where that leaf gets "
            "no gradient and the step would change nothing. Build the optimizer over model.parameters() "
            "in the mode you train in: in flat mode (the flat parameters), or for the whole run in "
            "per-tensor mode (`storage.unflatten()` before building it, and no flatten() until training "
            "ends)"
        )


def elementwise_warning(optimizer: Any, groups: list[dict[str, Any]], flat_type: type[Any]) -> str | None:
    """Return the warning for a per-tensor optimizer over flat parameters in flat mode, or ``None``."""
    flats = [p for p in _params(groups) if isinstance(p, flat_type) and p.requires_grad]
    if not flats or is_elementwise(optimizer):
        return None
    names = [name for flat in flats[:1] for name in flat.metadata()[0][:3]]
    return (
        f"flat mode: {type(optimizer).__name__} is not a known element-wise optimizer, and each flat "
        f"parameter is one 1-D tensor holding many of the model's tensors ({', '.join(names)}, ...), so "
        "math that works per tensor (factored second moments, trust ratios, orthogonalized updates, "
        "a fallback for p.ndim < 2) computes something else than on the plain model. Train in "
        "per-tensor mode: `storage.unflatten()` before building the optimizer over model.parameters() "
        "(the gradients stay in the flat buffers). If its math is element-wise, silence this with "
        "warnings.filterwarnings('ignore', message='flat mode: ')"
    )


def _attached(storage: Any) -> bool:
    try:
        storage.module  # noqa: B018 - raises for a removed storage
    except RuntimeError:
        return False
    return True


@dataclass(eq=False)
class _Reach:
    """What one optimizer steps of the storages, and the optimizers it is part of.

    Attributes:
        optimizer: the optimizer (held weakly).
        group_ids: ``id`` of its ``param_groups`` list and of each group dict (a wrapper shares them).
        elements: ``(id(flat parameter), slot index) -> (qualified name, how it is held)`` of each slot
            it steps (through the flat parameter or through the slot's leaf).
        within: the optimizers whose ``step`` ran around its check (ZeRO, ``ShardedOptimizer`` and
            Lookahead step an inner optimizer over the same memory).
        told: the optimizers a warning about this one was given with.
    """

    optimizer: weakref.ref[Any]
    group_ids: frozenset[int]
    elements: dict[tuple[int, int], tuple[str, str]]
    within: list[weakref.ref[Any]] = field(default_factory=list)
    told: list[weakref.ref[Any]] = field(default_factory=list)


#: ``id(optimizer) -> what it steps``, for each optimizer checked at a step (the entry leaves with it).
_REACH: dict[int, _Reach] = {}
#: ``element -> ids of the optimizers in _REACH that step it``.
_HOLDERS: dict[tuple[int, int], set[int]] = {}


def twice_warning(optimizer: Any, groups: list[dict[str, Any]], flat_type: type[Any]) -> str | None:
    """Record what ``optimizer`` steps; return the warning if another live optimizer steps some of it.

    The flat parameters and the leaves of per-tensor mode are the same memory: an element reached by
    two optimizers (one over ``storage.flat_params``, one over leaves, or two over leaves) is updated
    twice per step. Optimizers that step inside another's ``step`` (wrappers), or that share its param
    groups, are one optimizer. Runs at an optimizer's first step (and again after a change of its
    groups or of any storage's mode); an optimizer already garbage-collected counts no more.
    """
    before = _REACH.get(id(optimizer))
    within = before.within if before else []
    for outer in _stepping_around(optimizer):
        if not any(ref() is outer for ref in within):
            within.append(weakref.ref(outer))
    reach = _Reach(
        weakref.ref(optimizer),
        frozenset({id(groups), *(id(group) for group in groups)}),
        _elements(groups, flat_type),
        within,
        before.told if before else [],
    )
    forget_optimizer(id(optimizer))
    _REACH[id(optimizer)] = reach
    for element in reach.elements:
        _HOLDERS.setdefault(element, set()).add(id(optimizer))
    if _clash(reach) is not None:
        gc.collect()  # an optimizer replaced by this one may wait for the cycle collector
    clash = _clash(reach)
    if clash is None:
        return None
    other, shared = clash
    reach.told.append(weakref.ref(other))
    _REACH[id(other)].told.append(reach.optimizer)
    name, how = reach.elements[shared[0]]
    _, other_how = _REACH[id(other)].elements[shared[0]]
    more = f" and {len(shared) - 1} more tensor(s)" if len(shared) > 1 else ""
    return (
        "two optimizers: each element of a flat storage is stepped by one optimizer, since the flat "
        "parameters and the per-tensor leaves are the same memory; but "
        f"{type(optimizer).__name__} ({how}) and {type(other).__name__} ({other_how}) both step "
        f"'{name}'{more}, so each step updates them twice. Build the optimizers over disjoint parts, e.g. "
        "in per-tensor mode Muon([p for p in model.parameters() if p.ndim == 2]) and AdamW([p for p in "
        "model.parameters() if p.ndim != 2]) rather than AdamW(storage.flat_params), which holds every "
        "tensor; if one replaced the other, drop the old one (`del` every reference to it). Silence this "
        "with warnings.filterwarnings('ignore', message='two optimizers: ')"
    )


def forget_optimizer(key: int) -> None:
    """Forget what the optimizer of ``id`` ``key`` steps (it is gone, or is checked again)."""
    reach = _REACH.pop(key, None)
    for element in reach.elements if reach else ():
        holders = _HOLDERS[element]
        holders.discard(key)
        if not holders:
            del _HOLDERS[element]


def _clash(reach: _Reach) -> tuple[Any, list[tuple[int, int]]] | None:
    """Return another live optimizer stepping some of ``reach``'s elements, with the shared ones."""
    mine = reach.optimizer()
    if not reach.elements or mine is None:
        return None
    others = {key for element in reach.elements for key in _HOLDERS.get(element, ())}
    for entry in [_REACH[key] for key in others if key in _REACH]:
        other = entry.optimizer()
        if other is None or other is mine or reach.group_ids & entry.group_ids:
            continue
        related = (*reach.within, *entry.within, *reach.told)
        if any(ref() is other or ref() is mine for ref in related):
            continue
        shared = [element for element in reach.elements if element in entry.elements]
        if shared:
            return other, shared
    return None


def _elements(groups: list[dict[str, Any]], flat_type: type[Any]) -> dict[tuple[int, int], tuple[str, str]]:
    """Return ``(id(flat parameter), slot index) -> (qualified name, how)`` of each slot ``groups`` train."""
    found: dict[tuple[int, int], tuple[str, str]] = {}
    for param in _params(groups):
        if not getattr(param, "requires_grad", False):
            continue
        if isinstance(param, flat_type):
            for index, name in enumerate(param.metadata()[0]):
                found[(id(param), index)] = (name, "through a flat parameter")
            continue
        owner = slot_of_leaf(param)
        if owner is not None:
            storage, slot = owner
            found[(id(storage.groups()[slot.group_index].flat), slot.index)] = (slot.name, "through its leaf")
    return found


def _stepping_around(optimizer: Any) -> list[torch.optim.Optimizer]:
    """Return the other optimizers whose ``step`` is running now, around this one's."""
    outer = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "step":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.optim.Optimizer) and owner is not optimizer:
                outer.append(owner)
        frame = frame.f_back
    return outer
