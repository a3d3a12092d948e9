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

Laid out for one-buffer collectives (``max_padding``, NCCL's path): a bucket of
one matrix would pad its buffer ``W`` times, so the buckets move in **units**,
runs of consecutive buckets that share one ``reduce_scatter`` and one
``all_gather`` (each rank's share of a unit packed into one slot). Three deals
are tried (:data:`_DEALS`), and the layout with the fewest elements by owner,
then the smallest largest unit, is kept. Two re-deal rule 1's owners of equal
tensors in layout order, each to the rank with the fewest elements so far
(instead of side by side; :func:`_interleaved`), and a unit closes at the first
bucket where its ranks' shares are even to within ``max_padding`` (a bucket that
starts none joins the unit before it where that still evens out). The third
replaces rule 1: units first, each packed into one even slot per rank
(``sharded_packing.py``). In all three, rule 2's cut levels the state unit by
unit, no rank's share of a unit above what ``max_padding`` allows. A unit holds
at most :data:`UNIT_BUDGET` rank shares (with ZeRO-2 its padded buffer waits for
its last bucket). The layout is kept only where it balances the state and cost
about as well as the layout by owner (:func:`_as_balanced`); else that one is
returned.
"""

from __future__ import annotations

import bisect
import copy
import heapq
from collections.abc import Hashable, Sequence
from typing import Callable, Literal, NamedTuple

from .sharded_costs import state_numel, step_cost
from .sharded_packing import Tensor, deal_in_units
from .sharded_rules import cuttable

__all__ = [
    "BALANCE",
    "SMALL_RUN",
    "UNIT_BUDGET",
    "Bucket",
    "BucketTensor",
    "Plan",
    "pads_little",
    "plan_ownership",
    "whole_bound",
]

#: A run of element-wise tensors whose state is under this fraction of a rank's mean goes whole to a
#: neighbour's owner (one range fewer per run; the rest balances it).
SMALL_RUN = 0.01

#: Laid out for one-buffer collectives, a unit of several buckets holds at most this many times a
#: rank's mean share of the elements (with ZeRO-2 its padded buffer waits for its last bucket).
UNIT_BUDGET = 4

#: Units are laid out for this fraction of the padding allowed (the rest covers rounding and gaps).
_MARGIN = 0.9

#: Laid out for one buffer, the most loaded rank's cost and state may exceed what the layout by owner
#: gives them by this fraction (or, where every unit moves in one buffer, the mean by :data:`BALANCE`);
#: past it, the layout by owner is taken.
_LEEWAY = 0.01

#: How whole tensors are dealt for units: over the model, then again in layout order to the rank with the
#: fewest elements so far, or counting what each rank still has to take (:func:`_interleaved`); or unit by
#: unit (``sharded_packing``).
_Deal = Literal["least", "ahead", "units"]
_DEALS: tuple[_Deal, ...] = ("ahead", "least", "units")

#: The balance every layout keeps where it can: the most loaded rank within this fraction of the mean.
BALANCE = 0.05


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
    #: What two buckets must share to move in one buffer (their dtype and device; ``None``: anything).
    kind: Hashable = None


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
    #: The buckets that move together, ``(first, stop)`` spans in order: one bucket each, or laid out
    #: for one-buffer collectives, runs whose shares are even (see the module's docstring).
    units: list[tuple[int, int]]


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


#: What a cut of element-wise parts levels: a part's weight per element.
_PerElement = Callable[[_Part], float]


def plan_ownership(buckets: Sequence[Bucket], world: int, max_padding: float | None = None) -> Plan:
    """Return who owns which elements of every bucket (see the module's rule).

    Args:
        buckets: the flat buffers to shard, in the order collectives start in.
        world: the number of ranks.
        max_padding: lay the ownership out for one-buffer collectives: units of buckets whose ranks'
            shares are even to within this fraction of the unit (``None``: each bucket moves on its own,
            each owner's ranges as few as possible).

    Returns:
        The plan: each rank's ranges of each bucket, its cost, state and gradient bytes, the units.

    Example:
        >>> import torch
        >>> one = [BucketTensor(0, 64, (8, 8), torch.optim.Muon)]
        >>> plan = plan_ownership([Bucket(64, 4, one), Bucket(64, 4, one)], 2)
        >>> plan.ranges  # one matrix per bucket, one bucket per rank
        [[[(0, 64)], []], [[], [(0, 64)]]]
        >>> plan_ownership([Bucket(64, 4, one), Bucket(64, 4, one)], 2, max_padding=0.05).units
        [(0, 2)]
    """
    by_owner = _plan(buckets, world, None, "least")
    assert by_owner is not None  # the layout by owner always exists
    if max_padding is None:
        return by_owner
    laid = []
    for deal in _DEALS:  # the better layout is kept
        plan = _plan(buckets, world, max_padding, deal)
        if plan is not None:
            left = _moved_by_owner(plan, buckets, max_padding)
            if _as_balanced(plan, by_owner, every_unit=not left):
                laid.append((left, _largest_unit(plan, buckets), plan))
    return min(laid, key=lambda entry: entry[:2])[2] if laid else by_owner


def _plan(buckets: Sequence[Bucket], world: int, max_padding: float | None, deal: _Deal) -> Plan | None:
    """Return the plan by owner (``max_padding`` ``None``) or laid out in units (``None``: no unit fits).

    ``deal``: how whole tensors are dealt for units (:data:`_DEALS`).
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

    atomic = [p for p in parts if p.atomic]
    # Rule 2's small element-wise runs go whole with a neighbouring whole tensor: decided first, so that
    # a deal unit by unit packs each whole tensor with the runs that go with it.
    mean = sum(p.state for p in parts) / world
    offsets: dict[int, list[int]] = {}
    for part in atomic:
        offsets.setdefault(part.bucket, []).append(part.offset)
    attached: list[tuple[list[_Part], tuple[int, int]]] = []  # (run, the whole tensor it goes with)
    large: list[_Part] = []
    for run in _runs(parts):
        neighbour = _neighbour(run, offsets)
        if neighbour is not None and sum(p.state for p in run) < SMALL_RUN * mean:
            attached.append((run, neighbour))
        else:
            large += run
    # 1. whole tensors: largest cost first, to the least loaded rank (or unit by unit: sharded_packing)
    whole: dict[tuple[int, int], int] = {}
    laid_out: list[tuple[int, int]] | None = None
    if max_padding is not None and deal == "units":
        dealt = _unit_by_unit(buckets, atomic, attached, world, max_padding)
        if dealt is None:
            return None  # no unit packs
        owners, laid_out = dealt
        for part, rank in zip(atomic, owners):
            give(part, part.offset, part.offset + part.numel, rank)
            whole[part.bucket, part.offset] = rank
    else:
        heap = [(0.0, 0.0, r) for r in range(world)]
        for part in sorted(atomic, key=lambda p: (-p.cost, -p.state, p.bucket, p.offset)):
            _, _, rank = heapq.heappop(heap)
            give(part, part.offset, part.offset + part.numel, rank)
            whole[part.bucket, part.offset] = rank
            heapq.heappush(heap, (cost[rank], state[rank], rank))
        if max_padding is None:
            _side_by_side(atomic, whole)
        else:
            _interleaved(atomic, whole, ahead=deal == "ahead")
        owned = [(p, a, b, whole[p.bucket, p.offset]) for p, a, b, _ in owned]
    # 2. element-wise runs: small ones with their neighbour, the others cut to level the loads
    for run, neighbour in attached:
        for part in run:
            give(part, part.offset, part.offset + part.numel, whole[neighbour])
    if max_padding is None:
        _fill(large, state, lambda p: p.state / p.numel, give)
        units = [(b, b + 1) for b in range(len(buckets))]
    else:
        laid = _cut_in_units(buckets, owned, large, state, max_padding, give, laid_out)
        if laid is None:
            return None  # nothing evens out
        units = laid
    spans: list[list[tuple[int, int, int]]] = [[] for _ in buckets]
    for part, start, stop, rank in owned:
        spans[part.bucket].append((start, stop, rank))
    ranges = [_ranges(bucket.numel, spans[b], world) for b, bucket in enumerate(buckets)]
    bound = (
        max(sum(cost) / world, whole_bound([p.cost for p in atomic], world)),
        max(sum(state) / world, whole_bound([p.state for p in atomic], world)),
        max(sum(grads) / world, whole_bound([float(p.numel * p.itemsize) for p in atomic], world)),
    )
    return Plan(ranges, cost, state, grads, bound, units)


def _unit_by_unit(
    buckets: Sequence[Bucket],
    atomic: Sequence[_Part],
    attached: Sequence[tuple[list[_Part], tuple[int, int]]],
    world: int,
    max_padding: float,
) -> tuple[list[int], list[tuple[int, int]]] | None:
    """Deal the whole tensors unit by unit (``sharded_packing``); return their ranks and the units.

    Each whole tensor is packed with the small element-wise runs ``attached`` to it (they go to its
    owner). ``None``: no unit packs.
    """
    along: dict[tuple[int, int], list[_Part]] = {}
    for run, neighbour in attached:
        along.setdefault(neighbour, []).extend(run)
    tensors = []
    for part in atomic:
        with_it = [part, *along.get((part.bucket, part.offset), [])]
        tensors.append(
            Tensor(
                part.bucket,
                sum(p.numel for p in with_it),
                sum(p.cost for p in with_it),
                sum(p.state for p in with_it),
            )
        )
    budget = UNIT_BUDGET * sum(bucket.numel for bucket in buckets) / world
    kinds = [bucket.kind for bucket in buckets]
    sizes = [bucket.numel for bucket in buckets]
    owners, packed = deal_in_units(tensors, sizes, kinds, world, _MARGIN * max_padding, budget)
    if not any(fits for _, _, fits in packed):
        return None
    return owners, [(first, stop) for first, stop, _ in packed]


def pads_little(chunk: float, numel: int, world: int, max_padding: float) -> bool:
    """Return whether ``world`` slots of ``chunk`` pad ``numel`` elements by at most ``max_padding`` of them.

    Or by less than one element per rank (ZeRO's equal slices of a small buffer).

    Example:
        >>> pads_little(25, 100, 4, 0.05), pads_little(100, 100, 4, 0.05), pads_little(3, 10, 4, 0.05)
        (True, False, True)
    """
    return world * chunk - numel <= max(max_padding * numel, world - 1)


def _as_balanced(plan: Plan, other: Plan, every_unit: bool) -> bool:
    """Return whether ``plan``'s most loaded rank's cost and state stay as balanced as ``other``'s allow.

    Within :data:`_LEEWAY` of ``other``'s; where every unit moves in one buffer (``every_unit``), within
    :data:`BALANCE` of the mean is enough.
    """
    world = len(plan.cost)
    return all(
        max(mine) <= (1 + _LEEWAY) * max(theirs)
        or (every_unit and max(mine) <= (1 + BALANCE) * sum(mine) / world)
        for mine, theirs in ((plan.cost, other.cost), (plan.state, other.state))
    )


def _unit_shares(plan: Plan, first: int, stop: int) -> list[int]:
    """Return each rank's elements of the buckets ``first`` to ``stop``."""
    shares = [0] * len(plan.cost)
    for ranges in plan.ranges[first:stop]:
        for rank, owner in enumerate(ranges):
            if owner:
                shares[rank] += sum(b - a for a, b in owner)
    return shares


def _moved_by_owner(plan: Plan, buckets: Sequence[Bucket], max_padding: float) -> int:
    """Return the elements of the units that pad more than ``max_padding`` (they move by owner)."""
    world, left = len(plan.cost), 0
    for first, stop in plan.units:
        numel = sum(bucket.numel for bucket in buckets[first:stop])
        if not pads_little(max(_unit_shares(plan, first, stop)), numel, world, max_padding):
            left += numel
    return left


def _largest_unit(plan: Plan, buckets: Sequence[Bucket]) -> int:
    """Return the elements of the largest unit of several buckets (0: none)."""
    return max(
        (sum(b.numel for b in buckets[first:stop]) for first, stop in plan.units if stop - first > 1),
        default=0,
    )


def _cut_in_units(
    buckets: Sequence[Bucket],
    owned: Sequence[tuple[_Part, int, int, int]],
    large: Sequence[_Part],
    state: Sequence[float],
    max_padding: float,
    give: Callable[[_Part, int, int, int], None],
    spans: Sequence[tuple[int, int]] | None = None,
) -> list[tuple[int, int]] | None:
    """Lay the buckets out in units and cut the large element-wise runs for them; return the units.

    ``spans``: the units, already laid out (else :func:`_units` lays them out). Each unit that evens
    out cuts its runs to level the state, no rank's share of the unit above what
    ``max_padding`` allows; the runs of the units that do not (they move by owner) are cut together to
    level the state, as without units. ``None`` (nothing cut): no bucket or run of buckets evens out.
    """
    world = len(state)
    fixed: list[dict[int, int]] = [{} for _ in buckets]  # each bucket's elements by rank, before the cut
    for part, start, stop, rank in owned:
        fixed[part.bucket][rank] = fixed[part.bucket].get(rank, 0) + stop - start
    flexible: dict[int, list[_Part]] = {}
    for part in large:
        flexible.setdefault(part.bucket, []).append(part)
    target = _MARGIN * max_padding  # the cut's rounding and the gaps between members stay under it
    spare_of = [sum(p.numel for p in flexible.get(b, ())) for b in range(len(buckets))]

    def sums(first: int, stop: int) -> _Run:
        run = _Run(world, None)
        for b in range(first, stop):
            run.add(buckets[b], fixed[b], spare_of[b])
        return run

    if spans is None:
        laid = _units(buckets, fixed, spare_of, target, world)
    else:
        laid = [(first, stop, sums(first, stop).fits(target)) for first, stop in spans]
    if not any(fits for _, _, fits in laid):
        return None
    rest: list[_Part] = []
    for first, stop, fits in laid:
        run = [p for b in range(first, stop) for p in flexible.get(b, ())]
        if not fits:
            rest += run
            continue
        unit = sums(first, stop)  # its shares before the cut (the spare elements are what is cut)
        room = max(target * unit.numel, world - 1)
        cap = int((unit.numel + room) // world)  # the largest share the unit may give
        _cut(run, _capped_quotas(run, unit.shares, state, cap), lambda p: 1.0, give)
    _fill(rest, state, lambda p: p.state / p.numel, give)
    return [(first, stop) for first, stop, _ in laid]


class _Run:
    """What a run of buckets adds up to: each rank's fixed elements, the spare ones, all of them."""

    def __init__(self, world: int, kind: Hashable) -> None:
        self.shares, self.spare, self.numel, self.kind = [0] * world, 0, 0, kind
        #: The largest share.
        self.top = 0

    def add(self, bucket: Bucket, fixed: dict[int, int], spare: int) -> _Run:
        """Add a bucket (its fixed elements by rank and its spare elements); return the run."""
        for rank, count in fixed.items():
            self.shares[rank] += count
            self.top = max(self.top, self.shares[rank])
        self.spare += spare
        self.numel += bucket.numel
        return self

    def copy(self) -> _Run:
        """Return a copy that adds up on its own."""
        other = copy.copy(self)
        other.shares = list(self.shares)
        return other

    def fits(self, max_padding: float) -> bool:
        """Return whether the run pads at most ``max_padding``: its shares and spare elements levelled."""
        world = len(self.shares)
        if not pads_little(self.top, self.numel, world, max_padding):
            return False
        level = _level(self.shares, self.spare) if self.spare else 0.0
        return pads_little(max(self.top, level), self.numel, world, max_padding)


def _units(
    buckets: Sequence[Bucket],
    fixed: Sequence[dict[int, int]],
    spare_of: Sequence[int],
    max_padding: float,
    world: int,
) -> list[tuple[int, int, bool]]:
    """Return runs of consecutive buckets, each closed at the first bucket where it pads little enough.

    Little enough: ``world`` slots of its largest share less its elements, at most ``max_padding`` of
    it; the shares are the ``fixed`` elements (per bucket and rank) plus the ``spare_of`` elements (per
    bucket: its large element-wise runs) cut to one level. A unit holds buckets of one
    kind, and at most :data:`UNIT_BUDGET` times a rank's mean share of the elements. A bucket that
    starts no such unit joins the unit before it where that still fits (at the end: the units before
    it, as many as the budget allows), else it moves on its own (``False``: a unit that does not fit).
    """
    budget = UNIT_BUDGET * sum(bucket.numel for bucket in buckets) / world
    units: list[tuple[int, int, bool]] = []
    runs: list[_Run | None] = []  # what each unit adds up to (``None``: it does not fit)

    def scan(first: int) -> tuple[_Run | None, int]:
        """Return the unit that starts at ``first`` and where it stops (``None``: none; where it ended)."""
        run = _Run(world, buckets[first].kind)
        for b in range(first, len(buckets)):
            run.add(buckets[b], fixed[b], spare_of[b])
            if b > first and (run.numel > budget or buckets[b].kind != run.kind):
                return None, b
            if run.fits(max_padding):
                return run, b + 1
        return None, len(buckets)

    first = 0
    while first < len(buckets):
        run, stop = scan(first)
        if run is not None:
            units.append((first, stop, True))
            runs.append(run)
            first = stop
            continue
        if stop == len(buckets) and _joined(
            first, units, runs, buckets, fixed, spare_of, max_padding, budget, world
        ):
            return units  # the last buckets joined the units before them
        before = runs[-1] if runs else None
        if before is not None and before.kind == buckets[first].kind:  # join the unit before, if it fits
            grown = before.copy().add(buckets[first], fixed[first], spare_of[first])
            if grown.numel <= budget and grown.fits(max_padding):
                units[-1], runs[-1] = (units[-1][0], first + 1, True), grown
                first += 1
                continue
        units.append((first, first + 1, False))
        runs.append(None)
        first += 1
    return units


def _joined(
    first: int,
    units: list[tuple[int, int, bool]],
    runs: list[_Run | None],
    buckets: Sequence[Bucket],
    fixed: Sequence[dict[int, int]],
    spare_of: Sequence[int],
    max_padding: float,
    budget: float,
    world: int,
) -> bool:
    """Join the last buckets (from ``first``) and ``units``' last ones into one unit, if one fits.

    Joins as few units as fit; none past the budget or another kind of bucket. Returns whether it did.
    """
    run = _Run(world, buckets[first].kind)
    for b in range(first, len(buckets)):
        run.add(buckets[b], fixed[b], spare_of[b])
    kinds = {bucket.kind for bucket in buckets[first:]}
    for k in range(len(units) - 1, -1, -1):
        start, stop, _ = units[k]
        for b in range(start, stop):
            run.add(buckets[b], fixed[b], spare_of[b])
            kinds.add(buckets[b].kind)
        if run.numel > budget or len(kinds) > 1:
            return False
        if run.fits(max_padding):
            del units[k:], runs[k:]
            units.append((start, len(buckets), True))
            runs.append(run)
            return True
    return False


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
    for group in _alike(atomic).values():
        owners = sorted(whole[p.bucket, p.offset] for p in group)
        for part, rank in zip(group, owners):
            whole[part.bucket, part.offset] = rank


def _interleaved(atomic: Sequence[_Part], whole: dict[tuple[int, int], int], ahead: bool) -> None:
    """Deal the owners of equal whole tensors again in layout order, each to the rank that has least so far.

    As :func:`_side_by_side`, each rank keeps as many of each kind as rule 1 gave it (no load changes);
    walking the layout, each tensor goes to the rank with the fewest elements so far among those with
    one of its kind left, so that every run of buckets is close to even (one-buffer units stay small).
    ``ahead``: the elements a rank still has to take of this kind count as already taken less, so that
    no rank is left with many of a kind at the end of the layout (smaller units, mostly).
    """
    alike = _alike(atomic)
    left: dict[tuple[float, float, int, int], dict[int, int]] = {}
    for kind, group in alike.items():
        counts = left[kind] = {}
        for part in group:
            rank = whole[part.bucket, part.offset]
            counts[rank] = counts.get(rank, 0) + 1
    dealt = [0] * (max(whole.values(), default=0) + 1)  # elements dealt to each rank so far

    def key(rank: int, counts: dict[int, int], numel: int) -> int:
        return dealt[rank] - (counts[rank] * numel if ahead else 0)

    # per kind, its ranks by key; a key only grows, so an entry that is out of date is pushed again
    heaps = {kind: [(key(r, counts, kind[2]), r) for r in counts] for kind, counts in left.items()}
    for heap in heaps.values():
        heapq.heapify(heap)
    for part in atomic:  # in layout order
        kind = _kind(part)
        counts, heap = left[kind], heaps[kind]
        while True:
            stale, rank = heap[0]
            now = key(rank, counts, part.numel)
            if now == stale:
                break
            heapq.heapreplace(heap, (now, rank))
        whole[part.bucket, part.offset] = rank
        dealt[rank] += part.numel
        counts[rank] -= 1
        if counts[rank]:
            heapq.heapreplace(heap, (key(rank, counts, part.numel), rank))
        else:
            heapq.heappop(heap)


def _kind(part: _Part) -> tuple[float, float, int, int]:
    """Return what makes whole tensors interchangeable: cost, state, size and element size."""
    return part.cost, part.state, part.numel, part.itemsize


def _alike(atomic: Sequence[_Part]) -> dict[tuple[float, float, int, int], list[_Part]]:
    """Return the whole tensors by (cost, state, size, element size), each list in layout order."""
    alike: dict[tuple[float, float, int, int], list[_Part]] = {}
    for part in atomic:
        alike.setdefault(_kind(part), []).append(part)
    return alike


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


def _neighbour(run: Sequence[_Part], offsets: dict[int, list[int]]) -> tuple[int, int] | None:
    """Return the whole tensor before ``run`` in its bucket, else after it: ``(bucket, offset)``, or None."""
    bucket = run[0].bucket
    atomic = offsets.get(bucket, [])
    at = bisect.bisect_left(atomic, run[0].offset)
    if at > 0:
        return bucket, atomic[at - 1]
    return (bucket, atomic[at]) if at < len(atomic) else None


def _fill(
    parts: Sequence[_Part],
    loads: Sequence[float],
    per_element: _PerElement,
    give: Callable[[_Part, int, int, int], None],
) -> None:
    """Cut ``parts``, end to end, so that each rank's load rises to one level (rank order, in order).

    A part adds ``per_element(part)`` to its owner's load per element (state bytes, or 1: elements).
    """
    if not parts:
        return
    level = _level(loads, sum(per_element(p) * p.numel for p in parts))
    _cut(parts, [max(0.0, level - load) for load in loads], per_element, give)


def _capped_quotas(
    parts: Sequence[_Part], shares: Sequence[int], state: Sequence[float], cap: int
) -> list[float]:
    """Return each rank's elements of ``parts`` that level the state, no rank's share above ``cap``.

    ``shares``: each rank's elements of the unit so far; ``state``: each rank's state bytes over every
    bucket so far. Water filling with a ceiling: rank ``r`` takes ``(L - state[r]) / per`` elements
    (``per``: the parts' state bytes per element), at most ``cap - shares[r]``, the level ``L`` found by
    bisection; without state (no class steps them) the elements themselves are levelled. Whole
    numbers (the largest remainders round up) that add up to the parts' elements, if the room allows.
    """
    total = sum(p.numel for p in parts)
    room = [max(0, cap - s) for s in shares]
    if not total:
        return [0.0] * len(room)
    if sum(room) <= total:  # the ceiling takes every element (the last rank any left)
        return [float(r) for r in room[:-1]] + [float(total - sum(room[:-1]))]
    per = sum(p.state for p in parts) / total
    loads = list(state) if per > 0 else [float(s) for s in shares]
    per = per if per > 0 else 1.0

    def taken(level: float) -> list[float]:
        return [min(r, max(0.0, (level - load) / per)) for r, load in zip(room, loads)]

    low, high = min(loads), max(loads) + per * total
    for _ in range(100):
        middle = (low + high) / 2
        if sum(taken(middle)) < total:
            low = middle
        else:
            high = middle
    quotas = taken(high)
    whole = [min(r, int(q)) for q, r in zip(quotas, room)]
    short = total - sum(whole)
    for r in sorted(range(len(room)), key=lambda r: whole[r] - quotas[r]):  # largest remainders first
        up = min(short, room[r] - whole[r])
        whole[r] += up
        short -= up
    return [float(w) for w in whole]


def _cut(
    parts: Sequence[_Part],
    quotas: Sequence[float],
    per_element: _PerElement,
    give: Callable[[_Part, int, int, int], None],
) -> None:
    """Cut ``parts``, end to end, giving each rank in turn its quota (of load: ``per_element`` each)."""
    world = len(quotas)
    rank, left = 0, quotas[0]
    for part in parts:
        per = per_element(part)
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
