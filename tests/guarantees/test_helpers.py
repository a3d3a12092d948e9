"""The shared test helpers themselves: each comparator fails on what it claims to check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import (
    assert_agrees_with_twin,
    assert_same_optim_state,
    assert_same_values,
    assert_unchanged,
    bn_mlp,
    grads,
    mlp,
    registered_bn_mlp,
    snapshot,
    sum_square,
    train_steps,
    twin,
    values,
)


def test_assert_same_values_checks_keys_order_dtype_and_bits():
    """Bit-exact by default: other keys, another key order, another dtype or one ulp off all fail."""
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    assert_same_values(a, {k: v.clone() for k, v in a.items()})
    with pytest.raises(AssertionError, match="keys differ"):
        assert_same_values(a, {"b": a["b"], "w": a["w"]})
    with pytest.raises(AssertionError, match="w"):
        assert_same_values(a, {"w": a["w"].double(), "b": a["b"]})
    with pytest.raises(AssertionError, match="b"):
        assert_same_values(a, {"w": a["w"], "b": torch.nextafter(a["b"], torch.tensor(4.0))})


def test_assert_same_values_with_a_tolerance_accepts_close_values_only():
    """rtol/atol (or close=True) accept values within the tolerance and name the key of those outside."""
    a, b = {"w": torch.tensor([1.0])}, {"w": torch.tensor([1.0 + 1e-7])}
    assert_same_values(a, b, close=True)
    assert_same_values(a, b, rtol=1e-6, atol=0)
    with pytest.raises(AssertionError, match=r"step 3 w"):
        assert_same_values(a, {"w": torch.tensor([1.1])}, rtol=1e-6, atol=1e-7, msg="step 3")
    with pytest.raises(AssertionError, match="g"):
        assert_same_values({"g": None}, {"g": torch.zeros(1)})


def test_grads_of_a_flattened_model_and_its_twin_compare():
    """grads() reports the flattened model's gradients under the plain names; a changed one is caught."""
    plain = mlp(depth=2)
    model = twin(plain)
    register_flat_storage(model)
    x = torch.randn(3, 5)
    for m in (model, plain):
        m(x).pow(2).sum().backward()
    assert_same_values(grads(model), grads(plain), close=True)
    plain[0].bias.grad.add_(1.0)
    with pytest.raises(AssertionError, match=r"0\.bias"):
        assert_same_values(grads(model), grads(plain), close=True)


def test_assert_agrees_with_twin_catches_a_diverged_value():
    """A flattened model whose value differs from the twin's fails the check."""
    plain = mlp(depth=2)
    model = twin(plain)
    storage = register_flat_storage(model)
    x = torch.randn(3, 5)
    assert_agrees_with_twin(plain, model, x)
    with torch.no_grad():
        storage["0"][0] += 1.0
    with pytest.raises(AssertionError):
        assert_agrees_with_twin(plain, model, x)


def test_assert_same_optim_state_checks_groups_ids_and_entries():
    """Another hyper-parameter, other param ids or another moment all fail; a copy passes."""
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train_steps(model, opt, [torch.randn(4, 3)])
    state = opt.state_dict()
    copied = {
        "state": {pid: {k: v.clone() for k, v in entry.items()} for pid, entry in state["state"].items()},
        "param_groups": [dict(g) for g in state["param_groups"]],
    }
    assert_same_optim_state(state, copied)
    copied["state"][0]["exp_avg"] += 1e-3
    assert_same_optim_state(state, copied, rtol=0, atol=1e-2)
    with pytest.raises(AssertionError):
        assert_same_optim_state(state, copied)
    copied["param_groups"][0]["lr"] = 0.2
    with pytest.raises(AssertionError):
        assert_same_optim_state(state, copied, rtol=0, atol=1e-2)
    with pytest.raises(AssertionError):
        assert_same_optim_state(
            state, {**state, "param_groups": [{**state["param_groups"][0], "params": [1, 0]}]}
        )


def test_train_steps_takes_one_step_per_batch_and_returns_the_losses():
    """One zero_grad/backward/step per batch; the losses are those before each step; zero_grad_last frees."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    x = torch.ones(1, 2)
    # loss (w1 + w2)^2, gradient 2 (w1 + w2) per weight: w goes 1 -> 0 -> 0
    assert train_steps(model, opt, [x, x], sum_square) == [4.0, 0.0]
    assert model.weight.grad is not None
    train_steps(model, opt, [x], sum_square, zero_grad_last=True)
    assert model.weight.grad is None
    assert_same_values(values(model), {"weight": torch.zeros(1, 2)})


def test_snapshot_detects_changes():
    """The helper itself: assert_unchanged notices changed values, objects, modes and attributes."""
    model, storage = registered_bn_mlp()
    snap = snapshot(model)
    assert_unchanged(model, snap)
    with torch.no_grad():
        model[1].running_mean.add_(1)
    with pytest.raises(AssertionError, match=r"1\.running_mean changed value"):
        assert_unchanged(model, snap)
    model, storage = registered_bn_mlp()
    snap = snapshot(model)
    with torch.no_grad():
        model[0].weight[0, 0] += 1
    with pytest.raises(AssertionError, match=r"flat_param_a changed value"):
        assert_unchanged(model, snap)
    model, storage = registered_bn_mlp()
    snap = snapshot(model)
    model[2].bias = nn.Parameter(model[2].bias.detach().clone())
    with pytest.raises(AssertionError, match=r"parameter 2\.bias was replaced"):
        assert_unchanged(model, snap)
    model, storage = registered_bn_mlp()
    snap = snapshot(model)
    storage.unflatten()
    with pytest.raises(AssertionError):
        assert_unchanged(model, snap)
    model = bn_mlp()
    snap = snapshot(model)
    model[0].__dict__["_flat_parametrize"] = None
    with pytest.raises(AssertionError, match=r"_flat_parametrize"):
        assert_unchanged(model, snap)
