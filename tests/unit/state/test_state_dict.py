"""State dicts: plain keys and order, zero copy, both forms, strictness, atomic loading."""

from __future__ import annotations

import io
from collections import OrderedDict

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import TiedLM, WithOwnParam, mlp, twin, values


def _flat_ptr_range(storage) -> range:
    flat = storage["0"]
    return range(flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size())


@pytest.mark.parametrize(
    "factory", [WithOwnParam, TiedLM, lambda: nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))]
)
def test_state_dict_has_the_plain_keys_in_plain_order(factory):
    """state_dict() of the flattened module equals the plain module's keys, in order."""
    model = factory()
    keys = list(model.state_dict())
    sub_keys = {name: list(m.state_dict()) for name, m in model.named_children()}
    register_flat_storage(model)
    assert list(model.state_dict()) == keys
    for name, sub in model.named_children():
        assert list(sub.state_dict()) == sub_keys[name]


def test_state_dict_is_zero_copy():
    """State-dict values of flattened parameters share memory with the flat buffer."""
    model = WithOwnParam()
    storage = register_flat_storage(model)
    sd = model.state_dict()
    inside = _flat_ptr_range(storage)
    for info in storage.param_infos:
        assert sd[info.name].data_ptr() in inside
        assert not sd[info.name].requires_grad
    kept = model.state_dict(keep_vars=True)
    assert kept["fc.weight"].requires_grad


def test_plain_checkpoint_loads_into_flattened_and_back():
    """A plain model's checkpoint loads into the flattened model and vice versa."""
    source = WithOwnParam()
    with torch.no_grad():
        for p in source.parameters():
            p.uniform_()
    source.bn.running_mean.fill_(0.25)
    target = WithOwnParam()
    register_flat_storage(target)
    target.load_state_dict(source.state_dict())
    expected = values(source)
    assert all(torch.equal(v, expected[k]) for k, v in values(target).items())
    back = WithOwnParam()
    back.load_state_dict(target.state_dict())
    assert all(torch.equal(v, expected[k]) for k, v in values(back).items())


def test_flat_state_dict_round_trips_into_a_same_layout_model():
    """flat_state_dict() loads into another model registered with the same groups."""
    source = TiedLM()
    storage = register_flat_storage(source, align=4)
    flat = storage.flat_state_dict()
    assert list(flat)[:2] == ["flat_param_0", "flat_layout_0"]
    assert flat["flat_param_0"].data_ptr() == storage["0"].data_ptr()
    assert flat["flat_layout_0"].dtype == torch.uint8
    target = TiedLM()
    register_flat_storage(target, align=4)
    target.load_state_dict(flat)
    for (k, a), (_, b) in zip(values(source).items(), values(target).items()):
        assert torch.equal(a, b), k


def test_flat_state_dict_survives_torch_save_with_weights_only():
    """Both forms survive torch.save / torch.load(weights_only=True)."""
    model = WithOwnParam()
    storage = register_flat_storage(model)
    for state in (model.state_dict(), storage.flat_state_dict()):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        fresh = WithOwnParam()
        register_flat_storage(fresh)
        fresh.load_state_dict(loaded)
        assert all(torch.equal(a, b) for a, b in zip(values(model).values(), values(fresh).values()))


def test_load_casts_dtypes_like_plain_pytorch():
    """A float64 checkpoint loads into a float32 flattened model, cast."""
    source = mlp(1)
    target = twin(source)
    register_flat_storage(target)
    target.load_state_dict({k: v.double() * 2 for k, v in source.state_dict().items()})
    torch.testing.assert_close(target[0].weight, source[0].weight * 2)


def test_non_strict_load_reports_original_names():
    """strict=False returns missing and unexpected keys by their original names."""
    model = mlp(2)
    register_flat_storage(model)
    sd = twin(model).state_dict() if False else mlp(2, seed=3).state_dict()
    del sd["2.weight"]
    sd["extra.weight"] = torch.zeros(1)
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["2.weight"]
    assert result.unexpected_keys == ["extra.weight"]
    torch.testing.assert_close(model[0].weight, mlp(2, seed=3)[0].weight)


def test_load_state_dict_is_atomic_on_a_late_missing_key():
    """A strict load that fails on a missing key has copied no value (flat or not)."""
    model = WithOwnParam()
    register_flat_storage(model, ["fc.*"])
    before = values(model)
    sd = {k: torch.full_like(v, 9) for k, v in before.items()}
    del sd["bn.running_var"]
    with pytest.raises(RuntimeError, match=r'Missing key.*"bn\.running_var"'):
        model.load_state_dict(sd)
    after = values(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_load_state_dict_is_atomic_on_a_wrong_shape():
    """A shape mismatch in the last entry leaves every earlier entry untouched, also non-strict."""
    model = WithOwnParam()
    register_flat_storage(model)
    before = values(model)
    sd = {k: torch.full_like(v, 9) for k, v in before.items()}
    sd["bn.bias"] = torch.zeros(4)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=r"size mismatch for bn\.bias"):
            model.load_state_dict(sd, strict=strict)
        after = values(model)
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_load_state_dict_is_atomic_when_a_module_raises(monkeypatch):
    """An exception from any module's loader rolls back values loaded before it."""
    model = WithOwnParam()
    register_flat_storage(model, ["fc.*", "scale"])
    before = values(model)
    sd = {k: torch.full_like(v, 9) for k, v in before.items()}

    def boom(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(type(model.bn), "_load_from_state_dict", boom)
    with pytest.raises(OSError, match="disk on fire"):
        model.load_state_dict(sd)
    after = values(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_assign_true_copies_into_the_flat_buffer():
    """load_state_dict(assign=True) keeps flattened slots in the flat buffer."""
    model = mlp(1)
    storage = register_flat_storage(model)
    sd = {k: torch.ones_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    assert storage["0"].eq(1).all()
    assert model[0].weight.data_ptr() == storage["0"].data_ptr()


def test_load_in_unflattened_mode_keeps_parameters_and_mode():
    """Loading while unflattened updates the same Parameter objects and stays unflattened."""
    model = mlp(1)
    storage = register_flat_storage(model)
    with storage.unflattened():
        weight = model[0].weight
        model.load_state_dict({k: torch.ones_like(v) for k, v in model.state_dict().items()})
        assert not storage.is_flattened and model[0].weight is weight and weight.eq(1).all()
    assert storage["0"].eq(1).all()


def test_submodule_and_parent_loads_work():
    """load_state_dict on a submodule, or on a parent of the registered module, reaches the flat buffer."""
    inner = mlp(2)
    storage = register_flat_storage(inner)
    inner[0].load_state_dict({"weight": torch.ones(5, 5), "bias": torch.zeros(5)})
    assert storage["0"][:25].eq(1).all()
    outer = nn.Sequential(OrderedDict(body=inner, head=nn.Linear(5, 1)))
    sd = outer.state_dict()
    assert list(sd)[:2] == ["body.0.weight", "body.0.bias"]
    sd["body.2.bias"] = torch.full((5,), 3.0)
    outer.load_state_dict(sd)
    assert inner[2].bias.eq(3).all()
    flat = {f"body.{k}": v for k, v in storage.flat_state_dict().items()}
    flat.update({f"head.{k}": v for k, v in outer.head.state_dict().items()})
    outer.load_state_dict(flat)


def test_loading_through_a_parametrized_optimizer_copy_is_exact():
    """A state dict taken, modified and loaded back gives exactly the modified values."""
    model = TiedLM()
    register_flat_storage(model)
    sd = {k: v + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(sd)
    for key, value in model.state_dict().items():
        assert torch.equal(value, sd[key]), key


def test_flat_state_dict_of_another_dtype_is_cast():
    """A float64 flat checkpoint loads into a float32 flattened model, cast."""
    source = mlp(2)
    storage = register_flat_storage(source)
    flat = {k: (v.double() if k == "flat_param_0" else v) for k, v in storage.flat_state_dict().items()}
    target = mlp(2, seed=5)
    register_flat_storage(target)
    target.load_state_dict(flat)
    assert target[0].weight.dtype == torch.float32
    torch.testing.assert_close(target[0].weight, source[0].weight)


def test_partial_flat_load_non_strict_reports_the_missing_group_by_original_names():
    """strict=False with one group's flat entry missing loads the others and lists the missing names."""
    source = mlp(2)
    storage = register_flat_storage(source, {"w": ["*.weight"], "b": ["*.bias"]})
    flat = storage.flat_state_dict()
    del flat["flat_param_b"], flat["flat_layout_b"]
    target = mlp(2, seed=5)
    target_storage = register_flat_storage(target, {"w": ["*.weight"], "b": ["*.bias"]})
    before_b = target_storage["b"].detach().clone()
    result = target.load_state_dict(flat, strict=False)
    assert result.missing_keys == ["0.bias", "2.bias"] and result.unexpected_keys == []
    assert torch.equal(target_storage["w"], storage["w"]) and torch.equal(target_storage["b"], before_b)


def test_flat_state_dict_in_unflattened_mode_has_current_values_without_toggling():
    """flat_state_dict() while unflattened: a reassigned parameter lands in its slot first, mode kept."""
    model = mlp(1)
    storage = register_flat_storage(model)
    storage.unflatten()
    weight = model[0].weight
    model[0].bias = nn.Parameter(torch.full((5,), 3.0))
    flat = storage.flat_state_dict()["flat_param_0"]
    assert flat[25:].eq(3).all() and storage["0"][25:].eq(3).all()
    assert model[0].bias.data_ptr() == storage["0"][25:].data_ptr()  # the new leaf is its slot
    assert not storage.is_flattened and model[0].weight is weight
