"""register_flat_storage / get_flat_storage / remove_flat_storage: what they change and restore."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from flatten_parametrize import FlatParameter, get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import TiedLM, WithOwnParam, assert_same_values, mlp, values


def test_register_keeps_the_module_tree_print_and_container_behaviour():
    """No child module is added: len, indexing, iteration, print and modules() are as before."""
    model = mlp(3)
    before_print, before_modules = str(model), [type(m) for m in model.modules()]
    children = list(model)
    register_flat_storage(model)
    assert len(model) == 6 and list(model) == children and model[0] is children[0]
    assert str(model) == before_print
    assert [type(m).__name__ for m in model.modules()] == [t.__name__ for t in before_modules]
    assert all(isinstance(m, t) for m, t in zip(model.modules(), before_modules))


def test_parameters_are_the_flat_parameters_and_attributes_are_views():
    """module.parameters() yields the flat parameter; layer.weight is a view of it."""
    model = mlp(2)
    storage = register_flat_storage(model)
    params = list(model.parameters())
    assert len(params) == 1 and isinstance(params[0], FlatParameter)
    assert params[0] is storage["0"] and storage.flat_params == [params[0]]
    weight = model[0].weight
    assert not weight.is_leaf and weight.shape == (5, 5)
    assert weight.untyped_storage().data_ptr() == params[0].untyped_storage().data_ptr()


def test_values_survive_registration():
    """Every parameter reads the same values after registration."""
    model = WithOwnParam()
    before = values(model)
    register_flat_storage(model)
    after = values(model)
    assert list(after) == list(before)
    for key in before:
        assert torch.equal(before[key], after[key])


def test_automatic_groups_split_by_dtype_and_requires_grad_in_first_seen_order():
    """groups=None makes one group per (device, dtype, requires_grad), named 0, 1, ..."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double(), nn.Linear(2, 2))
    model[2].requires_grad_(False)
    storage = register_flat_storage(model)
    assert storage.group_names == ["0", "1", "2"]
    assert [f.dtype for f in storage.flat_params] == [torch.float32, torch.float64, torch.float32]
    assert [f.requires_grad for f in storage.flat_params] == [True, True, False]
    assert [i.name for i in storage.param_infos if i.group == "2"] == ["2.weight", "2.bias"]


def test_module_without_parameters_gets_an_empty_storage():
    """A parameterless module registers fine, with no groups."""
    model = nn.Sequential(nn.ReLU())
    storage = register_flat_storage(model)
    assert storage.group_names == [] and storage.flat_params == [] and list(model.parameters()) == []


def test_group_forms_list_nested_dict_and_items():
    """A list is group 0, a list of lists gives 0, 1, a dict gives named groups; items mix kinds."""
    model = mlp(3)
    storage = register_flat_storage(model, [model[0].weight, model[2], "4.*"])
    assert storage.group_names == ["0"]
    assert [i.name for i in storage.param_infos] == ["0.weight", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert [n for n, _ in model.named_parameters()] == ["flat_param_0", "0.bias"]
    remove_flat_storage(model)

    storage = register_flat_storage(model, [[model[0]], (model[2], model[4])])
    assert storage.group_names == ["0", "1"]
    remove_flat_storage(model)

    storage = register_flat_storage(model, {"decay": ["*.weight"], "no_decay": model[0].bias})
    assert storage.group_names == ["decay", "no_decay"]
    assert [n for n, _ in model.named_parameters()] == [
        "flat_param_decay",
        "flat_param_no_decay",
        "2.bias",
        "4.bias",
    ]


@pytest.mark.parametrize("groups", [[], [[]], {}, {"no_decay": []}, [[], []], "parameterless-submodule"])
def test_explicitly_empty_groups_flatten_nothing(groups):
    """An empty groups argument or group is not an error: no flat parameter, the module as before."""
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    if groups == "parameterless-submodule":
        groups = [model[1]]
    before = values(model)
    named = [(n, p) for n, p in model.named_parameters()]
    storage = register_flat_storage(model, groups)
    assert storage.group_names == [] and storage.flat_params == [] and storage.param_infos == []
    assert [(n, p) for n, p in model.named_parameters()] == named
    assert type(model[0]) is nn.Linear and isinstance(model[0].weight, nn.Parameter)
    assert list(storage.named_views()) == [] and list(storage.named_grads()) == []
    assert "name" in storage.summary() and "group" in repr(storage)
    for sd in (model.state_dict(), storage.flat_state_dict()):
        assert list(sd) == list(before) and all(torch.equal(sd[k], before[k]) for k in before)
    model.load_state_dict(storage.flat_state_dict())
    with storage.unflattened():
        assert [(n, p) for n, p in model.named_parameters()] == named
    assert storage.is_flattened
    assert storage.views_of([]) == {}
    with storage.using([]):
        model(torch.ones(1, 3)).sum().backward()
    assert model[0].weight.grad is not None
    remove_flat_storage(model)
    assert get_flat_storage(model) is None and [(n, p) for n, p in model.named_parameters()] == named


@pytest.mark.parametrize(
    ("groups", "names", "members"),
    [
        (lambda m: [[], [m[0].weight]], ["0"], [["0.weight"]]),
        (lambda m: [[m[0].weight], [], ["*.bias"]], ["0", "1"], [["0.weight"], ["0.bias"]]),
        (lambda m: {"a": [], "b": [m[0]]}, ["b"], [["0.weight", "0.bias"]]),
        (lambda m: {"decay": ["*.weight"], "no_decay": []}, ["decay"], [["0.weight"]]),
    ],
    ids=["leading-empty-list", "empty-list-between", "empty-dict-entry", "empty-no-decay-side"],
)
def test_only_non_empty_groups_get_a_flat_parameter(groups, names, members):
    """List groups are numbered over the non-empty ones (as fairscale's param_list); dict keys are kept."""
    model = nn.Sequential(nn.Linear(3, 2))
    twin_model = copy.deepcopy(model)
    storage = register_flat_storage(model, groups(model))
    assert storage.group_names == names
    assert [n for n, _ in model.named_parameters() if n.startswith("flat_param_")] == [
        f"flat_param_{n}" for n in names
    ]
    assert [[i.name for i in storage.param_infos if i.group == n] for n in names] == members
    x = torch.randn(4, 3)
    model(x).sum().backward()
    twin_model(x).sum().backward()
    assert torch.equal(dict(storage.named_grads())["0.weight"], twin_model[0].weight.grad)
    sd = storage.flat_state_dict()
    restored = nn.Sequential(nn.Linear(3, 2))
    register_flat_storage(restored, groups(restored)).module.load_state_dict(sd)
    assert torch.equal(restored[0].weight, twin_model[0].weight)
    remove_flat_storage(model)
    assert list(model.state_dict()) == ["0.weight", "0.bias"]


def test_generator_of_parameters_is_one_group():
    """An iterator such as module.parameters() is accepted as one group."""
    model = mlp(2)
    storage = register_flat_storage(model, model[0].parameters())
    assert [i.name for i in storage.param_infos] == ["0.weight", "0.bias"]


def test_parameters_left_out_stay_ordinary_parameters():
    """Parameters in no group stay ordinary leaf parameters of their module."""
    model = mlp(2)
    bias = model[2].bias
    register_flat_storage(model, ["0.*"])
    assert model[2].bias is bias and model[2].bias.is_leaf


def test_tied_parameter_has_one_slot_and_every_name_is_a_view_of_it():
    """An embedding tied to the head occupies one slot; both names are views of it."""
    model = TiedLM()
    storage = register_flat_storage(model)
    (info,) = [i for i in storage.param_infos if i.name == "embed.weight"]
    assert info.aliases == ("head.weight",)
    assert sum(i.numel for i in storage.param_infos) == storage["0"].numel()
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    with torch.no_grad():
        model.embed.weight[0, 0] = 42.0
    assert model.head.weight[0, 0].item() == 42.0


def test_align_pads_offsets_with_invisible_zeros():
    """With align=N every view starts at a multiple of N and the padding is zero."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    storage = register_flat_storage(model, align=8)
    assert all(i.offset % 8 == 0 for i in storage.param_infos)
    flat = storage["0"].detach()
    covered = torch.zeros(flat.numel(), dtype=torch.bool)
    for info in storage.param_infos:
        covered[info.offset : info.offset + info.numel] = True
    assert flat.numel() % 8 == 0 and flat[~covered].eq(0).all()
    assert model[0].weight.shape == (3, 3) and model[1].bias.shape == (1,)


def test_get_flat_storage_returns_the_coordinator_or_none():
    """get_flat_storage answers the coordinator of the registered module, else None."""
    model = mlp(1)
    assert get_flat_storage(model) is None
    storage = register_flat_storage(model)
    assert get_flat_storage(model) is storage and get_flat_storage(model[0]) is None
    remove_flat_storage(model)
    assert get_flat_storage(model) is None


def test_remove_restores_parameters_classes_keys_and_current_values():
    """remove_flat_storage gives back the same Parameter objects, classes and keys, with new values."""
    model = WithOwnParam()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    classes = [type(m) for m in model.modules()]
    storage = register_flat_storage(model)
    with torch.no_grad():
        storage["0"].add_(1.0)
    expected = values(model)
    remove_flat_storage(model)
    assert dict(model.named_parameters()) == params
    assert [type(m) for m in model.modules()] == classes and type(model.fc) is nn.Linear
    assert list(model.state_dict()) == keys
    assert_same_values(model, expected)
    assert not parametrize.is_parametrized(model.fc)
    for module in model.modules():
        assert "_flat_parametrize" not in module.__dict__ and "parametrizations" not in module.__dict__
    assert model.fc.weight.is_leaf and model.fc.weight.untyped_storage().size() == 9 * 4


def test_remove_keeps_ties_and_gradients():
    """After removal a tied parameter is one object again and gradients are kept."""
    model = TiedLM()
    register_flat_storage(model)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    remove_flat_storage(model)
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.grad is not None and model.body.bias.grad is not None


def test_register_remove_round_trip_twice_trains_like_plain():
    """Registration can be removed and redone; the model then still trains."""
    model = mlp(2)
    register_flat_storage(model)
    remove_flat_storage(model)
    storage = register_flat_storage(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = storage["0"].detach().clone()
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    assert not torch.equal(before, storage["0"].detach())


def test_deepcopy_gives_an_independent_flattened_copy():
    """copy.deepcopy copies the flat buffer; the copy's views point at its own buffer."""
    model = mlp(2)
    storage = register_flat_storage(model)
    x = torch.randn(3, 5)
    model(x)  # fill the view cache
    clone = copy.deepcopy(model)
    other = get_flat_storage(clone)
    assert other is not None and other is not storage
    assert other["0"] is not storage["0"] and other["0"].data_ptr() != storage["0"].data_ptr()
    torch.testing.assert_close(clone(x), model(x))
    with torch.no_grad():
        other["0"].zero_()
    assert model[0].weight.abs().sum() > 0 and clone[0].weight.abs().sum() == 0
    assert type(clone[0]) is type(model[0]) and type(clone[0]).__name__ == "Linear"  # one class, shared
    remove_flat_storage(clone)
    assert type(clone[0]) is nn.Linear and type(model[0]) is not nn.Linear
    torch.testing.assert_close(model(x), model(x))


def test_deepcopy_of_unflattened_model_stays_independent():
    """A deep copy taken in unflattened mode flattens into its own buffer."""
    model = mlp(1)
    storage = register_flat_storage(model)
    storage.unflatten()
    clone = copy.deepcopy(model)
    other = get_flat_storage(clone)
    other.flatten()
    with torch.no_grad():
        other["0"].fill_(3.0)
    assert not torch.equal(model[0].weight, clone[0].weight)
    assert clone[0].weight.eq(3.0).all()


def test_registration_is_atomic_when_a_class_cannot_be_created():
    """A module class whose __init_subclass__ raises leaves the module exactly as before."""

    class Refuses(nn.Linear):
        def __init_subclass__(cls, **kwargs):
            raise TypeError("no subclasses of Refuses")

    model = nn.Sequential(nn.Linear(2, 2), Refuses(2, 2))
    params = dict(model.named_parameters())
    with pytest.raises(TypeError, match="no subclasses"):
        register_flat_storage(model)
    assert dict(model.named_parameters()) == params
    assert type(model[0]) is nn.Linear and type(model[1]) is Refuses
    assert get_flat_storage(model) is None
    assert all("_flat_parametrize" not in m.__dict__ for m in model.modules())


def test_registration_is_atomic_when_a_late_step_fails(monkeypatch):
    """If installing the k-th view fails, everything installed before is undone."""
    import flatten_parametrize._install.surgery as install_module

    real = install_module.register_view
    for fail_at in range(4):
        calls = {"n": 0}

        def flaky(*args, calls=calls, fail_at=fail_at, **kwargs):
            if calls["n"] == fail_at:
                raise RuntimeError("injected failure")
            calls["n"] += 1
            return real(*args, **kwargs)

        model = WithOwnParam()
        params = dict(model.named_parameters())
        before = values(model)
        text = str(model)
        monkeypatch.setattr(install_module, "register_view", flaky)
        with pytest.raises(RuntimeError, match="injected failure"):
            register_flat_storage(model)
        monkeypatch.setattr(install_module, "register_view", real)
        assert dict(model.named_parameters()) == params
        assert all(p.is_leaf for p in params.values())
        after = values(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert str(model) == text and type(model.fc) is nn.Linear
        assert not any(parametrize.is_parametrized(m) for m in model.modules())
        assert list(model.state_dict()) == list(before)
