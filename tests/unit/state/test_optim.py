"""Optimizer state across the switch: plain <-> flat optimizer state dicts."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from flatten_parametrize import register_flat_storage
from flatten_parametrize._state.optim import flat_optim_state_dict, plain_optim_state_dict

from _helpers import TiedLM, WithOwnParam, assert_same_optim_state, assert_same_values, mlp, train_steps, twin

Step = Callable[[nn.Module, torch.optim.Optimizer], None]


def _batches(n: int, width: int = 5) -> list[torch.Tensor]:
    return [torch.randn(4, width) for _ in range(n)]


def test_adam_state_moves_from_plain_to_flattened():
    """Adam trained 3 steps on the plain model, state converted, 3 more steps: same weights as plain."""
    xs = _batches(6)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, xs[:3])
    plain = twin(model)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(optimizer.state_dict())
    storage = register_flat_storage(model, align=4)
    flat_opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    flat_opt.load_state_dict(flat_optim_state_dict(storage, optimizer.state_dict()))
    train_steps(model, flat_opt, xs[3:])
    train_steps(plain, plain_opt, xs[3:])
    assert_same_values(model, plain, rtol=1e-6, atol=1e-7)


def test_adam_state_moves_from_flattened_to_plain():
    """Adam trained 3 steps on the flattened model, state converted to a plain model, 3 more: same weights."""
    xs = _batches(6)
    model = mlp()
    storage = register_flat_storage(model, align=4)
    flat_opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, flat_opt, xs[:3])
    plain = mlp(seed=1)
    plain.load_state_dict(model.state_dict())
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(plain_optim_state_dict(storage, flat_opt.state_dict()))
    train_steps(model, flat_opt, xs[3:])
    train_steps(plain, plain_opt, xs[3:])
    assert_same_values(model, plain, rtol=1e-6, atol=1e-7)


def test_round_trip_gives_back_the_same_state():
    """plain -> flat -> plain is the identity on Adam's state, and padding is zero in the flat state."""
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    train_steps(model, optimizer, _batches(2))
    storage = register_flat_storage(model, align=8)
    flat = flat_optim_state_dict(storage, optimizer.state_dict())
    exp_avg = flat["state"][0]["exp_avg"]
    assert exp_avg.shape == storage["0"].shape
    mask = torch.ones_like(exp_avg, dtype=torch.bool)
    for info in storage.param_infos:
        mask[info.offset : info.offset + info.numel] = False
    assert mask.any() and not exp_avg[mask].any()
    assert_same_optim_state(plain_optim_state_dict(storage, flat), optimizer.state_dict())


def test_converted_state_shares_no_memory_with_the_input():
    """Changing the converted state (or the source optimizer afterwards) leaves the other untouched."""
    model = WithOwnParam()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, optimizer, [torch.randn(4, 3)])
    storage = register_flat_storage(model, ["fc.*"])  # scale and bn.* stay ordinary parameters
    source = optimizer.state_dict()
    before = copy.deepcopy(source)
    converted = flat_optim_state_dict(storage, source)
    for entry in converted["state"].values():
        entry["momentum_buffer"].add_(1.0)
    assert_same_optim_state(source, before)
    kept = copy.deepcopy(converted)
    back = plain_optim_state_dict(storage, converted)
    for entry in back["state"].values():
        entry["momentum_buffer"].add_(1.0)
    assert_same_optim_state(converted, kept)


def test_left_out_parameters_keep_their_state_both_ways():
    """Parameters in no group keep their own state; training continues identically both ways."""
    xs = [torch.randn(6, 3) for _ in range(4)]
    model = WithOwnParam()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_steps(model, optimizer, xs[:2])
    plain = twin(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    plain_opt.load_state_dict(optimizer.state_dict())
    storage = register_flat_storage(model, ["fc.weight", "bn.*"])  # scale and fc.bias stay ordinary
    flat_opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    converted = flat_optim_state_dict(storage, optimizer.state_dict())
    flat_opt.load_state_dict(converted)
    assert len(converted["state"]) == 3  # scale, flat_param_0, fc.bias
    train_steps(model, flat_opt, xs[2:])
    train_steps(plain, plain_opt, xs[2:])
    assert_same_values(model, plain, rtol=1e-6, atol=1e-7)
    back = plain_optim_state_dict(storage, flat_opt.state_dict())
    for a, b in zip(back["state"].values(), plain_opt.state_dict()["state"].values()):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"], rtol=1e-6, atol=1e-7)


def test_tied_parameters_convert_once_both_ways():
    """A tied parameter is one optimizer entry on both sides; training continues identically."""
    xs = [torch.randint(0, 11, (3, 4)) for _ in range(4)]
    model = TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, xs[:2])
    plain = twin(model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(optimizer.state_dict())
    storage = register_flat_storage(model)
    flat_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flat_opt.load_state_dict(flat_optim_state_dict(storage, optimizer.state_dict()))
    train_steps(model, flat_opt, xs[2:])
    train_steps(plain, plain_opt, xs[2:])
    assert_same_values(model, plain, rtol=1e-6, atol=1e-7)
    back = plain_optim_state_dict(storage, flat_opt.state_dict())
    assert len(back["state"]) == len(list(plain.parameters())) == 5


def test_tied_parameter_may_be_named_by_its_alias():
    """param_names may name a tied parameter by any of its names."""
    model = TiedLM()
    optimizer = torch.optim.Adam(model.parameters())
    train_steps(model, optimizer, [torch.randint(0, 11, (2, 3))])
    names = ["head.weight", "norm.weight", "norm.bias", "body.weight", "body.bias"]
    storage = register_flat_storage(model)
    converted = flat_optim_state_dict(storage, optimizer.state_dict(), param_names=names)
    assert converted["state"][0]["exp_avg"].shape == storage["0"].shape


def test_named_param_groups_follow_the_flat_groups():
    """Two param groups saved with names (named_parameters) map to two flat groups, hyperparameters kept."""
    xs = _batches(6)
    model = mlp()

    def groups(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict]:
        named = list(named)
        return [
            {"params": [(n, p) for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [(n, p) for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
        ]

    optimizer = torch.optim.AdamW(groups(model.named_parameters()), lr=1e-2)
    train_steps(model, optimizer, xs[:3])
    plain = twin(model)
    plain_opt = torch.optim.AdamW(groups(plain.named_parameters()), lr=1e-2)
    plain_opt.load_state_dict(optimizer.state_dict())
    storage = register_flat_storage(model, {"decay": ["*.weight"], "no_decay": ["*.bias"]})
    flat_opt = torch.optim.AdamW(
        [
            {"params": [("flat_param_decay", storage["decay"])], "weight_decay": 0.1},
            {"params": [("flat_param_no_decay", storage["no_decay"])], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    converted = flat_optim_state_dict(storage, optimizer.state_dict())
    assert [g["param_names"] for g in converted["param_groups"]] == [
        ["flat_param_decay"],
        ["flat_param_no_decay"],
    ]
    assert [g["weight_decay"] for g in converted["param_groups"]] == [0.1, 0.0]
    flat_opt.load_state_dict(converted)
    train_steps(model, flat_opt, xs[3:])
    train_steps(plain, plain_opt, xs[3:])
    assert_same_values(model, plain, rtol=1e-6, atol=1e-7)
    back = plain_optim_state_dict(storage, flat_opt.state_dict())
    assert [g["param_names"] for g in back["param_groups"]] == [
        g["param_names"] for g in plain_opt.state_dict()["param_groups"]
    ]


def test_param_names_give_the_optimizer_order():
    """An optimizer that holds the parameters in another order converts with param_names."""
    model = mlp(depth=2)
    named = list(model.named_parameters())[::-1]
    optimizer = torch.optim.Adam([p for _, p in named], lr=1e-2)
    train_steps(model, optimizer, _batches(2))
    storage = register_flat_storage(model)
    converted = flat_optim_state_dict(storage, optimizer.state_dict(), param_names=[n for n, _ in named])
    views = storage.views_of([converted["state"][0]["exp_avg"]])
    for name, param in named:
        assert torch.equal(views[name], optimizer.state[param]["exp_avg"]), name
    back = plain_optim_state_dict(storage, converted)
    assert [len(g["params"]) for g in back["param_groups"]] == [4]


def test_frozen_group_stays_out_of_both_optimizers():
    """A flat group none of whose parameters the optimizer holds is left out of the flat optimizer too."""
    model = mlp()
    model[0].requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_steps(model, optimizer, _batches(2))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    storage = register_flat_storage(model)  # groups '0' (frozen, seen first) and '1' (trainable)
    assert not storage["0"].requires_grad
    converted = flat_optim_state_dict(storage, optimizer.state_dict(), param_names=names)
    assert [g["params"] for g in converted["param_groups"]] == [[0]]
    flat_opt = torch.optim.Adam([storage["1"]], lr=1e-2)
    flat_opt.load_state_dict(converted)
    back = plain_optim_state_dict(storage, flat_opt.state_dict(), param_names=["flat_param_1"])
    assert_same_optim_state(back, optimizer.state_dict())


def test_members_without_state_get_zeros():
    """A member the plain optimizer never stepped (no gradient yet) gets zeros in the flat state."""
    model = mlp(depth=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model[2].requires_grad_(False)
    train_steps(model, optimizer, _batches(1))  # model[2] gets no gradient, hence no state
    model[2].requires_grad_(True)
    storage = register_flat_storage(model)
    views = storage.views_of([flat_optim_state_dict(storage, optimizer.state_dict())["state"][0]["exp_avg"]])
    assert not views["2.weight"].any() and views["0.weight"].any()


def test_conversion_works_in_unflattened_mode():
    """Converting does not depend on the storage's mode and does not change it."""
    model = WithOwnParam()
    optimizer = torch.optim.Adam(model.parameters())
    train_steps(model, optimizer, [torch.randn(4, 3)])
    storage = register_flat_storage(model, ["fc.*"])
    flat = flat_optim_state_dict(storage, optimizer.state_dict())
    with storage.unflattened():
        assert_same_optim_state(flat_optim_state_dict(storage, optimizer.state_dict()), flat)
        assert not storage.is_flattened


def test_converted_names_follow_module_parameters_order():
    """The converted param_names are those of optimizers built from named_parameters() on each side."""
    model = WithOwnParam()
    optimizer = torch.optim.Adam(model.named_parameters())
    train_steps(model, optimizer, [torch.randn(4, 3)])
    storage = register_flat_storage(model, ["fc.*", "bn.weight"])
    converted = flat_optim_state_dict(storage, optimizer.state_dict())
    expected = torch.optim.Adam(model.named_parameters()).state_dict()["param_groups"][0]["param_names"]
    assert converted["param_groups"][0]["param_names"] == expected == ["scale", "flat_param_0", "bn.bias"]
    back = plain_optim_state_dict(storage, converted)
    assert back["param_groups"][0]["param_names"] == ["scale", "fc.weight", "fc.bias", "bn.weight", "bn.bias"]


# ------------------------------------------------------------------------- errors
def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(depth=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, _batches(1))
    return model, optimizer


def test_refuses_what_is_not_an_optimizer_state_dict():
    """A non-state-dict (e.g. the optimizer itself) is a TypeError that says what to pass."""
    model, optimizer = _trained()
    storage = register_flat_storage(model)
    with pytest.raises(
        TypeError, match=r"needs an optimizer state dict .* got Adam; pass optimizer\.state_dict"
    ):
        flat_optim_state_dict(storage, optimizer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs 'state' to be a dict and 'param_groups' a list; got list"):
        plain_optim_state_dict(storage, {"state": [], "param_groups": []})
    with pytest.raises(
        TypeError, match="every param group to be a dict with a 'params' list; param group 0 is int"
    ):
        flat_optim_state_dict(storage, {"state": {}, "param_groups": [3]})


def test_refuses_state_of_ids_in_no_group():
    """State for an id that no param group holds is refused."""
    model, optimizer = _trained()
    storage = register_flat_storage(model)
    state = optimizer.state_dict()
    state["state"][7] = {}
    with pytest.raises(ValueError, match=r"ids \[7\] that no param group holds"):
        flat_optim_state_dict(storage, state)


def test_refuses_a_state_dict_of_another_model():
    """Another model's state dict: a wrong count, an unknown name, or wrong shapes are refused."""
    model, _ = _trained()
    storage = register_flat_storage(model)
    other = mlp(depth=3)
    other_opt = torch.optim.Adam(other.parameters())
    train_steps(other, other_opt, _batches(1))
    with pytest.raises(ValueError, match="it holds 6 parameters, the plain module has 4; pass param_names"):
        flat_optim_state_dict(storage, other_opt.state_dict())
    named_opt = torch.optim.Adam(nn.Linear(5, 5).named_parameters())
    with pytest.raises(
        ValueError, match="named 'weight', which is not one; pass the state dict of this model's"
    ):
        flat_optim_state_dict(storage, named_opt.state_dict())
    wider = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 5))
    wider_opt = torch.optim.Adam(wider.parameters())
    train_steps(wider, wider_opt, _batches(1))
    with pytest.raises(ValueError, match=r"state 'exp_avg' of 0.weight is \(6, 5\), the parameter \(5, 5\)"):
        flat_optim_state_dict(storage, wider_opt.state_dict())


def test_refuses_a_state_dict_of_the_other_side():
    """A flat state dict given to flat_optim_state_dict (and vice versa) names the right function."""
    model, _ = _trained()
    plain_state = torch.optim.Adam(model.named_parameters()).state_dict()
    storage = register_flat_storage(model)
    flat_state = torch.optim.Adam(model.named_parameters()).state_dict()
    with pytest.raises(
        ValueError, match=r"'flat_param_0', which is not one; .* convert it with plain_optim_state"
    ):
        flat_optim_state_dict(storage, flat_state)
    with pytest.raises(
        ValueError, match=r"'0\.weight', which is not one; .* convert it with flat_optim_state_dict"
    ):
        plain_optim_state_dict(storage, plain_state)


def test_refuses_bad_param_names():
    """param_names must be a list with one name per parameter, each parameter named once."""
    model, optimizer = _trained()
    storage = register_flat_storage(model)
    with pytest.raises(TypeError, match="needs param_names to be a list of parameter names; got str"):
        flat_optim_state_dict(storage, optimizer.state_dict(), param_names="0.weight")
    with pytest.raises(ValueError, match="param_names has 1 names for 4 parameters"):
        flat_optim_state_dict(storage, optimizer.state_dict(), param_names=["0.weight"])
    with pytest.raises(ValueError, match=r"'0\.weight' and '0\.weight' name the same parameter"):
        flat_optim_state_dict(storage, optimizer.state_dict(), param_names=["0.weight"] * 4)


def test_refuses_a_tied_parameter_listed_twice():
    """Both names of a tied parameter in one optimizer are refused: it would be stepped twice."""
    model = TiedLM()
    storage = register_flat_storage(model)
    state = {"state": {}, "param_groups": [{"params": [0, 1], "lr": 0.1}]}
    with pytest.raises(ValueError, match=r"'embed\.weight' and 'head\.weight' name the same parameter"):
        flat_optim_state_dict(storage, state, param_names=["embed.weight", "head.weight"])


def test_refuses_a_flat_group_split_over_param_groups():
    """Members of one flat group in two param groups are refused: one flat parameter, one param group."""
    model = mlp(depth=2)
    optimizer = torch.optim.Adam(
        [{"params": [model[0].weight, model[0].bias]}, {"params": list(model[2].parameters())}]
    )
    storage = register_flat_storage(model)
    with pytest.raises(
        ValueError, match=r"0\.weight is in param group 0 and 2\.weight in param group 1, both in flat"
    ):
        flat_optim_state_dict(storage, optimizer.state_dict())


def test_refuses_a_flat_group_the_optimizer_holds_in_part():
    """An optimizer holding only some members of a flat group is refused: the group steps as a whole."""
    model = mlp(depth=2)
    optimizer = torch.optim.Adam(model[0].parameters())
    storage = register_flat_storage(model)
    with pytest.raises(ValueError, match=r"holds 0\.weight but not 2\.weight, 2\.bias of flat group '0'"):
        flat_optim_state_dict(storage, optimizer.state_dict(), param_names=["0.weight", "0.bias"])


def test_refuses_scalar_state_that_differs_within_a_flat_group():
    """Adam steps that differ between members of one flat group cannot become one step."""
    model, optimizer = _trained()
    state = optimizer.state_dict()
    state["state"][1]["step"] = torch.tensor(5.0)
    storage = register_flat_storage(model)
    with pytest.raises(
        ValueError, match=r"state 'step' is tensor\(1.\) for 0.weight and tensor\(5.\) for 0.bias"
    ):
        flat_optim_state_dict(storage, state)


def test_refuses_state_that_is_neither_per_element_nor_scalar():
    """A state tensor of another shape (factored second moments, say) cannot be flattened."""
    model, optimizer = _trained()
    state = optimizer.state_dict()
    for entry in state["state"].values():
        entry["row_var"] = torch.zeros(2)
    storage = register_flat_storage(model)
    with pytest.raises(
        ValueError, match=r"state 'row_var' of 0.weight has shape \(2,\), which flat group '0'"
    ):
        flat_optim_state_dict(storage, state)


def test_refuses_flat_state_of_another_size():
    """Flat-parameter state of another length (another layout) is refused when splitting."""
    model = mlp(depth=2)
    storage = register_flat_storage(model)
    state = {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"params": [0]}]}
    with pytest.raises(ValueError, match=r"state 'exp_avg' of flat_param_0 has shape \(3,\); pass the state"):
        plain_optim_state_dict(storage, state)


@pytest.mark.parametrize(
    "factory,groups",
    [
        (lambda: nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 5)), nn.Linear(5, 2)), None),
        (WithOwnParam, ["scale", "bn.*"]),
        (TiedLM, ["head.weight", "norm.*"]),
    ],
    ids=["parametrized", "root_param_grouped", "tied_grouped"],
)
def test_param_order_is_that_of_named_parameters_on_each_side(factory, groups):
    """Converted param_names equal named_parameters() of the plain model and of the flattened one."""
    model = factory()
    plain_state = torch.optim.SGD(model.named_parameters(), lr=0.1).state_dict()
    storage = register_flat_storage(model, groups)
    flat_state = torch.optim.SGD(model.named_parameters(), lr=0.1).state_dict()
    assert flat_optim_state_dict(storage, plain_state)["param_groups"] == flat_state["param_groups"]
    assert plain_optim_state_dict(storage, flat_state)["param_groups"] == plain_state["param_groups"]
    with storage.unflattened():
        assert flat_optim_state_dict(storage, plain_state)["param_groups"] == flat_state["param_groups"]
