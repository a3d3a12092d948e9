"""torchao's module swaps and quantization run on a flattened model as on the plain one (not importing it).

torchao's ``quantize_`` (post-training quantization and ``QATConfig``), its
legacy QAT quantizers' ``prepare``/``convert`` and float8 training's
``convert_to_float8_training`` swap modules with ``new.weight = old.weight``
and replace weights by quantized tensor subclasses. In flat mode ``old.weight``
is a view of the flat buffer, which torch refuses as a parameter
(``cannot assign 'torch.FloatTensor' as parameter 'weight'``), and a
quantized tensor cannot live in a flat buffer. So each of these entry points,
called on a module that holds a flattened storage in flat mode, runs inside
``storage.unflattened()``, where the model is a plain one: when the block ends,
a swapped-in module that re-hosts a parameter takes over its slot (a change of
owner: same flat parameters, no dead space) and a quantized weight leaves the
storage with a warning (``_install/rehost.py``). While a feature holds the
layout (``features.refuse_held_layout``: disk offload, a ``ShardedOptimizer``,
live ensemble stacks) the call is refused before the model changes; mixed
precision and gradient sync follow the new layout. :func:`patch` wraps them
(``flatten_parametrize/_outside.py`` lists them and runs it as soon as
torchao's modules are imported).

What is wrapped is what those entry points call through their module's
globals (``quant_api._replace_with_custom_fn_if_matches_filter``, the walk
that ``quantize_`` makes over the model; ``float8_linear_utils.swap_linear_layers``)
and the quantizers' methods, so a ``quantize_`` imported by name before
``flatten_parametrize`` is covered too. A call nested in a wrapped one (the walk
recurses) runs as is.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import ExitStack
from types import ModuleType
from typing import Any, Callable

from torch import nn

from .features import refuse_held_layout
from .names import library_state, registered_storage
from .on_import import is_ours, wrapper_of

__all__ = ["flat_storages_in", "patch"]

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
#: The start of the dead-space warning of ``_install/dead_space.py``.
_DEAD_SPACE = "a submodule replaced after registration leaves"
#: Depth of wrapped calls running in this thread (a nested one runs as is).
_running = threading.local()


def flat_storages_in(model: Any) -> list[Any]:
    """Return the storages in flat mode that hold parameters of ``model`` (registered, wrapping or inner)."""
    if not isinstance(model, nn.Module):
        return []
    found: dict[int, Any] = {}
    for module in model.modules():
        state = library_state(module)
        for core in (registered_storage(module), None if state is None else state.storage):
            if core is not None and core.is_flattened:
                found[id(core)] = core
    return list(found.values())


def _wrap(original: Callable[..., Any], model_at: int, what: str) -> Callable[..., Any]:
    def swap_on_plain_model(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_running, "depth", 0)
        model = args[model_at] if len(args) > model_at else kwargs.get("model", kwargs.get("module"))
        storages = [] if depth else flat_storages_in(model)
        for storage in storages:  # before the swap changes anything (flatten() would refuse after it)
            refuse_held_layout(storage, what)
        _running.depth = depth + 1
        try:
            with ExitStack() as stack:
                for storage in storages:
                    stack.enter_context(storage.unflattened())
                if storages:  # what a swap leaves dead is reclaimed when the block ends
                    stack.enter_context(warnings.catch_warnings())
                    warnings.filterwarnings("ignore", message=_DEAD_SPACE)
                return original(*args, **kwargs)
        finally:
            _running.depth = depth

    return wrapper_of(original, swap_on_plain_model)


def patch(module: ModuleType) -> None:
    """Wrap the entry point of torchao's ``module`` (the legacy QAT quantizers' methods in theirs), once."""
    name = _FUNCTIONS.get(module.__name__)
    if name is None:
        _patch_quantizers(module)
        return
    original = getattr(module, name, None)
    if callable(original) and not is_ours(original):
        setattr(module, name, _wrap(original, 0, _ENTRY_POINTS[module.__name__]))


def _patch_quantizers(module: ModuleType) -> None:
    for cls in list(vars(module).values()):
        if not isinstance(cls, type) or cls.__module__ != module.__name__:
            continue
        for method in ("prepare", "convert"):
            original = cls.__dict__.get(method)
            if callable(original) and not is_ours(original):
                what = f"torchao's {cls.__name__}.{method}"
                setattr(cls, method, _wrap(original, 1, what))  # (self, model, ...)
