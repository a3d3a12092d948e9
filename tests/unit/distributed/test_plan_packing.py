"""Whole tensors dealt unit by unit for one-buffer collectives (NCCL's path).

``flatten_parametrize/_distributed/sharded_packing.deal_in_units`` lays the units out first and packs
each unit's whole tensors into one even slot per rank; ``sharded_plan.plan_ownership`` tries it beside
the deals over the whole model and keeps the layout that leaves the fewest elements by owner. Checked
on random layouts against what a unit must be, on the cases its rule names (a unit grows until it packs,
a bucket that starts none joins the unit before it, a bucket in no unit goes to the least loaded rank),
and on a GPT-2-shaped model on 8 ranks, whose layers the deals over the whole model could not even out.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatten_parametrize._distributed import sharded_plan
from flatten_parametrize._distributed.sharded_packing import Tensor, deal_in_units
from flatten_parametrize._distributed.sharded_plan import (
    BALANCE,
    UNIT_BUDGET,
    Bucket,
    pads_little,
    plan_ownership,
)

from _helpers import plan_buckets

MAX_PADDING = 0.05


def _deal(sizes: list[list[int]], world: int, budget: float = 1e9, kinds: list[str] | None = None):
    tensors = [Tensor(b, n, float(n), float(n)) for b, bucket in enumerate(sizes) for n in bucket]
    owner, units = deal_in_units(
        tensors, [sum(bucket) for bucket in sizes], kinds or [""] * len(sizes), world, MAX_PADDING, budget
    )
    return tensors, owner, units


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=5), min_size=1, max_size=12),
    st.integers(2, 6),
    st.integers(1, 3),
    st.lists(st.sampled_from("ab"), min_size=12, max_size=12),
)
def test_units_tile_the_buckets_and_each_packed_unit_gives_no_rank_more_than_its_padding_allows(
    sizes, world, shares, kinds
):
    budget = shares * sum(map(sum, sizes)) / world
    kinds = kinds[: len(sizes)]
    tensors, owner, units = _deal(sizes, world, budget, kinds)
    assert [first for first, _, _ in units] == [0] + [stop for _, stop, _ in units[:-1]]
    assert units[-1][1] == len(sizes)
    assert all(0 <= rank < world for rank in owner)
    for first, stop, packed in units:
        numel = sum(sum(bucket) for bucket in sizes[first:stop])
        assert len(set(kinds[first:stop])) == 1
        assert stop - first == 1 or numel <= budget
        if not packed:
            assert stop - first == 1
            continue
        held = [0] * world
        for tensor, rank in zip(tensors, owner):
            if first <= tensor.bucket < stop:
                held[rank] += tensor.numel
        assert max(held) <= (1 + MAX_PADDING) * numel / world


def test_a_unit_grows_until_its_tensors_pack_evenly():
    _, owner, units = _deal([[3, 2], [1]], 2)
    assert units == [(0, 2, True)]
    assert owner[1] == owner[2] != owner[0]  # 3 | 2 + 1


def test_a_bucket_that_starts_no_unit_joins_the_unit_before_it():
    # [2, 2] packs alone; [3] and [3, 1] do not; [2, 2, 3] does not; [2, 2, 3, 1] does: 3 + 1 | 2 + 2
    _, owner, units = _deal([[2, 2], [3], [1]], 2)
    assert units == [(0, 3, True)]
    assert owner[0] == owner[1] != owner[2] == owner[3]


def test_a_bucket_in_no_unit_moves_by_owner_and_its_tensor_goes_to_the_least_loaded_rank():
    # 20 | 19 packs (5% allows 20.475); the lone 50 packs nowhere and exceeds the budget with them:
    # it goes to the rank that holds the 19
    _, owner, units = _deal([[20, 19], [50]], 2, budget=60)
    assert units == [(0, 1, True), (1, 2, False)]
    assert owner[2] == owner[1] != owner[0]


def test_buckets_of_another_kind_never_share_a_unit():
    _, _, units = _deal([[4], [4], [4], [4]], 2, kinds=["a", "b", "a", "b"])
    assert all(stop - first == 1 for first, stop, _ in units)
    assert not any(packed for _, _, packed in units)


def _gpt2_like(layers: int = 12) -> list[Bucket]:
    """One bucket a layer of GPT-2's shapes / 96 (fused qkv, out, fc, proj and their vectors), then wte."""
    layer = [(8, 24), (24,), (8, 8), (8,), (8, 32), (32,), (32, 8), (8,), (8,), (8,), (8,), (8,)]
    return plan_buckets([layer] * layers + [[(4200,)]])


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_gpt2_shaped_layers_move_in_one_buffer_each_unit_within_the_budget_and_balance(world):
    buckets = _gpt2_like()
    total = sum(bucket.numel for bucket in buckets)
    plan = plan_ownership(buckets, world, MAX_PADDING)
    for first, stop in plan.units:
        numel = sum(bucket.numel for bucket in buckets[first:stop])
        shares = [
            sum(hi - lo for b in range(first, stop) for lo, hi in plan.ranges[b][r]) for r in range(world)
        ]
        assert pads_little(max(shares), numel, world, MAX_PADDING)
        assert stop - first == 1 or numel <= UNIT_BUDGET * total / world
    for loads in (plan.cost, plan.state):
        assert max(loads) <= (1 + BALANCE) * sum(loads) / world


def test_the_deal_unit_by_unit_packs_each_matrix_with_the_small_vectors_that_go_with_it():
    """A layer's biases and norms go whole with the matrix before them: packed with it, every unit evens.

    Packed as the matrices alone, 2 ranks' slots of each layer would be even before the vectors and
    uneven after (every layer moved by owner).
    """
    buckets = _gpt2_like()
    plan = sharded_plan._plan(buckets, 2, MAX_PADDING, "units")
    assert plan is not None
    for first, stop in plan.units:
        numel = sum(bucket.numel for bucket in buckets[first:stop])
        shares = [sum(hi - lo for b in range(first, stop) for lo, hi in plan.ranges[b][r]) for r in range(2)]
        assert pads_little(max(shares), numel, 2, MAX_PADDING)
