"""Parameters of a module that no flat storage holds, and a counter that moves when torch registers one.

They are ordinary parameters of the model: one left out of every group at
registration (``register_flat_storage(model, ["*.weight"])``), a new
submodule's (a classifier head put in after it: SPEC "Structure changes"), one
registered on a module since, one that left its storage (another dtype, a
quantized tensor). Gradient sync and ``ShardedOptimizer`` average them as DDP
does (``_distributed/outside_params.py``); the storage's whole-buffer calls
leave them out and say so for those that came after registration
(``_guards/left_out.py``). :data:`GENERATION` moves at every parameter or
submodule registration anywhere (torch's global registration hooks,
:func:`watch_registrations`), so that a walk over a module is done again only
after one. A parameter put straight into a module's ``_parameters`` dict calls
no hook of torch's: it is found at the next registration or mode change.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .flat_parameter import FlatParameter
from .leaves import storage_of_leaf

__all__ = ["GENERATION", "named_unheld", "unheld", "watch_registrations"]

#: Moves whenever torch registers a parameter or a submodule on any module (``GENERATION[0]``).
GENERATION = [0]

_installed: list[Any] = []


def _moved(*args: Any) -> None:
    GENERATION[0] += 1


def watch_registrations() -> None:
    """Register torch's global parameter and module registration hooks that move :data:`GENERATION`, once."""
    if not _installed:
        _installed.append(nn.modules.module.register_module_parameter_registration_hook(_moved))
        _installed.append(nn.modules.module.register_module_module_registration_hook(_moved))


def named_unheld(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Return ``(name, parameter)`` of each parameter of ``module`` that no flat storage holds.

    Frozen ones included. Only leaf ``nn.Parameter`` objects count: what a
    forward puts in the parameters' places for its length (a mixed-precision
    policy's compute views in per-tensor mode) is not a parameter of the model.
    """
    return [
        (name, p)
        for name, p in module.named_parameters()
        if isinstance(p, nn.Parameter)
        and p.is_leaf
        and not isinstance(p, FlatParameter)
        and storage_of_leaf(p) is None
    ]


def unheld(module: nn.Module) -> list[nn.Parameter]:
    """Return the parameters of :func:`named_unheld`."""
    return [p for _, p in named_unheld(module)]
