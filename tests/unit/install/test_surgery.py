"""Structure changes after registration: replaced, deleted, added and re-parented submodules.

A new module's parameters are ordinary and seen by both state-dict forms, unflattened(),
removal and the optimizer; the slots it replaced never come back (dead space in the buffer,
shown by summary()). Each case against a plain twin changed the same way.
"""

from __future__ import annotations

import copy
import importlib.util
import pickle
from typing import Callable

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import TiedLM, assert_agrees_with_twin, assert_same_values, twin, values


class Net(nn.Module):
    """A body and a classifier head, with a timm-like ``reset_classifier``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def reset_classifier(self, classes: int) -> None:
        self.head = nn.Linear(6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Adapter(nn.Module):
    """A peft-like wrapper around a base layer (merged away by ``unload``)."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora = nn.Linear(6, 6, bias=False)
        nn.init.zeros_(self.lora.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora(x)


def _seeded(change: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    def apply(model: nn.Module) -> None:
        torch.manual_seed(42)  # the twin's new modules get the same values
        change(model)

    return apply


CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "reset_classifier": _seeded(lambda m: m.reset_classifier(5)),
    "replace_body_layer": _seeded(lambda m: m.body.__setitem__(0, nn.Linear(4, 6))),
    "delete_and_add": _seeded(lambda m: (delattr(m, "head"), setattr(m, "head", nn.Linear(6, 2)))),
    "add_extra": _seeded(lambda m: m.add_module("extra", nn.Linear(2, 2))),
}


@pytest.mark.parametrize("mode", ["flat", "unflattened"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_structure_agrees_with_the_plain_model_everywhere(change, mode):
    """New modules hold ordinary parameters seen by every reader; replaced slots never come back."""
    torch.manual_seed(0)
    plain = Net()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    if mode == "unflattened":
        storage.unflatten()
    CHANGES[change](plain)
    CHANGES[change](flat)
    if mode == "unflattened":
        storage.flatten()
    x = torch.randn(3, 4)
    assert_agrees_with_twin(plain, flat, x, step=True)


def test_summary_shows_replaced_slots_as_dead_space():
    """The replaced head's old slots stay in the buffer and summary() says so."""
    model = Net()
    storage = register_flat_storage(model)
    model.reset_classifier(5)
    table = storage.summary()
    assert "head.weight (replaced: dead space)" in table and "body.0.weight " in table
    assert [n for n, _ in model.named_parameters()] == ["flat_param_0", "head.weight", "head.bias"]
    assert set(dict(storage.named_views())) == {"body.0.weight", "body.0.bias"}


def test_an_adapter_wrapped_and_unloaded_peft_style_keeps_working():
    """A base layer re-parented under an adapter and put back: forward, state dicts and removal agree."""
    torch.manual_seed(0)
    plain = Net()
    flat = twin(plain)
    register_flat_storage(flat)
    x = torch.randn(3, 4)
    for model in (plain, flat):
        torch.manual_seed(7)
        model.body[0] = nn.Sequential(model.body[0])  # the layer moves to body.0.0
        model.body.add_module("adapter", Adapter(nn.Identity()))
    assert torch.equal(flat(x), plain(x))
    assert_same_values(values(flat), values(plain))
    for model in (plain, flat):
        model.body[0] = model.body[0][0]  # unload: the base layer is back where it was
        del model.body.adapter
    assert_agrees_with_twin(plain, flat, x, step=True)


def test_replacing_one_name_of_a_tied_parameter_keeps_the_other():
    """A new head in place of one tied with the embedding: the embedding keeps its slot, the head is new."""
    plain = TiedLM()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    for model in (plain, flat):
        torch.manual_seed(3)
        model.head = nn.Linear(6, 11, bias=False)
    tokens = torch.randint(0, 11, (2, 4))
    assert "embed.weight (= head.weight)" not in storage.summary()
    assert_agrees_with_twin(plain, flat, tokens, step=True)


def test_pickling_after_a_replacement_is_refused_with_the_path():
    """A pickled model is registered again with its layout: a dead slot is refused, naming its path."""
    model = Net()
    register_flat_storage(model)
    model.reset_classifier(5)
    with pytest.raises(
        RuntimeError, match=r"cannot pickle Net: head\.weight was replaced.*remove_flat_storage"
    ):
        pickle.dumps(model)
    copied = copy.deepcopy(model)  # deepcopy copies the changed tree as it is
    x = torch.randn(2, 4)
    assert torch.equal(copied(x), model(x))


# ------------------------------------------------------------- unflattened mode is a plain model
class ConvNet(nn.Module):
    """Conv + BatchNorm + ReLU and a Linear head: what fusion and quantization look for."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(3 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.relu(self.bn(self.conv(x))).flatten(1))


def _conv_pair() -> tuple[ConvNet, ConvNet, torch.Tensor]:
    plain = ConvNet()
    x = torch.randn(4, 2, 6, 6)
    plain.train()
    plain(x)  # non-trivial running statistics
    plain.eval()
    flat = twin(plain)
    register_flat_storage(flat)
    return plain, flat, x


def test_unflattened_mode_gives_back_the_original_classes_without_minting_new_ones():
    """Inside unflattened(), `type(model.conv) is nn.Conv2d` and no library state is in the module."""
    _, flat, _ = _conv_pair()
    storage = get_flat_storage(flat)
    flat_classes = [type(m) for m in flat.modules()]
    for _ in range(2):
        with storage.unflattened():
            assert (
                type(flat.conv) is nn.Conv2d
                and type(flat.fc) is nn.Linear
                and type(flat.bn) is nn.BatchNorm2d
            )
            assert not any(k.startswith("_flat") or k == "parametrizations" for k in flat.conv.__dict__)
        assert [type(m) for m in flat.modules()] == flat_classes


def test_quantize_dynamic_inside_unflattened_equals_the_plain_result():
    """torch.ao.quantization.quantize_dynamic finds the exact nn.Linear type and gives the plain output."""
    plain, flat, x = _conv_pair()
    expected = torch.ao.quantization.quantize_dynamic(plain, {nn.Linear})(x)
    with get_flat_storage(flat).unflattened():
        quantized = torch.ao.quantization.quantize_dynamic(flat, {nn.Linear})
    assert type(quantized.fc) is not nn.Linear and torch.equal(quantized(x), expected)
    assert torch.equal(flat(x), plain(x))  # the model itself is unchanged


def test_fusion_inside_unflattened_equals_the_plain_result():
    """fuse_modules and fuse_conv_bn_eval work there and equal the plain results."""
    plain, flat, x = _conv_pair()
    storage = get_flat_storage(flat)
    expected = torch.ao.quantization.fuse_modules(plain, [["conv", "bn", "relu"]])(x)
    expected_conv = torch.nn.utils.fusion.fuse_conv_bn_eval(plain.conv, plain.bn)(x)
    with storage.unflattened():
        fused = torch.ao.quantization.fuse_modules(flat, [["conv", "bn", "relu"]])
        fused_conv = torch.nn.utils.fusion.fuse_conv_bn_eval(flat.conv, flat.bn)
    assert torch.equal(fused(x), expected) and torch.equal(fused_conv(x), expected_conv)
    assert torch.equal(flat(x), plain(x))
    fused_flat = torch.nn.utils.fusion.fuse_conv_bn_eval(flat.conv, flat.bn)  # in flat mode, too
    assert type(fused_flat) is nn.Conv2d and torch.equal(fused_flat(x), expected_conv)


def test_jit_script_inside_unflattened_equals_the_plain_result():
    """torch.jit.script of the model works inside unflattened() (the flat-mode refusal says so)."""
    plain, flat, x = _conv_pair()
    with get_flat_storage(flat).unflattened():
        scripted = torch.jit.script(flat)
    assert torch.equal(scripted(x), torch.jit.script(plain)(x))
    with pytest.raises(RuntimeError, match=r"Script it inside storage\.unflattened\(\)"):
        torch.jit.script(flat)


@pytest.mark.skipif(importlib.util.find_spec("opacus") is None, reason="opacus is not installed")
def test_opacus_per_sample_gradients_inside_unflattened_equal_the_plain_ones():
    """opacus' per-layer grad samplers look up exact module types: they work inside unflattened()."""
    from opacus import GradSampleModule

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4, 2))
    flat = twin(plain)
    register_flat_storage(flat)
    x = torch.randn(5, 2, 6)
    expected_module = GradSampleModule(plain)
    expected_module(x).sum().backward()
    expected = [p.grad_sample.clone() for p in plain.parameters()]
    expected_module.remove_hooks()
    with get_flat_storage(flat).unflattened():
        sampler = GradSampleModule(flat)
        sampler(x).sum().backward()
        got = [p.grad_sample.clone() for p in flat.parameters()]
        sampler.remove_hooks()
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
