"""torch's reparametrizations of a weight run on a flattened model as on the plain one.

``torch.nn.utils.weight_norm`` and ``spectral_norm`` (the forward-pre-hook
versions, still common in audio and GAN code) and ``torch.nn.utils.prune`` take
a weight off ``module._parameters`` and register parameters under other names:
``weight_g`` and ``weight_v`` (new ones), ``weight_orig`` (the same
``nn.Parameter``); a forward pre-hook computes a plain ``module.weight`` from
them. ``torch.nn.utils.parametrize.register_parametrization`` (which
``torch.nn.utils.parametrizations``' ``weight_norm``, ``orthogonal`` and
``spectral_norm`` call) moves it to ``parametrizations.weight.original``. Their
``remove`` counterparts put one parameter back. In flat mode a flattened weight
is a view in no ``_parameters``: torch fails with ``KeyError: 'weight'`` or
``cannot assign 'torch.FloatTensor' object to parameter 'weight_orig'``, a
parametrization on a flattened attribute is refused, and
``remove_parametrizations`` of one registered before the storage put the view
back as a buffer (the weight silently stopped training). So each of them,
called on a module that holds a flattened storage in flat mode, runs on the
plain model (``plain_calls.py``); when the block ends the groups are laid out
again as the model now is: a parameter under a new name keeps its slot
(``weight_orig``, ``parametrizations.weight.original``), a weight taken off
leaves its slot (no dead space), and new parameters (``weight_g``,
``weight_v``, ``original0``, the weight ``remove`` puts back) are ordinary
parameters of their module, as a new module's are (state dicts, gradient sync
and removal see them). In per-tensor mode the modules are plain already: the
calls run as is.

What is wrapped are the methods every hook-based entry point calls
(``WeightNorm.apply`` and ``remove``, ``SpectralNorm.apply`` and ``remove``,
``BasePruningMethod.apply``, which each pruning method's ``apply`` calls, and
``remove``), so functions imported by name before the package are covered, and
``parametrize``'s two functions, which torch's parametrizations look up in
their module (a name imported from it before the package is not covered).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from torch import nn

from .._core.parametrize_interop import FlatViewList, HiddenParametrizations
from .._install.module_classes import own_class
from .on_import import is_ours, wrapper_of
from .plain_calls import Methods, wrap_methods

__all__ = ["METHODS", "patch"]

#: module -> (class or ``""`` for the module, function, how the user reaches it) of each function wrapped.
METHODS: Methods = {
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
    "torch.nn.utils.parametrize": (
        ("", "register_parametrization", "torch.nn.utils.parametrize.register_parametrization"),
        ("", "remove_parametrizations", "torch.nn.utils.parametrize.remove_parametrizations"),
    ),
}


def patch(module: ModuleType) -> None:
    """Wrap the methods of :data:`METHODS` in ``module``, once (a static or class method stays one).

    In ``parametrize`` also wrap ``_inject_property``, which adds the property of a new
    parametrization to ``module.__class__``: a module whose class the library shares
    (``module_classes.make_class``) gets a class of its own first. That covers the
    ``register_parametrization`` imported by name before the package, which runs on the
    flattened module itself.
    """
    wrap_methods(module, METHODS, {"register_parametrization": _refuse_on_a_view})
    inject = getattr(module, "_inject_property", None)
    if module.__name__ == "torch.nn.utils.parametrize" and callable(inject) and not is_ours(inject):
        module._inject_property = _own_class_first(inject)  # type: ignore[attr-defined]


def _own_class_first(inject: Callable[[nn.Module, str], None]) -> Callable[..., Any]:
    def _inject_property(module: nn.Module, tensor_name: str) -> None:
        own_class(module)
        inject(module, tensor_name)

    return wrapper_of(inject, _inject_property)


def _refuse_on_a_view(module: nn.Module, tensor_name: str, *args: Any, **kwargs: Any) -> None:
    """Refuse, before anything changes, a parametrization on a view that torch's own container serves.

    A module parametrized before registration holds the library's views in torch's
    container, in both modes (``parametrize_interop.FlatViewList``): the call would be
    refused inside ``unflattened()``, after the switch.
    """
    container = module.__dict__.get("parametrizations", module._modules.get("parametrizations"))
    if container is None or isinstance(container, HiddenParametrizations):  # the library's alone: runs
        return
    if isinstance(container._modules.get(tensor_name), FlatViewList):
        container._modules[tensor_name].append(None)  # its refusal, naming the attribute
