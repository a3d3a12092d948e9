"""Whole tensors dealt unit by unit: each unit of buckets packed into one even slot per rank.

One of the deals that ``sharded_plan.plan_ownership`` tries when it lays the ownership out for
one-buffer collectives (NCCL). The other deals give each rank its tensors over the whole model first
(longest-processing-time by cost) and look for runs of buckets that happen to even out; this one
decides the runs first, so that a rank's tensors are spread over the units in the proportions that
make each unit even:

1. A unit grows bucket by bucket (buckets of one kind, at most ``budget`` elements) and closes at the
   first bucket where its whole tensors pack into ``world`` bins of at most ``(1 + max_padding)``
   times its mean share (best fit, largest first). A bucket that starts no such unit within the budget
   joins the unit before it, grown on from there to the first bucket where it packs again; else it
   moves by owner (in no unit), and the next bucket starts again.
2. Each unit's bins go to ranks as longest-processing-time first does: the costliest bin to the rank
   with the least cost so far (ties: the least state), so that the ranks' loads over the model stay
   level while each unit stays even.
3. The tensors of the buckets in no unit go, largest cost first, to the rank with the least cost.

Pure functions of sizes; :func:`deal_in_units` returns each tensor's rank and the units.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable, Sequence
from typing import NamedTuple

__all__ = ["Tensor", "deal_in_units"]


class Tensor(NamedTuple):
    """A whole tensor to deal: its bucket, its size, its step cost and its state bytes."""

    bucket: int
    numel: int
    cost: float
    state: float


def deal_in_units(
    tensors: Sequence[Tensor],
    sizes: Sequence[int],
    kinds: Sequence[Hashable],
    world: int,
    max_padding: float,
    budget: float,
) -> tuple[list[int], list[tuple[int, int, bool]]]:
    """Return each tensor's rank and the units of buckets (see the module's rule).

    Args:
        tensors: the whole tensors, in layout order.
        sizes: each bucket's elements (element-wise members and padding included).
        kinds: what buckets must share to move in one buffer (their dtype and device).
        world: the number of ranks.
        max_padding: a unit's largest bin may exceed its mean share by this fraction.
        budget: the most elements a unit of several buckets may hold.

    Returns:
        ``(owner, units)``: ``owner[i]`` is ``tensors[i]``'s rank; ``units`` are ``(first, stop, packed)``
        spans that tile the buckets (``packed``: its tensors packed evenly; else one bucket by owner).

    Example:
        >>> eight = [Tensor(b, 64, 1.0, 256.0) for b in range(8)]  # one matrix a bucket
        >>> owner, units = deal_in_units(eight, [64] * 8, [None] * 8, 4, 0.05, 4 * 512 / 4)
        >>> units, sorted(owner[:4]), sorted(owner[4:])
        ([(0, 4, True), (4, 8, True)], [0, 1, 2, 3], [0, 1, 2, 3])
    """
    of_bucket: list[list[int]] = [[] for _ in sizes]
    for i, tensor in enumerate(tensors):
        of_bucket[tensor.bucket].append(i)
    units = _units(_Layout(tensors, of_bucket, sizes, kinds, world, max_padding, budget))
    owner = [-1] * len(tensors)
    cost, state = [0.0] * world, [0.0] * world
    for _, _, bins in units:
        if bins is None:
            continue
        loads = [(sum(tensors[i].cost for i in b), sum(tensors[i].state for i in b), b) for b in bins]
        loads.sort(key=lambda load: (-load[0], -load[1]))
        ranks = sorted(range(world), key=lambda r: (cost[r], state[r], r))
        for rank, (c, s, members) in zip(ranks, loads):
            cost[rank] += c
            state[rank] += s
            for i in members:
                owner[i] = rank
    left = [i for i in range(len(tensors)) if owner[i] < 0]
    heap = [(cost[r], state[r], r) for r in range(world)]
    heapq.heapify(heap)
    for i in sorted(left, key=lambda i: (-tensors[i].cost, -tensors[i].state, i)):
        c, s, rank = heapq.heappop(heap)
        owner[i] = rank
        heapq.heappush(heap, (c + tensors[i].cost, s + tensors[i].state, rank))
    return owner, [(first, stop, bins is not None) for first, stop, bins in units]


class _Layout(NamedTuple):
    """What the units are laid out over (see :func:`deal_in_units`'s arguments)."""

    tensors: Sequence[Tensor]
    #: Each bucket's tensors (indices into ``tensors``).
    of_bucket: Sequence[Sequence[int]]
    sizes: Sequence[int]
    kinds: Sequence[Hashable]
    world: int
    max_padding: float
    budget: float


def _units(layout: _Layout) -> list[tuple[int, int, list[list[int]] | None]]:
    """Return the units, each with its bins of tensor indices (``None``: a bucket that moves by owner)."""
    units: list[tuple[int, int, list[list[int]] | None]] = []
    first = 0
    while first < len(layout.sizes):
        bins, stop = _scan(layout, first, first)
        if bins is None and units and units[-1][2] is not None:  # join the unit before, grown on from it
            start = units[-1][0]
            bins, stop = _scan(layout, start, first)
            if bins is not None:
                units[-1] = (start, stop, bins)
                first = stop
                continue
        if bins is None:
            units.append((first, first + 1, None))
            first += 1
        else:
            units.append((first, stop, bins))
            first = stop
    return units


def _scan(layout: _Layout, first: int, past: int) -> tuple[list[list[int]] | None, int]:
    """Return the bins of the unit that starts at ``first`` and where it stops (``None``: it packs nowhere).

    The unit holds at least the buckets up to ``past`` (included); a pack is tried only where no
    tensor is above the unit's largest allowed bin.
    """
    tensors, sizes, kinds, world = layout.tensors, layout.sizes, layout.kinds, layout.world
    members: list[int] = []
    numel, largest = 0, 0
    for b in range(first, len(sizes)):
        if b > first and (kinds[b] != kinds[first] or numel + sizes[b] > layout.budget):
            return None, b
        members += layout.of_bucket[b]
        numel += sizes[b]
        largest = max([largest] + [tensors[i].numel for i in layout.of_bucket[b]])
        if b < past or largest > (1 + layout.max_padding) * numel / world:
            continue
        bins = _pack(tensors, members, numel, world, layout.max_padding)
        if bins is not None:
            return bins, b + 1
    return None, len(sizes)


def _pack(
    tensors: Sequence[Tensor], members: Sequence[int], numel: int, world: int, max_padding: float
) -> list[list[int]] | None:
    """Pack ``members`` into ``world`` bins of at most ``(1 + max_padding) * numel / world`` elements.

    Largest first, each tensor to the emptiest bin (spread: the element-wise members of the unit level
    the bins, and each rank's cost stays even), or where that leaves some over, to the fullest bin it
    fits in (best fit: tight). Returns the bins (``None``: neither way packs them all).
    """
    cap = (1 + max_padding) * numel / world
    order = sorted(members, key=lambda i: (-tensors[i].numel, i))
    for spread in (True, False):
        bins: list[list[int]] = [[] for _ in range(world)]
        fills = [(0, b) for b in range(world)]  # sorted by fill
        for i in order:
            n = tensors[i].numel
            at = 0 if spread else bisect.bisect_right(fills, (cap - n, world)) - 1
            if at < 0 or fills[at][0] + n > cap:
                break
            fill, b = fills.pop(at)
            bins[b].append(i)
            bisect.insort(fills, (fill + n, b))
        else:
            return bins
    return None
