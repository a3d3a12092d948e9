"""Modules that already use weight_norm, orthogonal or spectral_norm flatten their original tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from flatten_parametrize import register_flat_storage, remove_flat_storage

from _helpers import assert_same_values, grads, train_steps, twin, values

_PARAMETRIZATIONS = {
    "weight_norm": parametrizations.weight_norm,
    "orthogonal": parametrizations.orthogonal,
    "spectral_norm": parametrizations.spectral_norm,
}


def _net() -> nn.Sequential:
    """One layer per parametrization; spectral_norm updates buffers (_u, _v) at every training forward."""
    return nn.Sequential(
        parametrizations.weight_norm(nn.Linear(4, 5)),
        nn.Tanh(),
        parametrizations.orthogonal(nn.Linear(5, 5)),
        nn.Tanh(),
        parametrizations.spectral_norm(nn.Linear(5, 3)),
    )


@pytest.mark.parametrize("name", list(_PARAMETRIZATIONS))
def test_original_tensors_live_in_the_flat_buffer(name: str):
    """The parametrization's original tensors (not the computed weight) are flattened, as views."""
    layer = _PARAMETRIZATIONS[name](nn.Linear(3, 3))
    originals = [n for n, _ in layer.named_parameters()]
    storage = register_flat_storage(layer)
    assert [info.name for info in storage.param_infos] == originals
    assert [n for n, _ in layer.named_parameters()] == ["flat_param_0"]
    said = r"a submodule's parameters\(\) in flat mode .*'parametrizations.weight'"
    with pytest.warns(UserWarning, match=said):  # slices, said (_guards/submodule_walks.py)
        assert list(layer.parametrizations.weight.parameters()) == []
    flat = storage["0"]
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for info in storage.param_infos:
        view = dict(storage.named_views())[info.name]
        assert start <= view.data_ptr() < end and view.shape == info.shape
    assert parametrize.is_parametrized(layer, "weight")
    assert parametrize.type_before_parametrizations(layer) is nn.Linear


def test_forward_and_backward_match_the_plain_model():
    """Outputs and gradients of the original tensors equal those of the plain model."""
    plain = _net()
    model = twin(plain)
    register_flat_storage(model)
    x = torch.randn(7, 4)
    out, expected = model(x), plain(x)
    assert torch.equal(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_same_values(grads(model), grads(plain), close=True)


def test_training_matches_the_plain_model():
    """Adam steps on the flattened model end where they end on the plain model (spectral-norm buffers too)."""
    plain = _net()
    model = twin(plain)
    register_flat_storage(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref = torch.optim.Adam(plain.parameters(), lr=1e-2)
    batches = [torch.randn(6, 4) for _ in range(4)]
    train_steps(model, opt, batches)
    train_steps(plain, ref, batches)
    assert_same_values(model, plain, rtol=1e-5, atol=1e-6)


def test_state_dicts_have_the_plain_keys_and_load_both_ways():
    """state_dict() keys are the plain model's (originals and buffers); checkpoints load both ways."""
    plain = _net()
    model = _net()
    storage = register_flat_storage(model)
    assert list(model.state_dict()) == list(plain.state_dict())
    model.load_state_dict(plain.state_dict())
    assert_same_values(model, plain, rtol=1e-5, atol=1e-6)
    x = torch.randn(3, 4)
    model.eval()
    plain.eval()
    assert torch.equal(model(x), plain(x))
    with torch.no_grad():
        storage["0"].mul_(0.5)
    back = _net()
    back.load_state_dict(model.state_dict())
    assert_same_values(back, model, rtol=1e-5, atol=1e-6)
    fresh = _net()
    register_flat_storage(fresh)
    fresh.load_state_dict(storage.flat_state_dict())
    assert_same_values(fresh, model, rtol=1e-5, atol=1e-6)


def test_cached_parametrizations_still_work():
    """parametrize.cached() computes each weight once, from the flat buffer."""
    plain = _net().eval()
    model = twin(plain)
    register_flat_storage(model)
    x = torch.randn(2, 4)
    with parametrize.cached():
        assert torch.equal(model(x), plain(x))
        assert model[2].weight is model[2].weight


def test_remove_flat_storage_gives_back_the_parametrized_model():
    """remove_flat_storage leaves the parametrizations as on the plain model, with the trained values."""
    plain = _net()
    model = twin(plain)
    storage = register_flat_storage(model)
    x = torch.randn(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).sum().backward()
    opt.step()
    trained = values(model)
    remove_flat_storage(model)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(model.state_dict()) == list(plain.state_dict())
    assert_same_values(model, trained)
    assert type(model[0].parametrizations.weight) is parametrize.ParametrizationList
    assert parametrize.type_before_parametrizations(model[0]) is nn.Linear
    assert "parametrizations" not in model[0].parametrizations.weight.__dict__
    del storage
    parametrize.remove_parametrizations(model[0], "weight")
    assert type(model[0]) is nn.Linear and isinstance(model[0].weight, nn.Parameter)


def test_deepcopy_of_the_flattened_parametrized_model_is_independent():
    """copy.deepcopy gives a copy with its own flat buffer; changing one leaves the other."""
    model = _net().eval()
    storage = register_flat_storage(model)
    replica = copy.deepcopy(model)
    x = torch.randn(2, 4)
    before = model(x)
    assert torch.equal(replica(x), before)
    with torch.no_grad():
        replica.flat_param_0.zero_()
    assert torch.equal(model(x), before)
    assert storage["0"].data_ptr() != replica.flat_param_0.data_ptr()
