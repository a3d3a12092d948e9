"""A unit's padded buffer for one ``reduce_scatter``, filled shard by shard.

NCCL's one-buffer path reduces a unit of several buckets (``Partition.units``) with one
``reduce_scatter`` of ``W`` slots: each owner's ranges of every shard of the unit, in the unit's order,
packed into that owner's slot, zeros after them. With ZeRO-2 the reducer fills it as backward finishes
each bucket's gradient and frees that gradient at once, so that a unit waiting for its last bucket
holds its padded buffer and no full gradient besides (packing them all at the end held the unit twice).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .shard import Shard

__all__ = ["UnitBuffer"]


class UnitBuffer:
    """The padded buffer of a unit: ``world`` slots of ``chunk`` elements (the most any rank owns of it).

    Args:
        unit: the shards that move together, in order.
        chunk: a rank's slot.
        world: the number of ranks.
        dtype: the buffer's dtype (the gradients are cast to it as they are put).
        device: the buffer's device.
    """

    def __init__(
        self, unit: Sequence[Shard], chunk: int, world: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.chunk = chunk
        #: What the ``reduce_scatter`` sends.
        self.buffer = torch.empty(chunk * world, dtype=dtype, device=device)
        #: Per shard: where each of its ranges goes, ``(at, start, stop)``.
        self._copies: list[list[tuple[int, int, int]]] = []
        taken = [0] * world
        for shard in unit:
            copies = []
            for owner, ranges in enumerate(shard.ranges):
                for lo, hi in ranges:
                    copies.append((owner * chunk + taken[owner], lo, hi))
                    taken[owner] += hi - lo
            self._copies.append(copies)
        for owner, used in enumerate(taken):
            if used < chunk:
                self.buffer[owner * chunk + used : (owner + 1) * chunk].zero_()
        #: The positions in the unit of the shards put so far.
        self.filled: set[int] = set()

    def put(self, position: int, grad: Tensor) -> None:
        """Copy the flat gradient of the unit's ``position``-th shard into every owner's slot."""
        for at, lo, hi in self._copies[position]:
            self.buffer[at : at + hi - lo].copy_(grad[lo:hi])
        self.filled.add(position)
