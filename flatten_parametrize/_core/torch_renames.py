"""torch's hook-based reparametrizations run on a flattened model as on the plain one.

``torch.nn.utils.weight_norm`` and ``spectral_norm`` (the forward-pre-hook
versions, still common in audio and GAN code) and ``torch.nn.utils.prune`` take
a weight off ``module._parameters`` and register parameters under other names:
``weight_g`` and ``weight_v`` (new ones), ``weight_orig`` (the same
``nn.Parameter``); a forward pre-hook computes a plain ``module.weight`` from
them. Their ``remove`` counterparts put one parameter back. In flat mode a
flattened weight is a view in no ``_parameters``, and torch fails with
``KeyError: 'weight'`` or ``cannot assign 'torch.FloatTensor' object to
parameter 'weight_orig'``. So each of them, called on a module that holds a
flattened storage in flat mode, runs on the plain model (``plain_calls.py``);
when the block ends the groups are laid out again as the model now is: a
parameter under a new name keeps its slot (``weight_orig``), a weight taken off
leaves its slot (no dead space), and new parameters (``weight_g``,
``weight_v``, the weight ``remove`` puts back) are ordinary parameters of their
module, as a new module's are (state dicts, gradient sync and removal see
them). In per-tensor mode the modules are plain already: the calls run as is.

What is wrapped are the methods every entry point calls (``WeightNorm.apply``
and ``remove``, ``SpectralNorm.apply`` and ``remove``,
``BasePruningMethod.apply``, which each pruning method's ``apply`` calls, and
``remove``), so functions imported by name before the package are covered.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .on_import import is_ours
from .plain_calls import on_plain_model

__all__ = ["METHODS", "patch"]

#: module -> (class, method, how the user reaches it) of each method wrapped.
METHODS = {
    "torch.nn.utils.weight_norm": (
        ("WeightNorm", "apply", "torch.nn.utils.weight_norm"),
        ("WeightNorm", "remove", "torch.nn.utils.remove_weight_norm"),
    ),
    "torch.nn.utils.spectral_norm": (
        ("SpectralNorm", "apply", "torch.nn.utils.spectral_norm"),
        ("SpectralNorm", "remove", "torch.nn.utils.remove_spectral_norm"),
    ),
    "torch.nn.utils.prune": (
        ("BasePruningMethod", "apply", "torch.nn.utils.prune"),
        ("BasePruningMethod", "remove", "torch.nn.utils.prune.remove"),
    ),
}


def patch(module: ModuleType) -> None:
    """Wrap the methods of :data:`METHODS` in ``module``, once (a static or class method stays one)."""
    for cls_name, name, what in METHODS.get(module.__name__, ()):
        cls = getattr(module, cls_name, None)
        raw: Any = None if cls is None else cls.__dict__.get(name)
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        function = raw.__func__ if kind is not None else raw
        if not callable(function) or is_ours(function):
            continue
        model_at = 0 if kind is staticmethod else 1  # after ``cls`` or ``self``
        wrapped = on_plain_model(function, model_at, what)
        setattr(cls, name, kind(wrapped) if kind is not None else wrapped)
