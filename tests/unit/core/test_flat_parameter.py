"""FlatParameter: layout metadata that survives pickling and deepcopy."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from flatten_parametrize import FlatParameter, register_flat_storage

from _helpers import TiedLM


def _example() -> FlatParameter:
    return FlatParameter(
        torch.arange(7.0), names=["a.weight", "a.bias"], shapes=[(2, 3), (1,)], numels=[6, 1]
    )


def test_metadata_matches_fairscale_triple():
    """metadata() returns (names, shapes, numels) lists."""
    names, shapes, numels = _example().metadata()
    assert names == ["a.weight", "a.bias"]
    assert shapes == [torch.Size([2, 3]), torch.Size([1])]
    assert numels == [6, 1]


def test_registered_flat_parameter_carries_the_group_layout():
    """The flat parameter of a group lists its canonical names, shapes, numels and offsets."""
    model = TiedLM()
    flat = register_flat_storage(model, align=4)["0"]
    names, shapes, numels = flat.metadata()
    assert names == ["embed.weight", "norm.weight", "norm.bias", "body.weight", "body.bias"]
    assert numels == [66, 6, 6, 36, 6] and shapes[3] == (6, 6)
    assert flat.offsets == [0, 68, 76, 84, 120]


@pytest.mark.parametrize("dump", ["pickle", "torch", "torch_weights_only"])
def test_flat_parameter_survives_serialization(dump):
    """pickle, torch.save and torch.load(weights_only=True) keep type, values and layout."""
    flat = _example()
    flat.requires_grad_(False)
    if dump == "pickle":
        loaded = pickle.loads(pickle.dumps(flat))
    else:
        buffer = io.BytesIO()
        torch.save(flat, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=dump == "torch_weights_only")
    assert type(loaded) is FlatParameter
    assert torch.equal(loaded, flat) and loaded.requires_grad is False
    assert loaded.metadata() == flat.metadata() and loaded.offsets == flat.offsets


def test_flat_parameter_deepcopy_keeps_layout_and_copies_data():
    """copy.deepcopy gives an independent FlatParameter with the same layout."""
    flat = _example()
    clone = copy.deepcopy(flat)
    assert type(clone) is FlatParameter and clone.metadata() == flat.metadata()
    assert clone.data_ptr() != flat.data_ptr() and torch.equal(clone, flat)
    assert isinstance(clone, nn.Parameter) and clone.requires_grad


def test_flat_parameter_is_a_parameter_for_modules_and_optimizers():
    """It registers as a module parameter and an optimizer steps it."""
    flat = _example()
    module = nn.Module()
    module.flat = flat
    assert list(module.parameters()) == [flat]
    flat.grad = torch.ones(7)
    torch.optim.SGD([flat], lr=1.0).step()
    assert torch.equal(flat.detach(), torch.arange(7.0) - 1)


def test_flat_parameter_rejects_a_layout_that_does_not_fit():
    """A layout larger than the buffer or a non-1-D buffer is refused."""
    with pytest.raises(ValueError, match="needs 8 elements but the buffer holds 7"):
        FlatParameter(torch.zeros(7), names=["a"], shapes=[(8,)], numels=[8])
    with pytest.raises(ValueError, match="one-dimensional"):
        FlatParameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="one name, shape, numel and offset per tensor"):
        FlatParameter(torch.zeros(2), names=["a", "b"], shapes=[(1,)], numels=[1])


def test_checkpoint_written_before_the_sub_packages_loads_with_weights_only():
    """A flat parameter and flat state dict saved by the earlier package layout load with weights_only=True.

    ``tests/unit/core/data/flat_parameter_before_subpackages.pt`` was written by the package as it was
    before its modules moved into sub-packages: ``torch.save({"flat": storage["0"], "sd":
    storage.flat_state_dict()})`` of ``nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))`` after
    ``torch.manual_seed(0)``. Its pickle names ``flatten_parametrize._flat_parameter``.
    """
    path = Path(__file__).parent / "data" / "flat_parameter_before_subpackages.pt"
    loaded = torch.load(path, weights_only=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    flat = loaded["flat"]
    assert type(flat) is FlatParameter
    assert torch.equal(flat.detach(), expected)
    assert flat.metadata()[0] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    register_flat_storage(model)
    with torch.no_grad():
        model[0].weight.zero_()
    model.load_state_dict(loaded["sd"])
    assert torch.equal(model.flat_param_0.detach(), expected)


def test_new_pickles_name_the_stable_path():
    """torch.save of a flat parameter names ``flatten_parametrize._flat_parameter``, the path kept stable."""
    buffer = io.BytesIO()
    torch.save(register_flat_storage(nn.Linear(2, 2))["0"], buffer)
    assert b"flatten_parametrize._flat_parameter" in buffer.getvalue()
    assert b"flatten_parametrize._core" not in buffer.getvalue()


def test_detach_keeps_the_type_and_layout_over_the_same_storage():
    """torch requires ``detach()`` of a Parameter subclass to keep its type (``nn.Parameter`` checks)."""
    flat = _example()
    out = flat.detach()
    assert type(out) is FlatParameter and out.metadata() == flat.metadata()
    assert out.data_ptr() == flat.data_ptr() and not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("in_vmap", [False, True])
def test_nn_parameter_of_a_flat_parameter_is_a_flat_parameter_over_the_same_storage(in_vmap):
    """``nn.Parameter(flat)`` (tensordict calls it at the exit of ``to_module``, inside vmap too)."""
    flat = _example()
    made = []

    def wrap(x):
        made.append(nn.Parameter(flat))
        return x * 2

    if in_vmap:
        torch.func.vmap(wrap)(torch.ones(3, 2))
    else:
        wrap(torch.ones(2))
    (param,) = made
    assert type(param) is FlatParameter and param.metadata() == flat.metadata()
    assert param.data_ptr() == flat.data_ptr() and param.requires_grad and param.is_leaf
