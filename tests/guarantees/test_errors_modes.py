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

from _helpers import TiedHead, assert_unchanged, bn_mlp, registered_bn_mlp, snapshot

# ------------------------------------- flatten() after unflattened-mode changes


def test_flatten_lays_out_again_without_a_parameter_set_to_none():
    """A bias set to None in unflattened mode: flatten() holds the model as it is now (other shapes: see
    ``tests/interop/test_per_tensor_writes.py``)."""
    model, storage = registered_bn_mlp()
    plain = bn_mlp()
    storage.unflatten()
    model[1].bias = None
    plain[1].bias = None
    storage.flatten()
    assert storage.is_flattened and model[1].bias is None and "1.bias" not in model.state_dict()
    assert model.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(4, 3)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)


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


def test_flatten_unties_a_tie_broken_in_unflattened_mode_as_the_plain_model():
    """One name of a tied pair given a parameter of its own: flatten() keeps them apart, as on plain."""
    model, plain = TiedHead(), TiedHead()
    storage = register_flat_storage(model)
    storage.unflatten()
    for m in (model, plain):
        m.head.weight = nn.Parameter(torch.zeros(5, 4))
    storage.flatten()
    assert storage.is_flattened and model.head.weight is not model.emb.weight
    assert sum(f.numel() for f in storage.flat_params) == sum(p.numel() for p in plain.parameters())
    tokens = torch.tensor([[0, 1, 4]])
    assert torch.equal(model(tokens), plain(tokens))


def test_unflattened_context_exits_with_a_reshaped_parameter_laid_out_again():
    """Leaving unflattened() with a parameter of another shape: the groups hold it, as on plain."""
    model, storage = registered_bn_mlp()
    with storage.unflattened():
        model[1].weight = nn.Parameter(torch.ones(3))
        model[1].bias = nn.Parameter(torch.zeros(3))
    assert storage.is_flattened
    assert [i.shape for i in storage.param_infos if i.group == "b"] == [torch.Size([3]), torch.Size([3])]
    assert storage.flat_state_dict()["flat_param_b"].numel() == 6
    assert torch.equal(model[1].weight, torch.ones(3))


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
