"""_guards/step_checks: optimizers over another mode's parameters, and per-tensor math in flat mode."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage
from flatten_parametrize._guards import step_checks

from _helpers import mlp, twin


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(3, 5)).pow(2).mean().backward()
    opt.step()


def test_an_optimizer_built_in_unflattened_mode_and_stepped_in_flat_mode_raises():
    """Its leaves get no gradient in flat mode: the step raises with the fix instead of changing nothing."""
    model = mlp(2)
    storage = register_flat_storage(model)
    with storage.unflattened():
        opt = torch.optim.Adafactor(model.parameters(), lr=0.1)
    before = storage["0"].detach().clone()
    message = r"Adafactor steps '0\.weight', a leaf parameter .*`storage\.unflatten\(\)`"
    with pytest.raises(RuntimeError, match=message):
        _step(model, opt)
    assert torch.equal(storage["0"].detach(), before)
    storage.unflatten()  # the fix: train in per-tensor mode
    plain = mlp(2)
    ref = torch.optim.Adafactor(plain.parameters(), lr=0.1)
    torch.manual_seed(0)
    _step(model, opt)
    torch.manual_seed(0)
    _step(plain, ref)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_an_optimizer_over_parameters_taken_before_registering_raises_in_flat_mode():
    """`list(model.parameters())` before registering holds the leaves: stepping them in flat mode raises."""
    model = mlp(2)
    params = list(model.parameters())
    register_flat_storage(model)
    opt = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(RuntimeError, match="the storage is in flat mode now"):
        _step(model, opt)


def test_an_optimizer_built_in_flat_mode_steps_the_same_values_in_per_tensor_mode():
    """The flat parameters' gradients are their leaves' in unflattened mode: SGD steps the same values."""
    plain = mlp(2)
    model = twin(plain)
    storage = register_flat_storage(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        if step == 2:
            storage.unflatten()
        for m, o in ((model, opt), (plain, ref)):
            torch.manual_seed(step)
            _step(m, o)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_a_per_tensor_optimizer_over_flat_parameters_warns_once_with_the_fix():
    """torch's Adafactor in flat mode warns at its first step, naming the class and per-tensor mode.

    (torch's Muon refuses the 1-D flat parameters itself, with its own error.)
    """
    model = mlp(2)
    register_flat_storage(model)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.1)
    message = r"flat mode: Adafactor is not a known element-wise optimizer.*unflatten"
    with pytest.warns(UserWarning, match=message):
        _step(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, opt)  # once


@pytest.mark.parametrize(
    "cls",
    [
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.Adamax,
        torch.optim.Adadelta,
        torch.optim.Rprop,
    ],
)
def test_element_wise_optimizers_never_warn(cls):
    """torch's element-wise optimizers over flat parameters: no warning."""
    model = mlp(2)
    register_flat_storage(model)
    opt = cls(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, opt)


def test_a_subclass_that_keeps_step_is_element_wise_and_one_that_overrides_it_is_not():
    """Subclasses inherit the verdict of the class that defines `step`."""

    class Tuned(torch.optim.AdamW):
        pass

    class Custom(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            return super().step(closure)

    param = nn.Parameter(torch.zeros(2))
    assert step_checks.is_elementwise(Tuned([param]))
    assert not step_checks.is_elementwise(Custom([param], lr=0.1))


def test_the_warning_is_silenced_by_its_documented_filter():
    """`warnings.filterwarnings('ignore', message='flat mode: ')` silences it."""
    model = mlp(2)
    register_flat_storage(model)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="flat mode: ")
        _step(model, opt)


def test_per_tensor_optimizers_in_per_tensor_mode_never_warn():
    """Over the leaves of unflattened mode nothing is flat: no warning."""
    model = mlp(2)
    storage = register_flat_storage(model)
    storage.unflatten()
    opt = torch.optim.Adafactor(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, opt)
