"""The plan laid out for one-buffer collectives (NCCL's path): units of buckets that move as one.

``flatten_parametrize/_distributed/sharded_plan.plan_ownership(..., max_padding=...)`` deals whole
tensors so that runs of buckets even out, and gives each such run (a unit) one ``reduce_scatter`` and
one ``all_gather``. Checked on random layouts of matrices (Muon: whole) and vectors (AdamW: cut) against
what the collectives and the balance targets need, and on the case the layout exists for: one matrix
per bucket.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatten_parametrize._distributed.sharded_plan import (
    BALANCE,
    UNIT_BUDGET,
    plan_ownership,
)

from _helpers import plan_buckets

MAX_PADDING = 0.05

#: A member: a matrix (rows, columns) stepped whole by Muon, or a vector of n elements cut by AdamW.
members = st.one_of(
    st.tuples(st.integers(1, 12), st.integers(1, 12)),
    st.tuples(st.integers(1, 40)),
)
layouts = st.lists(st.lists(members, min_size=1, max_size=4), min_size=1, max_size=10)


def _shares(plan: Any, first: int, stop: int, world: int) -> list[int]:
    return [sum(hi - lo for b in range(first, stop) for lo, hi in plan.ranges[b][r]) for r in range(world)]


@settings(max_examples=150, deadline=None)
@given(layouts, st.integers(2, 5))
def test_units_tile_the_buckets_in_order_and_every_element_has_one_owner(layout, world):
    buckets = plan_buckets(layout)
    plan = plan_ownership(buckets, world, MAX_PADDING)
    assert [first for first, _ in plan.units] == [0] + [stop for _, stop in plan.units[:-1]]
    assert plan.units[-1][1] == len(buckets)
    for bucket, ranges in zip(buckets, plan.ranges):
        spans = sorted(span for owner in ranges for span in owner)
        assert [lo for lo, _ in spans] == [0] + [hi for _, hi in spans[:-1]]
        assert spans[-1][1] == bucket.numel


@settings(max_examples=150, deadline=None)
@given(layouts, st.integers(2, 5))
def test_a_unit_of_several_buckets_pads_one_buffer_at_most_the_limit_and_holds_at_most_the_budget(
    layout, world
):
    buckets = plan_buckets(layout)
    plan = plan_ownership(buckets, world, MAX_PADDING)
    total = sum(bucket.numel for bucket in buckets)
    for first, stop in plan.units:
        if stop - first > 1:
            numel = sum(bucket.numel for bucket in buckets[first:stop])
            padding = world * max(_shares(plan, first, stop, world)) - numel
            assert padding <= max(MAX_PADDING * numel, world - 1)
            assert numel <= UNIT_BUDGET * total / world


@settings(max_examples=150, deadline=None)
@given(layouts, st.integers(2, 5))
def test_the_layout_for_one_buffer_keeps_the_balance_of_the_layout_by_owner(layout, world):
    buckets = plan_buckets(layout)
    units = plan_ownership(buckets, world, MAX_PADDING)
    by_owner = plan_ownership(buckets, world)
    for mine, theirs in ((units.cost, by_owner.cost), (units.state, by_owner.state)):
        mean = sum(mine) / world
        assert max(mine) <= max(1.01 * max(theirs), (1 + BALANCE) * mean) + 1e-6


def test_one_matrix_per_bucket_moves_in_units_of_one_matrix_per_rank():
    """Eight equal matrices, each its own bucket, on four ranks: two units, each rank one matrix of each."""
    buckets = plan_buckets([[(8, 8)]] * 8)
    plan = plan_ownership(buckets, 4, MAX_PADDING)
    assert plan.units == [(0, 4), (4, 8)]
    for first, stop in plan.units:
        assert _shares(plan, first, stop, 4) == [64] * 4  # no padding
    by_owner = plan_ownership(buckets, 4)
    assert by_owner.units == [(b, b + 1) for b in range(8)]
    assert by_owner.state == plan.state


def test_buckets_of_another_dtype_never_share_a_unit():
    kinds = [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    plan = plan_ownership(plan_buckets([[(8, 8)]] * 4, kinds), 2, MAX_PADDING)
    assert plan.units == [(0, 2), (2, 4)]


def test_where_nothing_evens_out_the_layout_is_the_one_by_owner():
    """Matrices too few for the ranks: no run of buckets pads little, so nothing changes."""
    buckets = plan_buckets([[(8, 8)], [(4, 4)]])
    assert plan_ownership(buckets, 4, MAX_PADDING) == plan_ownership(buckets, 4)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_unit_evens_out_with_the_vectors_it_holds(world):
    """A matrix and a vector per bucket, two buckets per rank: each unit's shares are even."""
    buckets = plan_buckets([[(6, 6), (30,)]] * (2 * world))
    plan = plan_ownership(buckets, world, MAX_PADDING)
    several = [(a, b) for a, b in plan.units if b - a > 1]
    assert several
    for first, stop in several:
        numel = sum(bucket.numel for bucket in buckets[first:stop])
        assert world * max(_shares(plan, first, stop, world)) - numel <= max(MAX_PADDING * numel, world - 1)
