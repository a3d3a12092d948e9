"""What stepping one tensor costs an optimizer class, for ownership by whole tensors.

``ShardedOptimizer(whole_tensors=True)`` gives each rank whole tensors and balances
the ranks by what their tensors' steps cost (``sharded_plan.py``). The cost model,
per class:

* **Muon-like** (a class whose name contains ``Muon``): Newton-Schulz on the
  matrix ``(m, n)`` (a tensor of more dimensions as ``(shape[0], rest)``),
  :data:`NEWTON_SCHULZ_STEPS` iterations of ``X X^T`` and two products, that is
  ``steps * (4 max(m, n) min(m, n)^2 + 2 min(m, n)^3)`` flops; state: one
  momentum per element.
* **Shampoo-like** (``Shampoo``, ``SOAP``): the roots of the two preconditioners,
  ``m^3 + n^3``, plus the element-wise update; state: ``m^2 + n^2`` plus one
  per element.
* **Adafactor-like** (``Adafactor``): the element-wise update; state: the
  factored second moment, ``m + n`` (one per element for a vector).
* **element-wise** (every other class): :data:`ELEMENTWISE_FLOPS` per element;
  state: two per element for the Adam family, one for the others.

A class states its own cost with two optional class attributes, called with the
tensor's shape: ``step_cost(shape) -> float`` (flops, or any unit comparable
with the numbers above) and ``state_numel(shape) -> int`` (the elements of state
it keeps for that tensor), e.g.
``step_cost = staticmethod(lambda shape: 10.0 * math.prod(shape))``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["ELEMENTWISE_FLOPS", "NEWTON_SCHULZ_STEPS", "state_numel", "step_cost"]

#: Newton-Schulz iterations of a Muon step (torch's and Keller Jordan's default).
NEWTON_SCHULZ_STEPS = 5
#: Flops per element of an element-wise step (Adam's update, about ten operations).
ELEMENTWISE_FLOPS = 10.0
#: Element-wise classes that keep two tensors per element (first and second moments).
_TWO_MOMENTS = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Lamb", "Lion")


def _kind(optimizer_class: type) -> str:
    name = optimizer_class.__name__.lower()
    for kind in ("muon", "shampoo", "soap", "adafactor"):
        if kind in name:
            return "shampoo" if kind == "soap" else kind
    return "elementwise"


def _matrix(shape: Sequence[int]) -> tuple[int, int]:
    """Return ``shape`` as a matrix ``(rows, columns)`` (a vector is one row)."""
    if len(shape) < 2:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def step_cost(optimizer_class: type, shape: Sequence[int]) -> float:
    """Return the flops of one step of ``optimizer_class`` on a tensor of ``shape`` (the module's model).

    Args:
        optimizer_class: the class that steps the tensor; its ``step_cost(shape)``, if it has one, wins.
        shape: the tensor's shape.

    Returns:
        The cost, in flops.

    Example:
        >>> import torch
        >>> step_cost(torch.optim.AdamW, (1024, 4096))  # ten per element
        41943040.0
        >>> round(step_cost(torch.optim.Muon, (4096, 4096)) / step_cost(torch.optim.Muon, (1024, 4096)), 2)
        21.33
    """
    own = getattr(optimizer_class, "step_cost", None)
    if callable(own):
        return float(own(tuple(shape)))
    numel = math.prod(shape)
    kind = _kind(optimizer_class)
    if kind == "muon" and len(shape) >= 2:
        rows, cols = _matrix(shape)
        small, big = min(rows, cols), max(rows, cols)
        return float(NEWTON_SCHULZ_STEPS * (4 * big * small**2 + 2 * small**3))
    if kind == "shampoo" and len(shape) >= 2:
        rows, cols = _matrix(shape)
        return float(rows**3 + cols**3) + ELEMENTWISE_FLOPS * numel
    return ELEMENTWISE_FLOPS * numel


def state_numel(optimizer_class: type, shape: Sequence[int]) -> int:
    """Return the elements of state ``optimizer_class`` keeps for a tensor of ``shape`` (the module's model).

    Args:
        optimizer_class: the class that steps the tensor; its ``state_numel(shape)``, if it has one, wins.
        shape: the tensor's shape.

    Returns:
        The number of state elements (scalars such as a step count left out).

    Example:
        >>> import torch
        >>> state_numel(torch.optim.AdamW, (4, 8)), state_numel(torch.optim.Muon, (4, 8))
        (64, 32)
        >>> state_numel(torch.optim.Adafactor, (4, 8))
        12
    """
    own = getattr(optimizer_class, "state_numel", None)
    if callable(own):
        return int(own(tuple(shape)))
    numel = math.prod(shape)
    kind = _kind(optimizer_class)
    if kind == "adafactor" and len(shape) >= 2:
        return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
    if kind == "shampoo" and len(shape) >= 2:
        rows, cols = _matrix(shape)
        return rows**2 + cols**2 + numel
    if kind == "elementwise" and optimizer_class.__name__ in _TWO_MOMENTS:
        return 2 * numel
    return numel
