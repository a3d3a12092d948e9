"""FlatStorage: flat/unflattened toggles, using(), views and gradients by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatten_parametrize import ParamInfo, register_flat_storage

from _helpers import TiedLM, WithOwnParam, assert_same_values, mlp, sum_square, train_steps, twin


def test_param_infos_describe_every_slot():
    """param_infos lists name, aliases, group, offset, numel, shape, dtype for each slot."""
    model = TiedLM()
    storage = register_flat_storage(model)
    infos = storage.param_infos
    assert all(isinstance(i, ParamInfo) for i in infos)
    assert [i.name for i in infos] == ["embed.weight", "norm.weight", "norm.bias", "body.weight", "body.bias"]
    assert infos[0] == ParamInfo(
        "embed.weight", ("head.weight",), "0", 0, 66, torch.Size([11, 6]), torch.float32
    )
    assert [i.offset for i in infos] == [0, 66, 72, 78, 114]


def test_unflatten_gives_leaf_parameters_that_share_the_flat_memory():
    """In unflattened mode attributes are leaf Parameters aliasing the flat buffer."""
    model = mlp(2)
    storage = register_flat_storage(model)
    storage.unflatten()
    assert not storage.is_flattened
    weight = model[0].weight
    assert isinstance(weight, nn.Parameter) and weight.is_leaf
    assert weight.data_ptr() == storage["0"].data_ptr()
    with torch.no_grad():
        weight.fill_(2.0)
    assert storage["0"][:25].eq(2.0).all()


def test_unflatten_yields_the_originals_in_plain_order():
    """module.parameters() in unflattened mode lists the originals as the plain model does."""
    model = WithOwnParam()
    names = [n for n, _ in model.named_parameters()]
    originals = list(model.parameters())
    storage = register_flat_storage(model, ["fc.*", "bn.weight"])
    with storage.unflattened():
        assert [n for n, _ in model.named_parameters()] == names
        assert list(model.parameters()) == originals
    assert [n for n, _ in model.named_parameters()] == ["scale", "flat_param_0", "bn.bias"]


def test_unflattened_grads_are_views_of_the_flat_grad():
    """When a flat gradient exists, unflattened .grad are views of it and backward accumulates there."""
    model = mlp(1)
    storage = register_flat_storage(model)
    x = torch.randn(3, 5)
    model(x).sum().backward()
    with storage.unflattened():
        assert model[0].weight.grad.data_ptr() == storage["0"].grad.data_ptr()
        model(x).sum().backward()
    twin_model = mlp(1)
    twin_model(x).sum().backward()
    torch.testing.assert_close(dict(storage.named_grads())["0.weight"], 2 * twin_model[0].weight.grad)


def test_changes_made_unflattened_reach_the_flat_buffer():
    """In-place edits, .data swaps, reassigned parameters and new grads all land in flat mode."""
    model = mlp(2)
    storage = register_flat_storage(model)
    with storage.unflattened():
        with torch.no_grad():
            model[0].weight.fill_(1.0)
        model[0].bias.data = torch.full((5,), 2.0)
        model[2].weight = nn.Parameter(torch.full((5, 5), 3.0))
        model[2].bias.grad = torch.full((5,), 4.0)
    assert model[0].weight.eq(1.0).all() and model[0].bias.eq(2.0).all()
    assert model[2].weight.eq(3.0).all()
    grads = dict(storage.named_grads())
    assert grads["2.bias"].eq(4.0).all() and grads["0.weight"].eq(0.0).all()
    with storage.unflattened():
        assert model[0].bias.data_ptr() == storage["0"].data_ptr() + 25 * 4


def test_gradients_cleared_unflattened_clear_the_flat_grad():
    """zero_grad(set_to_none) in unflattened mode leaves the flat grad None."""
    model = mlp(1)
    storage = register_flat_storage(model)
    model(torch.randn(2, 5)).sum().backward()
    with storage.unflattened():
        model.zero_grad(set_to_none=True)
    assert storage["0"].grad is None


def test_optimizer_built_unflattened_trains_like_the_plain_model():
    """An optimizer over the unflattened parameters matches the plain model step for step."""
    model = mlp(2)
    plain = twin(model)
    storage = register_flat_storage(model)
    x = torch.randn(4, 5)
    with storage.unflattened():
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        ref = torch.optim.Adam(plain.parameters(), lr=0.01)
        train_steps(model, opt, [x] * 3, sum_square)
        train_steps(plain, ref, [x] * 3, sum_square)
    assert_same_values(dict(storage.named_views()), dict(plain.named_parameters()), close=True)


def test_unflattened_restores_the_previous_mode_on_error():
    """The context manager flattens again on exit, also when the block raises."""
    model = mlp(1)
    storage = register_flat_storage(model)
    with pytest.raises(KeyError):
        with storage.unflattened():
            raise KeyError("boom")
    assert storage.is_flattened
    storage.unflatten()
    with storage.unflattened():
        pass
    assert not storage.is_flattened


def test_flatten_and_unflatten_are_no_ops_in_their_own_mode():
    """flatten() while flat and unflatten() while unflattened change nothing."""
    model = mlp(1)
    storage = register_flat_storage(model)
    flat = storage["0"]
    storage.flatten()
    assert storage.is_flattened and dict(model.named_parameters()) == {"flat_param_0": flat}
    storage.unflatten()
    params = dict(model.named_parameters())
    storage.unflatten()
    assert dict(model.named_parameters()) == params


def test_tie_survives_toggles():
    """A tied parameter is one Parameter object under both names in unflattened mode."""
    model = TiedLM()
    storage = register_flat_storage(model)
    with storage.unflattened():
        assert model.head.weight is model.embed.weight
        assert len(list(model.parameters())) == 5
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()


def test_using_serves_views_from_given_tensors_with_autograd():
    """Inside using() the module runs on the given tensors and gradients flow into them."""
    model = mlp(1)
    storage = register_flat_storage(model)
    weights = torch.randn(30, requires_grad=True)
    x = torch.randn(2, 5)
    with storage.using([weights]):
        out = model(x)
        assert dict(storage.named_views())["0.bias"].data_ptr() == weights.data_ptr() + 25 * 4
    torch.testing.assert_close(out, torch.tanh(x @ weights[:25].view(5, 5).T + weights[25:]))
    out.sum().backward()
    assert weights.grad is not None and storage["0"].grad is None
    assert model[0].weight.data_ptr() == storage["0"].data_ptr()


def test_using_accepts_a_dict_by_group_name_and_restores_on_error():
    """using() takes {group: tensor}; the flat parameters come back after an exception."""
    model = mlp(2)
    storage = register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]})
    zeros = {"w": torch.zeros(50), "b": torch.ones(10)}
    with pytest.raises(ValueError, match="inside"):
        with storage.using(zeros):
            assert model[0].weight.eq(0).all() and model[2].bias.eq(1).all()
            raise ValueError("inside")
    assert dict(model.named_parameters())["flat_param_w"] is storage["w"]
    assert not model[0].bias.eq(1).all()


def test_using_nests():
    """Nested using() blocks restore the outer tensors."""
    model = mlp(1)
    storage = register_flat_storage(model)
    with storage.using(torch.zeros(30)):
        with storage.using(torch.ones(30)):
            assert model[0].bias.eq(1).all()
        assert model[0].bias.eq(0).all()


def test_views_of_maps_external_tensors_by_name():
    """views_of splits any flat-shaped tensors (e.g. optimizer state) into named views."""
    model = TiedLM()
    storage = register_flat_storage(model)
    opt = torch.optim.Adam(model.parameters())
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    exp_avg = opt.state[storage["0"]]["exp_avg"]
    views = storage.views_of([exp_avg])
    assert list(views) == ["embed.weight", "norm.weight", "norm.bias", "body.weight", "body.bias"]
    assert (
        views["body.weight"].shape == (6, 6)
        and views["body.weight"].data_ptr() == exp_avg.data_ptr() + 78 * 4
    )
    assert "head.weight" in storage.views_of({"0": exp_avg.double()}, remove_duplicate=False)


def test_named_views_and_grads_follow_the_mode():
    """named_views/named_grads give views in flat mode and leaf parameters unflattened."""
    model = mlp(1)
    storage = register_flat_storage(model)
    assert dict(storage.named_grads()) == {"0.weight": None, "0.bias": None}
    model(torch.randn(2, 5)).sum().backward()
    grads = dict(storage.named_grads())
    assert grads["0.bias"].data_ptr() == storage["0"].grad.data_ptr() + 25 * 4
    with storage.unflattened():
        views = dict(storage.named_views())
        assert views["0.weight"] is model[0].weight
        assert dict(storage.named_grads())["0.bias"] is model[0].bias.grad


def test_toggling_keeps_the_same_classes():
    """flatten/unflatten never mint new classes; unflattened mode gives back the original classes."""
    model = mlp(2)
    plain_classes = [type(m) for m in model.modules()]
    storage = register_flat_storage(model)
    classes = [type(m) for m in model.modules()]
    for _ in range(3):
        storage.unflatten()
        assert [type(m) for m in model.modules()][1:] == plain_classes[1:]  # the root keeps its class
        assert type(model[0]) is nn.Linear and "_flat_parametrize" not in model[0].__dict__
        storage.flatten()
        assert [type(m) for m in model.modules()] == classes
    assert [type(m) for m in model.modules()] == classes
    assert isinstance(model[0], nn.Linear) and type(model[0]).__name__ == "Linear"
