"""torch's weight_norm, spectral_norm, pruning and parametrizations on a flattened model (_outside/)

``torch.nn.utils.weight_norm`` / ``spectral_norm`` (the forward-pre-hook versions),
``torch.nn.utils.prune`` and ``torch.nn.utils.parametrize`` (behind ``torch.nn.utils.parametrizations``)
rename a weight; in flat mode torch failed with ``KeyError: 'weight'`` or "cannot assign
'torch.FloatTensor' object to parameter 'weight_orig'", a parametrization was refused, and
``remove_parametrizations`` of one registered before the storage turned the weight into a buffer
that no longer trained. Each is applied, trained and removed on a flattened model and on its plain
twin from the same seed: outputs, state dicts, classes and the model after ``remove_flat_storage``
are the plain twin's, in flat mode and in per-tensor mode flattened afterwards. The twins are built
twice from one seed, not deep-copied: torch's copies of a parametrized module share its class, so
removing a parametrization from one breaks the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize, prune

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


class _Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


#: torch's parametrizations: two new originals, one given other memory by ``right_inverse``, one
#: with a power iteration per training read, and one that keeps the same parameter.
PARAMETRIZATIONS: dict[str, Callable[[nn.Module], Any]] = {
    "weight_norm": parametrizations.weight_norm,
    "orthogonal": parametrizations.orthogonal,
    "spectral_norm": parametrizations.spectral_norm,
    "register_parametrization": lambda m: parametrize.register_parametrization(m, "weight", _Double()),
}


def _linear_net(kind: str | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    if kind is not None:
        PARAMETRIZATIONS[kind](first)
    return nn.Sequential(first, nn.Tanh(), nn.Linear(4, 3))


def _assert_linear_as_plain(model: nn.Module, plain: nn.Module) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(x), plain(x))
    assert list(model.state_dict()) == list(plain.state_dict())
    assert_same_values(values(model), values(plain))


def _train_linear(model: nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("kind", list(PARAMETRIZATIONS))
def test_a_torch_parametrization_in_flat_mode_trains_and_is_removed_as_on_the_plain_model(kind: str):
    """Refused before; now laid out as in per-tensor mode (the same parameter keeps its slot)."""
    plain, model = _linear_net(), _linear_net()
    storage = register_flat_storage(model)
    for m in (plain, model):
        torch.manual_seed(1)
        PARAMETRIZATIONS[kind](m[0])
    assert storage.is_flattened and parametrize.is_parametrized(model[0], "weight")
    _assert_linear_as_plain(model, plain)
    _train_linear(model)
    _train_linear(plain)
    _assert_linear_as_plain(model, plain)
    for m in (plain, model):
        parametrize.remove_parametrizations(m[0], "weight", leave_parametrized=True)
    assert type(model[0]).__bases__[0] is type(plain[0]) is nn.Linear
    _assert_linear_as_plain(model, plain)
    remove_flat_storage(model)
    assert type(model[0]) is nn.Linear
    _assert_linear_as_plain(model, plain)


@pytest.mark.parametrize("per_tensor", [False, True], ids=["flat", "per-tensor"])
@pytest.mark.parametrize("kind", list(PARAMETRIZATIONS))
def test_removing_a_parametrization_registered_before_the_storage_keeps_a_trained_weight(
    kind: str, per_tensor: bool
):
    """In flat mode the view went back as a buffer (orthogonal: the weight stopped training, no word)."""
    plain, model = _linear_net(kind), _linear_net(kind)
    storage = register_flat_storage(model)
    if per_tensor:
        storage.unflatten()
    for m in (plain, model):
        parametrize.remove_parametrizations(m[0], "weight", leave_parametrized=True)
    assert "weight" not in model[0]._buffers
    _train_linear(model)
    _train_linear(plain)
    storage.flatten()
    _assert_linear_as_plain(model, plain)
    remove_flat_storage(model)
    assert type(model[0]) is type(plain[0]) is nn.Linear
    _assert_linear_as_plain(model, plain)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("per_tensor", [False, True], ids=["flat", "per-tensor"])
def test_torch_ao_sparsifier_prepares_trains_and_squashes_as_on_the_plain_model(per_tensor: bool):
    """torch.ao.pruning's WeightNormSparsifier: FakeSparsity parametrizations, steps, squash_mask."""
    from torch.ao.pruning import WeightNormSparsifier

    plain, model = _linear_net(), _linear_net()
    storage = register_flat_storage(model)
    if per_tensor:
        storage.unflatten()
    for m in (plain, model):
        sparsifier = WeightNormSparsifier(sparsity_level=0.5, sparse_block_shape=(1, 2), zeros_per_block=1)
        sparsifier.prepare(m, config=[{"tensor_fqn": "0.weight"}])
        sparsifier.step()
        _train_linear(m)
        sparsifier.step()
        sparsifier.squash_mask()
    assert type(model[0]) is type(plain[0]) is nn.Linear or type(model[0]).__bases__[0] is nn.Linear
    assert int((model[0].weight == 0).sum()) == int((plain[0].weight == 0).sum()) > 0
    _assert_linear_as_plain(model, plain)
    remove_flat_storage(model)
    assert type(model[0]) is nn.Linear
    _assert_linear_as_plain(model, plain)
