"""Flat mode says a submodule asked for parameters that are slices; the per-tensor recipe is the plain run.

In flat mode ``model.fc1.requires_grad_(False)`` and optimizer groups built from
``model.fc1.parameters()`` reach none of fc1's weights (slices of the flat parameter): a
warning with the per-tensor recipe, once per storage and method (``_guards/submodule_walks.py``).
GaLore-style groups from ``module.weight`` and torch's Muon docstring split fail with torch's own
messages (``docs/troubleshooting.md`` keys entries by them). Each case is checked against a plain
twin from the same seed: the trap is reproduced, and the recipe (``storage.unflatten()``) gives the
plain twin's weights bit for bit. The frameworks that walk submodules stay silent:
``tests/interop/test_submodule_walks_silent.py``.
"""

from __future__ import annotations

import os
import sysconfig
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage, remove_flat_storage

SAID = r"a submodule's \w+\(\) in flat mode"
RECIPE = r"storage\.unflatten\(\) before building the optimizer, or inside `with storage\.unflattened\(\):`"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        optimizer.step()


def _assert_equal(model: nn.Module, plain: nn.Module) -> None:
    got, want = model.state_dict(), plain.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _per_module_lr(model: nn.Module) -> torch.optim.Optimizer:
    """fc1 held still (learning rate 0), the rest trained."""
    fc1 = {id(p) for p in model.fc1.parameters()}
    rest = [p for p in model.parameters() if id(p) not in fc1]
    return torch.optim.AdamW([{"params": list(model.fc1.parameters()), "lr": 0.0}, {"params": rest}], lr=1e-2)


def _galore_groups(model: nn.Module) -> torch.optim.Optimizer:
    matrices = [module.weight for module in (model.fc1, model.fc2)]
    others = [module.bias for module in (model.fc1, model.fc2)]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others}], lr=1e-2)


def _muon_split(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon's docstring: Muon for the matrices, AdamW for the rest."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    return [torch.optim.Muon(matrices, lr=1e-2), torch.optim.AdamW(others, lr=1e-2)]


class _Both(torch.optim.Optimizer):
    """Steps several optimizers as one (the Muon split)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step()


def test_freezing_a_submodule_in_flat_mode_warns_and_the_recipe_freezes_it():
    """``fc1.requires_grad_(False)``: fc1 moves in flat mode, with a warning; per-tensor mode freezes it."""
    plain, model, recipe = Net(), Net(), Net()
    plain.fc1.requires_grad_(False)
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    start = recipe.fc1.weight.detach().clone()
    assert torch.equal(plain.fc1.weight, start)

    register_flat_storage(model)
    with pytest.warns(UserWarning, match=rf"{SAID} reaches none .*'fc1' \(Linear: bias, weight\).*{RECIPE}"):
        model.fc1.requires_grad_(False)
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert not torch.equal(model.fc1.weight, start)  # the trap: fc1 moved

    storage = register_flat_storage(recipe)
    storage.unflatten()
    recipe.fc1.requires_grad_(False)
    _train(recipe, torch.optim.AdamW(recipe.parameters(), lr=1e-2))
    _assert_equal(recipe, plain)


def test_per_module_learning_rates_in_flat_mode_warn_and_the_recipe_gives_the_plain_run():
    """A group of ``fc1.parameters()`` at lr 0: fc1 moves in flat mode, warned; per-tensor is plain."""
    plain, model, recipe = Net(), Net(), Net()
    start = recipe.fc1.weight.detach().clone()
    _train(plain, _per_module_lr(plain))
    assert torch.equal(plain.fc1.weight, start)

    register_flat_storage(model)
    with pytest.warns(UserWarning, match=rf"{SAID} sees none .*'fc1'.*{RECIPE}"):
        optimizer = _per_module_lr(model)
    _train(model, optimizer)
    assert not torch.equal(model.fc1.weight, start)  # the trap: fc1 moved at the other group's rate

    storage = register_flat_storage(recipe)
    storage.unflatten()
    _train(recipe, _per_module_lr(recipe))
    _assert_equal(recipe, plain)


def test_galore_style_groups_from_module_weight_fail_with_torchs_message_and_the_recipe_trains():
    """Groups of ``module.weight``: torch's "can't optimize a non-leaf Tensor" flat; per-tensor: plain."""
    plain, model, recipe = Net(), Net(), Net()
    _train(plain, _galore_groups(plain))

    register_flat_storage(model)
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        _galore_groups(model)

    storage = register_flat_storage(recipe)
    storage.unflatten()
    _train(recipe, _galore_groups(recipe))
    _assert_equal(recipe, plain)


def test_the_muon_docstring_split_fails_with_torchs_message_and_the_recipe_trains():
    """``p.ndim >= 2`` over ``model.parameters()``: an empty list for Muon in flat mode; per-tensor: plain."""
    plain, model, recipe = Net(), Net(), Net()
    _train(plain, _Both(_muon_split(plain)))

    register_flat_storage(model)
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        _muon_split(model)

    storage = register_flat_storage(recipe)
    storage.unflatten()
    _train(recipe, _Both(_muon_split(recipe)))
    _assert_equal(recipe, plain)


def test_each_method_is_said_once_per_storage():
    """A second call of the same method on the same storage is silent; another method or storage warns."""
    model, other = Net(), Net()
    register_flat_storage(model)
    register_flat_storage(other)
    with pytest.warns(UserWarning, match=r"a submodule's parameters\(\)"):
        list(model.fc1.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(model.fc1.parameters())
        list(model.fc2.parameters(recurse=False))
    with pytest.warns(UserWarning, match=r"a submodule's named_parameters\(\) .*'fc2'"):
        list(model.fc2.named_parameters())
    with pytest.warns(UserWarning, match=r"a submodule's parameters\(\)"):
        list(other.fc1.parameters())


def test_the_registered_module_per_tensor_mode_and_the_librarys_own_calls_are_silent():
    """The root's walks, calls in ``unflattened()`` or per-tensor mode and the library's calls are silent."""
    model = Net()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=SAID)
        storage = register_flat_storage(model)
        assert [n for n, _ in model.named_parameters()] == ["flat_param_0"]
        model.requires_grad_(True)
        list(model.parameters(recurse=False))
        with storage.unflattened():
            assert [n for n, _ in model.fc1.named_parameters()] == ["weight", "bias"]
            model.fc1.requires_grad_(True)
        storage.unflatten()
        list(model.fc2.parameters())
        storage.flatten()
        model.load_state_dict(model.state_dict())
        model.double().float()
        storage.summary()
        remove_flat_storage(model)
        list(model.fc1.parameters())


def test_a_call_from_an_installed_package_is_silent():
    """The same call made by code under site-packages (a framework's own walk) says nothing."""
    model = Net()
    register_flat_storage(model)
    path = os.path.join(sysconfig.get_paths()["purelib"], "some_framework", "walk.py")
    code = compile("found = [p for m in model.modules() for p in m.parameters()]", path, "exec")
    scope: dict[str, object] = {"model": model}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=SAID)
        exec(code, scope)  # the code compiled here, attributed to an installed file
    assert [tuple(p.shape) for p in scope["found"]] == [(63,)]  # type: ignore[attr-defined]
    with pytest.warns(UserWarning, match=SAID):  # the same walk from user code
        _ = [p for m in model.modules() for p in m.parameters()]
