"""load_state_dict refuses a bad plain or flat state dict atomically: nothing is loaded.

Each test pins the exception type and the part of the message that names the offending key or group
together with the rule it breaks, and (for calls on a module) checks with :func:`assert_unchanged`
that the failed call left the module exactly as it was: same parameter objects, bit-for-bit the same
values, same classes, library attributes, hooks and storage.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import TiedHead, assert_unchanged, bn_mlp, registered_bn_mlp, snapshot


def _load_case(strict: bool = True):
    """A registered model (groups 'a', 'b'; layer 2 left out; BN stats set) and a valid plain source."""
    model, storage = registered_bn_mlp(seed=0)
    source = bn_mlp(seed=1)
    with torch.no_grad():
        source(torch.randn(4, 3) * 3)  # other running stats
    return model, storage, source


def _assert_dict_unchanged(sd: Mapping[str, Any], keys: list[str]) -> None:
    assert list(sd) == keys, "load_state_dict changed the caller's dict"


def _flat_source(groups: Any = None, align: int = 1, model: nn.Module | None = None) -> dict[str, Any]:
    """A valid flat state dict of another model (values differ from the target's)."""
    if model is None:
        model = bn_mlp(seed=1)
        with torch.no_grad():
            model(torch.randn(4, 3) * 3)
    groups = groups if groups is not None else {"a": ["0.*"], "b": ["1.*"]}
    storage = register_flat_storage(model, groups, align=align)
    return {k: v.clone() for k, v in storage.flat_state_dict().items()}


# ------------------------------------------------- the plain (unflattened) form


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
    model = TiedHead(seed=0)
    register_flat_storage(model)
    sd = TiedHead(seed=1).state_dict()
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


def test_load_refuses_a_state_dict_that_is_not_a_mapping():
    """load_state_dict needs a mapping: TypeError naming the type; nothing changes."""
    model, _, _ = _load_case()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"Expected state_dict to be dict-like, got <class 'list'>"):
        model.load_state_dict([("0.weight", torch.zeros(4, 3))])  # type: ignore[arg-type]
    assert_unchanged(model, snap)


# ---------------------------------------------------------------- the flat form


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
