"""register_flat_storage(..., exist_ok=True): the same groups give the existing storage, others raise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage, weight_decay_groups

from _helpers import assert_same_values, mlp
from _hf import gpt2
from _lightning import LitLM, loader, trainer


def test_same_automatic_groups_return_the_existing_storage():
    """groups=None twice: the same storage, the same flat parameters and values, nothing re-registered."""
    model = mlp()
    storage = register_flat_storage(model)
    flat = model.flat_param_0
    with torch.no_grad():
        flat.add_(1.0)
    before = flat.detach().clone()
    assert register_flat_storage(model, exist_ok=True) is storage
    assert model.flat_param_0 is flat and torch.equal(flat, before)


@pytest.mark.parametrize(
    "make_groups",
    [
        lambda m: {"w": ["*.weight"], "b": ["*.bias"]},
        lambda m: [[m[0], m[2]], [m[4]]],
    ],
    ids=["globs", "modules"],
)
def test_same_explicit_groups_return_the_existing_storage(make_groups):
    """Globs and submodules resolve against the flattened module as they did against the plain one."""
    model = mlp()
    storage = register_flat_storage(model, make_groups(model))
    assert register_flat_storage(model, make_groups(model), exist_ok=True) is storage


def test_the_original_parameter_objects_return_the_existing_storage():
    """Parameter objects taken before registration name their slots (flattened attributes read as views)."""
    model = mlp()
    groups = [[model[0].weight, model[0].bias], [model[2].weight]]
    storage = register_flat_storage(model, groups)
    assert register_flat_storage(model, groups, exist_ok=True) is storage
    with pytest.raises(TypeError, match=r"not an nn\.Parameter"):
        register_flat_storage(model, [[model[0].weight]], exist_ok=True)


def test_weight_decay_groups_of_the_flattened_model_return_the_existing_storage():
    """The recipe for code that runs twice: weight_decay_groups then register with exist_ok, both on GPT-2."""
    model = gpt2()
    storage = register_flat_storage(model, weight_decay_groups(model), exist_ok=True)
    assert register_flat_storage(model, weight_decay_groups(model), exist_ok=True) is storage


def test_same_groups_in_unflattened_mode_return_the_existing_storage():
    """Inside unflattened() the originals are the module's parameters; the layout is still the storage's."""
    model = mlp()
    storage = register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]})
    with storage.unflattened():
        assert register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]}, exist_ok=True) is storage


def test_same_buckets_return_the_existing_storage():
    """bucket_cap_mb splits the same way again."""
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    storage = register_flat_storage(model, bucket_cap_mb=0.5)
    assert len(storage.group_names) > 1
    assert register_flat_storage(model, bucket_cap_mb=0.5, exist_ok=True) is storage


def test_other_group_names_raise():
    """Groups named otherwise are refused, naming both sets of groups."""
    model = mlp()
    register_flat_storage(model)
    message = r"with groups \['0'\], and these arguments make groups \['w', 'b'\]"
    with pytest.raises(RuntimeError, match=message):
        register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]}, exist_ok=True)


def test_other_members_raise():
    """A group holding other parameters (or another order) is refused, naming the group."""
    model = mlp()
    register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]})
    with pytest.raises(RuntimeError, match=r"group 'w' of the existing flat storage holds \[0\.weight"):
        register_flat_storage(model, {"w": ["0.weight"], "b": ["*.bias", "[24].weight"]}, exist_ok=True)
    with pytest.raises(RuntimeError, match=r"group 'w'"):
        register_flat_storage(model, {"w": ["4.weight", "[02].weight"], "b": ["*.bias"]}, exist_ok=True)


def test_other_alignment_raises():
    """The same members at other offsets (another align) are refused."""
    model = mlp()
    register_flat_storage(model)
    with pytest.raises(RuntimeError, match=r"align=8 puts them at \[0, 32, 40"):
        register_flat_storage(model, align=8, exist_ok=True)


def test_bad_groups_raise_as_without_exist_ok():
    """A glob that matches nothing is a ValueError with exist_ok too."""
    model = mlp()
    register_flat_storage(model)
    with pytest.raises(ValueError, match="matches no parameter name"):
        register_flat_storage(model, ["nope.*"], exist_ok=True)


def test_without_a_storage_exist_ok_registers():
    """exist_ok=True on a plain module registers as usual; without it a second call still raises."""
    model = mlp()
    storage = register_flat_storage(model, exist_ok=True)
    assert [n for n, _ in model.named_parameters()] == ["flat_param_0"]
    with pytest.raises(RuntimeError, match="already has one"):
        register_flat_storage(model)
    assert register_flat_storage(model, exist_ok=True) is storage


def test_exist_ok_must_be_a_bool():
    """exist_ok takes True or False only."""
    with pytest.raises(TypeError, match="exist_ok must be a bool; got int 1"):
        register_flat_storage(mlp(), exist_ok=1)  # type: ignore[arg-type]


def test_lightning_calls_configure_model_for_fit_and_validate():
    """Lightning runs configure_model for fit and for validate: one storage, the plain model's losses."""
    runs = {}
    for flat in (True, False):
        module = LitLM(flat)
        trainer(max_steps=3).fit(module, loader())
        val = trainer().validate(module, loader(), verbose=False)
        runs[flat] = (module, module.losses, val[0]["val_loss"])
    module = runs[True][0]
    assert len(module.storages) == 2 and module.storages[0] is module.storages[1]
    assert runs[True][1] == runs[False][1] and len(runs[True][1]) == 3
    assert runs[True][2] == runs[False][2]
    assert_same_values(module.model, runs[False][0].model)
