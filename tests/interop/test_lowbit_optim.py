"""torchao's low-bit AdamW (AdamW8bit, AdamW4bit, AdamWFp8) on a flattened model, against the plain twin.

torchao 0.18 (``torchao/optim/adam.py``, ``_AdamBase._new_buffer``) quantizes a parameter's state only when
the parameter has at least 4096 elements and a multiple of ``block_size`` (256 for AdamW8bit and AdamWFp8,
128 for AdamW4bit), in blocks of ``block_size`` consecutive elements; any other parameter keeps float32
state. The recipe in ``docs/performance.md`` puts exactly the parameters it quantizes on the plain model in
one group (each a whole number of blocks, so packed back to back every block is one of the plain model's)
and the rest in a group torchao does not quantize, or leaves them ordinary parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8
from torchao.optim.subclass_4bit import OptimState4bit
from torchao.optim.subclass_8bit import OptimState8bit
from torchao.optim.subclass_fp8 import OptimStateFp8

from flatten_parametrize import register_flat_storage

from _helpers import assert_same_values, train_steps

LOWBIT = {AdamW8bit: 256, AdamW4bit: 128, AdamWFp8: 256}  # class -> its default block_size
QUANTIZED_STATE = (OptimState8bit, OptimState4bit, OptimStateFp8)
HYPER = {"lr": 1e-2, "weight_decay": 0.01}
STEPS = 5

pytestmark = pytest.mark.filterwarnings("ignore:OptimState.* does not implement _stable_hash_for_caching")


def model() -> nn.Sequential:
    """Tensors torchao quantizes (64x64), one of 4160 elements it does not (not whole blocks), small ones."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 65), nn.Tanh(), nn.Linear(65, 8)
    )


def batches() -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(16, 64, generator=generator) for _ in range(STEPS))


def lowbit_groups(module: nn.Module, block_size: int, *, rest: bool) -> dict[str, list[nn.Parameter]]:
    """The recipe of docs/performance.md: what torchao quantizes on the plain model, and the rest."""

    def quantized(numel: int) -> bool:  # torchao's _AdamBase._new_buffer
        return numel >= 4096 and numel % block_size == 0

    params = list(module.parameters())
    groups = {"lowbit": [p for p in params if quantized(p.numel())]}
    others = [p for p in params if not quantized(p.numel())]
    if rest and not quantized(sum(p.numel() for p in others)):
        groups["rest"] = others  # flattened too, and kept in float32 as on the plain model
    return groups


def quantized_elements(optimizer: torch.optim.Optimizer) -> int:
    """Elements of optimizer state held in torchao's quantized tensor types."""
    return sum(
        t.numel() for s in optimizer.state.values() for t in s.values() if isinstance(t, QUANTIZED_STATE)
    )


def distance(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return math.sqrt(sum(float((sa[k].double() - sb[k].double()).pow(2).sum()) for k in sb))


def trained(
    setup: Callable[[nn.Module], object], optimizer_class: type, **kwargs: object
) -> tuple[nn.Module, int]:
    net = model()
    setup(net)
    optimizer = optimizer_class(net.parameters(), **HYPER, **kwargs)
    train_steps(net, optimizer, batches())
    return net, quantized_elements(optimizer)


@pytest.fixture(scope="module")
def exact() -> nn.Module:
    """The plain model trained by torch's float32 AdamW."""
    return trained(lambda net: None, torch.optim.AdamW, foreach=False)[0]


_PLAIN: dict[type, tuple[nn.Module, int]] = {}


def plain_run(optimizer_class: type) -> tuple[nn.Module, int]:
    if optimizer_class not in _PLAIN:  # torchao compiles its step per shape: train each plain twin once
        _PLAIN[optimizer_class] = trained(lambda net: None, optimizer_class)
    return _PLAIN[optimizer_class]


@pytest.mark.parametrize("rest", [True, False], ids=["rest-in-a-group", "rest-ordinary"])
@pytest.mark.parametrize("optimizer_class", list(LOWBIT), ids=lambda c: c.__name__)
def test_recipe_quantizes_what_the_plain_model_does_and_trains_bit_for_bit_like_it(
    optimizer_class: type, rest: bool, exact: nn.Module
):
    """As many quantized state elements as the plain twin, and its final weights bit for bit."""
    plain, plain_quantized = plain_run(optimizer_class)
    block_size = LOWBIT[optimizer_class]

    def setup(net: nn.Module) -> None:
        groups = lowbit_groups(net, block_size, rest=rest)
        assert ("rest" in groups) == rest  # the rest (9,801 elements) is not a whole number of blocks
        register_flat_storage(net, groups)

    flat, flat_quantized = trained(setup, optimizer_class)
    assert plain_quantized == 2 * 64 * 64  # exp_avg and exp_avg_sq of the 64x64 weight
    assert flat_quantized == plain_quantized
    assert_same_values(flat, plain)
    assert distance(flat, exact) == distance(plain, exact) > 0


@pytest.mark.parametrize("optimizer_class", [AdamW8bit], ids=lambda c: c.__name__)
def test_one_flat_group_is_not_what_the_plain_model_gets(optimizer_class: type, exact: nn.Module):
    """What the recipe avoids: groups=None quantizes nothing (its numel is no multiple of the block size).

    With align=block_size it quantizes the small tensors too, and lands farther from exact AdamW.
    """
    plain, plain_quantized = plain_run(optimizer_class)
    _, quantized = trained(register_flat_storage, optimizer_class)
    assert quantized == 0
    block_size = LOWBIT[optimizer_class]
    aligned, quantized = trained(lambda net: register_flat_storage(net, align=block_size), optimizer_class)
    assert quantized > plain_quantized
    assert distance(aligned, exact) > distance(plain, exact)
