"""Warn once per optimizer, before its first step, when its param groups cannot decay like the plain model's.

Decay rules written for plain models decide per parameter by ``p.dim()`` or by
name. On a flattened model every flat parameter is one-dimensional and named
``flat_param_<group>``, so such a rule puts whole flat parameters on one side:

* by dimension (nanoGPT's ``configure_optimizers``: ``p.dim() >= 2`` decays;
  timm's ``param_groups_weight_decay`` and ``create_optimizer_v2(model,
  weight_decay=...)``: ``ndim <= 1 or name.endswith(".bias")`` does not): every
  flat parameter lands in the group without decay, and the matrices the plain
  model decays are not decayed;
* by name (transformers' ``Trainer.get_decay_parameter_names``): a flat
  parameter whose group name says nothing lands in the group with decay, and the
  biases and norms the plain model leaves out are decayed.

The library cannot know which rule built the groups, so it looks at the result:
an optimizer that has groups with and groups without weight decay (a split was
asked for) but whose flat parameters all sit on one side, while that side's
flat parameters hold tensors the rules above put on the other (matrices on the
side without decay; matrices and one-dimensional tensors together on the side
with decay). Uniform decay (no group without it, or none with it) and the
recipe (:func:`~flatten_parametrize.weight_decay_groups`, param groups built
by group name) never warn.

The check is a global optimizer step pre-hook, installed with the first
:class:`FlatParameter`. It also runs the checks of ``step_checks.py``: leaf
parameters of unflattened mode stepped in flat mode (raises), an
optimizer that is not element-wise over flat parameters (warns once), and
memory that another optimizer steps too (warns once). After
an optimizer's first step it costs one dict lookup per step; an optimizer
whose groups change (``add_param_group``), or any storage's mode, is checked
again, and warned about once at most per warning.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .._core.compiling import never_traced
from .._core.leaves import EPOCH
from .step_checks import check_modes, elementwise_warning, forget_optimizer, twice_warning

__all__ = ["watch_optimizers"]

_handle: RemovableHandle | None = None
#: ``id(optimizer) -> (number of param groups, mode epoch)`` when it was last checked (entries leave with
#: the optimizer).
_checked: dict[int, tuple[int, int]] = {}
#: ``(id(optimizer), kind)`` of the warnings given.
_warned: set[tuple[int, str]] = set()

_RECIPE = (
    "Fix: register with groups=weight_decay_groups(model, no_decay=<the rule>) (e.g. no_decay=lambda "
    "name, p: p.dim() < 2 for nanoGPT's rule, lambda name, p: p.ndim <= 1 or name.endswith('.bias') for "
    "timm's, the default for transformers') and build the param groups by group name: "
    "[{{'params': [storage['decay']], 'weight_decay': {wd}}}, "
    "{{'params': [storage['no_decay_bias']], 'weight_decay': 0.0}}] (timm's create_optimizer_v2 takes such "
    "a list in place of the model; transformers' Trainer builds it itself from these group names). "
    "See 'Weight decay by p.dim() or by name' in docs/good-to-know.md."
)


def watch_optimizers(flat_type: type[torch.Tensor]) -> None:
    """Install the check (once per process) for optimizers that hold parameters of ``flat_type``."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_Hook(flat_type))


class _Hook:
    """The global step pre-hook: checks each optimizer once (again after its groups changed)."""

    __slots__ = ("flat_type",)

    def __init__(self, flat_type: type[torch.Tensor]) -> None:
        self.flat_type = flat_type

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list) or _checked.get(id(optimizer)) == (len(groups), EPOCH[0]):
            return  # it runs for every optimizer in the process: never in a step's way
        _check(optimizer, groups, self.flat_type)


@never_traced  # a compiled step runs the first check eagerly (weakref.finalize is not traceable)
def _check(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], flat_type: type[torch.Tensor]
) -> None:
    key = id(optimizer)
    check_modes(optimizer, groups)  # raises (and is checked again at the next step) before anything
    if key not in _checked:
        weakref.finalize(optimizer, _forget, key)  # an id is reused only after its object is gone
    _checked[key] = (len(groups), EPOCH[0])
    warnings_due = (
        ("decay", _mismatch(groups, flat_type, _asked(optimizer))),
        ("elementwise", elementwise_warning(optimizer, groups, flat_type)),
        ("twice", twice_warning(optimizer, groups, flat_type)),
    )
    for kind, message in warnings_due:
        if message is not None and (key, kind) not in _warned:
            _warned.add((key, kind))
            warnings.warn(message, UserWarning, stacklevel=4)


def _asked(optimizer: Any) -> dict[str, Any]:
    """Return ``{"weight_decay": value}`` if the optimizer was built with a weight decay of its own choosing.

    A ``weight_decay`` in ``defaults`` that differs from the class's own default
    was asked for (timm's ``create_optimizer_v2(model, weight_decay=0.05)``);
    the class default alone (``AdamW``'s 0.01) says nothing.
    """
    defaults = getattr(optimizer, "defaults", None)
    if not isinstance(defaults, dict) or "weight_decay" not in defaults:
        return {}
    try:
        default = inspect.signature(type(optimizer).__init__).parameters["weight_decay"].default
    except (KeyError, TypeError, ValueError):
        default = inspect.Parameter.empty
    if default is not inspect.Parameter.empty and defaults["weight_decay"] == default:
        return {}
    return {"weight_decay": defaults["weight_decay"]}


def _forget(key: int) -> None:
    _checked.pop(key, None)
    forget_optimizer(key)
    _warned.difference_update({(key, "decay"), (key, "elementwise"), (key, "twice")})


def _decay(group: dict[str, Any]) -> float:
    value = group.get("weight_decay", 0.0)
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return 0.0


def _slots(flat: Any) -> list[tuple[str, tuple[int, ...]]]:
    names, shapes, _ = flat.metadata()
    return [(name, tuple(shape)) for name, shape in zip(names, shapes)]


def _first(flats: Iterable[tuple[int, Any]], matrix: bool) -> tuple[int, str, tuple[int, ...]] | None:
    """Return ``(group index, slot name, shape)`` of the first matrix (or 1-D tensor) in ``flats``."""
    for index, flat in flats:
        for name, shape in _slots(flat):
            if (len(shape) >= 2) == matrix:
                return index, name, shape
    return None


def _describe(found: tuple[int, str, tuple[int, ...]], groups: list[dict[str, Any]]) -> str:
    index, name, shape = found
    wd = _decay(groups[index])
    return f"param group {index} (weight_decay={wd}) has a flat parameter holding '{name}' {shape}"


def _mismatch(
    groups: list[dict[str, Any]], flat_type: type[torch.Tensor], defaults: dict[str, Any] | None = None
) -> str | None:
    """Return the warning for param ``groups`` that cannot decay like the plain model's, or ``None``.

    Args:
        groups: an optimizer's ``param_groups``.
        flat_type: the flat parameter class.
        defaults: the optimizer's ``defaults``: a ``weight_decay`` asked for there and given to no
            group holding matrices is a split that dropped its empty side (timm 1.0.31 drops empty
            param groups, so its rule by ``p.dim()`` leaves one group without decay).

    Returns:
        The message (the rule, the offending flat parameter, the fix), or ``None``.
    """
    decaying = [i for i, g in enumerate(groups) if _decay(g) > 0]
    plain = [i for i, g in enumerate(groups) if _decay(g) == 0]
    asked = _decay(defaults or {})
    if not plain or not (decaying or asked > 0):
        return None  # uniform decay (or none asked for): every rule gives the plain model's math
    flats: dict[bool, list[tuple[int, Any]]] = {True: [], False: []}
    for index, group in enumerate(groups):
        for param in group.get("params", ()):
            if isinstance(param, flat_type) and param.requires_grad:
                flats[_decay(group) > 0].append((index, param))
    wd = _decay(groups[decaying[0]]) if decaying else asked
    if flats[True] == [] and flats[False]:
        matrix = _first(flats[False], matrix=True)
        if matrix is None:
            return None
        return (
            "weight decay: a rule by p.dim() (nanoGPT's p.dim() >= 2; timm's param_groups_weight_decay and "
            "create_optimizer_v2(model, weight_decay=...): ndim <= 1 or name.endswith('.bias')) sees only "
            "one-dimensional flat parameters and decays none of the matrices the plain model decays: "
            + (
                f"param groups {decaying} decay (weight_decay={wd}) but hold no flat parameter"
                if decaying
                else f"the optimizer was asked for weight_decay={wd} but no param group decays"
            )
            + f", and {_describe(matrix, groups)}. "
            + _RECIPE.format(wd=wd)
        )
    if flats[False] == [] and flats[True]:
        matrix = _first(flats[True], matrix=True)
        vector = _first(flats[True], matrix=False)
        if matrix is None or vector is None:
            return None
        return (
            "weight decay: a rule by parameter name (transformers' Trainer.get_decay_parameter_names: bias "
            "and norm names do not decay) sees only flat_param_<group> and decays the biases and norms the "
            f"plain model leaves out: param groups {plain} do not decay but hold no flat parameter, while "
            f"the flat parameters of param groups {decaying} (weight_decay={wd}) hold both matrices "
            f"('{matrix[1]}' {matrix[2]}) and one-dimensional tensors ('{vector[1]}' {vector[2]}). "
            + _RECIPE.format(wd=wd)
        )
    return None
