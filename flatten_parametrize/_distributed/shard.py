"""One rank's part of a flat buffer, for :class:`~flatten_parametrize.ShardedOptimizer`.

Every rank owns element ranges of each sharded flat buffer (which ones is the
ownership rule's choice, ``sharded_strategies.py``); a :class:`Shard` holds
every rank's ranges (the collectives need them all) and this rank's pieces:
the tensors its inner optimizers step, views of the flat buffer inside its
ranges (a slice of ZeRO's equal cut; whole tensors in their shapes, or a 1-D
part of one that an element-wise class steps across a cut).

Gradients: with ZeRO-2 this rank's averaged gradient of its ranges is one
packed tensor (its ranges back to back, :attr:`Shard.grad`) that the pieces'
gradients view; with ZeRO-1 they view the whole averaged flat gradient.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._core.grad.owner import set_grad

__all__ = ["Piece", "Shard", "copy_value", "elementwise"]


def elementwise(value: Any, numel: int) -> bool:
    """Return whether an optimizer state value has one element per element of a tensor of ``numel``."""
    return isinstance(value, Tensor) and value.dim() >= 1 and value.numel() == numel


def copy_value(value: Any) -> Any:
    """Return a copy of a state value that shares no memory with it."""
    return value.clone() if isinstance(value, Tensor) else copy.deepcopy(value)


class Piece(NamedTuple):
    """A tensor that this rank's inner optimizers step: where it lies in the flat buffer and its shape."""

    #: Its key among the shard's pieces (the member index of a whole tensor; 0 for a slice).
    key: Hashable
    #: Its first element in the flat buffer.
    offset: int
    #: Its number of elements.
    numel: int
    #: Its shape.
    shape: tuple[int, ...]


class Shard:
    """Every rank's element ranges of one flat parameter, and this rank's pieces of it.

    Args:
        g: index of the flat parameter in ``storage.flat_params``.
        flat: the flat parameter.
        rank: this rank.
        ranges: each rank's ``(start, stop)`` element ranges, in rank order, each rank's in order.
        pieces: this rank's pieces, each inside one of its ranges, in flat order.
    """

    def __init__(
        self,
        g: int,
        flat: Tensor,
        rank: int,
        ranges: Sequence[Sequence[tuple[int, int]]],
        pieces: Sequence[Piece],
    ) -> None:
        #: Index of the flat parameter in ``storage.flat_params``.
        self.g = g
        self.flat = flat
        self.numel = flat.numel()
        #: The dtype and device the pieces were made for (a flat parameter moved since cannot be followed).
        self.dtype, self.device = flat.dtype, flat.device
        self.rank = rank
        self.ranges = [tuple((int(a), int(b)) for a, b in owner if b > a) for owner in ranges]
        #: The most elements one rank owns: the slot of each rank in one padded buffer.
        self.chunk = max((sum(b - a for a, b in owner) for owner in self.ranges), default=0)
        #: Whether each rank's elements are one range at ``rank * chunk``: one padded buffer of the flat
        #: one needs no spreading (ZeRO's equal slices).
        self.aligned = all(
            owner == () or (len(owner) == 1 and owner[0][0] == r * self.chunk)
            for r, owner in enumerate(self.ranges)
        )
        #: This rank's pieces, and the tensor of each (a view of the flat buffer).
        self.specs = tuple(pieces)
        self.pieces = {spec.key: torch.zeros(0, dtype=flat.dtype, device=flat.device) for spec in self.specs}
        #: ZeRO-2: this rank's averaged gradient of its ranges, packed (``None``: none).
        self.grad: Tensor | None = None
        #: The flat parameter the optimizer's gradient-ready hook is on.
        self.hooked: Tensor | None = None
        self.ptr = 0
        self._packed = self._packed_offsets()
        self.bind()

    # ------------------------------------------------------------------ ranges
    @property
    def mine(self) -> tuple[tuple[int, int], ...]:
        """This rank's element ranges."""
        return self.ranges[self.rank]

    @property
    def owned(self) -> int:
        """The number of elements this rank owns."""
        return sum(b - a for a, b in self.mine)

    def _packed_offsets(self) -> list[tuple[int, int, int]]:
        """Return ``(start, stop, packed start)`` of each of this rank's ranges."""
        out, at = [], 0
        for a, b in self.mine:
            out.append((a, b, at))
            at += b - a
        return out

    def packed(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Return the packed ``(start, stop)`` of each part of flat ``[start, stop)`` that this rank owns."""
        return [
            (at + max(start, a) - a, at + min(stop, b) - a)
            for a, b, at in self._packed
            if min(stop, b) > max(start, a)
        ]

    def packed_ranges(self) -> list[tuple[int, int]]:
        """Return where each of this rank's ranges lies in its packed gradient."""
        return [(at, at + b - a) for a, b, at in self._packed]

    def pack(self, values: Tensor) -> Tensor:
        """Return this rank's ranges of ``values`` (shaped like the flat buffer), back to back."""
        if len(self.mine) == 1:
            a, b = self.mine[0]
            return values[a:b]
        if not self.mine:
            return values[:0]
        return torch.cat([values[a:b] for a, b in self.mine])

    # ------------------------------------------------------------------ values
    def bind(self) -> None:
        """Point every piece at the flat buffer's current memory."""
        flat = self.flat.detach()
        storage, base = flat.untyped_storage(), flat.storage_offset()
        with torch.no_grad():
            for spec in self.specs:
                self.pieces[spec.key].set_(
                    storage, base + spec.offset, spec.shape, _contiguous_strides(spec.shape)
                )
        self.ptr = flat.data_ptr()

    # --------------------------------------------------------------- gradients
    def receive(self, values: Tensor, accumulate: bool) -> None:
        """ZeRO-2: make ``values`` (this rank's packed gradient, maybe padded) its gradient, or add it."""
        values = values[: self.owned]
        if accumulate and self.grad is not None:
            self.grad.add_(values)
        else:
            self.grad = values if values.is_contiguous() else values.contiguous()
        self._point(self.grad, packed=True)

    def take(self, source: Tensor | None) -> None:
        """ZeRO-1: make each piece's gradient its view of ``source``, the whole flat gradient (or none)."""
        self.grad = None
        self._point(source, packed=False)

    def _point(self, source: Tensor | None, packed: bool) -> None:
        """Give each piece its view of ``source`` (packed: this rank's ranges; else the flat gradient)."""
        for spec in self.specs:
            grad = None
            if source is not None:
                parts = self.packed(spec.offset, spec.offset + spec.numel) if packed else [(spec.offset, 0)]
                start = parts[0][0] if parts else 0  # an empty piece (a slice past the end) views nothing
                grad = source[start : start + spec.numel].view(spec.shape)
            set_grad(self.pieces[spec.key], grad)

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop (or zero) this rank's gradient and its pieces'."""
        if set_to_none:
            self.grad = None
            self._point(None, packed=True)
            return
        for piece in self.pieces.values():
            if piece.grad is not None:
                piece.grad.zero_()

    def drop_piece(self, key: Hashable) -> None:
        """Drop one piece's gradient (its optimizer skips it, as a parameter without one)."""
        piece = self.pieces.get(key)
        if piece is not None:
            set_grad(piece, None)

    def local(self, start: int, stop: int) -> list[Tensor]:
        """Return this rank's ZeRO-2 gradient of the flat range ``[start, stop)``: views, none without one."""
        grad = self.grad
        return [] if grad is None else [grad[a:b] for a, b in self.packed(start, stop)]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
