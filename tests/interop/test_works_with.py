"""Third-party code that averages, exports or privatizes a model: flattened works as the plain one."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import ema_pytorch
import opacus
import torch
import torch_ema
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from flatten_parametrize import register_flat_storage

from _helpers import assert_same_values, mlp, train_steps


def _convnet(seed: int = 0) -> nn.Sequential:
    """A timm/torchvision-style stem: conv, BatchNorm, ReLU, pooling, classifier."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _batches(model: nn.Module, steps: int) -> Iterator[torch.Tensor]:
    """``steps`` seeded batches: images for the convnet, vectors for the mlp."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        if isinstance(model[0], nn.Conv2d):
            yield torch.randn(4, 3, 8, 8, generator=generator)
        else:
            yield torch.randn(4, 5, generator=generator)


def _train(model: nn.Module, steps: int, after_step: Callable[[], None] | None = None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return train_steps(
        model, optimizer, _batches(model, steps), lambda m, x: m(x).square().mean(), after_step=after_step
    )


def test_batchnorm_convnet_trains_like_the_plain_model():
    """Conv + BatchNorm: the same losses, running statistics and eval outputs as the plain model."""
    plain = _convnet()
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    assert _train(model, 3) == _train(plain, 3)
    assert_same_values(model, plain)
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(model.eval()(x), plain.eval()(x))


def test_torch_averaged_model_ema_matches_the_plain_one():
    """torch.optim.swa_utils.AveragedModel with an EMA average tracks the plain model's EMA exactly."""
    plain = mlp()
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    averages = []
    for m in (model, plain):
        ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        _train(m, 3, after_step=lambda ema=ema, m=m: ema.update_parameters(m))
        averages.append(ema)
    assert_same_values(averages[0], averages[1])


def test_ema_pytorch_matches_the_plain_one_and_ignore_names_takes_flat_names():
    """ema_pytorch's EMA equals the plain one; its name-keyed options see flat names, so name a group."""
    plain = mlp()
    model = copy.deepcopy(plain)
    register_flat_storage(model, {"weights": ["*.weight"], "biases": ["*.bias"]})
    emas = []
    for m, ignore in ((model, {"flat_param_biases"}), (plain, {f"{i}.bias" for i in (0, 2, 4)})):
        ema = ema_pytorch.EMA(m, beta=0.9, update_after_step=0, update_every=1, ignore_names=ignore)
        _train(m, 3, after_step=ema.update)
        emas.append(ema.ema_model)
    assert_same_values(emas[0], emas[1])
    averaged = ema_pytorch.EMA(mlp(), beta=0.9, update_after_step=0, update_every=1)
    _train(averaged.online_model, 3, after_step=averaged.update)
    assert not torch.equal(averaged.ema_model[0].bias, emas[1][0].bias)  # ignore_names did something


def test_torch_ema_matches_the_plain_one():
    """torch_ema's ExponentialMovingAverage over model.parameters() gives the plain averages."""
    plain = mlp()
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    for m in (model, plain):
        ema = torch_ema.ExponentialMovingAverage(m.parameters(), decay=0.9)
        _train(m, 3, after_step=ema.update)
        ema.copy_to(m.parameters())
    assert_same_values(model, plain)


def test_torch_export_reads_the_flat_parameter():
    """torch.export records the flat parameter as a parameter input, not a constant; outputs match."""
    model = mlp()
    register_flat_storage(model)
    x = torch.randn(2, 5)
    program = torch.export.export(model, (x,))
    assert list(program.graph_signature.parameters) == ["flat_param_0"] and not program.constants
    assert torch.equal(program.module()(x), model(x))


def test_opacus_per_sample_gradients_match_the_plain_ones():
    """opacus' GradSampleModule gives the flat parameter the plain per-sample gradients, concatenated."""
    plain = mlp()
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    x = torch.randn(4, 5)
    grads = []
    for m in (model, plain):
        wrapped = opacus.GradSampleModule(m)
        wrapped(x).square().sum().backward()
        grads.append([p.grad_sample for p in m.parameters()])
    assert len(grads[0]) == 1 and grads[0][0].shape == (4, storage["0"].numel())
    expected = torch.cat([g.reshape(4, -1) for g in grads[1]], dim=1)
    torch.testing.assert_close(grads[0][0], expected, rtol=1e-6, atol=1e-7)
