"""Dead space said when it happens, reclaimed by the next flatten(), optimizer state moved with the slots.

``_install/dead_space.py`` warns at the assignment that replaces a submodule whose slots nothing
serves afterwards; ``_install/rehost.py`` lays the groups out again at the next ``flatten()``;
``_state/relaid_optim.py`` moves each optimizer's state with the slots at its next step. Each case
against a plain twin changed the same way.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import assert_same_values, train_steps, twin, values

DEAD = r"a submodule replaced after registration leaves 2 slot\(s\) of the flat storage unused: "


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _new_head(model: nn.Module) -> None:
    torch.manual_seed(7)
    model.head = nn.Linear(6, 3)


def test_replacing_a_submodule_warns_with_names_bytes_and_the_fix():
    """model.head = new in flat mode: one warning naming head.weight and head.bias, 84 bytes, the fix."""
    model = Net()
    storage = register_flat_storage(model)
    with pytest.warns(UserWarning, match=DEAD) as record:
        model.head = nn.Linear(6, 5)
    assert len(record) == 1
    assert str(record[0].message) == (
        "a submodule replaced after registration leaves 2 slot(s) of the flat storage unused: "
        "head.weight (18 elements, group '0'), head.bias (3 elements, group '0'); 84 bytes of dead space "
        "in the flat buffer (storage.summary() marks it). Reclaim it with `storage.unflatten(); "
        "storage.flatten()` (the groups are laid out again, the flat parameters kept) or "
        "remove_flat_storage(model)"
    )
    assert "head.weight (replaced: dead space)" in storage.summary()


def test_setting_a_submodule_to_none_and_replacing_inside_unflattened_warn_too():
    """body[0] = None (flat mode) and a new head inside unflattened() are said at the assignment."""
    model = Net()
    storage = register_flat_storage(model)
    with pytest.warns(UserWarning, match=DEAD + "body.0.weight"):
        model.body[0] = nn.Identity()
    storage.unflatten()
    with pytest.warns(UserWarning, match=DEAD + "head.weight"):
        model.head = None  # type: ignore[assignment]


def test_deleting_a_submodule_of_a_changed_module_warns():
    """del model.head on the registered module (a class of the library) is said as well."""
    model = Net()
    storage = register_flat_storage(model)
    with pytest.warns(UserWarning, match=DEAD + "head.weight"):
        del model.head
    assert "head.weight (replaced: dead space)" in storage.summary()
    storage.unflatten()
    storage.flatten()
    assert storage.flat_params[0].numel() == 30


def test_changes_that_leave_nothing_dead_say_nothing():
    """A new module where none was, a module without slots, a re-hosting swap, the same module: no warning."""
    model = Net()
    storage = register_flat_storage(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.extra = nn.Linear(2, 2)
        model.body[1] = nn.ReLU()
        model.extra = nn.Linear(2, 3)  # ordinary parameters, no slot
        model.head = model.head
        with storage.unflattened():
            old = model.head
            new = nn.Linear(6, 3, device="meta")
            new.weight, new.bias = old.weight, old.bias
            model.head = new


def test_flatten_reclaims_dead_space_and_optimizer_state_follows_the_slots():
    """After a new head, unflatten()/flatten() keep the FlatParameter; SGD momentum, Adam train as plain."""
    for make in (
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    ):
        plain = Net()
        flat = twin(plain)
        storage = register_flat_storage(flat)
        flat_param = storage.flat_params[0]
        opt_plain, opt_flat = make(plain), make(flat)
        batches = [torch.randn(5, 4) for _ in range(3)]
        train_steps(plain, opt_plain, batches)
        train_steps(flat, opt_flat, batches)
        _new_head(plain)
        with pytest.warns(UserWarning, match=DEAD):
            _new_head(flat)
        # The plain optimizer steps the old head no more (no gradient); the new head is not in it.
        storage.unflatten()
        storage.flatten()
        assert storage.flat_params[0] is flat_param and flat_param.numel() == 30
        assert sum(p.numel() for p in flat.parameters()) == sum(p.numel() for p in plain.parameters())
        train_steps(plain, opt_plain, batches)
        train_steps(flat, opt_flat, batches)
        assert_same_values(values(flat), values(plain))
        assert (
            opt_flat.state[flat_param][
                "exp_avg" if "exp_avg" in opt_flat.state[flat_param] else "momentum_buffer"
            ].numel()
            == 30
        )


def test_state_that_cannot_be_moved_raises_at_the_step_with_the_fix():
    """A tensor-subclass state (a low-bit optimizer's) for the old layout: the step raises and says why."""

    class Packed(torch.Tensor):
        pass

    model = Net()
    storage = register_flat_storage(model)
    flat_param = storage.flat_params[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, opt, [torch.randn(5, 4)])
    opt.state[flat_param]["momentum_buffer"] = torch.zeros(51).as_subclass(Packed)
    with pytest.warns(UserWarning, match=DEAD):
        _new_head(model)
    storage.unflatten()
    storage.flatten()
    with pytest.raises(
        RuntimeError,
        match=r"SGD's state 'momentum_buffer' of flat_param_0 was made for its old "
        r"layout \(51 elements\) and is a Packed.*build the optimizer again",
    ):
        train_steps(model, opt, [torch.randn(5, 4)])
