"""Trainable parameters added after registration: said by the first whole-buffer call leaving them out.

A new head or a parameter registered after ``register_flat_storage`` is an ordinary parameter in no
group (SPEC "Structure changes"): ``model.parameters()``, the state dicts, gradient sync and
``ShardedOptimizer`` include it, as on the plain model; ``flat_params``, ``named_grads()``,
``named_views()`` and ``views_of()`` cannot. A clip over ``storage.flat_params`` (as the docs show
it) then clipped by another norm than the plain model's with no word; now the first such call warns
once, naming the parameters and the fix, which gives the plain model's norm.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import twin

LEFT_OUT = (
    r"leaves out {names}: parameters that the model got after registration \(a new submodule, "
    r"register_parameter, a weight that left the storage\) are ordinary parameters in no group"
)

CALLS: dict[str, Callable[[Any], Any]] = {
    "storage.flat_params": lambda storage: storage.flat_params,
    "storage.named_grads()": lambda storage: list(storage.named_grads()),
    "storage.named_views()": lambda storage: list(storage.named_views()),
    "storage.views_of()": lambda storage: storage.views_of([storage[g] for g in storage.group_names]),
}

CHANGES: dict[str, tuple[Callable[[nn.Sequential], None], str]] = {
    "a new head": (lambda m: m.__setitem__(2, nn.Linear(8, 3)), r"2\.weight, 2\.bias"),
    "register_parameter": (
        lambda m: m[0].register_parameter("scale", nn.Parameter(torch.ones(8))),
        r"0\.scale",
    ),
    "a new submodule": (lambda m: m.add_module("extra", nn.Linear(2, 3)), r"extra\.weight, extra\.bias"),
}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _forward(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    out = model[2](model[1](model[0](x) * getattr(model[0], "scale", 1.0)))
    return model.extra(out) if hasattr(model, "extra") else out


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("mode", ["flat", "per-tensor"])
def test_a_parameter_added_after_registration_is_said_once_by_the_first_call_missing_it(mode, change, call):
    """The call warns with the names, the rule and the fix, once; model.parameters() clips as plain."""
    plain = _net()
    model = twin(plain)
    storage = register_flat_storage(model)
    if mode == "per-tensor":
        storage.unflatten()
    for m in (plain, model):
        torch.manual_seed(1)
        CHANGES[change][0](m)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    for m in (plain, model):
        _forward(m, x).pow(2).mean().backward()
    names = CHANGES[change][1]
    with pytest.warns(UserWarning, match=re.escape(call) + " " + LEFT_OUT.format(names=names)) as record:
        CALLS[call](storage)
    assert len([w for w in record if "leaves out" in str(w.message)]) == 1
    assert "Clip and optimize over model.parameters()" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        for again in CALLS.values():
            again(storage)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # the fix: the plain model's norm
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["flat", "per-tensor"])
def test_parameters_left_out_at_registration_frozen_ones_and_copies_are_not_said(mode):
    """Left out of every group on purpose, frozen, or brought by a copy: nothing to say."""
    model = _net()
    storage = register_flat_storage(model, [model[0]])  # model[2] left out on purpose
    if mode == "per-tensor":
        storage.unflatten()
    model.add_module("frozen", nn.Linear(3, 3).requires_grad_(False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(storage.flat_params) == 1
        model.add_module("extra", nn.Linear(3, 3))
        copied = copy.deepcopy(model)  # its storage notes what the copy holds now
        list(get_flat_storage(copied).named_grads())
    with pytest.warns(UserWarning, match=r"storage\.flat_params leaves out extra\.weight, extra\.bias: "):
        storage.flat_params  # noqa: B018


def test_a_layout_change_in_per_tensor_mode_says_nothing_of_the_parameters_that_stay_in_their_groups():
    """A crop laid out again (its group holds the new parameter) and a mode switch: nothing is left out."""
    model = nn.Sequential(nn.Embedding(16, 4), nn.Linear(4, 4))
    storage = register_flat_storage(model)
    storage.unflatten()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model[0].weight = nn.Parameter(model[0].weight[:8])
        assert sum(f.numel() for f in storage.flat_params) == 8 * 4 + 4 * 4 + 4
        storage.flatten()
        list(storage.named_grads())
