"""Wrappers around a model: registering on one registers on the model it wraps.

peft's ``PeftModel`` (``base_model.model``), DDP's ``.module`` and a compiled
model's ``_orig_mod`` hold every parameter under one child, as does a plain
module around a Hugging Face model. Registering on the wrapper itself would
leave the wrapped model without parameters of its own, and its own code
(transformers' ``model.device``, ``generate()``, peft's ``merge_and_unload()``)
breaks. So registration goes to the wrapped model.

Only those: an ordinary module whose parameters all sit under one child
(``self.layers = nn.Sequential(...)``) keeps its flat parameters on itself.
"""

from __future__ import annotations

from torch import nn

from .._core.names import STORAGE_ATTR
from .grouping import GroupSpec, SlotSpec

__all__ = ["registration_target", "strip_prefix"]

_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def _is_wrapper(module: nn.Module) -> bool:
    """A module that only forwards to the model it wraps."""
    return (
        isinstance(module, _PARALLEL)
        or type(module).__name__ == "OptimizedModule"  # torch.compile
        or hasattr(module, "peft_config")  # peft's PeftModel and its tuners (LoraModel, ...)
    )


def _is_pretrained_model(module: nn.Module) -> bool:
    """A Hugging Face model, whose own code reads ``next(self.parameters())`` (checked by class name)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def registration_target(module: nn.Module) -> tuple[nn.Module, str]:
    """Return the module that a storage registered on ``module`` lives on, and its path prefix.

    Starting at ``module``: while it has no storage and no parameter of its
    own, exactly one child holds parameters, and either ``module`` is a
    wrapper (peft, ``DistributedDataParallel``, ``DataParallel``,
    ``torch.compile``) or that child is a Hugging Face ``PreTrainedModel``,
    step into that child. The prefix is the path walked with a trailing dot
    (``"base_model.model."``), or ``""`` when ``module`` itself is the target.

    Example:
        >>> wrapped = nn.parallel.DataParallel(nn.Linear(2, 2))
        >>> target, prefix = registration_target(wrapped)
        >>> target is wrapped.module, prefix
        (True, 'module.')
        >>> registration_target(nn.Sequential(nn.Sequential(nn.Linear(2, 2))))[1]  # not a wrapper
        ''
    """
    prefix = ""
    while STORAGE_ATTR not in module.__dict__ and all(p is None for p in module._parameters.values()):
        holders = [(n, c) for n, c in module.named_children() if next(c.parameters(), None) is not None]
        if len(holders) != 1 or not (_is_wrapper(module) or _is_pretrained_model(holders[0][1])):
            break
        name, module = holders[0]
        prefix += name + "."
    return module, prefix


def strip_prefix(specs: list[GroupSpec], prefix: str) -> list[GroupSpec]:
    """Make the names of ``specs`` (resolved against the wrapper) relative to the wrapped model."""
    if not prefix:
        return specs
    return [
        GroupSpec(spec.name, [SlotSpec(s.param, [n[len(prefix) :] for n in s.names]) for s in spec.slots])
        for spec in specs
    ]
