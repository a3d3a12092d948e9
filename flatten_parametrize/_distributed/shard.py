"""One rank's slice of a flat buffer, for :class:`~flatten_parametrize.ShardedOptimizer`.

A flat buffer of ``n`` elements over ``W`` ranks is cut into ``W`` slices of
``c = ceil(n / W)`` elements (as if padded once to ``W * c``). The slice's
parameter, the one the inner optimizer steps, is a view of the flat buffer
where the slice lies inside it; where it reaches past the end it is a small
zero-padded copy (a "shadow").
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._core.grad import set_grad

__all__ = ["Shard", "TensorShard", "copy_value", "elementwise"]


def elementwise(value: Any) -> bool:
    """Return whether an optimizer state value has one element per parameter element (a 1-D tensor)."""
    return isinstance(value, Tensor) and value.dim() == 1


def copy_value(value: Any) -> Any:
    """Return a copy of a state value that shares no memory with it."""
    return value.clone() if isinstance(value, Tensor) else copy.deepcopy(value)


class Shard:
    """This rank's slice of one flat parameter and the inner optimizer's parameter for it."""

    #: Every rank's slice has ``chunk`` elements (the one-buffer collectives need it).
    even = True

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

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop (or zero) the slice's gradient."""
        grad = self.param.grad
        if grad is None:
            return
        if set_to_none:
            set_grad(self.param, None)
        else:
            grad.zero_()

    def drop_piece(self, index: int) -> None:
        """Drop member ``index``'s gradient where it is a tensor of its own (a slice has none)."""

    def assemble(self, pieces: Iterable[tuple[int, Tensor]], like: Tensor) -> Tensor:
        """Return a new zero-padded slice built from ``(flat offset, values)`` pieces overlapping it."""
        out = torch.zeros(self.chunk, dtype=like.dtype, device=self.param.device)
        for start, values in pieces:
            lo, hi = max(start, self.lo), min(start + values.numel(), self.hi)
            if hi > lo:
                out[lo - self.lo : hi - self.lo].copy_(values[lo - start : hi - start])
        return out


class TensorShard(Shard):
    """This rank's range of whole tensors of one flat parameter and a tensor of each for its optimizers.

    The ranks' ranges are cut at ``cuts`` (``cuts[r]`` to ``cuts[r + 1]``,
    uneven, no padding); ``param`` is this rank's range (a view of the flat
    buffer, 1-D), whose gradient holds the range's averaged gradient. Each
    piece is a tensor of one member inside the range, with the member's shape
    where the whole member is inside it (a 1-D part of a member that an
    element-wise optimizer steps may cross a cut); its gradient is a view of
    the range's gradient.

    Args:
        g: index of the flat parameter in ``storage.flat_params``.
        flat: the flat parameter.
        rank: this rank.
        cuts: the ranks' range boundaries, ``world + 1`` offsets from 0 to ``flat.numel()``.
        pieces: ``(member index, flat offset, numel, shape)`` of each piece in this rank's range.
        spans: member index -> the whole member's ``(flat offset, numel, shape)``, for each piece.
    """

    even = False

    def __init__(
        self,
        g: int,
        flat: Tensor,
        rank: int,
        cuts: Sequence[int],
        pieces: Sequence[tuple[int, int, int, tuple[int, ...]]],
        spans: dict[int, tuple[int, int, tuple[int, ...]]],
    ) -> None:
        self.g = g
        self.flat = flat
        self.numel = flat.numel()
        self.cuts = tuple(cuts)
        self.lo, self.hi = self.cuts[rank], self.cuts[rank + 1]
        self.chunk = max(b - a for a, b in zip(self.cuts, self.cuts[1:]))
        self.shadow = False
        self.param = torch.zeros(0, dtype=flat.dtype, device=flat.device)
        self.hooked = None
        self.where = tuple(pieces)
        self.spans = spans
        #: Member index -> its piece (what the inner optimizers step).
        self.pieces = {index: torch.zeros(0, dtype=flat.dtype, device=flat.device) for index, *_ in pieces}
        self.bind()

    def bounds(self, owner: int) -> tuple[int, int]:
        """Return the element range of ``owner``'s tensors inside the flat buffer."""
        return self.cuts[owner], self.cuts[owner + 1]

    def bind(self) -> None:
        """Point the range and every piece at the flat buffer's current memory."""
        flat = self.flat.detach()
        storage, base = flat.untyped_storage(), flat.storage_offset()
        with torch.no_grad():
            self.param.set_(storage, base + self.lo, (self.hi - self.lo,), (1,))
            for index, offset, _, shape in self.where:
                self.pieces[index].set_(storage, base + offset, shape, _contiguous_strides(shape))
        self.ptr = flat.data_ptr()
        self.version = flat._version

    def set_grad(self, values: Tensor, accumulate: bool) -> None:
        """Make ``values`` (this rank's range of the gradient, padded or not) the range's gradient.

        The pieces view it.
        """
        values = values[: self.hi - self.lo]
        grad = self.param.grad
        if accumulate and grad is not None:
            grad.add_(values)
        else:
            set_grad(self.param, values if values.is_contiguous() else values.contiguous())
        self._point_pieces()

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop (or zero) the range's gradient and the pieces'."""
        grad = self.param.grad
        if grad is None:
            return
        if set_to_none:
            set_grad(self.param, None)
            for piece in self.pieces.values():
                set_grad(piece, None)
        else:
            grad.zero_()

    def drop_piece(self, index: int) -> None:
        """Drop member ``index``'s gradient (the inner optimizer skips it, as a parameter without one)."""
        piece = self.pieces.get(index)
        if piece is not None:
            set_grad(piece, None)

    def _point_pieces(self) -> None:
        grad = self.param.grad
        for index, offset, numel, shape in self.where:
            start = offset - self.lo
            set_grad(self.pieces[index], None if grad is None else grad[start : start + numel].view(shape))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
