"""One rank's slice of a flat buffer, for :class:`~flatten_parametrize.ShardedOptimizer`.

A flat buffer of ``n`` elements over ``W`` ranks is cut into ``W`` slices of
``c = ceil(n / W)`` elements (as if padded once to ``W * c``). The slice's
parameter, the one the inner optimizer steps, is a view of the flat buffer
where the slice lies inside it; where it reaches past the end it is a small
zero-padded copy (a "shadow").
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .._core.grad import set_grad

__all__ = ["Shard", "copy_value", "elementwise"]


def elementwise(value: Any) -> bool:
    """Return whether an optimizer state value has one element per parameter element (a 1-D tensor)."""
    return isinstance(value, Tensor) and value.dim() == 1


def copy_value(value: Any) -> Any:
    """Return a copy of a state value that shares no memory with it."""
    return value.clone() if isinstance(value, Tensor) else copy.deepcopy(value)


class Shard:
    """This rank's slice of one flat parameter and the inner optimizer's parameter for it."""

    def __init__(self, g: int, flat: Tensor, rank: int, world: int) -> None:
        #: Index of the flat parameter in ``storage.flat_params``.
        self.g = g
        self.flat = flat
        self.numel = n = flat.numel()
        self.chunk = c = -(-n // world)
        self.lo, self.hi = min(rank * c, n), min((rank + 1) * c, n)
        #: Whether the slice reaches past the end of the buffer: then ``param`` is a zero-padded copy.
        self.shadow = self.hi - self.lo < c
        self.param = torch.zeros(c, dtype=flat.dtype, device=flat.device)
        self.hooked: Tensor | None = None
        self.bind()

    def bounds(self, owner: int) -> tuple[int, int]:
        """Return the element range of ``owner``'s slice inside the flat buffer."""
        return min(owner * self.chunk, self.numel), min((owner + 1) * self.chunk, self.numel)

    def bind(self) -> None:
        """Point ``param`` at the flat buffer's current memory (or refresh the padded copy)."""
        flat = self.flat.detach()
        with torch.no_grad():
            if self.shadow:
                self.param[: self.hi - self.lo].copy_(flat[self.lo : self.hi])
                self.param[self.hi - self.lo :].zero_()
            else:
                self.param.set_(flat.untyped_storage(), flat.storage_offset() + self.lo, (self.chunk,), (1,))
        self.ptr = flat.data_ptr()
        #: The flat buffer's version the padded copy was taken at (in-place writes since: take it again).
        self.version = flat._version

    def set_grad(self, values: Tensor, accumulate: bool) -> None:
        """Make ``values`` (this rank's gradient elements, padded or not) the slice's gradient."""
        grad = self.param.grad
        if accumulate and grad is not None:
            grad[: values.numel()].add_(values)
        elif values.numel() == self.chunk:
            set_grad(self.param, values)
        else:
            padded = torch.zeros_like(self.param)
            padded[: values.numel()].copy_(values)
            set_grad(self.param, padded)

    def assemble(self, pieces: Iterable[tuple[int, Tensor]], like: Tensor) -> Tensor:
        """Return a new zero-padded slice built from ``(flat offset, values)`` pieces overlapping it."""
        out = torch.zeros(self.chunk, dtype=like.dtype, device=self.param.device)
        for start, values in pieces:
            lo, hi = max(start, self.lo), min(start + values.numel(), self.hi)
            if hi > lo:
                out[lo - self.lo : hi - self.lo].copy_(values[lo - start : hi - start])
        return out
