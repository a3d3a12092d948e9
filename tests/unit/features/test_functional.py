"""Weights as vectors: functional_call, vmap ensembles, stack/call_stacked."""

from __future__ import annotations

import pytest
import torch

from flatten_parametrize import register_flat_storage

from _helpers import mlp


def test_call_stacked_evaluates_each_weight_set():
    """call_stacked(stack) equals running the module under using() for each row."""
    model = mlp(2)
    storage = register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]})
    stacks = storage.stack(3)
    stacks = [s + 0.1 * torch.randn_like(s) for s in stacks]
    x = torch.randn(4, 5)
    out = storage.call_stacked(stacks, x)
    assert out.shape == (3, 4, 5)
    for k in range(3):
        with storage.using({"w": stacks[0][k], "b": stacks[1][k]}):
            torch.testing.assert_close(out[k], model(x))


def test_call_stacked_gradients_reach_the_stack_not_the_module():
    """Gradients of an ensemble loss flow into the stacked weights only."""
    model = mlp(1)
    storage = register_flat_storage(model)
    (stack,) = storage.stack(2, requires_grad=True)
    storage.call_stacked([stack], torch.randn(3, 5)).pow(2).sum().backward()
    assert stack.grad is not None and stack.grad.shape == (2, 30)
    assert storage["0"].grad is None


def test_stack_rows_start_at_the_current_weights_and_are_independent():
    """stack(k) copies the current flat parameters; editing it leaves the module alone."""
    model = mlp(1)
    storage = register_flat_storage(model)
    (stack,) = storage.stack(2)
    assert torch.equal(stack[1], storage["0"].detach())
    stack.zero_()
    assert storage["0"].abs().sum() > 0


def test_stack_and_call_stacked_refuse_bad_input():
    """Bad k, wrong counts, names or shapes raise with the rule and the value."""
    model = mlp(1)
    storage = register_flat_storage(model)
    with pytest.raises(ValueError, match=r"integer k >= 1; got 0"):
        storage.stack(0)
    x = torch.randn(1, 5)
    with pytest.raises(ValueError, match=r"group '0' needs a \(k, 30\) stack; got shape \(2, 29\)"):
        storage.call_stacked([torch.zeros(2, 29)], x)
    with pytest.raises(ValueError, match=r"one stack per group \(1: \['0'\]\); got 2"):
        storage.call_stacked([torch.zeros(2, 30), torch.zeros(2, 30)], x)
    with pytest.raises(ValueError, match=r"one stack per group \['0'\]; got keys \['x'\]"):
        storage.call_stacked({"x": torch.zeros(2, 30)}, x)
    with pytest.raises(TypeError, match="one \\(k, numel\\) tensor per group"):
        storage.call_stacked(3, x)


def test_call_stacked_needs_the_same_k_for_every_group():
    """Stacks of different heights are refused."""
    model = mlp(1)
    storage = register_flat_storage(model, [["0.weight"], ["0.bias"]])
    with pytest.raises(ValueError, match=r"same k; got \[2, 3\]"):
        storage.call_stacked([torch.zeros(2, 25), torch.zeros(3, 5)], torch.randn(1, 5))
