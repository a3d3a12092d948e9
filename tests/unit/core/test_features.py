"""The seams where a feature plugs into the coordinator: its lifecycle and the flat-gradient hook."""

from __future__ import annotations

import copy
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage
from flatten_parametrize._core.features import Feature, layout_holders, refuse_held_layout
from flatten_parametrize._core.grad.owner import PRESCALE_MIN_SEGMENT_BYTES, GroupGrad, check_sync, claim_sync

from _helpers import core_of, mlp


class Recorder(Feature):
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


class ForwardWatcher(Recorder):
    """A feature that asks for per-tensor mode's forward hooks and records them."""

    def forward_sync(self) -> bool:
        return True

    def per_tensor_began(self, tx: Any) -> None:
        self.calls.append("began")

    def per_tensor_ended(self, tx: Any) -> None:
        self.calls.append("ended")

    def before_forward(self) -> None:
        self.calls.append("before")

    def after_forward(self) -> None:
        self.calls.append("after")


def test_a_feature_that_declares_nothing_more_holds_the_layout_and_is_not_carried():
    """The defaults of the optional hooks: it holds the layout while composed, is dropped by a pickle."""
    model = mlp(2)
    storage = register_flat_storage(model)
    core = core_of(storage)
    core.add_feature(Recorder())
    assert layout_holders(core) == {"Recorder": "remove the Recorder feature"}
    held = r"cannot run a change .* Recorder hold\(s\) its layout.*remove the Recorder feature"
    with pytest.raises(RuntimeError, match=held):
        refuse_held_layout(core, "a change")
    bare = Recorder()
    assert (bare.pickle_record(), bare.relayout_record(), bare.forward_sync()) == (None, None, False)


def test_per_tensor_modes_forward_calls_the_features_that_ask_for_it():
    """forward_sync() True: the mode's start and end, and each forward's start and end, reach the feature."""
    model = mlp(2)
    storage = register_flat_storage(model)
    watcher = ForwardWatcher()
    core_of(storage).add_feature(watcher)
    storage.unflatten()
    model(torch.randn(3, 5))
    storage.flatten()
    assert watcher.calls == ["began", "before", "after", "ended", "rebacked"]  # flatten() re-backs


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
    group.grads.add_hook(hook)
    x = torch.randn(3, width)
    model(x).sum().backward()
    plain(x).sum().backward()
    [(address, divided)] = hook.ready
    assert divided and address == storage["0"].grad.data_ptr()
    expected = torch.cat([plain.weight.grad.reshape(-1), plain.bias.grad]) / 2
    torch.testing.assert_close(storage["0"].grad, expected)
    group.grads.remove_hook(hook)
    model(x).sum().backward()
    assert len(hook.ready) == 1


class Owner:
    """Something that syncs gradients (held weakly by a claim)."""


def test_one_owner_at_a_time_syncs_a_groups_gradient():
    """A second live claimant is refused with the holder's message; a claim ends on release or collection."""
    model = mlp(2)
    storage = register_flat_storage(model, bucket_cap_mb=1e-4)
    buffers = [g.grads for g in core_of(storage).groups()]
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
    buffer = group.grads
    model(torch.ones(1, 5)).sum().backward()
    assert buffer.keep == GroupGrad.KEEP and len(buffer._kept) == 1
    hook = Releasing()
    buffer.add_hook(hook)
    assert buffer.keep == 0 and buffer._kept == []  # given up at once, not at the next backward
    storage["0"].grad = None
    model(torch.ones(1, 5)).sum().backward()
    assert buffer._kept == []
    buffer.remove_hook(hook)
    assert buffer.keep == GroupGrad.KEEP


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
    group.grads.add_hook(Doubling())
    model(torch.ones(1, 5)).sum().backward(create_graph=create_graph)
    plain(torch.ones(1, 5)).sum().backward()
    assert storage["0"].grad.dtype == torch.float32
    for name, param in plain.named_parameters():
        torch.testing.assert_close(dict(storage.named_grads())[name], 2 * param.grad, msg=name)


# ------------------------------------------------- the seams a mixed-precision compute copy needs


class ToMaster:
    """The flat-gradient hook of one group: converts the (float64) gradient to the master's dtype."""

    releases_gradient = False

    def __init__(self, feature: Float64Copy, g: int) -> None:
        self.feature, self.g = feature, g

    def divisor(self, flat: torch.Tensor) -> int | None:
        return None

    def grad_ready(self, grad: torch.Tensor, divided: bool) -> torch.Tensor:
        self.feature.converted += 1
        return grad.to(self.feature.core().groups()[self.g].flat.dtype)


class Float64Source:
    """One group's ``GroupViews.source`` (a ``view_cache.ViewSource``): this test writes into no view."""

    def __init__(self, feature: Float64Copy, g: int) -> None:
        self.feature, self.g = feature, g

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        return self.feature.source(self.g, flat)

    def exposed(self, index: int, view: torch.Tensor) -> None:
        self.feature.exposed += 1

    def watching(self) -> bool:
        return False

    def land(self) -> None:
        pass


class Float64Copy(Feature):
    """A tiny compute-copy feature: each group's views are served from a float64 copy of its flat parameter.

    The copy is cast once per group, and only after the master changed: at the core's sync points
    (``refresh``: each forward) it compares the flat parameter's identity, memory and version with
    what it cast; ``on_rebacked`` covers what those do not show. It counts its casts.
    """

    def __init__(self, core: Any, convert: bool = True) -> None:
        self.core = weakref.ref(core)
        self.casts = self.sourced = self.converted = self.exposed = 0
        self.copies: dict[int, torch.Tensor] = {}
        self.seen: dict[int, tuple[Any, ...]] = {}
        for group in core.groups():
            group.views.source = Float64Source(self, group.index)
            if convert:
                group.grads.add_hook(ToMaster(self, group.index))
            group.views.invalidate()
        core.add_feature(self)

    def source(self, g: int, flat: torch.Tensor) -> torch.Tensor:
        """``GroupViews.source``: the copy for the master, a cast of anything else (``using()``)."""
        self.sourced += 1
        group = self.core().groups()[g]
        if flat is not group.flat:
            return flat.detach().to(torch.float64)
        self._fresh(group, rebuilding=True)
        return self.copies[g]

    def _fresh(self, group: Any, rebuilding: bool = False) -> None:
        flat = group.flat
        stamp = (id(flat), flat.data_ptr(), flat.dtype, flat._version)
        if self.seen.get(group.index) == stamp:
            return
        copy_ = self.copies.get(group.index)
        with torch.no_grad():
            if copy_ is not None and copy_.device == flat.device:
                copy_.copy_(flat)  # in place: the cached views alias the copy
            else:
                self.copies[group.index] = flat.detach().to(torch.float64)
                if not rebuilding:
                    group.views.invalidate()
        self.casts += 1
        self.seen[group.index] = stamp

    # the Feature lifecycle
    def refresh(self) -> None:
        for group in self.core().groups():
            self._fresh(group)

    def on_rebacked(self) -> None:
        self.seen.clear()
        self.refresh()

    def on_removed(self) -> None:
        for group in self.core().groups():
            group.views.source = None

    def copy_for(self, storage: Any, memo: dict[int, Any]) -> None:
        return None


def _copied(convert: bool = True) -> tuple[nn.Module, nn.Module, Any, Float64Copy]:
    model = mlp(2)
    plain = copy.deepcopy(model).double()
    storage = register_flat_storage(model, [[model[0]], [model[2]]])
    return model, plain, storage, Float64Copy(core_of(storage), convert)


def _served_from_the_masters(storage: Any) -> None:
    expected = storage.views_of([flat.detach().double() for flat in storage.flat_params])
    for name, view in storage.named_views():
        assert view.dtype == torch.float64 and torch.equal(view, expected[name]), name


@pytest.mark.parametrize("convert", [True, False], ids=["hook-converts", "autograd-casts"])
def test_views_served_from_another_tensor_train_the_master(convert):
    """Views are the copy's (float64); gradients reach flat.grad in the master's dtype, as the plain's."""
    model, plain, storage, feature = _copied(convert)
    x = torch.randn(3, 5, dtype=torch.float64)
    out = model(x)
    assert out.dtype == torch.float64 and torch.equal(out, plain(x))
    out.sum().backward()
    plain(x).sum().backward()
    assert feature.converted == (2 if convert else 0)
    for flat in storage.flat_params:
        assert flat.grad is not None and flat.grad.dtype == torch.float32
    grads = dict(storage.named_grads())
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name], param.grad.float(), msg=name)
    with torch.no_grad():
        assert model[0].weight.dtype == torch.float64
    with torch.inference_mode():
        assert torch.equal(model(x), plain(x))


def test_the_copy_is_cast_once_per_group_and_only_after_the_master_changed():
    """No cast per read or forward; one per changed group after a step, load, write, .to(), flatten()."""
    model, plain, storage, feature = _copied()
    x = torch.randn(3, 5, dtype=torch.float64)
    for _ in range(3):
        model(x).sum().backward()
    assert feature.casts == 2  # one per group
    sourced = feature.sourced
    for _ in range(100):
        _ = model[0].weight, model[2].bias  # cached reads: nothing asks the source
    assert feature.sourced == sourced

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()  # in place: bumps each flat parameter's version
    model(x)
    assert feature.casts == 4
    _served_from_the_masters(storage)
    model(x)
    assert feature.casts == 4

    model.load_state_dict(plain.float().state_dict())  # in place, both groups
    model(x)
    assert feature.casts == 6
    _served_from_the_masters(storage)

    with torch.no_grad():
        storage["1"].add_(1)  # an in-place write of one master: one cast
    model(x)
    assert feature.casts == 7
    _served_from_the_masters(storage)

    with storage.unflattened():
        with torch.no_grad():
            model[0].weight.mul_(2)  # a leaf of unflattened mode: no version bump of the flat parameter
    assert feature.casts == 9  # flatten() tells on_rebacked
    _served_from_the_masters(storage)

    model.double()  # replaced buffers: on_rebacked
    assert feature.casts == 11 and storage["0"].dtype == torch.float64
    _served_from_the_masters(storage)


def test_substitutes_are_served_from_their_own_cast_not_the_copy():
    """using() / functional_call substitutes reach the source too: it serves them, not the master's copy."""
    model, plain, storage, _ = _copied()
    zeros = [torch.zeros_like(f) for f in storage.flat_params]
    with storage.using(zeros):
        assert torch.equal(model[0].weight, torch.zeros(5, 5, dtype=torch.float64))
    assert torch.equal(model[0].weight, plain[0].weight.detach())
