"""The bound that ``zero_scale`` shows against the plan: never above what any whole-tensor ownership reaches.

``flatten_parametrize/_distributed/sharded_plan.whole_bound`` is the least the most loaded rank can
hold when tensors are dealt whole; checked against every assignment of small cases.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from flatten_parametrize._distributed import sharded_plan
from flatten_parametrize._distributed.sharded_plan import _least_sum_at_least, whole_bound

sizes = st.lists(st.sampled_from([1.0, 2.0, 3.0, 5.0, 8.0, 13.0]), min_size=1, max_size=7)


def _best_makespan(values: list[float], world: int) -> float:
    best = float("inf")
    for owners in itertools.product(range(world), repeat=len(values)):
        loads = [0.0] * world
        for value, owner in zip(values, owners):
            loads[owner] += value
        best = min(best, max(loads))
    return best


@given(sizes, st.integers(1, 4))
def test_the_bound_is_never_above_the_best_whole_tensor_ownership(values, world):
    assert whole_bound(values, world) <= _best_makespan(values, world) + 1e-9


@given(sizes, st.floats(0.0, 40.0))
def test_the_least_covering_sum_is_the_least_sum_of_a_subset_that_reaches_the_target(values, target):
    sums = {sum(c) for k in range(len(values) + 1) for c in itertools.combinations(values, k)}
    reaching = [s for s in sums if s >= target]
    expected = min(reaching) if reaching else target
    assert _least_sum_at_least(values, target) == expected


def test_the_bound_of_nanochats_matrices_on_64_ranks_is_what_the_best_ownership_reaches():
    """40 MLP matrices of 90 units and 80 attention ones of 30 (mean 93.75): some rank holds 120."""
    values = [90.0] * 40 + [30.0] * 80
    assert whole_bound(values, 64) == 120.0
    assert whole_bound([90.0] * 40, 64) == 90.0  # one each: the largest


def test_a_search_over_its_budget_settles_for_the_target(monkeypatch):
    """Its target is a bound too (some rank holds at least the mean): a long search gives it back."""
    monkeypatch.setattr(sharded_plan, "_COVER_BUDGET", 1)
    assert _least_sum_at_least([90.0] * 40 + [30.0] * 80, 93.75) == 93.75
