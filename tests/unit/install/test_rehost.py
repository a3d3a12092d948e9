"""Module swaps and replaced weights of unflattened mode, laid out again by flatten() (``rehost.py``).

A swap that re-hosts the same parameter objects changes the owner of a slot,
not the slot: the flat parameter objects, their layout and optimizer state stay,
with the plain model's parameter count. A weight that cannot live in a flat
buffer (another dtype, a tensor subclass) leaves the storage with one warning,
and the rest of its group is laid out again. Each case against a plain twin
changed the same way, without torchao (tests/interop/test_quantization.py has
torchao's flows).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import assert_agrees_with_twin, mlp, train_steps, twin


class Rehosted(nn.Linear):
    """A swapped-in linear layer that takes over the old layer's parameter objects (as QAT's from_linear)."""

    @classmethod
    def from_linear(cls, old: nn.Linear) -> Rehosted:
        with torch.device("meta"):
            new = cls(old.in_features, old.out_features)
        new.weight = old.weight
        new.bias = old.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


class Marked(torch.Tensor):
    """A tensor subclass (as a quantized weight is), reporting the dtype of the values it holds."""


def _swap(model: nn.Sequential) -> None:
    for index in (0, 2):
        model[index] = Rehosted.from_linear(model[index])


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_a_swap_that_rehosts_the_parameters_keeps_the_slots_and_the_optimizer_state():
    """Inside unflattened(): same FlatParameter and layout, plain count, momentum works on, no warning."""
    plain = mlp()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    flat_param, infos = storage.flat_params[0], storage.param_infos
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, flat)]
    batches = [torch.randn(4, 5) for _ in range(3)]
    for model, opt in zip((plain, flat), opts):
        train_steps(model, opt, batches)
    _swap(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with storage.unflattened():
            _swap(flat)
    assert storage.is_flattened and storage.flat_params[0] is flat_param and storage.param_infos == infos
    assert _numel(flat) == _numel(plain) == flat_param.numel()
    assert type(flat[0]).__name__ == "Rehosted" and isinstance(flat[0], Rehosted)
    for model, opt in zip((plain, flat), opts):
        train_steps(model, opt, batches)
    assert_agrees_with_twin(plain, flat, torch.randn(3, 5), step=True)


def test_a_swap_in_flat_mode_raises_torchs_error_and_changes_nothing():
    """Outside code's new.weight = old.weight in flat mode: torch refuses the view; the model is unchanged."""
    flat = mlp()
    storage = register_flat_storage(flat)
    before = storage.flat_params[0].detach().clone()
    with pytest.raises(TypeError, match=r"cannot assign 'torch\.FloatTensor' as parameter 'weight'"):
        _swap(flat)
    assert type(flat[0]).__name__ == "Linear" and torch.equal(storage.flat_params[0], before)


def test_a_weight_of_another_dtype_leaves_the_storage_with_one_warning():
    """A float64 weight set inside unflattened(): released, the group laid out again without it."""
    plain = mlp()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    flat_param = storage.flat_params[0]
    new = nn.Parameter(torch.randn(5, 5, dtype=torch.float64))
    plain[2].weight = nn.Parameter(new.detach().clone())
    with pytest.warns(
        UserWarning,
        match=r"flatten\(\): 1 tensor\(s\) cannot live in a flat buffer and left the flat storage: 2.weight "
        r"\(a tensor of float64, not float32\).*group '0' was laid out again \(90 -> 65 elements\)",
    ):
        with storage.unflattened():
            flat[2].weight = new
    assert storage.flat_params[0] is flat_param and flat_param.numel() == 65
    assert "2.weight" not in [info.name for info in storage.param_infos] and flat[2].weight is new
    assert list(flat.state_dict()) == list(plain.state_dict())
    remove_flat_storage(flat)
    assert flat[2].weight is new and all(
        torch.equal(a, b) for a, b in zip(flat.state_dict().values(), plain.state_dict().values())
    )


def test_a_tensor_subclass_set_in_flat_mode_is_refused_with_the_path_that_works():
    """A subclassed weight cannot land in a slot: the refusal names the rule and unflattened(); that works."""
    flat = mlp()
    storage = register_flat_storage(flat)
    marked = nn.Parameter(torch.randn(5, 5).as_subclass(Marked))
    with pytest.raises(
        RuntimeError,
        match=r"cannot set 0.weight to a Marked \(a tensor subclass\).*cannot live "
        r"in a flat buffer; quantize or swap weights inside `with storage.unflattened\(\):`",
    ):
        flat[0].weight = marked
    assert storage.flat_params[0].numel() == 90
    with pytest.warns(UserWarning, match=r"0.weight \(a Marked \(a tensor subclass\)\)"):
        with storage.unflattened():
            flat[0].weight = marked
    assert flat[0].weight is marked and storage.flat_params[0].numel() == 65


def test_a_storage_whose_every_tensor_left_is_removed():
    """Nothing left to flatten: the storage is removed and the model is the plain one."""
    flat = nn.Sequential(nn.Linear(3, 3, bias=False))
    storage = register_flat_storage(flat)
    new = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    with pytest.warns(UserWarning, match="nothing was left in it, so the flat storage was removed"):
        with storage.unflattened():
            flat[0].weight = new
    assert get_flat_storage(flat) is None and flat[0].weight is new and type(flat[0]) is nn.Linear
    with pytest.raises(RuntimeError, match="this flat storage is detached"):
        storage.flatten()


def test_a_storage_whose_every_module_was_replaced_is_removed_at_flatten_with_a_warning():
    """Per-tensor mode: every flattened module replaced, flatten() removes the storage and says so."""
    flat = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    storage = register_flat_storage(flat)
    storage.unflatten()
    with pytest.warns(UserWarning, match="dead space"):
        flat[0], flat[2] = nn.Linear(3, 3), nn.Linear(3, 2)
    new = list(flat.parameters())
    with pytest.warns(UserWarning, match=r"flatten\(\): no tensor of the flat storage is left in the model"):
        storage.flatten()
    assert get_flat_storage(flat) is None and list(flat.parameters()) == new
    assert all(type(p) is nn.Parameter for p in new) and type(flat[0]) is nn.Linear
    removed = r"detached: flatten\(\) removed it.*register_flat_storage\(model\) flattens"
    with pytest.raises(RuntimeError, match=removed):
        storage.named_views()
    register_flat_storage(flat)  # the way on that the message names
    assert [n for n, _ in flat.named_parameters()] == ["flat_param_0"]


def test_features_holding_the_layout_refuse_the_release_and_keep_unflattened_mode(tmp_path: Path):
    """While disk offload holds the layout, flatten() with a released weight raises; removal works."""
    flat = mlp()
    storage = register_flat_storage(flat)
    storage.offload_to_disk(tmp_path)
    storage.unflatten()
    new = nn.Parameter(torch.randn(5, 5, dtype=torch.float64))
    flat[2].weight = new
    with pytest.raises(RuntimeError, match=r"cannot run flatten\(\) on a flattened module while DiskOffload"):
        storage.flatten()
    assert not storage.is_flattened and flat[2].weight is new
    with pytest.raises(
        RuntimeError,
        match=r"changed the model in per-tensor mode \(2.weight was replaced by a tensor of "
        r"float64, not float32\), but DiskOffload hold\(s\) the flat storage's layout"
        r".*storage.load_to_memory\(\)",
    ):
        storage.flat_params  # noqa: B018 - a whole-buffer call would miss the new weight
    remove_flat_storage(flat)  # the plain model, with the new weight
    assert get_flat_storage(flat) is None and flat[2].weight is new
