"""Before an optimizer steps: parameters of the mode the storage is not in, and per-tensor math in flat mode.

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
"""

from __future__ import annotations

from typing import Any

from .leaves import storage_of_leaf

__all__ = ["ELEMENTWISE", "check_modes", "elementwise_warning"]

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

