"""storage.using(...) and storage.views_of(...) refuse tensors that do not fit the flat parameters.

Each test pins the exception type and the part of the message that names the offending group, size,
dtype or device together with the rule it breaks, and (for calls on a module) checks with
:func:`assert_unchanged` that the failed call left the module exactly as it was: same parameter
objects, bit-for-bit the same values, same classes, library attributes, hooks and storage.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import assert_unchanged, registered_bn_mlp, snapshot


def two_group_model() -> tuple[nn.Sequential, Any, dict[str, torch.Tensor]]:
    model, storage = registered_bn_mlp()
    good = {g: torch.randn(storage[g].numel()) for g in storage.group_names}
    return model, storage, good


def _enter_using(storage: Any, tensors: Any) -> None:
    with storage.using(tensors):
        pass


# ---------------------------------------------------------------------- using()


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


# ------------------------------------------------------------------- views_of()


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


def test_using_and_views_of_refuse_unknown_dict_keys():
    """using() / views_of() name missing and unknown group keys."""
    model = nn.Sequential(nn.Linear(2, 2))
    storage = register_flat_storage(model)
    with pytest.raises(ValueError, match=r"missing \['0'\], unknown \[0\]"):
        with storage.using({0: torch.zeros(6)}):  # type: ignore[dict-item]
            pass
    with pytest.raises(ValueError, match=r"missing \['0'\], unknown \['x'\]"):
        storage.views_of({"x": torch.zeros(6)})
