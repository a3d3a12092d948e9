"""Small models and helpers shared by the tests (import as `from _models import ...`)."""

from __future__ import annotations

import copy

import torch
from torch import nn


class TiedLM(nn.Module):
    """A tiny language model whose output head shares the embedding matrix."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.norm(self.embed(tokens)))))


class WithOwnParam(nn.Module):
    """A module with a parameter of its own before its children, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.5, -0.5, 2.0]))
        self.fc = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("offset", torch.tensor([0.1, 0.2, 0.3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x * self.scale + self.offset))


def mlp(depth: int = 3, width: int = 5, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def twin(model: nn.Module) -> nn.Module:
    """Return an independent copy made before any flattening."""
    return copy.deepcopy(model)


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_values(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert list(a) == list(b)
    for key in a:
        if tol:
            torch.testing.assert_close(a[key], b[key], **tol)
        else:
            assert torch.equal(a[key], b[key]), key
