"""Warn when timm's weight-decay rule by ``ndim`` is applied to a flattened model (timm is not imported here).

timm's ``param_groups_weight_decay(model, weight_decay)`` (also what
``create_optimizer_v2(model, weight_decay=...)`` calls) puts ``ndim <= 1``
parameters and ``.bias`` names on the side without decay. On a flattened
model every flat parameter is one-dimensional, so nothing decays, not even
the matrices the plain model decays. timm 1.0.31 then drops the empty decay
group and builds the optimizer with ``weight_decay=0``: the optimizer keeps
no trace of the decay asked for, so the step check of ``_guards/decay_check.py``
cannot see it. This wrapper looks where the rule is applied: it warns (the
rule, the tensors, the fix) when ``weight_decay > 0`` was asked for a module
whose flat parameters (in flat mode) hold matrices that then get no decay.
:func:`patch` wraps ``timm.optim._param_groups.param_groups_weight_decay``
and the modules that imported it by name (``flatten_parametrize/_outside/registry.py``
lists it and runs it as soon as timm's optimizer package is imported).
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType
from typing import Any, Callable

from torch import nn

from .._core.flat_parameter import FlatParameter
from .on_import import is_ours, wrapper_of

__all__ = ["patch"]

_USERS = ("timm.optim._optim_factory", "timm.optim", "timm.optim.optim_factory")


def patch(module: ModuleType) -> None:
    """Wrap timm's ``timm.optim._param_groups.param_groups_weight_decay`` and its imports by name, once."""
    original = getattr(module, "param_groups_weight_decay", None)
    if original is None or is_ours(original):
        return
    wrapped = _wrap(original)
    module.param_groups_weight_decay = wrapped  # type: ignore[attr-defined]
    for name in _USERS:  # modules that imported it by name before this patch ran
        user = sys.modules.get(name)
        if user is not None and getattr(user, "param_groups_weight_decay", None) is original:
            user.param_groups_weight_decay = wrapped  # type: ignore[attr-defined]


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def param_groups_weight_decay(model: Any, weight_decay: Any = 1e-5, *args: Any, **kwargs: Any) -> Any:
        groups = original(model, weight_decay, *args, **kwargs)
        try:
            message = _message(model, weight_decay, groups)
        except Exception:  # never in the way of building an optimizer
            message = None
        if message is not None:
            warnings.warn(message, UserWarning, stacklevel=2)
        return groups

    return wrapper_of(original, param_groups_weight_decay)


def _message(model: Any, weight_decay: Any, groups: Any) -> str | None:
    if not isinstance(model, nn.Module) or not weight_decay or float(weight_decay) <= 0:
        return None
    decayed = {id(p) for g in groups if float(g.get("weight_decay", 0.0)) > 0 for p in g.get("params", ())}
    for param in model.parameters():
        if isinstance(param, FlatParameter) and param.requires_grad and id(param) not in decayed:
            names, shapes, _ = param.metadata()
            for name, shape in zip(names, shapes):
                if len(shape) >= 2:
                    return (
                        "weight decay: a rule by p.dim() (timm's param_groups_weight_decay, which "
                        "create_optimizer_v2(model, weight_decay=...) calls: ndim <= 1 or "
                        "name.endswith('.bias') does not decay) sees only one-dimensional flat parameters "
                        "and decays none of the matrices the plain model decays: "
                        f"weight_decay={weight_decay} was asked for, and the flat parameter holding "
                        f"'{name}' {tuple(shape)} gets none. "
                        "Fix: register with groups=weight_decay_groups(model, no_decay=lambda name, p: "
                        "p.ndim <= 1 or name.endswith('.bias')) and pass create_optimizer_v2 the param "
                        "groups by group name ([{'params': [storage['decay']], 'weight_decay': wd}, "
                        "{'params': [storage['no_decay_bias']], 'weight_decay': 0.0}]), or train in "
                        "per-tensor mode (storage.unflatten() before building the optimizer). See 'Weight "
                        "decay by p.dim() or by name' in docs/good-to-know.md."
                    )
    return None
