"""Ensembles: flattened models stacked with torch.func and tensordict, against plain twins."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _twins(n: int = 2) -> tuple[list[nn.Module], list[nn.Module]]:
    plains = [_mlp(seed) for seed in range(n)]
    flats = [copy.deepcopy(p) for p in plains]
    for model in flats:
        register_flat_storage(model)
    return plains, flats


def _ensemble(models: list[nn.Module], x: torch.Tensor):
    """The torch.func ensembling recipe: stack, functional_call on a meta copy, vmap; then backward."""
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")

    def call(p, b, inp):
        return functional_call(base, (p, b), (inp,))

    out = vmap(call, in_dims=(0, 0, None))(params, buffers, x)
    out.pow(2).sum().backward()
    return out, params


def test_flattened_models_of_one_architecture_share_their_class():
    """Two registrations of one class share one class (the original's name); copies keep it."""
    _, (a, b) = _twins()
    assert type(a) is type(b) and type(a).__name__ == "Sequential" and isinstance(a, nn.Sequential)
    assert type(copy.deepcopy(a)) is type(a)
    assert type(pickle.loads(pickle.dumps(a))) is type(a)
    storage = get_flat_storage(a)
    with storage.unflattened():
        assert type(a) is type(b)
    remove_flat_storage(a)
    assert type(a) is nn.Sequential and type(b) is not nn.Sequential
    b(torch.randn(2, 4))  # the other registration is untouched


def test_stack_module_state_ensemble_matches_the_plain_ensemble():
    """stack_module_state + functional_call + vmap: the plain ensemble's outputs and gradients."""
    plains, flats = _twins()
    x = torch.randn(6, 4)
    plain_out, plain_params = _ensemble(plains, x)
    flat_out, flat_params = _ensemble(flats, x)
    torch.testing.assert_close(flat_out, plain_out)
    assert list(flat_params) == ["flat_param_0"]
    for i, model in enumerate(flats):
        storage = get_flat_storage(model)
        grads = storage.views_of([flat_params["flat_param_0"].grad[i]])
        values = storage.views_of([flat_params["flat_param_0"].detach()[i]])
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_params[name].grad[i], msg=name)
            torch.testing.assert_close(values[name], plain_params[name][i].detach(), msg=name)


def test_a_failure_inside_vmap_leaves_the_base_model_as_it_was():
    """A forward that raises inside vmap (functional_call, stacked weights) leaves the base model."""
    _, flats = _twins()
    base = flats[0]
    params, buffers = stack_module_state(flats)
    x = torch.randn(6, 4)
    before = base(x).detach().clone()
    state = {k: v.clone() for k, v in base.state_dict().items()}

    def call(p, b, inp):
        return functional_call(base, (p, b), (inp,))

    with pytest.raises(RuntimeError):
        vmap(call, in_dims=(0, 0, None))(params, buffers, torch.randn(6, 7))
    torch.testing.assert_close(base(x), before)
    after = base.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())


def _tensordict_ensemble(models: list[nn.Module], x: torch.Tensor):
    """tensordict's ensembling recipe: from_modules, then to_module of each slice inside vmap."""
    params = TensorDict.from_modules(*models).detach().requires_grad_()
    base = models[0]

    def call(p, inp):
        with p.to_module(base):
            return base(inp)

    out = vmap(call, (0, None))(params, x)
    out.pow(2).sum().backward()
    return out, params


def test_tensordict_from_modules_vmap_to_module_matches_the_plain_ensemble():
    """from_modules + vmap + to_module: the plain ensemble's outputs and gradients; the base still works.

    tensordict wraps each swapped-back parameter in a new ``nn.Parameter`` at the exit of
    ``to_module``, inside vmap: ``nn.Parameter(flat)`` works there too.
    """
    plains, flats = _twins()
    x = torch.randn(6, 4)
    plain_out, plain_params = _tensordict_ensemble(plains, x)
    flat_out, flat_params = _tensordict_ensemble(flats, x)
    assert torch.equal(flat_out, plain_out)
    storage = get_flat_storage(flats[0])
    stacked_grad = flat_params["flat_param_0"].grad
    for member in range(2):
        for name, grad in storage.views_of([stacked_grad[member]]).items():
            assert torch.equal(grad, plain_params.get(tuple(name.split("."))).grad[member]), name
    base = flats[0]
    assert base._parameters["flat_param_0"] is storage.flat_params[0]
    assert torch.equal(base(x), plains[0](x))
    assert list(base.state_dict()) == list(plains[0].state_dict())


def test_a_failure_inside_tensordict_to_module_in_vmap_leaves_the_base_model_as_it_was():
    """A forward that raises inside ``to_module`` inside vmap: the base model works unchanged."""
    _, flats = _twins()
    base = flats[0]
    td = TensorDict.from_modules(*flats)
    x = torch.randn(6, 4)
    before = base(x).detach().clone()
    state = {k: v.clone() for k, v in base.state_dict().items()}

    def call(p, inp):
        with p.to_module(base):
            return base(inp[:, :3])  # 3 features for a Linear(4, 5): the forward raises

    with pytest.raises(RuntimeError, match="batch2 tensor"):
        vmap(call, (0, None))(td, x)
    torch.testing.assert_close(base(x), before)
    after = base.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())


def test_tensordict_to_module_outside_vmap_matches_the_plain_models():
    """tensordict's to_module of one model's weights into another: its outputs and gradients."""
    plains, flats = _twins()
    x = torch.randn(6, 4)
    for models in (plains, flats):
        td = TensorDict.from_module(models[1])
        with td.to_module(models[0]):
            out = models[0](x)
        out.pow(2).sum().backward()
    torch.testing.assert_close(flats[1](x), plains[1](x))
    for name, grad in get_flat_storage(flats[1]).named_grads():
        torch.testing.assert_close(grad, plains[1].get_parameter(name).grad, msg=name)
