"""What ``ShardedOptimizer`` can shard, decided when it is built: one rule per optimizer class.

A rank steps its own part of the model alone, so:

* **Cuts.** A slice cut through a tensor is stepped like the whole only by an
  element-wise class: with ``whole_tensors=True`` only the listed element-wise
  classes (``ALLOWED_OPTIMIZERS``) may be cut between ranks; every other class
  gets its tensors whole, whatever ``allow_unlisted`` says (it vouches for a class
  being element-wise where each rank must step slices).
* **Settings read when constructed.** A param group's setting reaches the class
  where the class reads it: each inner optimizer is constructed with its group's
  settings that name a parameter of the class's constructor
  (:func:`construction_kwargs`; pytorch_optimizer's Shampoo reads
  ``preconditioning_compute_steps`` there, timm's Lamb ``max_grad_norm`` from its
  defaults), one inner optimizer per class and such settings. The one inner
  optimizer over slices cannot: a group setting that its class keeps outside its
  param groups is refused there (:func:`check_slice_settings`).
* **Steps that read several tensors.** A class whose step of a tensor reads the
  others (a step size estimated from all of them, as Prodigy's and D-Adaptation's;
  a norm over every gradient, as the Lambs' global clip) would step each rank's
  tensors by another value than one process does, and a class that needs a
  closure would run forward and backward on the ranks that own its tensors only.
  :func:`check_steps_alone` steps the class on two small tensors together and each
  alone and refuses it if they differ or if it needs a closure: the rule is the
  class's behaviour, not a list (known settings that turn it on get a message
  naming them, :func:`check_known_settings`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._core.grad.owner import set_grad

__all__ = [
    "ALLOWED_OPTIMIZERS",
    "check_known_settings",
    "check_slice_settings",
    "check_steps_alone",
    "construction_kwargs",
    "cuttable",
]

#: Optimizers whose update of an element depends only on that element's gradient and state
#: (so that a slice cut through parameters is stepped exactly like the whole).
ALLOWED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
)

#: Optimizers whose math reads across their tensors while a setting is on: (module, class name) ->
#: (the setting, its value that turns it off). Both Lambs scale every gradient by the norm of all of them.
_ACROSS_WHEN_ON = {
    ("timm.optim.lamb", "Lamb"): ("max_grad_norm", None),
    ("pytorch_optimizer.optimizer.lamb", "Lamb"): ("pre_norm", False),
}

#: The way out for a class that cannot step a rank's tensors alone.
_WAY_OUT = (
    "train it without ShardedOptimizer: gradient sync (storage.enable_grad_sync()) with the optimizer "
    "over model.parameters() in per-tensor mode (storage.unflatten()) steps every tensor on every rank"
)


def cuttable(optimizer_class: type) -> bool:
    """Return whether ``whole_tensors=True`` may cut a tensor of ``optimizer_class`` between ranks."""
    return optimizer_class in ALLOWED_OPTIMIZERS


def _init_parameters(optimizer_class: type) -> set[str]:
    """Return the names of the keyword parameters of the class's constructor (not ``params``)."""
    try:
        signature = inspect.signature(optimizer_class.__init__)  # type: ignore[misc]
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {
        name for name, p in signature.parameters.items() if p.kind in kinds and name not in ("self", "params")
    }


def construction_kwargs(
    optimizer_class: type, base: Mapping[str, Any], group: Mapping[str, Any]
) -> dict[str, Any]:
    """Return the keyword arguments to construct ``optimizer_class`` with for ``group``.

    ``base`` (the constructor's keyword arguments, for its own class), then each
    setting of ``group`` that names a parameter of the class's constructor.
    """
    names = _init_parameters(optimizer_class)
    return {**base, **{k: v for k, v in group.items() if k in names}}


def check_slice_settings(
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: Mapping[str, Any],
    groups: Sequence[Mapping[str, Any]],
) -> None:
    """Refuse a group setting that the one inner optimizer over slices would not read (slices).

    A setting the class keeps outside its param groups (a constructor parameter
    missing from its ``defaults``) is read when it is constructed, with the
    constructor's ``kwargs``: a group's other value would not take effect.

    Raises:
        ValueError: naming the group, the setting and the way that works.
    """
    names = _init_parameters(optimizer_class)
    settings = {k for g in groups for k in g if k in names and k != "params"}
    if not settings:
        return
    probe = optimizer_class([torch.zeros(1, requires_grad=True)], **kwargs)
    for i, group in enumerate(groups):
        for key in sorted(settings - set(probe.defaults)):
            if key in group and group[key] != kwargs.get(key, _default(optimizer_class, key)):
                raise ValueError(
                    f"ShardedOptimizer: {optimizer_class.__qualname__} reads {key} when it is constructed, "
                    f"not from its param groups, so param group {i}'s {key}={group[key]!r} would not take "
                    f"effect; pass {key}= to ShardedOptimizer (every group then has it), or pass "
                    "whole_tensors=True (per-tensor mode), where each group's class is constructed with "
                    "its group's settings"
                )


def _default(optimizer_class: type, key: str) -> Any:
    try:
        parameter = inspect.signature(optimizer_class.__init__).parameters.get(key)  # type: ignore[misc]
    except (TypeError, ValueError):
        return None
    return None if parameter is None else parameter.default


def check_known_settings(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer set to read across its tensors by a known setting (a Lamb's global clip).

    Raises:
        ValueError: naming the setting and the value that turns it off.
    """
    cls = type(optimizer)
    rule = _ACROSS_WHEN_ON.get((cls.__module__, cls.__name__))
    if rule is None:
        return
    setting, off = rule
    value = optimizer.defaults.get(setting, getattr(optimizer, setting, off))
    if value != off:
        raise ValueError(
            "ShardedOptimizer(whole_tensors=True) steps each rank's own tensors, so their optimizer must not "
            f"read across tensors; {cls.__module__}.{cls.__name__} with {setting}={value!r} scales every "
            f"gradient by the norm of all its tensors, which no rank holds; pass {setting}={off!r} and call "
            "opt.clip_grad_norm_(max_norm), which clips by the norm over every rank"
        )


def _probe_shapes(shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Return two small shapes of the ranks of the group's first tensors (distinct sizes)."""
    ranks = [len(s) for s in shapes[:2]] or [2]
    if len(ranks) == 1:
        ranks.append(ranks[0])
    return [tuple(3 + i + j for j in range(rank)) for i, rank in enumerate(ranks)]


def _run(
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: Mapping[str, Any],
    starts: Sequence[Tensor],
    grads: Sequence[Sequence[Tensor]],
    closure: bool,
) -> list[Tensor]:
    """Step ``optimizer_class`` over copies of ``starts`` with ``grads``; return the updates."""
    params = [torch.nn.Parameter(t.clone()) for t in starts]
    opt = optimizer_class(params, **kwargs)
    for step in grads:
        for p, g in zip(params, step):
            set_grad(p, g.clone())
        loss = float(sum(float((p.detach() * g).sum()) for p, g in zip(params, step)))  # a linear model's
        if closure:
            opt.step(functools.partial(float, loss))
        else:
            opt.step()
    return [(p.detach() - t) for p, t in zip(params, starts)]


def _together(
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: Mapping[str, Any],
    starts: Sequence[Tensor],
    grads: Sequence[Sequence[Tensor]],
) -> tuple[list[Tensor] | None, bool]:
    """Step the class on every tensor at once: the updates (``None``: it failed), whether with a closure."""
    for closure in (False, True):
        try:
            with torch.no_grad():
                return _run(optimizer_class, kwargs, starts, grads, closure), closure
        except Exception:  # not without a closure; or not these tensors: the real ones will say
            continue
    return None, False


def check_steps_alone(
    optimizer_class: type[torch.optim.Optimizer], kwargs: Mapping[str, Any], shapes: Sequence[Sequence[int]]
) -> None:
    """Refuse a class whose step of a tensor reads other tensors, or that needs a closure.

    Steps the class (constructed with ``kwargs``) five times on two small
    tensors of the ranks of ``shapes`` together, then each alone, with the same
    gradients (a steady direction with noise, the second's a hundred times the
    first's, so that whatever mixes them shows): the updates must agree (to a
    millionth of their size). A class that fails on those tensors for another
    reason is left to the real ones, and so is one that draws random numbers in
    its step (PSGD's Kron): the two runs draw different ones.

    Raises:
        ValueError: naming the class and the way out.
    """
    if cuttable(optimizer_class):
        return
    gen = torch.Generator().manual_seed(0)
    starts = [torch.randn(shape, generator=gen) for shape in _probe_shapes(shapes)]
    # a steady direction with some noise: step-size estimators (Prodigy, D-Adaptation) see progress
    steady = [torch.randn(t.shape, generator=gen) * 100**i for i, t in enumerate(starts)]
    grads = [
        [g + 0.1 * torch.randn(g.shape, generator=gen) * g.abs().mean() for g in steady] for _ in range(5)
    ]
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    rng = torch.get_rng_state()
    try:
        together, closure = _together(optimizer_class, kwargs, starts, grads)
        drew = not torch.equal(rng, torch.get_rng_state())
    finally:
        torch.set_rng_state(rng)  # the user's random numbers go on as if nothing had run
    if together is None or drew:
        return
    if closure:
        raise ValueError(
            f"ShardedOptimizer steps each rank's own tensors, so their optimizer must step without a "
            f"closure; {name} needs one (it evaluates the loss inside its step), and the ranks that own "
            f"none of its tensors would not run it; {_WAY_OUT}"
        )
    alone = [
        _run(optimizer_class, kwargs, [t], [[g[i]] for g in grads], False)[0] for i, t in enumerate(starts)
    ]
    for both, one in zip(together, alone):
        scale = max(float(both.abs().max()), float(one.abs().max()), 1e-30)
        if float((both - one).abs().max()) > 1e-6 * scale:
            raise ValueError(
                "ShardedOptimizer(whole_tensors=True) steps each rank's own tensors, so their optimizer "
                f"must step each tensor from its own gradient and state; {name} does not: stepped on two "
                "tensors together it updates each differently than stepped on each alone (its step reads "
                "across tensors, e.g. a step size or a gradient norm over all of them); give its tensors "
                f"an optimizer class that steps each alone, or {_WAY_OUT}"
            )
