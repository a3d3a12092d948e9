"""Trainable parameters added after registration, in no group: said by the first call that misses them.

A submodule put in after registration (a new classifier head: ``model.head =
nn.Linear(...)``, timm's ``reset_classifier``), a parameter registered on a
module since (``register_parameter``, a new ``nn.Parameter`` attribute), a
weight that left the storage (another dtype) are ordinary parameters of the
model (SPEC "Structure changes"): ``model.parameters()``, ``state_dict()``,
``flat_state_dict()``, gradient sync and ``ShardedOptimizer`` include them, as
on the plain model. The storage's whole-buffer calls cannot: ``flat_params``,
``named_grads()``, ``named_views()`` and ``views_of()`` hold the groups only,
so a clip over ``storage.flat_params`` (as ``docs/per-tensor.md`` shows it), an
optimizer or an EMA over it would leave them out with no word.

:func:`say_left_out`, called by those four (``_storage.py``), warns once per
parameter with their names, the rule and the fix. The parameters left out of
every group at registration were left out on purpose and are never said
(:func:`registered` notes them; a copy or a loaded model notes what it holds
at its first call). The walk over the module runs again only after torch
registered a parameter or a submodule anywhere, or a storage changed mode or
layout (``_core/unheld.py``'s ``GENERATION``, ``_core/leaves.py``'s ``EPOCH``):
otherwise a call costs a dict lookup and a comparison.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

from torch import nn

from .._core.caller import caller_level
from .._core.leaves import EPOCH
from .._core.records import Coordinator
from .._core.unheld import GENERATION, named_unheld, watch_registrations

__all__ = ["registered", "say_left_out"]


@dataclass
class _Seen:
    """What a registered module held outside its groups: left out on purpose, or said already."""

    known: set[str]
    key: tuple[int, int]  # (GENERATION, EPOCH) of the last walk


#: The registered module -> :class:`_Seen` (forgotten with the module).
_SEEN: weakref.WeakKeyDictionary[nn.Module, _Seen] = weakref.WeakKeyDictionary()


def _key() -> tuple[int, int]:
    return (GENERATION[0], EPOCH[0])


def registered(module: nn.Module) -> None:
    """``module`` was registered: the parameters it holds outside every group now were left out on purpose."""
    watch_registrations()
    _SEEN[module] = _Seen({name for name, _ in named_unheld(module)}, _key())


def say_left_out(core: Coordinator, call: str) -> None:
    """Warn once per parameter if ``call`` leaves out trainable parameters that came after registration.

    Args:
        core: the storage core (after per-tensor mode's writes landed).
        call: the call that asks, as the user wrote it (``"storage.flat_params"``).
    """
    module = core.module_or_none()
    if module is None:
        return
    seen = _SEEN.get(module)
    if seen is None:  # a copy or a loaded model: what it holds outside its groups now came with it
        registered(module)
        return
    key = _key()
    if seen.key == key:
        return
    seen.key = key
    new = [name for name, param in named_unheld(module) if param.requires_grad and name not in seen.known]
    if not new:
        return
    seen.known.update(new)
    listed = ", ".join(new[:8]) + (f", ... ({len(new)} in all)" if len(new) > 8 else "")
    warnings.warn(
        f"{call} leaves out {listed}: parameters that the model got after registration (a new submodule, "
        "register_parameter, a weight that left the storage) are ordinary parameters in no group, so "
        "flat_params, named_grads(), named_views(), views_of() and a clip, optimizer or EMA over "
        "flat_params leave them out, while model.parameters(), state_dict(), gradient sync and "
        "ShardedOptimizer include them. Clip and optimize over model.parameters() (the flat parameters "
        "and these, or in per-tensor mode every leaf), or flatten them too: remove_flat_storage(model), "
        "then register_flat_storage(model)",
        UserWarning,
        stacklevel=caller_level(),
    )
