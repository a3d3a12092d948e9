"""The seams where a feature plugs into the coordinator: its lifecycle and the flat-gradient hook."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage
from flatten_parametrize._core.grad import PRESCALE_MIN_SEGMENT_BYTES

from _helpers import core_of, mlp


class Recorder:
    """A feature that records the lifecycle calls it gets."""

    def __init__(self, copies: bool = True) -> None:
        self.calls: list[str] = []
        self.copies = copies

    def on_rebacked(self) -> None:
        self.calls.append("rebacked")

    def on_removed(self) -> None:
        self.calls.append("removed")

    def copy_for(self, storage: Any, memo: dict[int, Any]) -> Recorder | None:
        self.calls.append("copied")
        return Recorder() if self.copies else None


def test_an_added_feature_is_told_when_flat_buffers_are_replaced(tmp_path):
    """.to() and a swap of the buffers by another feature (disk offload) notify every feature."""
    model = mlp(2)
    storage = register_flat_storage(model)
    feature = Recorder()
    core_of(storage).add_feature(feature)
    model.double()
    assert feature.calls == ["rebacked"]
    storage.offload_to_disk(tmp_path)
    storage.load_to_memory()
    assert feature.calls == ["rebacked"] * 3


def test_an_added_feature_is_told_when_the_storage_is_removed():
    """remove_flat_storage calls on_removed; a removed feature hears nothing more."""
    model = mlp(2)
    storage = register_flat_storage(model)
    gone, kept = Recorder(), Recorder()
    core_of(storage).add_feature(gone)
    core_of(storage).add_feature(kept)
    core_of(storage).remove_feature(gone)
    remove_flat_storage(model)
    assert (gone.calls, kept.calls) == ([], ["removed"])


def test_a_deep_copy_gets_the_copies_its_features_make():
    """copy.deepcopy asks each feature for its copy; None leaves the copy without it."""
    model = mlp(2)
    storage = register_flat_storage(model)
    carried, dropped = Recorder(), Recorder(copies=False)
    core_of(storage).add_feature(carried)
    core_of(storage).add_feature(dropped)
    clone = copy.deepcopy(model)
    assert carried.calls == dropped.calls == ["copied"]
    clone.double()
    assert [type(f).__name__ for f in core_of(get_flat_storage(clone)).features] == ["Recorder"]
    assert core_of(get_flat_storage(clone)).features[0].calls == ["rebacked"]


class Halve:
    """A flat-gradient hook that divides each gradient by 2 while it is built, and records where it went."""

    def __init__(self) -> None:
        self.ready: list[tuple[int, bool]] = []

    def divisor(self, flat: torch.Tensor) -> int | None:
        return 2

    def grad_ready(self, grad: torch.Tensor, divided: bool) -> None:
        self.ready.append((grad.data_ptr(), divided))  # no reference: accumulation may take it


def test_a_flat_gradient_hook_sees_each_flat_gradient_and_may_divide_it():
    """Each backward hands the hook its group's flat gradient once; a divisor divides it as it is built."""
    width = 128  # large enough to divide while copying (PRESCALE_MIN_SEGMENT_BYTES per segment)
    assert width * (width + 1) * 4 >= 2 * PRESCALE_MIN_SEGMENT_BYTES
    model, plain = nn.Linear(width, width), nn.Linear(width, width)
    plain.load_state_dict(model.state_dict())
    storage = register_flat_storage(model)
    hook = Halve()
    [group] = core_of(storage).groups()
    group.views.grad_buffer.add_hook(hook)
    x = torch.randn(3, width)
    model(x).sum().backward()
    plain(x).sum().backward()
    [(address, divided)] = hook.ready
    assert divided and address == storage["0"].grad.data_ptr()
    expected = torch.cat([plain.weight.grad.reshape(-1), plain.bias.grad]) / 2
    torch.testing.assert_close(storage["0"].grad, expected)
    group.views.grad_buffer.remove_hook(hook)
    model(x).sum().backward()
    assert len(hook.ready) == 1
