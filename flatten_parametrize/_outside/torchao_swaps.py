"""torchao's module swaps and quantization run on a flattened model as on the plain one (not importing it).

torchao's ``quantize_`` (post-training quantization and ``QATConfig``), its
legacy QAT quantizers' ``prepare``/``convert`` and float8 training's
``convert_to_float8_training`` swap modules with ``new.weight = old.weight``
and replace weights by quantized tensor subclasses. In flat mode ``old.weight``
is a view of the flat buffer, which torch refuses as a parameter
(``cannot assign 'torch.FloatTensor' as parameter 'weight'``), and a
quantized tensor cannot live in a flat buffer. So each of these entry points
runs on the plain model (``plain_calls.py``: inside ``storage.unflattened()``
for a module that holds a flattened storage in flat mode, refused first while a
feature holds the layout): when the block ends, a swapped-in module that
re-hosts a parameter takes over its slot (a change of owner: same flat
parameters, no dead space) and a quantized weight leaves the storage with a
warning (``_install/rehost.py``). :func:`patch` wraps them
(``flatten_parametrize/_outside/registry.py`` lists them and runs it as soon as
torchao's modules are imported).

What is wrapped is what those entry points call through their module's
globals (``quant_api._replace_with_custom_fn_if_matches_filter``, the walk
that ``quantize_`` makes over the model; ``float8_linear_utils.swap_linear_layers``)
and the quantizers' methods, so a ``quantize_`` imported by name before
``flatten_parametrize`` is covered too. A call nested in a wrapped one (the walk
recurses) runs as is.
"""

from __future__ import annotations

from types import ModuleType

from .on_import import is_ours
from .plain_calls import on_plain_model

__all__ = ["patch"]

#: module -> the function that its entry points call to change the model (its first argument).
_FUNCTIONS = {
    "torchao.quantization.quant_api": "_replace_with_custom_fn_if_matches_filter",
    "torchao.float8.float8_linear_utils": "swap_linear_layers",
}
#: module -> the user's entry point into it, for error messages.
_ENTRY_POINTS = {
    "torchao.quantization.quant_api": "torchao's quantize_",
    "torchao.float8.float8_linear_utils": "torchao's convert_to_float8_training",
}


def patch(module: ModuleType) -> None:
    """Wrap the entry point of torchao's ``module`` (the legacy QAT quantizers' methods in theirs), once."""
    name = _FUNCTIONS.get(module.__name__)
    if name is None:
        _patch_quantizers(module)
        return
    original = getattr(module, name, None)
    if callable(original) and not is_ours(original):
        setattr(module, name, on_plain_model(original, 0, _ENTRY_POINTS[module.__name__]))


def _patch_quantizers(module: ModuleType) -> None:
    for cls in list(vars(module).values()):
        if not isinstance(cls, type) or cls.__module__ != module.__name__:
            continue
        for method in ("prepare", "convert"):
            original = cls.__dict__.get(method)
            if callable(original) and not is_ours(original):
                what = f"torchao's {cls.__name__}.{method}"
                setattr(cls, method, on_plain_model(original, 1, what))  # (self, model, ...)
