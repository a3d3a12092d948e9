"""register_flat_storage refuses wrong types, bad values and bad state; a refusal changes nothing.

Each test pins the exception type and the part of the message that names the offending parameter,
group, item or module together with the rule it breaks, and (for calls on a module) checks with
:func:`assert_unchanged` that the failed call left the module exactly as it was: same parameter
objects, bit-for-bit the same values, same classes, library attributes, hooks and storage.
"""

from __future__ import annotations

import copy
import pickle
import re
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import TiedHead, assert_plain, assert_unchanged, bn_mlp, registered_bn_mlp, snapshot


def frozen_mlp(seed: int = 0) -> nn.Sequential:
    model = bn_mlp(seed)
    model[0].requires_grad_(False)
    return model


# ------------------------------------------- what a refused registration leaves


def test_registration_is_atomic_when_a_class_cannot_be_subclassed():
    """A module class that refuses subclassing makes registration fail with its error; nothing changes."""

    class Sealed(nn.Linear):
        def __init_subclass__(cls, **kwargs: Any) -> None:
            raise RuntimeError("Sealed cannot be subclassed")

    model = nn.Sequential(nn.Linear(3, 4), Sealed(4, 2))
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r"Sealed cannot be subclassed"):
        register_flat_storage(model)
    assert_unchanged(model, snap)
    assert_plain(model)


def test_deepcopy_of_a_failed_registration_is_plain():
    """After a refused registration the module deep-copies and pickles as a plain module."""
    model = bn_mlp()
    with pytest.raises(ValueError, match=r"parameter 0\.weight is in two groups, 'a' and 'b'"):
        register_flat_storage(model, {"a": ["0.*"], "b": ["0.weight"]})
    clone = copy.deepcopy(model)
    assert_plain(clone)
    pickle.loads(pickle.dumps(model))


# ------------------------------------------------------------------ wrong types


def test_register_refuses_a_module_that_is_not_a_module():
    """register_flat_storage needs an nn.Module: anything else is a TypeError naming its type."""
    with pytest.raises(TypeError, match=r"register_flat_storage needs an nn\.Module; got str"):
        register_flat_storage("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"register_flat_storage needs an nn\.Module; got Parameter"):
        register_flat_storage(nn.Parameter(torch.zeros(2)))  # type: ignore[arg-type]


def test_register_refuses_groups_as_a_bare_str():
    """A bare str as groups is a TypeError that shows the pattern and says to wrap it in a list."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"got the str '\*\.weight'; write \['\*\.weight'\]"):
        register_flat_storage(model, "*.weight")  # type: ignore[arg-type]
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_single_parameter_as_groups():
    """A single Parameter as groups is a TypeError describing it and saying to wrap it in a list."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"got a single Parameter of shape \(4, 3\); wrap it in a list"):
        register_flat_storage(model, model[0].weight)  # type: ignore[arg-type]
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_single_module_as_groups():
    """A single Module as groups is a TypeError naming its class and saying to wrap it in a list."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"got a single module Linear; wrap it in a list"):
        register_flat_storage(model, model[0])  # type: ignore[arg-type]
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_non_str_group_name():
    """Mapping keys are group names and must be str: TypeError naming the bad key."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"group names must be str; got int 0"):
        register_flat_storage(model, {0: ["0.*"]})  # type: ignore[dict-item]
    assert_unchanged(model, snap)
    assert_plain(model)


@pytest.mark.parametrize(
    ("item", "shown"),
    [(3, r"got int 3"), (None, r"got NoneType None"), (b"0.weight", r"got bytes b'0\.weight'")],
)
def test_register_refuses_an_item_of_a_wrong_type(item, shown):
    """A group item is a Parameter, Module or str pattern: anything else is a TypeError naming it."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(
        TypeError,
        match=r"item 1 of group 'decay' must be an nn\.Parameter, an nn\.Module or a str pattern; " + shown,
    ):
        register_flat_storage(model, {"decay": [model[0].weight, item]})
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_plain_tensor_item():
    """A plain Tensor (not the module's Parameter) as an item is a TypeError naming item, group and shape."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(
        TypeError, match=r"item 1 of group '0' is a Tensor of shape \(4, 3\), not an nn\.Parameter"
    ):
        register_flat_storage(model, [model[0].bias, model[0].weight.detach()])
    assert_unchanged(model, snap)
    assert_plain(model)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (
            {"decay": 3},
            r"group 'decay' must be an iterable of parameters, modules or name patterns; got int 3",
        ),
        ({"decay": b"x"}, r"group 'decay' must be an iterable .*; got bytes b'x'"),
        ([["0.*"], 7], r"group '1' must be an iterable of parameters, modules or name patterns; got int 7"),
        (5, r"groups must be an iterable of parameters, modules or name patterns; got int 5"),
    ],
)
def test_register_refuses_a_group_that_is_not_iterable(groups, message):
    """Each group value must be an iterable of items: TypeError naming the group and the value."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=message):
        register_flat_storage(model, groups)
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_mixing_items_and_nested_groups():
    """groups is either one group or a list of groups, not both: TypeError naming the nested entry."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"groups mixes single items and nested groups: got list \['2\.\*'\]"):
        register_flat_storage(model, [model[0].weight, ["2.*"]])
    assert_unchanged(model, snap)
    assert_plain(model)


@pytest.mark.parametrize(("align", "shown"), [(2.0, "float 2.0"), (True, "bool True"), ("4", "str '4'")])
def test_register_refuses_align_of_a_wrong_type(align, shown):
    """align must be an int (not float, bool or str): TypeError showing the value."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"align must be an int; got " + re.escape(shown)):
        register_flat_storage(model, align=align)
    assert_unchanged(model, snap)
    assert_plain(model)


# ------------------------------------------------------------------- bad values


def test_register_refuses_a_parameter_not_in_the_module():
    """Only parameters of the module can be flattened: ValueError naming item, group and shape."""
    model = bn_mlp()
    stranger = nn.Parameter(torch.zeros(2, 5))
    snap = snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"item 1 of group 'w' is not a parameter of the module: a Parameter of shape \(2, 5\)",
    ):
        register_flat_storage(model, {"w": [model[0].weight, stranger]})
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_module_not_in_the_module():
    """Only submodules of the module can be group items: ValueError naming item, group and class."""
    model = bn_mlp()
    other = nn.Conv1d(1, 1, 1)
    snap = snapshot(model)
    with pytest.raises(
        ValueError, match=r"item 0 of group '0' is a module Conv1d that is not a submodule of the module"
    ):
        register_flat_storage(model, [other])
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_glob_that_matches_nothing():
    """A str pattern must match some parameter name: ValueError naming the pattern and example names."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"item 1 of group '0': pattern '\*\.kernel' matches no parameter name; "
        r"names look like '0\.weight'",
    ):
        register_flat_storage(model, ["*.weight", "*.kernel"])
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_parameter_in_two_groups():
    """A parameter lives in one flat buffer: ValueError naming it and both groups."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"parameter 0\.weight is in two groups, 'weights' and 'first'"):
        register_flat_storage(model, {"weights": ["*.weight"], "first": [model[0]]})
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_tied_parameter_in_two_groups_by_its_two_names():
    """Both names of a tied parameter are one slot: putting them in two groups is a ValueError."""
    model = TiedHead()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"parameter emb\.weight is in two groups, 'a' and 'b'"):
        register_flat_storage(model, {"a": ["emb.weight"], "b": ["head.weight"]})
    assert_unchanged(model, snap)
    assert_plain(model)


def test_same_parameter_twice_in_one_group_is_one_slot():
    """Listing a parameter twice in one group (directly, by module or by overlapping globs) gives one slot."""
    model = nn.Sequential(nn.Linear(2, 2))
    storage = register_flat_storage(model, [model[0].weight, model[0], "0.*", "*.weight"])
    assert [info.name for info in storage.param_infos] == ["0.weight", "0.bias"]


def test_register_refuses_an_explicit_group_mixing_dtypes():
    """One flat buffer has one dtype: ValueError naming the group, both parameters and dtypes."""
    model = bn_mlp()
    model[2].double()
    snap = snapshot(model)
    with pytest.raises(
        ValueError, match=r"group 'all' mixes dtypes: 0\.weight is float32, 2\.weight is float64"
    ):
        register_flat_storage(model, {"all": ["0.weight", "2.weight"]})
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_an_explicit_group_mixing_requires_grad():
    """One flat buffer has one requires_grad: ValueError naming the group and both parameters."""
    model = frozen_mlp()
    snap = snapshot(model)
    with pytest.raises(
        ValueError, match=r"group '0' mixes requires_grad: 0\.weight is False, 1\.weight is True"
    ):
        register_flat_storage(model, ["*.weight"])
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_an_explicit_group_mixing_devices():
    """One flat buffer lives on one device: ValueError naming the group, both parameters and devices."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, device="meta"))
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"group '0' mixes devices: 0\.weight is cpu, 1\.weight is meta"):
        register_flat_storage(model, [model[0], model[1]])
    assert_unchanged(model, snap)
    assert_plain(model)


@pytest.mark.parametrize("name", ["a.b", "", "a b", "x-y"])
def test_register_refuses_an_invalid_group_name(name):
    """A group name must make a valid attribute flat_param_<name>: ValueError naming it."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=rf"group name {re.escape(repr(name))} cannot name a parameter"):
        register_flat_storage(model, {"ok": ["0.*"], name: ["2.*"]})
    assert_unchanged(model, snap)
    assert_plain(model)


@pytest.mark.parametrize("kind", ["buffer", "attribute", "submodule"])
def test_register_refuses_a_group_name_colliding_with_an_attribute(kind):
    """flat_param_<group> must be a free attribute name: ValueError naming the group and the attribute."""
    model = bn_mlp()
    if kind == "buffer":
        model.register_buffer("flat_param_x", torch.ones(2))
    elif kind == "attribute":
        model.flat_param_x = 3
    else:
        model.flat_param_x = nn.Identity()
    snap = snapshot(model)
    with pytest.raises(
        ValueError, match=r"group name 'x' would register 'flat_param_x', which the module already has"
    ):
        register_flat_storage(model, {"x": ["0.*"]})
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_an_automatic_group_name_colliding_with_an_attribute():
    """groups=None names groups '0', '1', ...: a taken flat_param_0 is a ValueError, not an overwrite."""
    model = bn_mlp()
    model.register_buffer("flat_param_0", torch.ones(2))
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"group name '0' would register 'flat_param_0'"):
        register_flat_storage(model)
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_duplicate_group_names():
    """Group names are unique: a mapping that yields a name twice is a ValueError naming it."""

    class Twice(Mapping):
        def __init__(self, groups: list[tuple[str, list[str]]]) -> None:
            self._groups = groups

        def __getitem__(self, key: str) -> list[str]:
            return next(v for k, v in self._groups if k == key)

        def __iter__(self) -> Iterator[str]:
            return iter([k for k, _ in self._groups])

        def __len__(self) -> int:
            return len(self._groups)

        def items(self):  # type: ignore[override]
            return list(self._groups)

    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"duplicate group name 'g'"):
        register_flat_storage(model, Twice([("g", ["0.*"]), ("g", ["2.*"])]))
    assert_unchanged(model, snap)
    assert_plain(model)


@pytest.mark.parametrize("align", [0, -4])
def test_register_refuses_align_below_one(align):
    """align must be >= 1: ValueError showing the value."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=rf"align must be >= 1; got {align}"):
        register_flat_storage(model, align=align)
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_sparse_parameter_in_a_group():
    """Only dense parameters can share a flat buffer: ValueError naming the sparse parameter."""
    model = nn.Linear(3, 3)
    model.sp = nn.Parameter(torch.eye(3).to_sparse())
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"cannot flatten 'sp': only dense \(strided\) parameters"):
        register_flat_storage(model)
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_accepts_a_sparse_parameter_left_out_of_every_group():
    """The sparse-parameter error says 'leave it out of the groups': doing so must work."""
    model = nn.Linear(3, 3)
    sp = model.sp = nn.Parameter(torch.eye(3).to_sparse())
    storage = register_flat_storage(model, ["weight", "bias"])
    assert storage.group_names == ["0"]
    assert model.sp is sp


def test_register_refuses_a_parameter_subclass():
    """A Parameter subclass would lose its behaviour as a view: refused, naming it."""

    class Tagged(nn.Parameter):
        pass

    model = nn.Sequential(nn.Linear(2, 2))
    model[0].bias = Tagged(torch.zeros(2))
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"cannot flatten '0.bias': it is a Tagged.*pass explicit groups"):
        register_flat_storage(model)
    assert_unchanged(model, snap)
    storage = register_flat_storage(model, ["0.weight"])
    assert type(model[0].bias) is Tagged and storage.group_names == ["0"]


@pytest.mark.parametrize("groups", [None, ["0.*"]])
def test_register_refuses_an_uninitialized_lazy_parameter(groups):
    """Lazy parameters have no shape yet: ValueError naming the parameter and saying to run a forward pass."""
    model = nn.Sequential(nn.LazyLinear(3), nn.Linear(3, 2))
    snap = snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"cannot flatten '0\.weight': it is an uninitialized \(lazy\) parameter; run one forward",
    ):
        register_flat_storage(model, groups)
    assert_unchanged(model, snap)
    assert_plain(model)


# -------------------------------------------------------------------- bad state


def test_register_refuses_registering_twice_on_the_same_module():
    """A module has at most one flat storage: RuntimeError saying the module itself has one."""
    model, storage = registered_bn_mlp()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r"cannot register flat storage: the module itself already has one"
    ):
        register_flat_storage(model, {"c": ["2.*"]})
    assert_unchanged(model, snap)
    assert get_flat_storage(model) is storage


def test_register_refuses_registering_twice_also_in_unflattened_mode():
    """Unflattened mode still owns the parameters: a second registration is a RuntimeError."""
    model, storage = registered_bn_mlp()
    storage.unflatten()
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r"the module itself already has one"):
        register_flat_storage(model)
    assert_unchanged(model, snap)
    assert not storage.is_flattened


def test_register_refuses_a_submodule_of_a_flattened_module():
    """Parameters already in a parent's storage cannot be flattened again: RuntimeError naming them."""
    model, _storage = registered_bn_mlp()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r"cannot register flat storage: weight, bias already live in another flat storage"
    ):
        register_flat_storage(model[0])
    assert_unchanged(model, snap)


def test_register_refuses_a_parent_of_a_flattened_module():
    """A module whose child has a storage cannot get one: RuntimeError naming the child's path."""
    inner, storage = registered_bn_mlp()
    outer = nn.Sequential(nn.Linear(2, 3), inner)
    snap = snapshot(outer)
    with pytest.raises(RuntimeError, match=r"cannot register flat storage: '1' already has one"):
        register_flat_storage(outer)
    assert_unchanged(outer, snap)
    assert get_flat_storage(inner) is storage


def test_register_refuses_a_flat_parameter_of_another_storage():
    """A FlatParameter reused in another module cannot be flattened: RuntimeError naming its name there."""
    model, storage = registered_bn_mlp()
    other = nn.Linear(2, 2)
    other.borrowed = storage["a"]
    snap_other, snap_model = snapshot(other), snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"cannot flatten 'borrowed': it is already the flat parameter of another flat storage",
    ):
        register_flat_storage(other)
    assert_unchanged(other, snap_other)
    assert_unchanged(model, snap_model)
    assert_plain(other)
