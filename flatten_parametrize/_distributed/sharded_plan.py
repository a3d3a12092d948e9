"""Who owns which tensors under ``ShardedOptimizer(whole_tensors=True)``: decided over every bucket at once.

A pure function of the buckets' layouts (each member's offset, shape and optimizer
class), their dtypes and the world size: :func:`plan_ownership`. The optimizer runs
it when it is built; ``benchmarks/bench_zero_scale.py`` runs the same function
without a process group on real model shapes.

The rule:

1. **Tensors that must stay whole** (their class is not element-wise,
   ``sharded_rules.cuttable``) go largest step cost first (``sharded_costs.py``)
   to the rank with the least cost so far, ties to the one with the fewest state
   bytes (longest-processing-time first, over all buckets: a bucket holding one
   matrix no longer gives it to the same rank as every other such bucket). The
   owners of equal tensors (same cost, state and size) are then dealt again in
   layout order, so that each owner's lie side by side (fewer ranges to move).
2. **Element-wise tensors** may be cut. A run of them between two whole tensors
   of a bucket whose state is under :data:`SMALL_RUN` of a rank's mean goes whole
   to the owner of the whole tensor before it (after it, at a bucket's start), so
   that it moves in that owner's range; the others are laid end to end over every
   bucket and cut so that each rank's state bytes rise to one common level (the
   ranks that the whole tensors loaded least get the most).
3. Padding between members goes to the owner of the elements before it, and
   adjacent ranges of one owner merge: a rank's part of a bucket is as few ranges
   as this ownership allows.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from typing import Callable, NamedTuple

from .sharded_costs import state_numel, step_cost
from .sharded_rules import cuttable

__all__ = ["SMALL_RUN", "Bucket", "BucketTensor", "Plan", "plan_ownership", "whole_bound"]

#: A run of element-wise tensors whose state is under this fraction of a rank's mean goes whole to a
#: neighbour's owner (one range fewer per run; the rest balances it).
SMALL_RUN = 0.01


class BucketTensor(NamedTuple):
    """A tensor of a bucket, as the plan sees it."""

    #: Its first element in the bucket.
    offset: int
    #: Its number of elements.
    numel: int
    #: Its shape.
    shape: tuple[int, ...]
    #: The class that steps it (``None``: not stepped by this optimizer; cut freely, no state).
    optimizer_class: type | None


class Bucket(NamedTuple):
    """A flat buffer to shard: its size (padding included), its element size in bytes and its members."""

    numel: int
    itemsize: int
    members: Sequence[BucketTensor]


class Plan(NamedTuple):
    """The ownership of every bucket, and what it gives each rank."""

    #: ``ranges[b][r]``: rank ``r``'s ``(start, stop)`` element ranges of bucket ``b``, in order.
    ranges: list[list[list[tuple[int, int]]]]
    #: Each rank's step cost (flops, ``sharded_costs.step_cost``).
    cost: list[float]
    #: Each rank's optimizer state, in bytes (``sharded_costs.state_numel``).
    state: list[float]
    #: Each rank's ZeRO-2 gradient (the elements it owns), in bytes.
    grads: list[int]
    #: The least the most loaded rank can hold under whole tensors (cost, state bytes, gradient bytes):
    #: the mean, or :func:`whole_bound` of the whole tensors, whichever is larger.
    bound: tuple[float, float, float]


class _Part(NamedTuple):
    bucket: int
    offset: int
    numel: int
    cost: float
    state: float
    itemsize: int
    atomic: bool


def _part(b: int, itemsize: int, member: BucketTensor) -> _Part:
    cls = member.optimizer_class
    if cls is None:
        return _Part(b, member.offset, member.numel, 0.0, 0.0, itemsize, False)
    cost = step_cost(cls, member.shape)
    state = float(state_numel(cls, member.shape) * itemsize)
    return _Part(b, member.offset, member.numel, cost, state, itemsize, not cuttable(cls))


def plan_ownership(buckets: Sequence[Bucket], world: int) -> Plan:
    """Return who owns which elements of every bucket (see the module's rule).

    Args:
        buckets: the flat buffers to shard, in the order collectives start in.
        world: the number of ranks.

    Returns:
        The plan: each rank's ranges of each bucket and its cost, state and gradient bytes.

    Example:
        >>> import torch
        >>> one = [BucketTensor(0, 64, (8, 8), torch.optim.Muon)]
        >>> plan = plan_ownership([Bucket(64, 4, one), Bucket(64, 4, one)], 2)
        >>> plan.ranges  # one matrix per bucket, one bucket per rank
        [[[(0, 64)], []], [[], [(0, 64)]]]
    """
    parts = [
        _part(b, bucket.itemsize, m) for b, bucket in enumerate(buckets) for m in bucket.members if m.numel
    ]
    parts.sort(key=lambda p: (p.bucket, p.offset))
    cost, state, grads = [0.0] * world, [0.0] * world, [0] * world
    owned: list[tuple[_Part, int, int, int]] = []  # (part, start, stop, rank)

    def give(part: _Part, start: int, stop: int, rank: int) -> None:
        share = (stop - start) / part.numel
        cost[rank] += part.cost * share
        state[rank] += part.state * share
        grads[rank] += (stop - start) * part.itemsize
        owned.append((part, start, stop, rank))

    # 1. whole tensors: largest cost first, to the least loaded rank
    heap = [(0.0, 0.0, r) for r in range(world)]
    whole: dict[tuple[int, int], int] = {}
    for part in sorted((p for p in parts if p.atomic), key=lambda p: (-p.cost, -p.state, p.bucket, p.offset)):
        _, _, rank = heapq.heappop(heap)
        give(part, part.offset, part.offset + part.numel, rank)
        whole[part.bucket, part.offset] = rank
        heapq.heappush(heap, (cost[rank], state[rank], rank))
    _side_by_side([p for p in parts if p.atomic], whole)
    owned = [(p, a, b, whole[p.bucket, p.offset]) for p, a, b, _ in owned]
    # 2. element-wise runs: small ones to a neighbour's owner, the others to one common level of state
    mean = sum(p.state for p in parts) / world
    offsets: dict[int, list[int]] = {}
    for part in parts:
        if part.atomic:
            offsets.setdefault(part.bucket, []).append(part.offset)
    large: list[_Part] = []
    for run in _runs(parts):
        neighbour = _neighbour(run, offsets, whole)
        if neighbour is not None and sum(p.state for p in run) < SMALL_RUN * mean:
            for part in run:
                give(part, part.offset, part.offset + part.numel, neighbour)
        else:
            large += run
    _fill(large, state, give)
    ranges = [
        _ranges(bucket.numel, [(s, e, r) for p, s, e, r in owned if p.bucket == b], world)
        for b, bucket in enumerate(buckets)
    ]
    atomic = [p for p in parts if p.atomic]
    bound = (
        max(sum(cost) / world, whole_bound([p.cost for p in atomic], world)),
        max(sum(state) / world, whole_bound([p.state for p in atomic], world)),
        max(sum(grads) / world, whole_bound([float(p.numel * p.itemsize) for p in atomic], world)),
    )
    return Plan(ranges, cost, state, grads, bound)


def whole_bound(sizes: Sequence[float], world: int) -> float:
    """Return a lower bound of the most loaded rank's load when ``sizes`` are dealt whole to ``world`` ranks.

    The larger of two bounds. Pigeonhole: among the ``k * world + 1`` largest, some rank
    holds ``k + 1``, each at least the ``(k * world + 1)``-th largest, so the largest
    ``(k + 1) * sizes[k * world]`` (sorted from the largest; ``k = 0``: the largest
    tensor). Cover: a rank's load is a sum of some of the sizes, and some rank holds at
    least the mean, so the least such sum that reaches the mean (:func:`_least_sum_at_least`).

    Example:
        >>> whole_bound([80.0] * 96 + [30.0] * 64, 64)  # 96 equal matrices on 64 ranks: two share one
        160.0
        >>> whole_bound([90.0] * 40 + [30.0] * 80, 64)  # mean 93.75: no sum of these lies in [93.75, 120)
        120.0
    """
    ordered = sorted(sizes, reverse=True)
    pigeonhole = max(
        ((k + 1) * ordered[k * world] for k in range(len(ordered) // world + 1) if k * world < len(ordered)),
        default=0.0,
    )
    return max(pigeonhole, _least_sum_at_least(ordered, sum(ordered) / world))


#: The most choices :func:`_least_sum_at_least` tries before it settles for its target (a valid bound).
_COVER_BUDGET = 20_000


def _least_sum_at_least(sizes: Sequence[float], target: float) -> float:
    """Return the least sum of some of ``sizes`` (each used at most once) that is at least ``target``.

    A search over how many of each distinct size to take, largest first, that stops at the first
    sum reaching ``target`` on each path and drops paths that cannot beat the best; with more than
    :data:`_COVER_BUDGET` choices it returns ``target`` itself (no sum is below it: still a bound).
    """
    counts: dict[float, int] = {}
    for size in sizes:
        if size > 0:
            counts[size] = counts.get(size, 0) + 1
    distinct = sorted(counts.items(), reverse=True)
    if not distinct:
        return max(target, 0.0)
    left = [0.0] * (len(distinct) + 1)  # the total of the sizes from each distinct size on
    for i in range(len(distinct) - 1, -1, -1):
        left[i] = left[i + 1] + distinct[i][0] * distinct[i][1]
    if left[0] < target:
        return target
    best = left[0]
    tried = 0

    def search(i: int, total: float) -> None:
        nonlocal best, tried
        size, count = distinct[i]
        need = target - total
        most = min(count, max(0, -(-need // size)))  # beyond it the sum only grows
        for n in range(int(most), -1, -1):
            tried += 1
            if tried > _COVER_BUDGET:
                return
            reached = total + n * size
            if reached >= best:
                continue
            if reached >= target:
                best = reached
            elif i + 1 < len(distinct) and reached + left[i + 1] >= target:
                search(i + 1, reached)

    search(0, 0.0)
    return target if tried > _COVER_BUDGET else best


def _side_by_side(atomic: Sequence[_Part], whole: dict[tuple[int, int], int]) -> None:
    """Deal the owners of equal whole tensors again in layout order, so that one owner's lie side by side.

    Tensors of equal cost, state and size are interchangeable: no rank's load changes, and a run of
    them in a bucket (a layer's experts) goes to few owners, in few ranges, instead of one owner each.
    """
    alike: dict[tuple[float, float, int, int], list[_Part]] = {}
    for part in atomic:  # in layout order
        alike.setdefault((part.cost, part.state, part.numel, part.itemsize), []).append(part)
    for group in alike.values():
        owners = sorted(whole[p.bucket, p.offset] for p in group)
        for part, rank in zip(group, owners):
            whole[part.bucket, part.offset] = rank


def _runs(parts: Sequence[_Part]) -> list[list[_Part]]:
    """Return the maximal runs of element-wise parts that follow each other in a bucket."""
    runs: list[list[_Part]] = []
    previous: _Part | None = None
    for part in parts:
        if not part.atomic:
            if previous is not None and not previous.atomic and previous.bucket == part.bucket:
                runs[-1].append(part)
            else:
                runs.append([part])
        previous = part
    return runs


def _neighbour(
    run: Sequence[_Part], offsets: dict[int, list[int]], whole: dict[tuple[int, int], int]
) -> int | None:
    """Return the owner of the whole tensor before ``run`` in its bucket (else after it), or ``None``."""
    bucket = run[0].bucket
    atomic = offsets.get(bucket, [])
    at = bisect.bisect_left(atomic, run[0].offset)
    if at > 0:
        return whole[bucket, atomic[at - 1]]
    return whole[bucket, atomic[at]] if at < len(atomic) else None


def _fill(parts: Sequence[_Part], state: list[float], give: Callable[[_Part, int, int, int], None]) -> None:
    """Cut ``parts``, end to end, so that each rank's state rises to one level (rank order, in order)."""
    total = sum(p.state for p in parts)
    if not parts:
        return
    level = _level(state, total)
    quotas = [max(0.0, level - s) for s in state]
    rank, left = 0, quotas[0]
    world = len(state)
    for part in parts:
        per = part.state / part.numel
        start = part.offset
        stop = part.offset + part.numel
        while start < stop:
            while rank < world - 1 and left <= 0:
                rank += 1
                left = quotas[rank]
            take = (
                stop - start
                if rank == world - 1 or per == 0
                else min(stop - start, max(1, round(left / per)))
            )
            give(part, start, start + take, rank)
            left -= take * per
            start += take


def _level(loads: Sequence[float], total: float) -> float:
    """Return the level ``L`` with ``sum(max(0, L - load)) == total`` (water filling)."""
    ordered = sorted(loads)
    below = 0.0
    for k, load in enumerate(ordered, start=1):
        below += load
        level = (total + below) / k
        if k == len(ordered) or level <= ordered[k]:
            return level
    return (total + below) / len(ordered)


def _ranges(numel: int, owned: Sequence[tuple[int, int, int]], world: int) -> list[list[tuple[int, int]]]:
    """Return each rank's merged ranges of a bucket; a gap goes to the owner before it (or after it)."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    if not owned:
        return [[(0, numel)] if r == 0 and numel else [] for r in range(world)]
    spans = sorted(owned)
    tiles: list[list[int]] = []  # [start, stop, rank]
    for start, stop, rank in spans:
        if tiles and tiles[-1][2] == rank:
            tiles[-1][1] = stop
        elif tiles:
            tiles[-1][1] = start  # a gap goes to the owner before it
            tiles.append([start, stop, rank])
        else:
            tiles.append([0, stop, rank])
    tiles[-1][1] = numel
    for start, stop, rank in tiles:
        if stop > start:
            out[rank].append((start, stop))
    return out
