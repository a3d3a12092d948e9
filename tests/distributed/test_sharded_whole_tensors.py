"""``ShardedOptimizer(whole_tensors=True)``: each rank owns whole tensors, per-tensor optimizers by group.

torch's ``Muon`` docstring split (the blocks' matrices to ``Muon``, the rest to ``AdamW``) over a small
GPT-like model in per-tensor mode, on 2 and 3 gloo ranks (one launch each, every scenario in it), ZeRO-1
and ZeRO-2, with gradient accumulation under ``no_sync``, an LR scheduler, a tie, a frozen layer and a
rank that owns no matrix. The reference runs in the same process: the plain model, the same optimizers,
each step's gradient the average of every rank's accumulated gradient, computed as the collectives
compute it. On 2 ranks that average is exact (a sum of two, a division by two), so the weights are
equal bit for bit; on 3 ranks the order of gloo's sum of three is its own, so they agree within a few
ulps (``rtol=1e-6``). ``clip_grad_norm_`` sums the ranks' float64 norms where torch's takes the norm of
per-tensor norms in float32: the same clip within ``rtol=1e-6``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from flatten_parametrize import ShardedOptimizer, register_flat_storage
from flatten_parametrize._distributed import sharded_collectives
from flatten_parametrize._distributed.sharded_plan import Bucket, BucketTensor, plan_ownership

from _helpers import (
    assert_same_optim_state,
    launch_gloo,
    launch_results,
    one_buffer_collectives,
    save_result,
)

pytestmark = pytest.mark.slow

STEPS = 3
ROWS = 6  # per rank and micro-batch


class _Gpt(nn.Module):
    """An embedding in front (element-wise AdamW: may be cut), two blocks of matrices, a tied head."""

    def __init__(self, vocab: int = 64, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {"up": nn.Linear(dim, 3 * dim), "down": nn.Linear(3 * dim, dim), "norm": nn.LayerNorm(dim)}
            )
            for _ in range(2)
        )
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block["down"](torch.tanh(block["up"](block["norm"](h))))
        return self.head(self.frozen(h))


def _split(model: nn.Module, matrix_class: type = torch.optim.Muon) -> list[dict[str, Any]]:
    """torch's Muon docstring split: hidden matrices to Muon (or another class), the rest to AdamW."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for n, p in named if not (p.ndim == 2 and n.startswith("blocks."))]
    return [
        {"params": matrices, "optimizer_class": matrix_class, "lr": 0.02},
        {"params": rest, "lr": 1e-2},
    ]


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 64, (ROWS, 5), generator=gen)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).pow(2).mean()


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _sharded(rank: int, world: int, scenario: _Scenario) -> dict[str, Any]:
    with one_buffer_collectives() if scenario.units else contextlib.nullcontext():
        model, opt, schedule = _built(scenario.shard_gradients, scenario.matrix_class, scenario.bucket_bytes)
    if not scenario.units:
        opt._comm.by_owner = not scenario.one_buffer
    # which buckets NCCL would move by owner (more padding than sharded_collectives.MAX_PADDING allows);
    # then every bucket takes the padded path here, however uneven (this tiny model's are)
    padded = [not opt._comm.by_owner_for(s) for s in opt._ownership.shards]
    paddings = [(s.chunk * world - s.numel) / s.numel for s in opt._ownership.shards]
    if scenario.one_buffer:
        sharded_collectives.MAX_PADDING = float("inf")
    held, norms = [], []
    landed: list[int] = []  # leaves accumulated in this backward
    started: list[int] = []  # at each bucket's reduction start: how many had landed
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: landed.append(1))
    start = opt._reducer.start

    def counting_start(unit: Any, *staged: Any) -> Any:
        started.append(len(landed))
        return start(unit, *staged)

    opt._reducer.start = counting_start
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            landed.clear()
            with opt.no_sync() if micro == 0 else contextlib.nullcontext():
                _loss(model, _batch(step, micro, rank)).backward()
        held.append(
            {
                # ZeRO-2 shows placeholders of the sharded gradients, which hold no values
                "leaf_grads": sum(type(p.grad) is torch.Tensor for p in model.parameters()),
                "range_grads": sum(s.grad.numel() for s in opt._ownership.shards if s.grad is not None),
            }
        )
        if scenario.clip:
            norms.append(opt.clip_grad_norm_(0.05))
        opt.step()
        schedule.step()
    return {
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "classes": sorted(type(o).__name__ for o in opt.local_optimizer.optimizers),
        "held": held,
        "norms": norms,
        "ranges": [(s.ranges, s.owned) for s in opt._ownership.shards],
        "started": started,
        "leaves": sum(p.requires_grad for p in model.parameters()),
        "padded": padded,
        "paddings": paddings,
        "one_buffer": [not opt._comm.by_owner_for(s) for s in opt._ownership.shards],
        "units": [
            (len(unit), opt._comm.one_buffer_for(unit)) for unit in opt._ownership.units if len(unit) > 1
        ],
    }


def _reference(worlds: list[int], clip: bool, matrix_class: type = torch.optim.Muon) -> dict[str, Any]:
    """The plain model, the same optimizers, each step's gradient averaged as the collectives do it.

    Step ``i`` averages over ``worlds[i]`` ranks (a run resumed at another world size).
    """
    model = _Gpt()
    groups = _split(model, matrix_class)
    muon = matrix_class(groups[0]["params"], lr=groups[0]["lr"])
    adamw = torch.optim.AdamW(groups[1]["params"], lr=groups[1]["lr"])
    schedules = [_schedule(muon), _schedule(adamw)]
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for step, world in enumerate(worlds):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            for p in params:
                p.grad = None
            for micro in range(2):
                _loss(model, _batch(step, micro, rank)).backward()
            for t, p in zip(total, params):
                t.add_(p.grad)
        for t, p in zip(total, params):
            p.grad = t / world
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(params, 0.05))
        muon.step()
        adamw.step()
        for schedule in schedules:
            schedule.step()
    state = [muon.state[p] for p in groups[0]["params"]] + [adamw.state[p] for p in groups[1]["params"]]
    return {
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "norms": norms,
        "state": state,
    }


def _train(model: nn.Module, opt: Any, schedule: Any, rank: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        for micro in range(2):
            with opt.no_sync() if micro == 0 else contextlib.nullcontext():
                _loss(model, _batch(step, micro, rank)).backward()
        opt.step()
        schedule.step()


def _built(
    shard_gradients: bool = True, matrix_class: type = torch.optim.Muon, bucket_bytes: int | None = None
) -> tuple[nn.Module, Any, Any]:
    """The model in per-tensor mode, its whole-tensor optimizer (the matrices' class + AdamW), a schedule."""
    model = _Gpt()
    storage = register_flat_storage(model, bucket_cap_mb=bucket_bytes and bucket_bytes / 2**20)
    storage.unflatten()
    opt = ShardedOptimizer(
        storage,
        torch.optim.AdamW,
        _split(model, matrix_class),
        whole_tensors=True,
        shard_gradients=shard_gradients,
    )
    return model, opt, _schedule(opt)


def _save(rank: int, world: int, outdir: Any) -> None:
    """Train 2 steps, gather the state on every rank; rank 0 writes model, optimizer and schedule."""
    model, opt, schedule = _built()
    _train(model, opt, schedule, rank, range(2))
    _dcp_save(model, opt, schedule, outdir / "dcp2")
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = opt.state_dict()
    if rank == 0:
        torch.save(
            {"model": model.state_dict(), "opt": state, "schedule": schedule.state_dict()},
            outdir / "checkpoint.pt",
        )
    save_result(outdir, rank, "saved", {"state": state})
    save_result(outdir, rank, "broadcast", _broadcast_resume(rank, full, schedule.state_dict()))


def _broadcast_resume(
    rank: int, full: tuple[dict[str, Any], dict[str, Any]], schedule: Any
) -> dict[str, Any]:
    """A fresh setup loads rank 0's full state dicts (``broadcast_from_rank0``; the others pass ``{}``)."""
    model, opt, fresh = _built()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    msd, osd = full if rank == 0 else ({}, {})
    set_model_state_dict(model, msd, options=options)  # torch's rank-0-only recipe: model, then optimizer
    set_optimizer_state_dict(model, opt, osd, options=options)
    fresh.load_state_dict(schedule)
    _train(model, opt, fresh, rank, range(2, 3))
    return {
        "held": [bool(full[0]), bool(full[1])],
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _dcp_save(model: nn.Module, opt: Any, schedule: Any, path: Any) -> None:
    """``dcp.save`` of ``get_state_dict(model, opt)`` and the schedule (collective)."""
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "schedule": schedule.state_dict()}, checkpoint_id=str(path))


def _dcp_resume(path: Any, rank: int, step: int, save_to: Any = None) -> dict[str, Any]:
    """A fresh setup ``dcp.load``s ``path`` (``set_state_dict``) and trains ``step`` here (then saves)."""
    model, opt, schedule = _built()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "schedule": schedule.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    schedule.load_state_dict(state["schedule"])
    _train(model, opt, schedule, rank, range(step, step + 1))
    if save_to is not None:
        _dcp_save(model, opt, schedule, save_to)
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _resume(rank: int, world: int, path: Any) -> dict[str, Any]:
    """Load a checkpoint written at another world size and train step 2 here."""
    model, opt, schedule = _built()
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    schedule.load_state_dict(saved["schedule"])
    _train(model, opt, schedule, rank, range(2, 3))
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


class _Scenario(NamedTuple):
    shard_gradients: bool
    clip: bool = False
    matrix_class: type = torch.optim.Muon
    #: Bucket size in bytes (``None``: one bucket).
    bucket_bytes: int | None = None
    #: NCCL's path, run on gloo: one padded buffer per bucket (``reduce_scatter`` / ``all_gather``).
    one_buffer: bool = False
    #: NCCL's path from the start: the plan laid out for it, buckets moving in units of several.
    units: bool = False


SCENARIOS = {
    "zero2": _Scenario(True),
    "zero1": _Scenario(False),
    "zero2_clip": _Scenario(True, clip=True),
    "adafactor_zero2": _Scenario(True, matrix_class=torch.optim.Adafactor),
    "zero2_buckets": _Scenario(True, bucket_bytes=1200),
    "zero1_buckets": _Scenario(False, bucket_bytes=1200),
    "zero2_one_buffer": _Scenario(True, bucket_bytes=1200, one_buffer=True),
    "zero1_one_buffer": _Scenario(False, bucket_bytes=1200, one_buffer=True),
    "zero2_units": _Scenario(True, clip=True, bucket_bytes=800, units=True),
    "zero1_units": _Scenario(False, bucket_bytes=800, units=True),
}


def _worker(rank: int, world: int, outdir: Any, saved_by: Any = None, dcp_from: Any = None) -> None:
    torch.set_num_threads(1)
    for name, scenario in SCENARIOS.items():
        limit = sharded_collectives.MAX_PADDING
        try:
            save_result(outdir, rank, name, _sharded(rank, world, scenario))
        finally:
            sharded_collectives.MAX_PADDING = limit
        reference = _reference([world] * STEPS, scenario.clip, scenario.matrix_class)
        save_result(outdir, rank, f"{name}.reference", reference)
    if saved_by is None:
        _save(rank, world, outdir)
    else:
        save_result(outdir, rank, "resumed", _resume(rank, world, saved_by / "checkpoint.pt"))
    if dcp_from is not None:
        save_result(outdir, rank, "dcp_resumed", _dcp_resume(dcp_from, rank, step=3))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch_gloo(_worker, tmp_path_factory.mktemp("whole2"), world=2)


@pytest.fixture(scope="module")
def one_rank(two_ranks: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """In this process, one gloo rank: the 2-rank DCP checkpoint resumed, step 2 trained, saved again."""
    outdir = tmp_path_factory.mktemp("whole1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = _dcp_resume(two_ranks["outdir"] / "dcp2", 0, step=2, save_to=outdir / "dcp1")
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    return {"outdir": outdir, **result}


@pytest.fixture(scope="module")
def three_ranks(
    two_ranks: dict[str, Any], one_rank: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    worker = functools.partial(_worker, saved_by=two_ranks["outdir"], dcp_from=one_rank["outdir"] / "dcp1")
    return launch_gloo(worker, tmp_path_factory.mktemp("whole3"), world=3)


@pytest.fixture(params=[2, 3], ids=["2 ranks", "3 ranks"])
def launch(request: pytest.FixtureRequest) -> dict[str, Any]:
    return request.getfixturevalue("two_ranks" if request.param == 2 else "three_ranks")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_muon_and_adamw_by_group_train_as_one_process_on_every_rank(launch, scenario):
    """Muon (or Adafactor) on the blocks' matrices, AdamW on the rest: each rank ends as one process."""
    exact = launch["world"] == 2 and not SCENARIOS[scenario].clip
    for result, reference in zip(
        launch_results(launch, scenario), launch_results(launch, f"{scenario}.reference")
    ):
        assert set(result["weights"]) == set(reference["weights"])
        for name, value in reference["weights"].items():
            if exact:
                assert torch.equal(result["weights"][name], value), name
            else:
                torch.testing.assert_close(result["weights"][name], value, rtol=1e-6, atol=1e-7)
        for norm, expected in zip(result["norms"], reference["norms"]):
            torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)


def test_the_ranges_tile_the_bucket_no_matrix_crosses_a_cut_and_zero2_keeps_only_those(launch):
    """Every element has one owner; no matrix is cut; after backward ZeRO-2 holds this rank's ranges only."""
    results = launch_results(launch, "zero2")
    every, _ = results[0]["ranges"][0]  # every rank's ranges of the trainable bucket (the frozen has none)
    tiles = sorted(r for owner in every for r in owner)
    assert tiles[0][0] == 0 and all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
    model = _Gpt()
    offsets = 0
    for name, p in model.named_parameters():  # the layout's order: the module's (one bucket)
        if p.requires_grad and name.startswith("blocks.") and p.ndim == 2:
            assert not any(offsets < lo < offsets + p.numel() for lo, _ in tiles), name
        offsets += p.numel() if p.requires_grad and name != "head.weight" else 0
    for result in results:
        _, owned = result["ranges"][0]
        for held in result["held"]:
            assert held["leaf_grads"] == 0  # the model's full gradients were freed
            assert held["range_grads"] == owned
    if launch["world"] == 3:
        assert sum(bool(owner) for owner in every) == 3  # every rank owns a part


def test_nccls_one_buffer_path_takes_the_buckets_padded_by_at_most_the_limit(launch):
    """Forced on gloo: every bucket through one padded buffer (trained alike above); by default only those
    whose padding is within MAX_PADDING, the others by owner."""
    for result in launch_results(launch, "zero2_one_buffer"):
        assert all(result["one_buffer"])
        assert result["padded"] == [p <= sharded_collectives.MAX_PADDING for p in result["paddings"]]
        assert any(p > 0 for p in result["paddings"])  # uneven: the padded copies were exercised


@pytest.mark.parametrize("scenario", ["zero2_units", "zero1_units"])
def test_laid_out_for_nccl_buckets_move_in_units_of_several_in_one_buffer(launch, scenario):
    """Built for one-buffer collectives: runs of buckets move as one, each padding at most the limit.

    On 2 ranks the four matrices even out in pairs of buckets; on 3 they cannot (the layout by owner is
    kept, and the scenario still trains as one process above).
    """
    for result in launch_results(launch, scenario):
        if launch["world"] == 2:
            assert result["units"], "no unit of several buckets"
        assert all(one for _, one in result["units"])


@pytest.mark.parametrize("scenario", ["zero2_buckets", "zero1_buckets"])
def test_a_buckets_reduction_starts_during_backward_once_its_last_leaf_landed(launch, scenario):
    """Several buckets: the first reductions start while later leaves still wait for their gradients."""
    for result in launch_results(launch, scenario):
        synced = result["started"][-len(result["ranges"]) :]  # the last backward's (the others: no_sync)
        assert len(synced) >= 3
        assert synced == sorted(synced)
        assert synced[0] < result["leaves"] // 2, synced  # the first bucket goes out early in backward


def test_the_plan_never_cuts_a_whole_tensor_and_tiles_every_bucket():
    """Over buckets of one matrix, of mixed matrices and of element-wise tensors, for 1 to 7 ranks."""
    muon, adamw = torch.optim.Muon, torch.optim.AdamW
    buckets = [
        Bucket(64, 4, [BucketTensor(0, 64, (8, 8), muon)]),
        Bucket(
            200,
            4,
            [
                BucketTensor(0, 100, (100,), adamw),
                BucketTensor(100, 24, (4, 6), muon),
                BucketTensor(128, 40, (5, 8), muon),
            ],
        ),
        Bucket(96, 4, [BucketTensor(0, 96, (96,), adamw)]),
    ]
    for world in (1, 2, 3, 4, 7):
        plan = plan_ownership(buckets, world)
        for bucket, ranges in zip(buckets, plan.ranges):
            tiles = sorted(r for owner in ranges for r in owner)
            assert tiles[0][0] == 0 and tiles[-1][1] == bucket.numel
            assert all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
            cuts = {lo for lo, _ in tiles}
            for m in bucket.members:
                if m.optimizer_class is muon:
                    assert not any(m.offset < c < m.offset + m.numel for c in cuts)
        assert sum(plan.grads) == 4 * sum(m.numel for b in buckets for m in b.members)


def test_buckets_of_one_matrix_each_spread_over_the_ranks_by_cost():
    """One matrix per bucket: each goes to the least loaded rank (not all to rank 0), largest cost first."""
    shapes = [(16, 16), (16, 16), (16, 4), (16, 4), (16, 16), (16, 4)]
    buckets = [Bucket(m * n, 4, [BucketTensor(0, m * n, (m, n), torch.optim.Muon)]) for m, n in shapes]
    for world in (2, 3, 4):
        plan = plan_ownership(buckets, world)
        owners = [next(r for r, owner in enumerate(ranges) if owner) for ranges in plan.ranges]
        assert len(set(owners)) == world
        biggest = max(plan.cost)
        assert biggest <= plan.bound[0] * 1.5


# ----------------------------------------------------------------------------- in this process (1 rank)


def _per_tensor_gpt() -> tuple[nn.Module, Any]:
    model = _Gpt()
    storage = register_flat_storage(model)
    storage.unflatten()
    return model, storage


def test_a_per_tensor_optimizer_without_whole_tensors_is_refused_with_the_way_out(world1):
    """Muon over slices cut through matrices would compute something else: refused, naming whole_tensors."""
    _, storage = _per_tensor_gpt()
    with pytest.raises(ValueError, match=r"element-wise optimizers only.*got Muon; pass whole_tensors=True"):
        ShardedOptimizer(storage, torch.optim.Muon)


def test_whole_tensor_groups_take_the_model_parameters_once_each(world1):
    """A tensor of another model, or one listed in two groups, is refused before anything changes."""
    model, storage = _per_tensor_gpt()
    other = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"must be a flat parameter of the storage or, in per-tensor mode.*"):
        ShardedOptimizer(storage, torch.optim.AdamW, [other], whole_tensors=True)
    with pytest.raises(ValueError, match=r"blocks\.0\.up\.weight appears in param groups 0 and 1; list each"):
        ShardedOptimizer(
            storage,
            torch.optim.AdamW,
            [{"params": [model.blocks[0].up.weight]}, {"params": [model.blocks[0].up.weight]}],
            whole_tensors=True,
        )
    with pytest.raises(TypeError, match=r"param group 0 must be a dict with a 'params' list"):
        ShardedOptimizer(storage, torch.optim.AdamW, [{"lr": 0.1}, {"params": []}], whole_tensors=True)


def test_on_one_rank_whole_tensors_step_as_the_plain_optimizers(world1):
    """World size 1: Muon and AdamW by group over one rank's whole model give the plain model's weights."""
    model, storage = _per_tensor_gpt()
    opt = ShardedOptimizer(storage, torch.optim.AdamW, _split(model), whole_tensors=True)
    reference = _reference([1] * STEPS, clip=False)
    schedule = _schedule(opt)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            _loss(model, _batch(step, micro, 0)).backward()
        opt.step()
        schedule.step()
    for name, value in reference["weights"].items():
        assert torch.equal(model.get_parameter(name), value), name


def test_a_param_group_added_later_is_refused_with_the_way_out(world1):
    """The flat parameters were cut for the groups given at construction."""
    model, storage = _per_tensor_gpt()
    opt = ShardedOptimizer(storage, torch.optim.AdamW, _split(model), whole_tensors=True)
    with pytest.raises(RuntimeError, match=r"whole_tensors=True\) cuts every flat parameter at construction"):
        opt.add_param_group({"params": []})


def test_the_per_rank_state_dict_of_whole_tensors_round_trips(world1):
    """sharded_state_dict() and load_sharded_state_dict() work for whole tensors too (one conversion)."""
    model, storage = _per_tensor_gpt()
    opt = ShardedOptimizer(storage, torch.optim.AdamW, _split(model), whole_tensors=True)
    for step in range(2):
        _loss(model, _batch(step, 0, 0)).backward()
        opt.step()
        opt.zero_grad()
    saved, gathered = opt.sharded_state_dict(), opt.state_dict()
    fresh_model, fresh_storage = _per_tensor_gpt()
    fresh = ShardedOptimizer(fresh_storage, torch.optim.AdamW, _split(fresh_model), whole_tensors=True)
    fresh.load_sharded_state_dict(saved)
    assert_same_optim_state(fresh.state_dict(), gathered)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_an_optimizer_that_outlives_its_per_tensor_model_leaves_quietly(world1):
    """The model goes first, then the optimizer: its finalizer finds no module to unhook and says nothing."""
    model, storage = _per_tensor_gpt()
    opt = ShardedOptimizer(storage, torch.optim.AdamW, _split(model), whole_tensors=True)
    del model, storage
    gc.collect()
    del opt
    gc.collect()


def test_the_gathered_state_is_the_one_process_optimizers_state_on_every_rank(two_ranks, one_intra_op_thread):
    """After 2 steps on 2 ranks: each tensor's state, by position, is Muon's and AdamW's in one process.

    The reference is computed with one thread, as the ranks compute.
    """
    reference = _reference([2, 2], clip=False)["state"]
    for result in launch_results(two_ranks, "saved"):
        state = result["state"]["state"]
        assert sorted(state) == list(range(len(reference)))
        for position, expected in enumerate(reference):
            assert state[position].keys() == expected.keys(), position
            for key, value in expected.items():
                assert torch.equal(state[position][key], value), (position, key)


def test_a_checkpoint_of_two_ranks_resumes_on_three_and_on_one_as_an_uninterrupted_run(
    two_ranks, three_ranks, world1, one_intra_op_thread
):
    """Saved on 2 ranks after 2 steps; step 3 on 3 ranks, and on 1 rank here: the reference's weights."""
    on_three = _reference([2, 2, 3], clip=False)["weights"]
    for result in launch_results(three_ranks, "resumed"):
        for name, value in on_three.items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-6, atol=1e-7)
    on_one = _reference([2, 2, 1], clip=False)["weights"]
    resumed = _resume(0, 1, two_ranks["outdir"] / "checkpoint.pt")
    for name, value in on_one.items():
        assert torch.equal(resumed["weights"][name], value), name


def test_full_state_dicts_of_rank_0_load_on_every_rank_with_broadcast_from_rank0(
    two_ranks, one_intra_op_thread
):
    """get_state_dict(full_state_dict, cpu_offload): rank 0 holds all; set_state_dict broadcasts it."""
    expected = _reference([2, 2, 2], clip=False)["weights"]
    for rank, result in enumerate(launch_results(two_ranks, "broadcast")):
        assert result["held"] == [rank == 0, rank == 0]
        for name, value in expected.items():
            assert torch.equal(result["weights"][name], value), (rank, name)


def test_dcp_checkpoints_resume_from_two_ranks_on_one_then_on_three_as_an_uninterrupted_run(
    one_rank, three_ranks, one_intra_op_thread
):
    """dcp.save on 2 ranks after 2 steps, dcp.load on 1 for step 3, saved, dcp.load on 3 for step 4."""
    for name, value in _reference([2, 2, 1], clip=False)["weights"].items():
        assert torch.equal(one_rank["weights"][name], value), name
    on_three = _reference([2, 2, 1, 3], clip=False)["weights"]
    for result in launch_results(three_ranks, "dcp_resumed"):
        for name, value in on_three.items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-6, atol=1e-7)


def _plain_twin_steps(flat_mode: bool) -> tuple[nn.Module, list[Any], nn.Module, Any]:
    """The plain model with torch's Muon + AdamW, and its flattened twin with the whole-tensor optimizer."""
    plain, twin = _Gpt(), _Gpt()
    groups = _split(plain)
    plain_opts = [
        torch.optim.Muon(groups[0]["params"], lr=groups[0]["lr"]),
        torch.optim.AdamW(groups[1]["params"], lr=groups[1]["lr"]),
    ]
    storage = register_flat_storage(twin)
    if not flat_mode:
        storage.unflatten()
        sharded = ShardedOptimizer(storage, torch.optim.AdamW, _split(twin), whole_tensors=True)
    else:  # groups over the flat parameters: AdamW on every tensor, in both models
        plain_opts = [torch.optim.AdamW(plain.parameters(), lr=1e-2)]
        sharded = ShardedOptimizer(storage, torch.optim.AdamW, whole_tensors=True, lr=1e-2)
    for model, opts in ((plain, plain_opts), (twin, [sharded])):
        _loss(model, _batch(0, 0, 0)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return plain, plain_opts, twin, sharded


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flatten_optimizer_state_dict"])
@pytest.mark.parametrize("flat_mode", [False, True], ids=["per-tensor mode", "flat mode"])
def test_get_state_dict_of_whole_tensors_is_the_plain_optimizers_and_loads_both_ways(
    world1, flat_mode, flatten
):
    """Key for key the plain model's DCP optimizer state; each loads into the other; both go on alike.

    The states are taken after step 1 and loaded after step 2 (so a load that did nothing would leave
    step 2's state on its side); step 3 then gives both sides the same weights.
    """
    plain, plain_opts, twin, sharded = _plain_twin_steps(flat_mode)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    _, plain_osd = get_state_dict(plain, plain_opts, options=options)
    _, sharded_osd = get_state_dict(twin, sharded, options=options)
    if flatten:
        assert sharded_osd.keys() == plain_osd.keys()
        for key, value in plain_osd.items():
            assert (
                torch.equal(sharded_osd[key], value)
                if isinstance(value, torch.Tensor)
                else (sharded_osd[key] == value)
            ), key
    else:
        assert sharded_osd["state"].keys() == plain_osd["state"].keys()
        for name, entry in plain_osd["state"].items():
            for key, value in entry.items():
                assert torch.equal(sharded_osd["state"][name][key], value), (name, key)
        assert [g["params"] for g in sharded_osd["param_groups"]] == [
            g["params"] for g in plain_osd["param_groups"]
        ]
    plain_osd, sharded_osd = copy.deepcopy(plain_osd), copy.deepcopy(sharded_osd)  # not views of live state
    for model, opts in ((plain, plain_opts), (twin, [sharded])):
        _loss(model, _batch(1, 0, 0)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    load = StateDictOptions(flatten_optimizer_state_dict=flatten, strict=False)
    for model, opts, osd in ((twin, sharded, plain_osd), (plain, plain_opts, sharded_osd)):
        set_state_dict(model, opts, model_state_dict={}, optim_state_dict=osd, options=load)
    for model, opts in ((plain, plain_opts), (twin, [sharded])):
        _loss(model, _batch(2, 0, 0)).backward()
        for opt in opts:
            opt.step()
    for name, value in plain.named_parameters():
        assert torch.equal(twin.get_parameter(name), value), name


def test_set_state_dict_of_a_checkpoint_without_a_tensor_of_whole_tensors_is_refused(world1):
    """A checkpoint lacking a tensor's group (or its state, with strict) loads nothing into the optimizer."""
    _, _, twin, sharded = _plain_twin_steps(flat_mode=False)
    _, osd = get_state_dict(twin, sharded)
    before = sharded.state_dict()["state"]
    no_group = {
        "state": osd["state"],
        "param_groups": [g for g in osd["param_groups"] if "blocks.0.up.weight" not in g["params"]],
    }
    with pytest.raises(ValueError, match=r"no param group of the checkpoint holds blocks\.0\.up\.weight"):
        set_state_dict(
            twin,
            sharded,
            model_state_dict={},
            optim_state_dict=no_group,
            options=StateDictOptions(strict=False),
        )
    no_state = {
        "state": {k: v for k, v in osd["state"].items() if k != "embed.weight"},
        "param_groups": osd["param_groups"],
    }
    with pytest.raises(RuntimeError, match=r"Missing optimizer state for parameter 'embed\.weight'"):
        set_state_dict(twin, sharded, model_state_dict={}, optim_state_dict=no_state)
    after = sharded.state_dict()["state"]
    assert all(torch.equal(after[i][k], v) for i, entry in before.items() for k, v in entry.items())


def test_a_one_process_optimizers_state_loads_into_the_sharded_one_and_back(world1):
    """One AdamW over the plain model and the sharded one over its twin swap states: both go on alike."""
    plain, twin = _Gpt(), _Gpt()
    storage = register_flat_storage(twin)
    storage.unflatten()
    single = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    sharded = ShardedOptimizer(
        storage, torch.optim.AdamW, list(twin.parameters()), whole_tensors=True, lr=1e-2
    )
    for model, opt in ((plain, single), (twin, sharded)):
        _loss(model, _batch(0, 0, 0)).backward()
        opt.step()
        opt.zero_grad()
    sharded.load_state_dict(single.state_dict())
    single.load_state_dict(sharded.state_dict())
    for model, opt in ((plain, single), (twin, sharded)):
        _loss(model, _batch(1, 0, 0)).backward()
        opt.step()
    for name, value in plain.named_parameters():
        assert torch.equal(twin.get_parameter(name), value), name


def test_a_state_dict_of_other_param_groups_is_refused_before_anything_changes(world1):
    """A state saved for one group of all tensors does not fit Muon's and AdamW's groups: nothing loads."""
    model, opt, schedule = _built()
    _train(model, opt, schedule, 0, range(1))
    before = opt.state_dict()["state"]
    single = torch.optim.AdamW(_Gpt().parameters(), lr=1e-2)
    with pytest.raises(
        ValueError, match=r"param groups hold \[\d+\] tensors, this optimizer's hold \[4, \d+\]"
    ):
        single.zero_grad()
        opt.load_state_dict(single.state_dict())
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], v) for i, entry in before.items() for k, v in entry.items())


def test_params_that_are_not_tensors_or_groups_are_a_type_error(world1):
    """A bare tensor (not a list of them) or a string is refused with what to pass."""
    model, storage = _per_tensor_gpt()
    with pytest.raises(TypeError, match=r"params must be None or an iterable of tensors.*got Parameter"):
        ShardedOptimizer(storage, torch.optim.AdamW, model.embed.weight, whole_tensors=True)


def test_a_cut_tensors_state_of_another_size_is_refused():
    """Loading the part of a tensor cut between ranks needs element-wise state of the tensor's size."""
    from flatten_parametrize._distributed.shard import Piece
    from flatten_parametrize._distributed.sharded_state import _cut, _Mine
    from flatten_parametrize._distributed.sharded_strategies import Entry

    saved = {"step": torch.tensor(3.0), "exp_avg": torch.ones(10)}
    piece = _Mine(2, 4, Piece(3, 104, 4, (4,)), torch.zeros(4), True)
    part = _cut(saved, piece, Entry(0, 100, 10, (2, 5)), "load")
    assert torch.equal(part["exp_avg"], torch.ones(4)) and part["step"] == 3
    with pytest.raises(
        ValueError, match=r"state 'exp_avg' of parameter 2 has 10 elements, but the tensor has 12"
    ):
        _cut(saved, piece, Entry(0, 100, 12, (3, 4)), "load")
