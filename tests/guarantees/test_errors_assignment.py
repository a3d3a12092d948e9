"""Writes, deletions, tracers and parametrizations that cannot land in the flat buffer are refused.

Each test pins the exception type and the part of the message that names the offending attribute or
parameter together with the rule it breaks, and (for calls on a module) checks with
:func:`assert_unchanged` that the failed call left the module exactly as it was: same parameter
objects, bit-for-bit the same values, same classes, library attributes, hooks and storage.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from flatten_parametrize import register_flat_storage

from _helpers import TiedHead, assert_unchanged, registered_bn_mlp, snapshot


class Double(nn.Module):
    """A parametrization: X -> 2 X."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x / 2


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


# ----------------------------------------------------------------- outside code


@pytest.mark.parametrize("case", list(WRITE_PATH_ERRORS))
def test_outside_code_that_cannot_land_gets_a_clear_error_and_changes_nothing(case):
    """Write paths, structure changes and tracers that cannot be honoured raise the library's error."""
    model, _ = registered_bn_mlp()
    _ORIGINAL[:] = [model[0]]
    snap = snapshot(model)
    action, message = WRITE_PATH_ERRORS[case]
    with pytest.raises(RuntimeError, match=message):
        action(model)
    assert_unchanged(model, snap)


# ------------------------------------------------------------------- assignment


def test_assigning_a_tensor_to_a_flattened_attribute_is_refused():
    """layer.weight = t in flat mode would be lost: RuntimeError naming it and saying how to write values."""
    model, _ = registered_bn_mlp()
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
    model, _ = registered_bn_mlp()
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
    model, _ = registered_bn_mlp()
    snap = snapshot(model)
    model[0].weight = model[0].weight
    model[1].bias = model[1].bias
    assert_unchanged(model, snap)

    tied = TiedHead()
    register_flat_storage(tied)
    snap = snapshot(tied)
    tied.head.weight = tied.emb.weight
    assert_unchanged(tied, snap)
    assert tied.head.weight.data_ptr() == tied.emb.weight.data_ptr()


def test_functional_call_by_original_name_is_refused():
    """functional_call keyed by a flattened name would be dropped: RuntimeError pointing to the flat name."""
    model, _ = registered_bn_mlp()
    model.eval()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"cannot assign to Linear\.weight: .*functional_call with the flat parameter's name",
    ):
        torch.func.functional_call(model, {"0.weight": torch.zeros(4, 3)}, (torch.ones(2, 3),))
    assert_unchanged(model, snap)


# ------------------------------------------------------------- parametrizations


def test_assigning_through_the_parametrization_is_refused():
    """right_inverse of a flattened attribute's parametrization is a RuntimeError naming the attribute."""
    model, _ = registered_bn_mlp()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"cannot assign to 0\.weight through its parametrization: it is a view of a flat storage",
    ):
        model[0].parametrizations.weight.right_inverse(torch.zeros(4, 3))
    assert_unchanged(model, snap)


@pytest.mark.parametrize("per_tensor", [False, True], ids=["flat", "per-tensor"])
@pytest.mark.parametrize("unsafe", [False, True])
def test_a_parametrization_on_top_of_a_flattened_attribute_of_a_parametrized_module_is_refused(
    unsafe, per_tensor
):
    """A module parametrized at registration holds the library's views in torch's container: refused.

    (On a module without one, the call runs on the plain model: ``tests/interop/test_torch_renames.py``.)
    """
    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 2))
    storage = register_flat_storage(model)
    if per_tensor:
        storage.unflatten()
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"(?s)(?=.*cannot add a parametrization on top of 0\.bias)(?=.*on a module that had none)",
    ):
        parametrize.register_parametrization(model[0], "bias", Double(), unsafe=unsafe)
    assert_unchanged(model, snap)
