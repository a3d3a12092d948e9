"""torch's hook-based weight_norm, spectral_norm and pruning on a flattened model (_core/torch_renames.py).

``torch.nn.utils.weight_norm`` / ``spectral_norm`` (the forward-pre-hook versions) and
``torch.nn.utils.prune`` rename a weight; in flat mode torch failed with ``KeyError: 'weight'`` or
"cannot assign 'torch.FloatTensor' object to parameter 'weight_orig'". Each is applied, trained
and removed on a flattened model and on its plain twin from the same seed: outputs, state dicts
and the model after ``remove_flat_storage`` are the plain twin's, in flat mode and in per-tensor
mode flattened afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from flatten_parametrize import register_flat_storage, remove_flat_storage

from _helpers import assert_same_values, twin, values

pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated in favor of")

#: name -> (apply it to a module, remove it from that module).
TOOLS: dict[str, tuple[Callable[[nn.Module], Any], Callable[[nn.Module], Any]]] = {
    "weight_norm": (torch.nn.utils.weight_norm, torch.nn.utils.remove_weight_norm),
    "spectral_norm": (torch.nn.utils.spectral_norm, torch.nn.utils.remove_spectral_norm),
    "prune": (lambda m: prune.l1_unstructured(m, "weight", amount=0.5), lambda m: prune.remove(m, "weight")),
}
X = torch.randn(3, 2, 9, generator=torch.Generator().manual_seed(0))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 4, 3), nn.Tanh(), nn.Conv1d(4, 2, 3))


def _apply_to_both(tool: str, plain: nn.Module, model: nn.Module) -> None:
    for m in (plain, model):
        torch.manual_seed(1)  # spectral_norm draws its vectors u and v
        TOOLS[tool][0](m[0])


def _train(model: nn.Module, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        model(X).pow(2).mean().backward()
        opt.step()


def _assert_as_plain(model: nn.Module, plain: nn.Module) -> None:
    assert torch.equal(model(X), plain(X))
    assert list(model.state_dict()) == list(plain.state_dict())
    assert_same_values(values(model), values(plain))


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_hook_based_reparametrization_in_flat_mode_trains_and_is_removed_as_on_the_plain_model(tool: str):
    plain = _net()
    model = twin(plain)
    storage = register_flat_storage(model)
    _apply_to_both(tool, plain, model)
    assert storage.is_flattened
    _assert_as_plain(model, plain)
    _train(model)
    _train(plain)
    _assert_as_plain(model, plain)
    for m in (plain, model):
        TOOLS[tool][1](m[0])
    assert storage.is_flattened
    _assert_as_plain(model, plain)
    remove_flat_storage(model)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    _assert_as_plain(model, plain)


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_weight_renamed_in_flat_mode_keeps_or_leaves_its_slot_with_no_dead_space(tool: str):
    """weight_orig is the same parameter (its slot, renamed); weight_g and weight_v are new, ordinary ones."""
    model = _net()
    storage = register_flat_storage(model)
    before = storage["0"].numel()
    _apply_to_both(tool, _net(), model)
    names = [info.name for info in storage.param_infos]
    if tool == "weight_norm":
        assert "0.weight" not in names and storage["0"].numel() == before - 24
        assert {"0.weight_g", "0.weight_v"} <= {n for n, _ in model.named_parameters()}
    else:
        assert names[0] == "0.weight_orig" and storage["0"].numel() == before


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_reparametrization_applied_in_per_tensor_mode_then_flattened_trains_as_the_plain_model(tool: str):
    plain = _net()
    model = twin(plain)
    storage = register_flat_storage(model)
    storage.unflatten()
    _apply_to_both(tool, plain, model)
    _train(model)
    _train(plain)
    storage.flatten()
    _assert_as_plain(model, plain)
    _train(model, 1)
    _train(plain, 1)
    _assert_as_plain(model, plain)
    for m in (plain, model):
        TOOLS[tool][1](m[0])
    _assert_as_plain(model, plain)
