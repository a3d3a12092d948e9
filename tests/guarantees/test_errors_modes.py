"""flatten() and leaving unflattened() refuse unflattened-mode changes that do not fit; no-ops are no-ops.

Each test pins the exception type and the part of the message that names the offending parameter and
both shapes (or both tied names) together with the rule it breaks, and (for calls on a module)
checks with :func:`assert_unchanged` that the failed call left the module exactly as it was: same
parameter objects, bit-for-bit the same values, same classes, library attributes, hooks and storage.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import TiedHead, assert_unchanged, registered_bn_mlp, snapshot

# ------------------------------------- flatten() after unflattened-mode changes


def test_flatten_refuses_a_reassigned_parameter_of_another_shape():
    """flatten() cannot fit a parameter of another shape: RuntimeError naming it and both shapes."""
    model, storage = registered_bn_mlp()
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
    model, storage = registered_bn_mlp()
    storage.unflatten()
    model[1].bias = None
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r"cannot flatten: 1\.bias is NoneType, not a parameter"):
        storage.flatten()
    assert_unchanged(model, snap)
    assert not storage.is_flattened


def test_flatten_refuses_a_reassigned_parameter_without_data_and_writes_nothing():
    """flatten() cannot write a meta parameter into the flat buffer: error naming it; no group is written."""
    model, storage = registered_bn_mlp()
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
    model = TiedHead()
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
    model, storage = registered_bn_mlp()
    with pytest.raises(
        RuntimeError,
        match=r"cannot flatten: 0\.weight has shape \(3,\) but its slot in the flat storage holds \(4, 3\)",
    ):
        with storage.unflattened():
            model[0].weight = nn.Parameter(torch.ones(3))
            snap = snapshot(model)
    assert_unchanged(model, snap)


# ------------------------------------ flatten() / unflatten() in their own mode


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
