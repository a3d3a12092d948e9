"""The warm gloo ranks that the multi-process tests share (``_gloo_pool.py``, through ``spawn_gloo``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _helpers import RankFailed, spawn_gloo

pytestmark = pytest.mark.slow  # processes


def _record(rank: int, world: int, outdir: Path) -> None:
    draw, dtype = torch.rand(()).item(), torch.get_default_dtype()  # as a new interpreter has them
    torch.manual_seed(rank + 7)  # a worker that seeds must not change the next launch's draw
    torch.set_default_dtype(torch.float64)  # nor its default dtype
    total = torch.ones(()) * (rank + 1)
    dist.all_reduce(total)
    (outdir / f"{rank}.txt").write_text(f"{os.getpid()} {draw!r} {dtype} {total.item()} {world}")


def _fail_on_rank_one(rank: int, world: int, outdir: Path) -> None:
    if rank == 1:
        raise ValueError("rank one fails on purpose")


def _hang_on_rank_one(rank: int, world: int, outdir: Path) -> None:
    if rank == 1:
        time.sleep(120)


def _launch(outdir: Path, world: int, **kwargs: object) -> list[list[str]]:
    outdir.mkdir()
    spawn_gloo(_record, outdir, world=world, **kwargs)  # type: ignore[arg-type]
    return [(outdir / f"{rank}.txt").read_text().split() for rank in range(world)]


def _pids(run: list[list[str]]) -> set[str]:
    return {rank[0] for rank in run}


def test_launches_reuse_the_ranks_and_each_starts_as_a_new_interpreter(tmp_path: Path) -> None:
    """Two launches run in the same processes; each sees a new interpreter's seed and dtype, a new group."""
    first, second = _launch(tmp_path / "a", 3), _launch(tmp_path / "b", 3)
    assert _pids(first) == _pids(second) and len(_pids(first)) == 3
    # A new interpreter seeds torch at random: each launch starts a rank from the seed its process began with.
    assert [rank[1] for rank in first] == [rank[1] for rank in second]
    for rank in first + second:
        assert rank[2:] == ["torch.float32", "6.0", "3"]


def test_a_failing_rank_is_reported_and_retires_the_ranks(tmp_path: Path) -> None:
    """The traceback of the rank that raised is in the report; the next launch runs in new processes."""
    before = _launch(tmp_path / "before", 2)
    (tmp_path / "fail").mkdir()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 raised:.*ValueError: rank one fails on purpose"):
        spawn_gloo(_fail_on_rank_one, tmp_path / "fail", world=2, grace_s=1)
    after = _launch(tmp_path / "after", 2)
    assert not _pids(before) & _pids(after)


def test_a_rank_past_the_deadline_is_killed_and_reported(tmp_path: Path) -> None:
    """A hanging rank is killed at the deadline; the launch says so and the next one works."""
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 killed: still running at the deadline"):
        spawn_gloo(_hang_on_rank_one, tmp_path, world=2, deadline_s=3)
    assert time.monotonic() - start < 60
    assert _launch(tmp_path / "after", 2)[1][3] == "3.0"


def test_fresh_ranks_are_new_processes_and_are_not_kept(tmp_path: Path) -> None:
    """``fresh=True`` runs in processes of its own, neither the pool's nor kept for the next launch."""
    pooled = _launch(tmp_path / "pooled", 2)
    fresh = _launch(tmp_path / "fresh", 2, fresh=True)
    again = _launch(tmp_path / "again", 2)
    assert not _pids(fresh) & (_pids(pooled) | _pids(again))
    assert _pids(pooled) == _pids(again)


def test_a_launch_under_another_environment_gets_ranks_started_under_it(tmp_path: Path, monkeypatch) -> None:
    """Ranks read the environment when they start: a changed one (MKL's ``MKL_CBWR``, say) means new ranks."""
    before = _launch(tmp_path / "before", 2)
    monkeypatch.setenv("FLATTEN_PARAMETRIZE_TEST_POOL", "1")
    under = _launch(tmp_path / "under", 2)
    assert not _pids(before) & _pids(under)
    assert _pids(_launch(tmp_path / "again", 2)) == _pids(under)


def test_a_kept_rank_that_died_between_launches_is_replaced(tmp_path: Path) -> None:
    """A rank of the pool killed after its launch: the next launch starts new ranks and runs."""
    import _gloo_pool

    before = _launch(tmp_path / "before", 2)
    _gloo_pool._POOLS[2].ranks[1].process.kill()
    _gloo_pool._POOLS[2].ranks[1].process.join(10)
    after = _launch(tmp_path / "after", 2)
    assert not _pids(before) & _pids(after)
    assert [rank[3] for rank in after] == ["3.0", "3.0"]
