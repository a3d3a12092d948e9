"""Shared by the mixed-precision tests of both modes: a small model with a tie, and a cast counter."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten


class Block(nn.Module):
    """Embedding, LayerNorm, a residual MLP and a tied head: several kinds of layers and a tie."""

    def __init__(self, vocab: int = 13, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))
        return self.head(h)


def cast_sizes(storage: Any) -> set[int]:
    """Return the sizes of ``storage``'s flat parameters and slots (what :class:`CountCasts` counts)."""
    return {f.numel() for f in storage.flat_params} | {i.numel for i in storage.param_infos}


class CountCasts(TorchDispatchMode):
    """Counts float32 -> bfloat16 conversions (``_to_copy``, ``copy_``) of tensors of the given sizes.

    Args:
        sizes: the sizes counted (:func:`cast_sizes`; the loss's own casts are not counted).
    """

    def __init__(self, sizes: set[int]) -> None:
        super().__init__()
        self.sizes = sizes
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _aten._to_copy.default:
            src, dst = args[0].dtype, kwargs.get("dtype")
        elif func is _aten.copy_.default:
            src, dst = args[1].dtype, args[0].dtype
        else:
            return out
        if src == torch.float32 and dst == torch.bfloat16 and args[0].numel() in self.sizes:
            self.casts += 1
        return out
