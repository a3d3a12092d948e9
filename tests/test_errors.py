"""Every public error: its type, a message that names the culprit and the rule, and no side effect.

Each test pins the exception type and the part of the message that names the
offending parameter, group or key together with the rule it breaks, and (for
calls on a module) checks with :func:`assert_unchanged` that the failed call
left the module exactly as it was: same parameter objects under the same
names, bit-for-bit the same values (parameters, buffers, state dict), same
classes, no library attribute added or removed, same hooks, same storage.
"""

from __future__ import annotations

import copy
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from flatten_parametrize import (
    FlatParameter,
    get_flat_storage,
    register_flat_storage,
    remove_flat_storage,
)

from _helpers import assert_plain, assert_unchanged, snapshot

# --------------------------------------------------------------------------- models


def mlp(seed: int = 0) -> nn.Sequential:
    """Linear -> BatchNorm1d (with non-default running stats) -> Linear."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model.train()
    with torch.no_grad():
        model(torch.randn(8, 3))
    return model


class Tied(nn.Module):
    """An embedding and an output head sharing one weight."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(5, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.emb(tokens)))


class Double(nn.Module):
    """A parametrization: X -> 2 X."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x / 2


def frozen_mlp(seed: int = 0) -> nn.Sequential:
    model = mlp(seed)
    model[0].requires_grad_(False)
    return model


def registered_mlp(seed: int = 0, **kwargs: Any) -> tuple[nn.Sequential, Any]:
    """An mlp with groups 'a' (layer 0), 'b' (batch norm), layer 2 left out of every group."""
    model = mlp(seed)
    storage = register_flat_storage(model, {"a": ["0.*"], "b": ["1.*"]}, **kwargs)
    return model, storage


def pattern(text: str) -> str:
    return re.escape(text)


def test_snapshot_detects_changes():
    """The helper itself: assert_unchanged notices changed values, objects, modes and attributes."""
    model, storage = registered_mlp()
    snap = snapshot(model)
    assert_unchanged(model, snap)
    with torch.no_grad():
        model[1].running_mean.add_(1)
    with pytest.raises(AssertionError, match=r"1\.running_mean changed value"):
        assert_unchanged(model, snap)
    model, storage = registered_mlp()
    snap = snapshot(model)
    with torch.no_grad():
        model[0].weight[0, 0] += 1
    with pytest.raises(AssertionError, match=r"flat_param_a changed value"):
        assert_unchanged(model, snap)
    model, storage = registered_mlp()
    snap = snapshot(model)
    model[2].bias = nn.Parameter(model[2].bias.detach().clone())
    with pytest.raises(AssertionError, match=r"parameter 2\.bias was replaced"):
        assert_unchanged(model, snap)
    model, storage = registered_mlp()
    snap = snapshot(model)
    storage.unflatten()
    with pytest.raises(AssertionError):
        assert_unchanged(model, snap)
    model = mlp()
    snap = snapshot(model)
    model[0].__dict__["_flat_parametrize"] = None
    with pytest.raises(AssertionError, match=r"_flat_parametrize"):
        assert_unchanged(model, snap)


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


# ===================================================================== register: wrong types


def test_register_refuses_a_module_that_is_not_a_module():
    """register_flat_storage needs an nn.Module: anything else is a TypeError naming its type."""
    with pytest.raises(TypeError, match=r"register_flat_storage needs an nn\.Module; got str"):
        register_flat_storage("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"register_flat_storage needs an nn\.Module; got Parameter"):
        register_flat_storage(nn.Parameter(torch.zeros(2)))  # type: ignore[arg-type]


def test_register_refuses_groups_as_a_bare_str():
    """A bare str as groups is a TypeError that shows the pattern and says to wrap it in a list."""
    model = mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"got the str '\*\.weight'; write \['\*\.weight'\]"):
        register_flat_storage(model, "*.weight")  # type: ignore[arg-type]
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_single_parameter_as_groups():
    """A single Parameter as groups is a TypeError describing it and saying to wrap it in a list."""
    model = mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"got a single Parameter of shape \(4, 3\); wrap it in a list"):
        register_flat_storage(model, model[0].weight)  # type: ignore[arg-type]
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_single_module_as_groups():
    """A single Module as groups is a TypeError naming its class and saying to wrap it in a list."""
    model = mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"got a single module Linear; wrap it in a list"):
        register_flat_storage(model, model[0])  # type: ignore[arg-type]
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_non_str_group_name():
    """Mapping keys are group names and must be str: TypeError naming the bad key."""
    model = mlp()
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
    model = mlp()
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
    model = mlp()
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
    model = mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=message):
        register_flat_storage(model, groups)
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_mixing_items_and_nested_groups():
    """groups is either one group or a list of groups, not both: TypeError naming the nested entry."""
    model = mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"groups mixes single items and nested groups: got list \['2\.\*'\]"):
        register_flat_storage(model, [model[0].weight, ["2.*"]])
    assert_unchanged(model, snap)
    assert_plain(model)


@pytest.mark.parametrize(("align", "shown"), [(2.0, "float 2.0"), (True, "bool True"), ("4", "str '4'")])
def test_register_refuses_align_of_a_wrong_type(align, shown):
    """align must be an int (not float, bool or str): TypeError showing the value."""
    model = mlp()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"align must be an int; got " + re.escape(shown)):
        register_flat_storage(model, align=align)
    assert_unchanged(model, snap)
    assert_plain(model)


# ===================================================================== register: bad values


def test_register_refuses_a_parameter_not_in_the_module():
    """Only parameters of the module can be flattened: ValueError naming item, group and shape."""
    model = mlp()
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
    model = mlp()
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
    model = mlp()
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
    model = mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"parameter 0\.weight is in two groups, 'weights' and 'first'"):
        register_flat_storage(model, {"weights": ["*.weight"], "first": [model[0]]})
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_a_tied_parameter_in_two_groups_by_its_two_names():
    """Both names of a tied parameter are one slot: putting them in two groups is a ValueError."""
    model = Tied()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"parameter emb\.weight is in two groups, 'a' and 'b'"):
        register_flat_storage(model, {"a": ["emb.weight"], "b": ["head.weight"]})
    assert_unchanged(model, snap)
    assert_plain(model)


def test_register_refuses_an_explicit_group_mixing_dtypes():
    """One flat buffer has one dtype: ValueError naming the group, both parameters and dtypes."""
    model = mlp()
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
    model = mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=rf"group name {re.escape(repr(name))} cannot name a parameter"):
        register_flat_storage(model, {"ok": ["0.*"], name: ["2.*"]})
    assert_unchanged(model, snap)
    assert_plain(model)


@pytest.mark.parametrize("kind", ["buffer", "attribute", "submodule"])
def test_register_refuses_a_group_name_colliding_with_an_attribute(kind):
    """flat_param_<group> must be a free attribute name: ValueError naming the group and the attribute."""
    model = mlp()
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
    model = mlp()
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

    model = mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"duplicate group name 'g'"):
        register_flat_storage(model, Twice([("g", ["0.*"]), ("g", ["2.*"])]))
    assert_unchanged(model, snap)
    assert_plain(model)


@pytest.mark.parametrize("align", [0, -4])
def test_register_refuses_align_below_one(align):
    """align must be >= 1: ValueError showing the value."""
    model = mlp()
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


# ===================================================================== register: bad state


def test_register_refuses_registering_twice_on_the_same_module():
    """A module has at most one flat storage: RuntimeError saying the module itself has one."""
    model, storage = registered_mlp()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r"cannot register flat storage: the module itself already has one"
    ):
        register_flat_storage(model, {"c": ["2.*"]})
    assert_unchanged(model, snap)
    assert get_flat_storage(model) is storage


def test_register_refuses_registering_twice_also_in_unflattened_mode():
    """Unflattened mode still owns the parameters: a second registration is a RuntimeError."""
    model, storage = registered_mlp()
    storage.unflatten()
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r"the module itself already has one"):
        register_flat_storage(model)
    assert_unchanged(model, snap)
    assert not storage.is_flattened


def test_register_refuses_a_submodule_of_a_flattened_module():
    """Parameters already in a parent's storage cannot be flattened again: RuntimeError naming them."""
    model, _storage = registered_mlp()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r"cannot register flat storage: weight, bias already live in another flat storage"
    ):
        register_flat_storage(model[0])
    assert_unchanged(model, snap)


def test_register_refuses_a_parent_of_a_flattened_module():
    """A module whose child has a storage cannot get one: RuntimeError naming the child's path."""
    inner, storage = registered_mlp()
    outer = nn.Sequential(nn.Linear(2, 3), inner)
    snap = snapshot(outer)
    with pytest.raises(RuntimeError, match=r"cannot register flat storage: '1' already has one"):
        register_flat_storage(outer)
    assert_unchanged(outer, snap)
    assert get_flat_storage(inner) is storage


def test_register_refuses_a_flat_parameter_of_another_storage():
    """A FlatParameter reused in another module cannot be flattened: RuntimeError naming its name there."""
    model, storage = registered_mlp()
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


# ===================================================================== get / remove / storage[...]


def test_remove_refuses_a_module_without_storage():
    """remove_flat_storage needs the registered module: ValueError naming its class."""
    model = mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"Sequential has no flat storage to remove"):
        remove_flat_storage(model)
    assert_unchanged(model, snap)
    assert_plain(model)


def test_remove_refuses_a_submodule_of_the_registered_module():
    """A submodule does not own the storage: ValueError, and the registered module is unchanged."""
    model, _ = registered_mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"Linear has no flat storage to remove; pass the module given to"):
        remove_flat_storage(model[0])
    assert_unchanged(model, snap)


def test_remove_refuses_a_non_module():
    """remove_flat_storage needs an nn.Module: TypeError naming the type."""
    with pytest.raises(TypeError, match=r"needs an nn\.Module; got dict"):
        remove_flat_storage({})  # type: ignore[arg-type]


def test_remove_refuses_a_reshaped_parameter_in_unflattened_mode():
    """remove_flat_storage cannot write back a parameter of another shape: RuntimeError, nothing removed."""
    model, storage = registered_mlp()
    storage.unflatten()
    model[0].weight = nn.Parameter(torch.zeros(2, 2))
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r"cannot flatten: 0\.weight has shape \(2, 2\) but its slot .* holds \(4, 3\)"
    ):
        remove_flat_storage(model)
    assert_unchanged(model, snap)
    assert get_flat_storage(model) is storage
    assert not storage.is_flattened


@pytest.mark.parametrize("obj", ["model", None, torch.zeros(2)])
def test_get_refuses_a_non_module(obj):
    """get_flat_storage needs an nn.Module: TypeError naming the type."""
    with pytest.raises(TypeError, match=rf"get_flat_storage needs an nn\.Module; got {type(obj).__name__}"):
        get_flat_storage(obj)  # type: ignore[arg-type]


def test_storage_getitem_refuses_an_unknown_group():
    """storage[name] of an unknown group is a KeyError naming it and listing the groups."""
    _model, storage = registered_mlp()
    with pytest.raises(KeyError, match=r"no group 'nope' in this flat storage; groups are \['a', 'b'\]"):
        storage["nope"]


def test_detached_storage_refuses_to_serve():
    """After remove_flat_storage the coordinator is detached: RuntimeError saying so."""
    model, storage = registered_mlp()
    remove_flat_storage(model)
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r"this flat storage is detached: .*remove_flat_storage was called"
    ):
        _ = storage.module
    with pytest.raises(RuntimeError, match=r"this flat storage is detached"):
        list(storage.named_views())
    assert_unchanged(model, snap)
    assert_plain(model)


# ===================================================================== using() / views_of()


def two_group_model() -> tuple[nn.Sequential, Any, dict[str, torch.Tensor]]:
    model, storage = registered_mlp()
    good = {g: torch.randn(storage[g].numel()) for g in storage.group_names}
    return model, storage, good


def _enter_using(storage: Any, tensors: Any) -> None:
    with storage.using(tensors):
        pass


def test_using_refuses_a_wrong_count():
    """using() needs one tensor per group: ValueError giving the groups and the count."""
    model, storage, good = two_group_model()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"using\(\) needs one tensor per group \(2: \['a', 'b'\]\); got 1"):
        _enter_using(storage, [good["a"]])
    with pytest.raises(ValueError, match=r"using\(\) needs one tensor per group \(2: \['a', 'b'\]\); got 3"):
        _enter_using(storage, [good["a"], good["b"], good["b"]])
    assert_unchanged(model, snap)


def test_using_refuses_wrong_dict_keys():
    """using() with a dict needs exactly the group names: ValueError naming missing and unknown keys."""
    model, storage, good = two_group_model()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
        _enter_using(storage, {"a": good["a"], "c": good["b"]})
    assert_unchanged(model, snap)


@pytest.mark.parametrize("bad", ["longer", "2d"])
def test_using_refuses_a_wrong_size(bad):
    """Each tensor of using() has its flat parameter's shape: ValueError naming the group and sizes."""
    model, storage, good = two_group_model()
    numel = storage["b"].numel()
    wrong = torch.zeros(numel + 1) if bad == "longer" else torch.zeros(1, numel)
    shown = f"({numel + 1},)" if bad == "longer" else f"(1, {numel})"
    snap = snapshot(model)
    with pytest.raises(
        ValueError,
        match=rf"using\(\): group 'b' needs a one-dimensional tensor of {numel} elements; "
        rf"got shape {re.escape(shown)}",
    ):
        _enter_using(storage, [good["a"], wrong])
    assert_unchanged(model, snap)


def test_using_refuses_a_wrong_dtype():
    """using() serves views as they are: a tensor of another dtype is a ValueError naming group and dtypes."""
    model, storage, good = two_group_model()
    snap = snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"using\(\): group 'a' needs a torch\.float32 tensor on cpu; got torch\.float64 on cpu",
    ):
        _enter_using(storage, {"a": good["a"].double(), "b": good["b"]})
    assert_unchanged(model, snap)


def test_using_refuses_a_wrong_device():
    """using() tensors must be on the flat parameter's device: ValueError naming group and devices."""
    model, storage, good = two_group_model()
    snap = snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"using\(\): group 'b' needs a torch\.float32 tensor on cpu; got torch\.float32 on meta",
    ):
        _enter_using(storage, [good["a"], torch.empty(storage["b"].numel(), device="meta")])
    assert_unchanged(model, snap)


def test_using_refuses_a_non_tensor_entry():
    """Each entry of using() must be a Tensor: TypeError naming the group and the type."""
    model, storage, good = two_group_model()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"using\(\): the entry for group 'b' must be a Tensor; got list"):
        _enter_using(storage, [good["a"], good["b"].tolist()])
    assert_unchanged(model, snap)


def test_using_refuses_a_single_tensor_for_two_groups():
    """A single tensor is only accepted for a one-group storage: TypeError giving the groups."""
    model, storage, good = two_group_model()
    snap = snapshot(model)
    with pytest.raises(
        TypeError, match=r"using\(\) got a single tensor but this storage has 2 groups \['a', 'b'\]"
    ):
        _enter_using(storage, good["a"])
    assert_unchanged(model, snap)


@pytest.mark.parametrize("bad", [3, "ab", None])
def test_using_refuses_a_container_of_a_wrong_type(bad):
    """using() takes a list or a dict of tensors: TypeError naming what it got."""
    model, storage, _ = two_group_model()
    snap = snapshot(model)
    with pytest.raises(
        TypeError, match=rf"using\(\) takes a list of tensors in group order .*; got {type(bad).__name__}"
    ):
        _enter_using(storage, bad)
    assert_unchanged(model, snap)


def test_using_refuses_unflattened_mode():
    """using() needs flat mode: RuntimeError saying to call flatten() first."""
    model, storage, good = two_group_model()
    storage.unflatten()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r"storage\.using\(\.\.\.\) needs flat mode.*call flatten\(\) first"
    ):
        _enter_using(storage, good)
    assert_unchanged(model, snap)
    assert not storage.is_flattened


def test_unflatten_refuses_inside_using():
    """unflatten() inside using() is a RuntimeError; the using() block still restores the flat parameters."""
    model, storage, good = two_group_model()
    snap = snapshot(model)
    with storage.using(good):
        with pytest.raises(RuntimeError, match=r"cannot unflatten inside storage\.using\(\.\.\.\)"):
            storage.unflatten()
        with pytest.raises(RuntimeError, match=r"cannot unflatten inside storage\.using\(\.\.\.\)"):
            with storage.unflattened():
                pass
        assert storage.is_flattened
        assert torch.equal(model[0].weight.reshape(-1), good["a"][:12])
    assert_unchanged(model, snap)


def test_module_conversion_refuses_inside_using():
    """module.to()/.double() inside using() is a RuntimeError and converts nothing."""
    model, storage, good = two_group_model()
    snap = snapshot(model)
    with storage.using(good):
        with pytest.raises(RuntimeError, match=r"cannot convert or move the module inside storage\.using"):
            model.double()
    assert_unchanged(model, snap)
    assert storage["a"].dtype == torch.float32


def test_views_of_refuses_a_wrong_size():
    """views_of() needs tensors of the flat parameters' sizes: ValueError naming the group and sizes."""
    model, storage, good = two_group_model()
    numel = storage["a"].numel()
    snap = snapshot(model)
    with pytest.raises(
        ValueError,
        match=rf"views_of\(\): group 'a' needs a one-dimensional tensor of {numel} elements; "
        rf"got shape \({numel - 1},\)",
    ):
        storage.views_of([torch.zeros(numel - 1), good["b"]])
    assert_unchanged(model, snap)


def test_views_of_refuses_a_wrong_count_and_type():
    """views_of() validates like using(): wrong count is a ValueError, a non-tensor a TypeError."""
    model, storage, good = two_group_model()
    snap = snapshot(model)
    with pytest.raises(
        ValueError, match=r"views_of\(\) needs one tensor per group \(2: \['a', 'b'\]\); got 1"
    ):
        storage.views_of([good["a"]])
    with pytest.raises(TypeError, match=r"views_of\(\): the entry for group 'a' must be a Tensor; got int"):
        storage.views_of({"a": 0, "b": good["b"]})
    assert_unchanged(model, snap)


# ===================================================================== assignment and parametrizations


def _wrong_flat_param(model: nn.Module) -> None:
    model.flat_param_a = nn.Parameter(torch.zeros(3))


def _bad_parameter_entry(model: nn.Module) -> None:
    model[0]._parameters["weight"] = nn.Parameter(torch.zeros(2, 2))
    model(torch.randn(2, 3))


def _bad_data(model: nn.Module) -> None:
    model[0].weight.data = torch.zeros(2, 2)
    model.state_dict()


def _deleted_flat_param(model: nn.Module) -> None:
    del model.flat_param_a


def _deleted_slot(model: nn.Module) -> None:
    del model[0].weight


def _pickle_after_replacement(model: nn.Module) -> None:
    model[0] = nn.Linear(3, 4)
    try:
        pickle.dumps(model)
    finally:
        model[0] = _ORIGINAL[0]


def _trace_submodule(model: nn.Module) -> None:
    torch.jit.trace(model[0], torch.randn(2, 3))


def _script_flat(model: nn.Module) -> None:
    torch.jit.script(model)


_ORIGINAL: list[nn.Module] = []

WRITE_PATH_ERRORS = {
    "flat parameter of another size": (
        _wrong_flat_param,
        r"cannot replace flat_param_a with a parameter of shape \(3,\)",
    ),
    "bad _parameters entry": (_bad_parameter_entry, r"cannot set 0\.weight to a tensor of shape \(2, 2\)"),
    "bad .data": (_bad_data, r"cannot take `0\.weight\.data = tensor`"),
    "deleted flat parameter": (_deleted_flat_param, r"cannot delete flat_param_a of Sequential"),
    "deleted slot": (_deleted_slot, r"cannot delete Linear\.weight: it is a view of a flat storage"),
    "pickle after replacement": (
        _pickle_after_replacement,
        r"cannot pickle Sequential: 0\.weight was replaced",
    ),
    "trace of a submodule": (_trace_submodule, r"torch\.jit\.trace reached 0\.weight outside the forward"),
    "script in flat mode": (_script_flat, r"torch\.jit\.script cannot compile Sequential"),
}


@pytest.mark.parametrize("case", list(WRITE_PATH_ERRORS))
def test_outside_code_that_cannot_land_gets_a_clear_error_and_changes_nothing(case):
    """Write paths, structure changes and tracers that cannot be honoured raise the library's error."""
    model, _ = registered_mlp()
    _ORIGINAL[:] = [model[0]]
    snap = snapshot(model)
    action, message = WRITE_PATH_ERRORS[case]
    with pytest.raises(RuntimeError, match=message):
        action(model)
    assert_unchanged(model, snap)


def test_assigning_a_tensor_to_a_flattened_attribute_is_refused():
    """layer.weight = t in flat mode would be lost: RuntimeError naming it and saying how to write values."""
    model, _ = registered_mlp()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"cannot assign to Linear\.weight: it is a view of a flat storage.*"
        r"with torch\.no_grad\(\): module\.weight\.copy_\(value\).*storage\.using\(\.\.\.\)",
    ):
        model[0].weight = torch.zeros(4, 3)
    assert_unchanged(model, snap)


def test_assigning_a_parameter_of_another_shape_to_a_flattened_attribute_is_refused():
    """An nn.Parameter that cannot land in its slot: RuntimeError naming the path, both shapes and the fix."""
    model, _ = registered_mlp()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"cannot set 0\.weight to a tensor of shape \(3, 4\).*holds shape \(4, 3\).*"
        r"storage\.unflattened\(\) or after remove_flat_storage",
    ):
        model[0].weight = nn.Parameter(torch.zeros(3, 4))
    assert_unchanged(model, snap)


def test_assigning_the_slots_own_view_is_a_no_op():
    """Assigning an attribute its own view (or a tied alias's view) changes nothing."""
    model, _ = registered_mlp()
    snap = snapshot(model)
    model[0].weight = model[0].weight
    model[1].bias = model[1].bias
    assert_unchanged(model, snap)

    tied = Tied()
    register_flat_storage(tied)
    snap = snapshot(tied)
    tied.head.weight = tied.emb.weight
    assert_unchanged(tied, snap)
    assert tied.head.weight.data_ptr() == tied.emb.weight.data_ptr()


def test_assigning_another_slots_view_is_refused():
    """A view of another slot is not this slot's view: RuntimeError, no silent aliasing."""
    model, _ = registered_mlp()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r"cannot assign to BatchNorm1d\.weight: it is a view of a flat storage"
    ):
        model[1].weight = model[1].bias
    assert_unchanged(model, snap)


def test_functional_call_by_original_name_is_refused():
    """functional_call keyed by a flattened name would be dropped: RuntimeError pointing to the flat name."""
    model, _ = registered_mlp()
    model.eval()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"cannot assign to Linear\.weight: .*functional_call with the flat parameter's name",
    ):
        torch.func.functional_call(model, {"0.weight": torch.zeros(4, 3)}, (torch.ones(2, 3),))
    assert_unchanged(model, snap)


def test_assigning_through_the_parametrization_is_refused():
    """right_inverse of a flattened attribute's parametrization is a RuntimeError naming the attribute."""
    model, _ = registered_mlp()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"cannot assign to 0\.weight through its parametrization: it is a view of a flat storage",
    ):
        model[0].parametrizations.weight.right_inverse(torch.zeros(4, 3))
    assert_unchanged(model, snap)


@pytest.mark.parametrize("unsafe", [False, True])
def test_adding_a_parametrization_on_top_of_a_flattened_attribute_is_refused(unsafe):
    """register_parametrization on a flattened attribute is a RuntimeError naming it; nothing changes."""
    model, _ = registered_mlp()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"(?s)(?=.*cannot add a parametrization on top of)(?=.*\bweight\b)",
    ):
        parametrize.register_parametrization(model[0], "weight", Double(), unsafe=unsafe)
    assert_unchanged(model, snap)


# ===================================================== flatten() after unflattened-mode changes


def test_flatten_refuses_a_reassigned_parameter_of_another_shape():
    """flatten() cannot fit a parameter of another shape: RuntimeError naming it and both shapes."""
    model, storage = registered_mlp()
    storage.unflatten()
    model[0].weight = nn.Parameter(torch.ones(2, 2))
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"cannot flatten: 0\.weight has shape \(2, 2\) but its slot in the flat storage holds \(4, 3\)",
    ):
        storage.flatten()
    assert_unchanged(model, snap)
    assert not storage.is_flattened


def test_flatten_refuses_a_parameter_set_to_none():
    """flatten() needs a parameter under every flattened name: RuntimeError naming the one set to None."""
    model, storage = registered_mlp()
    storage.unflatten()
    model[1].bias = None
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r"cannot flatten: 1\.bias is NoneType, not a parameter"):
        storage.flatten()
    assert_unchanged(model, snap)
    assert not storage.is_flattened


def test_flatten_refuses_a_reassigned_parameter_without_data_and_writes_nothing():
    """flatten() cannot write a meta parameter into the flat buffer: error naming it; no group is written."""
    model, storage = registered_mlp()
    storage.unflatten()
    model[0].bias = nn.Parameter(torch.full((4,), 7.0))  # group 'a': valid on its own
    model[1].weight = nn.Parameter(torch.empty(4, device="meta"))  # group 'b': holds no values
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r"1\.weight"):
        storage.flatten()
    assert_unchanged(model, snap)
    assert not storage.is_flattened


def test_flatten_refuses_a_broken_tie():
    """flatten() keeps ties: names of one tied parameter reassigned apart is a RuntimeError naming both."""
    model = Tied()
    storage = register_flat_storage(model)
    storage.unflatten()
    model.head.weight = nn.Parameter(torch.zeros(5, 4))
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"cannot flatten: tied parameter emb\.weight and head\.weight were reassigned separately",
    ):
        storage.flatten()
    assert_unchanged(model, snap)
    assert not storage.is_flattened


def test_unflattened_context_refuses_to_exit_with_a_reshaped_parameter():
    """Leaving unflattened() with a parameter of another shape is a RuntimeError naming it."""
    model, storage = registered_mlp()
    with pytest.raises(
        RuntimeError,
        match=r"cannot flatten: 0\.weight has shape \(3,\) but its slot in the flat storage holds \(4, 3\)",
    ):
        with storage.unflattened():
            model[0].weight = nn.Parameter(torch.ones(3))
            snap = snapshot(model)
    assert_unchanged(model, snap)


# ===================================================================== load_state_dict (atomic)


def _load_case(strict: bool = True):
    """A registered model (groups 'a', 'b'; layer 2 left out; BN stats set) and a valid plain source."""
    model, storage = registered_mlp(seed=0)
    source = mlp(seed=1)
    with torch.no_grad():
        source(torch.randn(4, 3) * 3)  # other running stats
    return model, storage, source


def _assert_dict_unchanged(sd: Mapping[str, Any], keys: list[str]) -> None:
    assert list(sd) == keys, "load_state_dict changed the caller's dict"


@pytest.mark.parametrize("key", ["0.weight", "1.running_var", "2.bias"])
def test_load_strict_refuses_a_missing_key_and_changes_nothing(key):
    """strict load reports a missing key by its original name; every other (valid) entry is not loaded."""
    model, _storage, source = _load_case()
    sd = source.state_dict()
    del sd[key]
    keys = list(sd)
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=rf'Missing key\(s\) in state_dict: "{re.escape(key)}"\.') as info:
        model.load_state_dict(sd)
    assert "flat_param" not in str(info.value)
    assert_unchanged(model, snap)
    _assert_dict_unchanged(sd, keys)


def test_load_strict_refuses_a_missing_tied_alias():
    """A tied model's state dict has both names; missing one is reported by that name, nothing loaded."""
    model = Tied(seed=0)
    register_flat_storage(model)
    sd = Tied(seed=1).state_dict()
    del sd["head.weight"]
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head\.weight"\.'):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)


def test_load_strict_refuses_an_unexpected_key_and_changes_nothing():
    """strict load reports an unexpected key by its name; no valid entry is loaded."""
    model, _storage, source = _load_case()
    sd = source.state_dict()
    sd["3.weight"] = torch.zeros(2)
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "3\.weight"\.') as info:
        model.load_state_dict(sd)
    assert "flat_param" not in str(info.value)
    assert "Missing" not in str(info.value)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize(
    ("key", "current"), [("1.weight", "[4]"), ("2.weight", "[2, 4]"), ("1.running_mean", "[4]")]
)
def test_load_refuses_a_wrong_shape_and_changes_nothing(strict, key, current):
    """A wrong-shape entry is a RuntimeError naming key and shapes, with or without strict; nothing loaded."""
    model, _storage, source = _load_case()
    sd = source.state_dict()
    sd[key] = torch.zeros(5, 5)
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=rf"size mismatch for {re.escape(key)}: copying a param with shape torch\.Size\(\[5, 5\]\) from "
        rf"checkpoint, the shape in current model is torch\.Size\({re.escape(current)}\)",
    ):
        model.load_state_dict(sd, strict=strict)
    assert_unchanged(model, snap)


def test_load_refuses_a_non_tensor_entry_for_a_flattened_name():
    """A non-tensor under a flattened name is a RuntimeError naming the key; nothing loaded."""
    model, _storage, source = _load_case()
    sd = source.state_dict()
    sd["0.bias"] = [0.0] * 4
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r'While copying the parameter named "0\.bias", expected torch\.Tensor'
    ):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)


def test_load_refuses_a_meta_entry_for_a_flattened_name():
    """A meta tensor holds no values: loading it into a flattened name is a RuntimeError naming the key."""
    model, _storage, source = _load_case()
    sd = source.state_dict()
    sd["1.weight"] = torch.empty(4, device="meta")
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r'While copying the parameter named "1\.weight"'):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("failure", ["missing", "shape"])
def test_load_with_assign_refuses_and_keeps_every_object(failure):
    """assign=True that fails (missing key / wrong shape) leaves the same objects and values in place."""
    model, _storage, source = _load_case()
    sd = source.state_dict()
    if failure == "missing":
        del sd["2.bias"]
        message = r'Missing key\(s\) in state_dict: "2\.bias"'
    else:
        sd["2.bias"] = torch.zeros(7)
        message = r"size mismatch for 2\.bias"
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=message):
        model.load_state_dict(sd, assign=True)
    assert_unchanged(model, snap)


def test_load_in_unflattened_mode_refuses_and_stays_unflattened():
    """A failed load in unflattened mode changes no value and leaves the module unflattened."""
    model, storage, source = _load_case()
    storage.unflatten()
    sd = source.state_dict()
    del sd["2.weight"]
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "2\.weight"'):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)
    assert not storage.is_flattened


def test_load_refuses_a_state_dict_that_is_not_a_mapping():
    """load_state_dict needs a mapping: TypeError naming the type; nothing changes."""
    model, _, _ = _load_case()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"Expected state_dict to be dict-like, got <class 'list'>"):
        model.load_state_dict([("0.weight", torch.zeros(4, 3))])  # type: ignore[arg-type]
    assert_unchanged(model, snap)


# ----------------------------------------------------------------- flat form


def _flat_source(groups: Any = None, align: int = 1, model: nn.Module | None = None) -> dict[str, Any]:
    """A valid flat state dict of another model (values differ from the target's)."""
    if model is None:
        model = mlp(seed=1)
        with torch.no_grad():
            model(torch.randn(4, 3) * 3)
    groups = groups if groups is not None else {"a": ["0.*"], "b": ["1.*"]}
    storage = register_flat_storage(model, groups, align=align)
    return {k: v.clone() for k, v in storage.flat_state_dict().items()}


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        # same group names, other members: group 'a' gets other tensors (and another size)
        (
            "groups",
            r"flat state dict for group 'a' was written for another layout: "
            r"the buffer holds 20 elements, here 16",
        ),
        # same members in another order: same size, other offsets
        (
            "order",
            r"flat state dict for group 'a' was written for another layout: slot 0 is 0\.bias at offset 0",
        ),
        # same members, another alignment
        (
            "align",
            r"flat state dict for group 'a' was written for another layout: "
            r"the buffer holds 24 elements, here 16",
        ),
        # another model with the same flat sizes but other shapes
        (
            "model",
            r"flat state dict for group 'a' was written for another layout: slot 0 is 0\.weight at offset 0 "
            r"with shape \(8, 1\) in the checkpoint, 0\.weight at offset 0 with shape \(4, 3\) here",
        ),
    ],
)
def test_load_refuses_a_flat_state_dict_of_another_layout(kind, message):
    """A flat state dict carries its layout: one for another layout is a ValueError naming the group."""
    model, _storage, _ = _load_case()
    if kind == "groups":
        sd = _flat_source({"a": ["0.*", "1.weight"], "b": ["1.bias"]})
    elif kind == "order":
        sd = _flat_source({"a": ["0.bias", "0.weight"], "b": ["1.*"]})
    elif kind == "align":
        sd = _flat_source(align=8)
    else:
        # layer 0 is Linear(1, 8): weight (8, 1) + bias (8,) = 16 elements, as our Linear(3, 4)
        sd = _flat_source(model=nn.Sequential(nn.Linear(1, 8), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    snap = snapshot(model)
    with pytest.raises(ValueError, match=message):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("kind", ["size", "dtype"])
def test_load_refuses_a_flat_entry_without_layout_record_that_does_not_match(kind):
    """A record-less flat entry (zero_to_fp32, fairscale) of another size or dtype: ValueError, no change."""
    model, storage, _ = _load_case()
    sd = _flat_source()
    del sd["flat_layout_b"]
    numel = storage["b"].numel()
    if kind == "size":
        sd["flat_param_b"] = torch.cat([sd["flat_param_b"], torch.zeros(1)])
        found = rf"found shape \({numel + 1},\), torch.float32"
    else:
        sd["flat_param_b"] = sd["flat_param_b"].double()
        found = rf"found shape \({numel},\), torch.float64"
    snap = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any warning
        with pytest.raises(
            ValueError,
            match=r"flat state dict entry 'flat_param_b' comes without its layout record and does not "
            rf"match group 'b': expected a one-dimensional torch.float32 tensor of {numel} elements, "
            + found,
        ):
            model.load_state_dict(sd, strict=False)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("group", ["a", "b"])
def test_load_refuses_a_flat_entry_of_the_wrong_size(group):
    """A flat entry must have its group's size: ValueError naming the key, the group and the sizes."""
    model, storage, _ = _load_case()
    sd = _flat_source()
    numel = storage[group].numel()
    sd[f"flat_param_{group}"] = torch.cat([sd[f"flat_param_{group}"], torch.zeros(1)])
    snap = snapshot(model)
    with pytest.raises(
        ValueError,
        match=rf"flat state dict entry 'flat_param_{group}' has shape \({numel + 1},\); "
        rf"group '{group}' needs a one-dimensional tensor of {numel} elements",
    ):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)


def test_load_refuses_a_flat_entry_that_is_not_a_tensor():
    """A flat entry must be a tensor: TypeError naming the key and the type."""
    model, _storage, _ = _load_case()
    sd = _flat_source()
    sd["flat_param_b"] = sd["flat_param_b"].tolist()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"flat state dict entry 'flat_param_b' must be a tensor; got list"):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("record", ["float", "list", "garbage"])
def test_load_refuses_a_corrupt_layout_record(record):
    """A layout record must be the uint8 record flat_state_dict() wrote: ValueError naming its key."""
    model, _storage, _ = _load_case()
    sd = _flat_source()
    if record == "float":
        sd["flat_layout_a"] = torch.zeros(3)
    elif record == "list":
        sd["flat_layout_a"] = [1, 2, 3]
    else:
        sd["flat_layout_a"] = torch.tensor(list(b"not json"), dtype=torch.uint8)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"flat state dict entry 'flat_layout_a' is not a layout record"):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("extra", ["0.weight", "1.bias"])
def test_load_refuses_a_dict_mixing_flat_and_unflattened_forms(extra):
    """One storage is loaded in one form: a dict with both is a ValueError naming a key of each form."""
    model, _storage, source = _load_case()
    sd = _flat_source()
    sd[extra] = source.state_dict()[extra]
    snap = snapshot(model)
    with pytest.raises(
        ValueError,
        match=rf"state dict mixes the flat form \('flat_param_a'\) and the unflattened form "
        rf"\('{re.escape(extra)}'\)",
    ):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)


def test_load_flat_form_strict_refuses_a_missing_key_late_and_changes_nothing():
    """A valid flat dict missing a plain entry (last key) is refused by strict; no flat value loaded."""
    model, _storage, _ = _load_case()
    sd = _flat_source()
    del sd["2.bias"]
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "2\.bias"\.'):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)


def test_load_flat_form_strict_refuses_a_missing_flat_group():
    """A flat dict without one group is reported under strict by that group's original names."""
    model, _storage, _ = _load_case()
    sd = _flat_source()
    del sd["flat_param_b"], sd["flat_layout_b"]
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r'Missing key\(s\) in state_dict: "1\.weight", "1\.bias"\.'
    ) as info:
        model.load_state_dict(sd)
    assert "flat_param" not in str(info.value)
    assert_unchanged(model, snap)


# ===================================================================== pickling, FlatParameter


def test_pickling_a_flat_storage_is_refused():
    """A FlatStorage cannot be pickled: RuntimeError saying to save a state dict instead."""
    model, storage = registered_mlp()
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r"a FlatStorage cannot be pickled on its own; pickle the"):
        pickle.dumps(storage)
    assert_unchanged(model, snap)


def test_flat_parameter_refuses_a_layout_that_does_not_fit():
    """FlatParameter's layout must fit its buffer: ValueError giving both sizes."""
    with pytest.raises(ValueError, match=r"FlatParameter layout needs 7 elements but the buffer holds 5"):
        FlatParameter(torch.zeros(5), names=["w", "b"], shapes=[(2, 2), (3,)], numels=[4, 3])
    with pytest.raises(ValueError, match=r"FlatParameter layout needs 9 elements but the buffer holds 8"):
        FlatParameter(torch.zeros(8), names=["w"], shapes=[(3,)], numels=[3], offsets=[6])


def test_flat_parameter_refuses_layout_lists_of_different_lengths():
    """FlatParameter needs one name, shape, numel and offset per tensor: ValueError giving the counts."""
    with pytest.raises(
        ValueError, match=r"one name, shape, numel and offset per tensor; got 2 names, 1 shapes, 1 numels"
    ):
        FlatParameter(torch.zeros(5), names=["w", "b"], shapes=[(2, 2)], numels=[4])


def test_flat_parameter_refuses_data_that_is_not_one_dimensional():
    """FlatParameter data is one-dimensional: ValueError giving the shape."""
    with pytest.raises(ValueError, match=r"FlatParameter data must be one-dimensional; got shape \(2, 2\)"):
        FlatParameter(torch.zeros(2, 2), names=["w"], shapes=[(2, 2)], numels=[4])


def test_flat_parameter_refuses_numels_that_disagree_with_shapes():
    """A layout whose numel is not the product of its shape does not describe its tensors: ValueError."""
    with pytest.raises(ValueError, match=r"(?s)(?=.*\bw\b)(?=.*numel)"):
        FlatParameter(torch.zeros(5), names=["w"], shapes=[(2, 2)], numels=[3])


def test_deepcopy_of_a_failed_registration_is_plain():
    """After a refused registration the module deep-copies and pickles as a plain module."""
    model = mlp()
    with pytest.raises(ValueError):
        register_flat_storage(model, {"a": ["0.*"], "b": ["0.weight"]})
    clone = copy.deepcopy(model)
    assert_plain(clone)
    pickle.loads(pickle.dumps(model))


# --------------------------------------------------------------------------- later additions
def test_storage_getitem_refuses_a_non_str_key():
    """storage[0] is a TypeError that lists the group names (groups are named by str)."""
    model = nn.Sequential(nn.Linear(2, 2))
    storage = register_flat_storage(model)
    with pytest.raises(TypeError, match=r"named by str; got int 0; groups are \['0'\]"):
        storage[0]  # type: ignore[index]


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


def test_same_parameter_twice_in_one_group_is_one_slot():
    """Listing a parameter twice in one group (directly, by module or by overlapping globs) gives one slot."""
    model = nn.Sequential(nn.Linear(2, 2))
    storage = register_flat_storage(model, [model[0].weight, model[0], "0.*", "*.weight"])
    assert [info.name for info in storage.param_infos] == ["0.weight", "0.bias"]


def test_flat_parameter_refuses_non_tensor_data_and_non_str_names():
    """FlatParameter checks its data and names."""
    with pytest.raises(TypeError, match="data must be a Tensor; got list"):
        FlatParameter([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"names must be str; got \[0\]"):
        FlatParameter(torch.zeros(1), names=[0], shapes=[(1,)], numels=[1])  # type: ignore[list-item]


def test_using_and_views_of_refuse_unknown_dict_keys():
    """using() / views_of() name missing and unknown group keys."""
    model = nn.Sequential(nn.Linear(2, 2))
    storage = register_flat_storage(model)
    with pytest.raises(ValueError, match=r"missing \['0'\], unknown \[0\]"):
        with storage.using({0: torch.zeros(6)}):  # type: ignore[dict-item]
            pass
    with pytest.raises(ValueError, match=r"missing \['0'\], unknown \['x'\]"):
        storage.views_of({"x": torch.zeros(6)})


def test_flatten_and_unflatten_in_their_own_mode_change_nothing():
    """flatten() while flat and unflatten() while unflattened are documented no-ops."""
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    storage = register_flat_storage(model)
    snap = snapshot(model)
    storage.flatten()
    assert_unchanged(model, snap)
    storage.unflatten()
    snap = snapshot(model)
    storage.unflatten()
    assert_unchanged(model, snap)


def test_failed_load_in_unflattened_mode_keeps_gradient_objects():
    """A refused load in unflattened mode leaves parameters, values and .grad objects as they were."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    storage = register_flat_storage(model)
    model(torch.ones(1, 2)).sum().backward()
    storage.unflatten()
    grads = [p.grad for p in model.parameters()]
    snap = snapshot(model)
    state = {k: v + 1 for k, v in model.state_dict().items()}
    del state["1.bias"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "1\.bias"'):
        model.load_state_dict(state)
    assert_unchanged(model, snap)
    assert all(a is b for a, b in zip(grads, [p.grad for p in model.parameters()]))
    assert not storage.is_flattened
