"""Checkpoints through ``torch.save`` and ``torch.load(weights_only=True)``: both forms, FlatParameter.

``weights_only=True`` (torch's default since 2.6) only unpickles allow-listed types; the
library registers ``FlatParameter`` and its rebuild function as safe globals, and both
state dict forms hold plain tensors only. Each test writes a checkpoint, reads it back
with ``weights_only=True`` (in memory, or from a file, also memory-mapped) and checks
that it restores values bit for bit, or that a layout check refuses it.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from flatten_parametrize import FlatParameter, get_flat_storage, register_flat_storage

from _helpers import Mixed, TiedLM, WithOwnParam, assert_same_values, train_steps, values


def _inputs(factory: Callable[[], nn.Module]) -> Any:
    if factory is TiedLM:
        return torch.randint(0, 11, (3, 5))
    return torch.randn(5, 4 if factory is Mixed else 3)


def _named(model: nn.Module) -> Any:
    if isinstance(model, Mixed):
        return {"f32": [model.inp, model.bn], "f64": [model.wide]}  # model.out left out
    return {"first": [next(model.children()).weight], "rest": ["*.bias"]}


#: (factory, groups, align): automatic groups, and named groups with padding and a part left out.
CASES = {
    "tied_lm-auto": (TiedLM, lambda model: None, 1),
    "tied_lm-named": (TiedLM, _named, 4),
    "bn_own_param-auto": (WithOwnParam, lambda model: None, 1),
    "bn_own_param-named": (WithOwnParam, _named, 4),
    "mixed-auto": (Mixed, lambda model: None, 1),
    "mixed-named": (Mixed, _named, 4),
}


def _trained(factory: Callable[[], nn.Module], groups: Any, align: int = 1) -> tuple[nn.Module, Any]:
    """A registered model after one training step, so that values differ from a fresh one."""
    model = factory()
    storage = register_flat_storage(model, groups(model), align=align)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(_inputs(factory)).float().pow(2).mean().backward()
    opt.step()
    return model, storage


def _roundtrip(obj: Any, tmp_path: Path | None = None, mmap: bool = False) -> Any:
    if tmp_path is None:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)
    path = tmp_path / "checkpoint.pt"
    torch.save(obj, path)
    return torch.load(path, weights_only=True, mmap=mmap)


@pytest.mark.parametrize("case", list(CASES))
def test_unflattened_checkpoint_loads_with_weights_only_anywhere(case):
    """module.state_dict() survives weights_only loading into a plain, a same and an other-layout model."""
    factory, groups, align = CASES[case]
    model, _ = _trained(factory, groups, align)
    expected = values(model)
    loaded = _roundtrip(model.state_dict())
    assert all(type(v) is torch.Tensor for v in loaded.values())
    plain, same, other = factory(), factory(), factory()
    register_flat_storage(same, groups(same), align=align)
    register_flat_storage(other, align=8)
    for target in (plain, same, other):
        target.load_state_dict(loaded)
        assert_same_values(target, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_flat_checkpoint_loads_with_weights_only_into_the_same_layout(case):
    """storage.flat_state_dict() survives weights_only loading and restores every value."""
    factory, groups, align = CASES[case]
    model, storage = _trained(factory, groups, align)
    expected = values(model)
    loaded = _roundtrip(storage.flat_state_dict())
    assert list(loaded) == list(storage.flat_state_dict())
    for group in storage.group_names:
        assert loaded[f"flat_layout_{group}"].dtype == torch.uint8
        assert torch.equal(loaded[f"flat_param_{group}"], storage[group].detach())
    fresh = factory()
    register_flat_storage(fresh, groups(fresh), align=align)
    fresh.load_state_dict(loaded)
    assert_same_values(fresh, expected)


def test_flat_checkpoint_of_another_layout_is_refused_after_weights_only_loading():
    """The layout record survives serialization: a flat checkpoint of another layout loads nowhere wrong."""
    _, storage = _trained(TiedLM, lambda model: None)
    loaded = _roundtrip(storage.flat_state_dict())
    other = TiedLM()
    register_flat_storage(other, align=8)
    before = values(other)
    with pytest.raises(ValueError, match=r"flat state dict for group '0' was written for another layout"):
        other.load_state_dict(loaded)
    assert_same_values(other, before)


@pytest.mark.parametrize("overwrite", [False, True])
def test_flat_parameters_survive_weights_only_loading_with_their_layout(overwrite):
    """A registered model's FlatParameters (any dtype, frozen or not, aligned) load back as FlatParameters."""
    model = Mixed()
    storage = register_flat_storage(model, align=4)
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    try:
        model.to(torch.float64)  # re-wraps the flat parameters when it replaces them
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    flats = storage.flat_params
    assert len(flats) == 3  # float32, float64, frozen
    loaded = _roundtrip({"flat": flats, "named": dict(model.named_parameters())})
    for flat, back in zip(flats, loaded["flat"]):
        assert type(back) is FlatParameter
        assert back.metadata() == flat.metadata() and back.offsets == flat.offsets
        assert back.requires_grad == flat.requires_grad and back.dtype == flat.dtype == torch.float64
        assert torch.equal(back.detach(), flat.detach())
    assert [type(p) for p in loaded["named"].values()] == [FlatParameter] * 3


@pytest.mark.parametrize("form", ["unflattened", "flat"])
@pytest.mark.parametrize("mmap", [False, True])
def test_a_training_checkpoint_resumes_exactly_where_it_stopped(tmp_path, form, mmap):
    """A checkpoint (model in either form, optimizer) read with weights_only trains on identically."""
    x = torch.randint(0, 11, (4, 6))
    model = TiedLM()
    storage = register_flat_storage(model, {"embed": ["embed.weight"], "rest": ["norm.*", "body.*"]})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(batch).logsumexp(-1).mean()

    train_steps(model, opt, [x] * 3, loss)
    state = model.state_dict() if form == "unflattened" else storage.flat_state_dict()
    checkpoint = _roundtrip({"model": state, "optim": opt.state_dict(), "step": 3}, tmp_path, mmap)
    resumed = TiedLM()
    register_flat_storage(resumed, {"embed": ["embed.weight"], "rest": ["norm.*", "body.*"]})
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(checkpoint["optim"])
    assert checkpoint["step"] == 3
    train_steps(model, opt, [x] * 3, loss)
    train_steps(resumed, resumed_opt, [x] * 3, loss)
    assert_same_values(resumed, values(model))


def test_a_deep_copied_models_checkpoint_loads_with_weights_only():
    """The state dicts of a deep copy (own classes, own buffers) are as loadable as the original's."""
    model, _ = _trained(WithOwnParam, lambda model: None)
    clone = copy.deepcopy(model)
    storage = get_flat_storage(clone)
    assert storage is not None
    for state in (clone.state_dict(), storage.flat_state_dict()):
        fresh = WithOwnParam()
        register_flat_storage(fresh)
        fresh.load_state_dict(_roundtrip(state))
        assert_same_values(fresh, values(model))
