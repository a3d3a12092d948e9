"""Weight-decay groups whose flat parameters a name-based decay rule classifies like the plain model's."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable
from typing import Union

import torch
from torch import nn

from ._api import registered_core
from ._install.grouping import collect_names
from ._install.reuse import plain_parameters
from ._install.wrappers import registration_target

__all__ = ["DECAY_GROUP", "NO_DECAY_GROUP", "NoDecayRule", "weight_decay_groups"]

NoDecayRule = Union[None, str, Iterable[str], Callable[[str, nn.Parameter], bool]]

#: Name of the group whose parameters decay (its flat parameter is ``flat_param_decay``).
DECAY_GROUP = "decay"
#: Name of the group whose parameters do not decay. It contains ``"bias"``, the
#: substring that transformers' ``Trainer`` (every version) excludes from weight
#: decay by name, so ``flat_param_no_decay_bias`` lands in Trainer's no-decay group.
NO_DECAY_GROUP = "no_decay_bias"

# transformers.Trainer.get_decay_parameter_names: parameters of nn.LayerNorm
# modules, and names (lowercased) matching one of these, do not decay.
_NORM_TYPES = (nn.LayerNorm,)
_NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


_Rule = Callable[[list[str], nn.Parameter], bool]


def _transformers_rule(module: nn.Module) -> _Rule:
    # By path, not sub.parameters(): a flattened module's norm layers hold views, not parameters.
    modules = module.named_modules(remove_duplicate=False)
    norms = tuple(path + "." for path, sub in modules if isinstance(sub, _NORM_TYPES))
    return lambda names, _: names[0].startswith(norms) or _NO_DECAY_NAMES.search(names[0].lower()) is not None


def _rule(module: nn.Module, no_decay: NoDecayRule) -> _Rule:
    """Return ``(names of one parameter, parameter) -> True if it does not decay``."""
    if no_decay is None:
        return _transformers_rule(module)
    if callable(no_decay):
        predicate = no_decay
        return lambda names, param: bool(predicate(names[0], param))
    patterns = [no_decay] if isinstance(no_decay, str) else no_decay
    if not isinstance(patterns, Iterable) or isinstance(patterns, bytes):
        raise TypeError(
            "no_decay must be None, a callable (name, param) -> bool, a glob or an iterable "
            f"of globs; got {type(no_decay).__name__} {no_decay!r}"
        )
    globs = list(patterns)
    for glob in globs:
        if not isinstance(glob, str):
            raise TypeError(
                f"no_decay globs must be str; got {type(glob).__name__} {glob!r}; write e.g. "
                "no_decay=['*.bias', '*norm*']"
            )
    return lambda names, param: any(fnmatch.fnmatchcase(n, glob) for n in names for glob in globs)


def weight_decay_groups(module: nn.Module, *, no_decay: NoDecayRule = None) -> dict[str, list[nn.Parameter]]:
    """Split the parameters of ``module`` into groups that decay and groups that do not.

    Pass the result to :func:`register_flat_storage`. The groups are named so
    that the flat parameters carry what a name-based decay rule looks for:
    ``flat_param_decay`` holds the parameters that decay and
    ``flat_param_no_decay_bias`` those that do not (the ``"bias"`` in its name
    is what transformers' ``Trainer`` excludes from weight decay). So a
    ``Trainer(args=TrainingArguments(weight_decay=...))`` that builds its own
    optimizer trains the flattened model with the plain model's math. Each
    side is split further by (device, dtype, requires_grad) as
    ``groups=None`` does, the extra groups getting a suffix ``_1``, ``_2``,
    ... in first-seen order; a side with no parameters is left out.

    Args:
        module: the module to register. On a module that already has a flat
            storage, the groups are made of its plain parameters (the objects
            registration flattened), for ``register_flat_storage(...,
            exist_ok=True)``.
        no_decay: which parameters do not decay. ``None`` (default):
            transformers' own rule, i.e. parameters of ``nn.LayerNorm``
            modules and every parameter whose lowercased qualified name
            contains ``bias``, ``layernorm`` or ``rmsnorm`` or has a ``norm``
            or ``*_norm`` component. A callable ``(name, param) -> bool``
            (``name`` is the first qualified name of a tied parameter), or a
            ``fnmatch`` glob or iterable of globs matched against every
            qualified name of the parameter (e.g. ``["*.bias", "*norm*"]``).
            Rules by dimension are callables on the plain parameters:
            nanoGPT's ``lambda name, p: p.dim() < 2``, timm's ``lambda name,
            p: p.ndim <= 1 or name.endswith(".bias")``; build the optimizer's
            param groups from the group names then (``storage["decay"]``,
            ``storage["no_decay_bias"]``), since such a rule applied to the
            flattened model sees only one-dimensional flat parameters (the
            library warns before the first step of an optimizer built so).

    Returns:
        A dict ``group name -> parameters`` in module order, for the ``groups``
        argument of :func:`register_flat_storage`.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module`` or ``no_decay`` has a
            wrong type.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from flatten_parametrize import register_flat_storage
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        >>> groups = weight_decay_groups(model)
        >>> {name: len(params) for name, params in groups.items()}
        {'decay': 2, 'no_decay_bias': 4}
        >>> storage = register_flat_storage(model, groups)
        >>> [(name, p.numel()) for name, p in model.named_parameters()]
        [('flat_param_decay', 48), ('flat_param_no_decay_bias', 26)]
        >>> opt = torch.optim.AdamW(
        ...     [{"params": [model.flat_param_decay], "weight_decay": 0.1},
        ...      {"params": [model.flat_param_no_decay_bias], "weight_decay": 0.0}])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"weight_decay_groups needs an nn.Module; got {type(module).__name__}")
    rule = _rule(module, no_decay)
    core = registered_core(module)
    if core is None:
        plain = list(collect_names(module).values())
    else:
        plain = plain_parameters(core, registration_target(module)[1])
    sides: dict[str, dict[tuple[torch.device, torch.dtype, bool], list[nn.Parameter]]] = {
        DECAY_GROUP: {},
        NO_DECAY_GROUP: {},
    }
    for spec in plain:
        param = spec.param
        side = sides[NO_DECAY_GROUP if rule(spec.names, param) else DECAY_GROUP]
        side.setdefault((param.device, param.dtype, param.requires_grad), []).append(param)
    groups: dict[str, list[nn.Parameter]] = {}
    for base, split in sides.items():
        for index, members in enumerate(split.values()):
            groups[base if index == 0 else f"{base}_{index}"] = members
    return groups
