"""get_flat_storage, remove_flat_storage, storage[...], a detached storage and pickling refuse bad calls.

Each test pins the exception type and the part of the message that names the offending module, group
or key together with the rule it breaks, and (for calls on a module) checks with
:func:`assert_unchanged` that the failed call left the module exactly as it was: same parameter
objects, bit-for-bit the same values, same classes, library attributes, hooks and storage.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from flatten_parametrize import FlatStorage, get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import assert_plain, assert_unchanged, bn_mlp, core_of, registered_bn_mlp, snapshot

# --------------------------------------- get_flat_storage / remove_flat_storage


@pytest.mark.parametrize("obj", ["model", None, torch.zeros(2)])
def test_get_refuses_a_non_module(obj):
    """get_flat_storage needs an nn.Module: TypeError naming the type."""
    with pytest.raises(TypeError, match=rf"get_flat_storage needs an nn\.Module; got {type(obj).__name__}"):
        get_flat_storage(obj)  # type: ignore[arg-type]


def test_remove_refuses_a_module_without_storage():
    """remove_flat_storage needs the registered module: ValueError naming its class."""
    model = bn_mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"Sequential has no flat storage to remove"):
        remove_flat_storage(model)
    assert_unchanged(model, snap)
    assert_plain(model)


def test_remove_refuses_a_submodule_of_the_registered_module():
    """A submodule does not own the storage: ValueError, and the registered module is unchanged."""
    model, _ = registered_bn_mlp()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"Linear has no flat storage to remove; pass the module given to"):
        remove_flat_storage(model[0])
    assert_unchanged(model, snap)


def test_remove_refuses_a_non_module():
    """remove_flat_storage needs an nn.Module: TypeError naming the type."""
    with pytest.raises(TypeError, match=r"needs an nn\.Module; got dict"):
        remove_flat_storage({})  # type: ignore[arg-type]


def test_remove_leaves_a_reshaped_parameter_of_unflattened_mode_as_the_plain_model():
    """remove_flat_storage after a parameter of another shape was put in unflattened mode: the plain model."""
    model, storage = registered_bn_mlp()
    storage.unflatten()
    new = nn.Parameter(torch.zeros(2, 2))
    model[0].weight = new
    remove_flat_storage(model)
    assert get_flat_storage(model) is None and model[0].weight is new
    assert all(type(p) is nn.Parameter and p.is_leaf for p in model.parameters())


# ----------------------------------- storage[...], a detached storage, pickling


def test_storage_getitem_refuses_an_unknown_group():
    """storage[name] of an unknown group is a KeyError naming it and listing the groups."""
    _model, storage = registered_bn_mlp()
    with pytest.raises(KeyError, match=r"no group 'nope' in this flat storage; groups are \['a', 'b'\]"):
        storage["nope"]


def test_storage_getitem_refuses_a_non_str_key():
    """storage[0] is a TypeError that lists the group names (groups are named by str)."""
    model = nn.Sequential(nn.Linear(2, 2))
    storage = register_flat_storage(model)
    with pytest.raises(TypeError, match=r"named by str; got int 0; groups are \['0'\]"):
        storage[0]  # type: ignore[index]


def test_detached_storage_refuses_to_serve():
    """After remove_flat_storage the coordinator is detached: RuntimeError saying so."""
    model, storage = registered_bn_mlp()
    remove_flat_storage(model)
    snap = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r"this flat storage is detached: .*remove_flat_storage was called"
    ):
        _ = storage.module
    with pytest.raises(RuntimeError, match=r"this flat storage is detached"):
        list(storage.named_views())
    with pytest.raises(RuntimeError, match=r"this flat storage is detached"):
        storage.flat_params  # noqa: B018
    assert_unchanged(model, snap)
    assert_plain(model)


def test_a_removed_storage_lets_go_of_its_buffers():
    """The FlatStorage a user still holds after remove_flat_storage keeps no flat buffer or gradient."""
    model, storage = registered_bn_mlp()
    model(torch.randn(4, 3)).sum().backward()
    flats = [g.flat for g in core_of(storage).groups()]
    remove_flat_storage(model)
    assert all(f.numel() == 0 and f.grad is None for f in flats)
    assert all(p.numel() and p.grad is not None for p in model.parameters() if p.requires_grad)


def test_pickling_a_flat_storage_is_refused():
    """A FlatStorage cannot be pickled: RuntimeError saying to save a state dict instead."""
    model, storage = registered_bn_mlp()
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r"a FlatStorage cannot be pickled on its own; pickle the"):
        pickle.dumps(storage)
    assert_unchanged(model, snap)


def test_flat_storage_is_not_constructed_directly():
    """FlatStorage(...) is refused with a TypeError naming register_flat_storage; nothing is registered."""
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"FlatStorage is not constructed directly; call register_flat_stor"):
        FlatStorage(model)  # type: ignore[call-arg]
    assert get_flat_storage(model) is None
    assert_plain(model)


def test_the_same_facade_is_returned_for_one_storage():
    """register_flat_storage, get_flat_storage and exist_ok=True hand out one FlatStorage object."""
    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    assert get_flat_storage(model) is storage
    assert register_flat_storage(model, exist_ok=True) is storage
