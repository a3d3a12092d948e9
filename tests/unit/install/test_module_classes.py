"""Modules of one class with the same flattened attributes share one injected class.

``_install/module_classes.make_class`` keys the classes it makes by the original class and the
flattened attribute names: the layers of a model stay of as many types as the plain model has
(Python's per-type attribute caches then serve one ``forward`` over all of them, as in the plain
model). A module that torch's ``parametrize`` gave a class of its own keeps a class of its own, and
one that torch parametrizes while flattened gets one first (``module_classes.own_class``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils import parametrize

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def _encoder(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False).eval()


def test_the_layers_of_a_flattened_model_are_of_as_many_types_as_the_plain_models():
    plain, flat = _encoder(), _encoder()
    register_flat_storage(flat)
    plain_types = {type(m) for m in plain.modules()}
    flat_types = {type(m) for m in flat.modules()}
    assert len(flat_types) == len(plain_types)
    pairs = zip(flat.modules(), plain.modules())
    assert all(type(a) is type(b) or type(a).__bases__[0] is type(b) for a, b in pairs)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        assert torch.equal(flat(x), plain(x))  # each layer still reads its own weights


def test_modules_that_flatten_other_attributes_get_other_classes():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, bias=False), nn.Linear(3, 3))
    register_flat_storage(model)
    assert type(model[0]) is type(model[2])
    assert type(model[0]) is not type(model[1])
    assert "bias" in vars(type(model[0])) and "bias" not in vars(type(model[1]))
    assert model[1].bias is None


def test_two_registrations_and_their_copies_share_the_layer_classes():
    a, b = _encoder(0), _encoder(1)
    register_flat_storage(a)
    register_flat_storage(b)
    c = copy.deepcopy(a)
    for x, y, z in zip(a.modules(), b.modules(), c.modules()):
        assert type(x) is type(y) is type(z)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        assert torch.equal(c(x), a(x)) and not torch.equal(b(x), a(x))


def test_removing_one_storage_leaves_the_others_that_share_its_classes_working():
    a, b, plain_b = _encoder(0), _encoder(1), _encoder(1)
    register_flat_storage(a)
    register_flat_storage(b)
    remove_flat_storage(a)
    assert type(a.layers[0].linear1) is nn.Linear
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        assert torch.equal(b(x), plain_b(x))


def test_a_module_parametrized_before_registration_keeps_a_class_of_its_own():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    parametrize.register_parametrization(model[0], "bias", Double())
    register_flat_storage(model)
    assert type(model[0]) is not type(model[1])
    assert type(model[0]).__bases__[0] is nn.Linear  # type_before_parametrizations keeps working
    assert parametrize.type_before_parametrizations(model[0]) is nn.Linear


def test_a_parametrization_torch_adds_to_one_flattened_module_leaves_its_class_siblings_alone():
    """``register_parametrization`` imported by name before the package runs on the flattened module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3)).eval()
    register_flat_storage(model)
    assert type(model[0]) is type(model[1])
    shared = type(model[0])
    original = parametrize.register_parametrization.__wrapped__  # torch's, as imported before the package
    original(model[0], "running_var", Double())
    assert type(model[1]) is shared and "running_var" not in vars(shared)
    assert type(model[0]) is not shared and isinstance(vars(type(model[0]))["running_var"], property)
    assert torch.equal(model[0].running_var, 2 * torch.ones(3))
    assert model[1].running_var is model[1]._buffers["running_var"]
    x = torch.randn(4, 3)
    with torch.no_grad():
        assert torch.allclose(model[1](x), x / (1 + 1e-5) ** 0.5 * model[1].weight + model[1].bias)
    get_flat_storage(model).flat_params[0].grad = None  # the storage still works
    model(x).sum().backward()
    assert get_flat_storage(model).flat_params[0].grad is not None
