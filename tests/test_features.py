"""The seams where a feature plugs into the coordinator: its lifecycle and the flat-gradient hook."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage
from flatten_parametrize._core.grad import PRESCALE_MIN_SEGMENT_BYTES, GradBuffer, check_sync, claim_sync

from _helpers import core_of, mlp


class Recorder:
    """A feature that records the lifecycle calls it gets."""

    def __init__(self, copies: bool = True) -> None:
        self.calls: list[str] = []
        self.copies = copies

    def on_rebacked(self) -> None:
        self.calls.append("rebacked")

    def refresh(self) -> None:
        pass  # called at every sync point

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

    releases_gradient = False

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


class Owner:
    """Something that syncs gradients (held weakly by a claim)."""


def test_one_owner_at_a_time_syncs_a_groups_gradient():
    """A second live claimant is refused with the holder's message; a claim ends on release or collection."""
    model = mlp(2)
    storage = register_flat_storage(model, bucket_cap_mb=1e-4)
    buffers = [g.views.grad_buffer for g in core_of(storage).groups()]
    assert len(buffers) > 1
    first, second = Owner(), Owner()
    claim_sync(buffers[:1], first, "first syncs", ["group 0 is first's; stop first"])
    claim_sync(buffers[:1], first, "first syncs", ["again: its own claim"])
    with pytest.raises(RuntimeError, match=r"^second syncs, but again: its own claim$"):
        claim_sync(buffers, second, "second syncs", ["mine"] * len(buffers))
    assert buffers[1].refusal_for(first) is None  # all or nothing: nothing was claimed
    buffers[0].release_sync(second)  # not the holder: nothing happens
    assert buffers[0].refusal_for(second) == "again: its own claim"
    buffers[0].release_sync(first)
    claim_sync(buffers, second, "second syncs", ["mine"] * len(buffers))
    del second
    check_sync(buffers, first, "first syncs")  # the collected owner's claims are void


class Releasing:
    """A hook whose owner drops full flat gradients (ZeRO-2)."""

    releases_gradient = True

    def divisor(self, flat: torch.Tensor) -> int | None:
        return None

    def grad_ready(self, grad: torch.Tensor, divided: bool) -> None:
        return None


def test_a_hook_that_releases_gradients_makes_the_buffer_keep_no_memory():
    """While a releasing hook is registered, backward builds each flat gradient in fresh memory."""
    model = mlp(2)
    storage = register_flat_storage(model)
    [group] = core_of(storage).groups()
    buffer = group.views.grad_buffer
    model(torch.ones(1, 5)).sum().backward()
    assert buffer.keep == GradBuffer.KEEP and len(buffer._kept) == 1
    hook = Releasing()
    buffer.add_hook(hook)
    assert buffer.keep == 0 and buffer._kept == []  # given up at once, not at the next backward
    storage["0"].grad = None
    model(torch.ones(1, 5)).sum().backward()
    assert buffer._kept == []
    buffer.remove_hook(hook)
    assert buffer.keep == GradBuffer.KEEP


class Doubling:
    """A hook that returns another gradient (twice the built one, in float64)."""

    releases_gradient = False

    def divisor(self, flat: torch.Tensor) -> int | None:
        return None

    def grad_ready(self, grad: torch.Tensor, divided: bool) -> torch.Tensor:
        return grad.to(torch.float64) * 2


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_flat_gradient_hook_may_replace_the_gradient(create_graph):
    """What grad_ready returns is the flat gradient; autograd casts it to the flat parameter's dtype."""
    model, plain = mlp(2), mlp(2)
    storage = register_flat_storage(model)
    [group] = core_of(storage).groups()
    group.views.grad_buffer.add_hook(Doubling())
    model(torch.ones(1, 5)).sum().backward(create_graph=create_graph)
    plain(torch.ones(1, 5)).sum().backward()
    assert storage["0"].grad.dtype == torch.float32
    for name, param in plain.named_parameters():
        torch.testing.assert_close(dict(storage.named_grads())[name], 2 * param.grad, msg=name)
