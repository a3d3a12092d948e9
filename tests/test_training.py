"""Integration: a flattened model trains exactly like the plain model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import TiedLM, WithOwnParam, twin


def _transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(16, 3))


@pytest.mark.parametrize(
    "optim",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    ],
    ids=["sgd_momentum", "adam", "adamw_fused"],
)
@pytest.mark.parametrize(
    "factory,inputs",
    [
        (WithOwnParam, lambda: torch.randn(8, 3)),
        (TiedLM, lambda: torch.randint(0, 11, (4, 5))),
        (_transformer, lambda: torch.randn(2, 4, 16)),
    ],
    ids=["own_param_bn", "tied_lm", "transformer"],
)
def test_flattened_training_matches_plain(factory, inputs, optim):
    """Several optimizer steps on the flattened model end at the plain model's weights."""
    plain = factory()
    model = twin(plain)
    register_flat_storage(model)
    opt, ref = optim(model.parameters()), optim(plain.parameters())
    for _ in range(4):
        x = inputs()
        for m, o in ((model, opt), (plain, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for (key, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=key)


def test_checkpoint_mid_training_moves_between_plain_and_flattened():
    """Train plain, load into flattened, continue; the result equals continuing the plain model."""
    plain = WithOwnParam()
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = torch.randn(6, 3)
    ref.zero_grad()
    plain(x).sum().backward()
    ref.step()
    model = WithOwnParam()
    register_flat_storage(model)
    model.load_state_dict(plain.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for m, o in ((model, opt), (plain, ref)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    back = WithOwnParam()
    back.load_state_dict(model.state_dict())
    for (key, a), (_, b) in zip(back.state_dict().items(), plain.state_dict().items()):
        torch.testing.assert_close(a, b, msg=key)
    assert get_flat_storage(model) is not None


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_plain_gradients(reentrant):
    """torch.utils.checkpoint (reentrant or not) over flattened layers gives the plain gradients."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(lambda t: torch.tanh(self.b(t)), self.a(x), use_reentrant=reentrant)
            return self.c(h)

    plain = Net()
    model = twin(plain)
    storage = register_flat_storage(model)
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    plain(x).sum().backward()
    for name, grad in storage.named_grads():
        torch.testing.assert_close(grad, plain.get_parameter(name).grad, msg=name)
