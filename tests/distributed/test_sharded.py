"""ZeRO-1/2 over the flat buffers (``_distributed/sharded.py``): ``ShardedOptimizer``.

Argument checks, state dicts and the world-size-1 behaviour run in this
process with a gloo world of size 1. Training runs in spawned gloo processes
on 127.0.0.1: one launch of 2 ranks and one of 3 ranks each run every
scenario (the tests then read their results); the 3-rank launch resumes the
checkpoints of the 2-rank one, and a test in this process resumes the 3-rank
checkpoints on 1 rank.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatten_parametrize import (
    ShardedOptimizer,
    plain_optim_state_dict,
    register_flat_storage,
    remove_flat_storage,
)
from flatten_parametrize._distributed import sharded as _sharded
from flatten_parametrize._distributed.sharded_grads import ShardedGrad

from _helpers import (
    assert_same_optim_state,
    assert_same_values,
    core_of,
    launch_gloo,
    launch_results,
    mlp,
    save_result,
    train_steps,
    values,
)

BATCH = 12  # divisible by 2 and 3 ranks


STEPS = 5


class _Net(nn.Module):
    """Tied embedding and head, a frozen layer, and a 2-element parameter (fewer elements than ranks)."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.body = nn.Linear(dim, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.tensor([1.0, 0.5]))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(tokens))
        h = torch.tanh(self.body(h)) * self.scale[0] + self.frozen(h) * self.scale[1]
        return self.head(h)


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _register(model: _Net):
    return register_flat_storage(
        model,
        {
            "decay": [model.embed.weight, model.body.weight],
            "no_decay": [model.norm, model.body.bias],
            "tiny": [model.scale],
            "frozen": [model.frozen],
        },
    )


def _tokens(step: int, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(vocab, (BATCH, 5), generator=gen), torch.randint(vocab, (BATCH, 5), generator=gen)


def _lm_loss(model: nn.Module, step: int, part: slice = slice(None)) -> torch.Tensor:
    x, y = _tokens(step)
    return nn.functional.cross_entropy(model(x[part]).flatten(0, 1), y[part].flatten())


def _mine(rank: int, world: int) -> slice:
    per = BATCH // world
    return slice(rank * per, (rank + 1) * per)


#: name -> (optimizer class, kwargs, norm_type of the clipping)
CONFIGS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], float]] = {
    "adamw": (torch.optim.AdamW, {"lr": 0.05}, 2.0),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 0.05, "foreach": True}, 2.0),
    "adamw_fused": (torch.optim.AdamW, {"lr": 0.05, "fused": True}, 2.0),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.2, "momentum": 0.9, "nesterov": True}, math.inf),
}


def _train(
    rank: int,
    world: int,
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    norm_type: float,
    shard: bool,
    per_tensor: bool = False,
) -> dict[str, Any]:
    """Train the sharded model and a plain twin on the combined batch (groups, clipping, a schedule).

    With ``per_tensor`` the flattened model trains in per-tensor mode (``storage.unflatten()`` first):
    the optimizer slices the same flat gradients, which the leaves' gradients are views of.
    """
    plain = _net()
    model = copy.deepcopy(plain)
    storage = _register(model)
    if per_tensor:
        storage.unflatten()
    groups = [
        {"params": [storage["decay"]], "weight_decay": 0.1},
        {"params": [storage["no_decay"], storage["tiny"], storage["frozen"]], "weight_decay": 0.0},
    ]
    opt = ShardedOptimizer(storage, cls, groups, shard_gradients=shard, **kwargs)
    plain_groups = [
        {"params": [plain.embed.weight, plain.body.weight], "weight_decay": 0.1},
        {"params": [*plain.norm.parameters(), plain.body.bias, plain.scale, *plain.frozen.parameters()]},
    ]
    plain_groups[1]["weight_decay"] = 0.0
    ref = cls(plain_groups, **kwargs)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in (opt, ref)]
    norms = []
    first_lr = opt.param_groups[0]["lr"]
    for step in range(STEPS):
        _lm_loss(model, step, _mine(rank, world)).backward()
        norm = opt.clip_grad_norm_(0.5, norm_type=norm_type)
        opt.step()
        opt.zero_grad()
        _lm_loss(plain, step, slice(None)).backward()
        plain_norm = torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 0.5, norm_type=norm_type)
        ref.step()
        ref.zero_grad()
        lrs = (
            opt.param_groups[0]["lr"],
            opt.local_optimizer.param_groups[0]["lr"],
            ref.param_groups[0]["lr"],
        )
        for schedule in schedules:
            schedule.step()
        norms.append((float(norm), float(plain_norm)))
    if per_tensor:
        assert not storage.is_flattened
        storage.flatten()
    return {
        "sharded": values(model),
        "plain": values(plain),
        "norms": norms,
        "lr": lrs,
        "first_lr": first_lr,
        "frozen_state": len(opt.state.get(storage["frozen"], {})),
    }


def _scenario_training(rank: int, world: int) -> dict[str, Any]:
    results = {}
    for name, (cls, kwargs, norm_type) in CONFIGS.items():
        for shard in (True, False):
            results[f"{name}, shard_gradients={shard}"] = _train(rank, world, cls, kwargs, norm_type, shard)
    return results


def _scenario_per_tensor(rank: int, world: int) -> dict[str, Any]:
    """ShardedOptimizer over a flattened model trained in per-tensor mode (ZeRO-1 and ZeRO-2)."""
    cls, kwargs, norm_type = CONFIGS["adamw_foreach"]
    return {
        f"shard_gradients={shard}": _train(rank, world, cls, kwargs, norm_type, shard, per_tensor=True)
        for shard in (True, False)
    }


def _scenario_one_buffer_collectives(rank: int, world: int) -> dict[str, Any]:
    """The NCCL path (one padded buffer: reduce_scatter / all_gather, all_reduce for ZeRO-1) on gloo."""
    real = _sharded.ShardedOptimizer.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self._comm.by_owner = False

    _sharded.ShardedOptimizer.__init__ = init
    try:
        cls, kwargs, norm_type = CONFIGS["adamw"]
        return {shard: _train(rank, world, cls, kwargs, norm_type, shard) for shard in (True, False)}
    finally:
        _sharded.ShardedOptimizer.__init__ = real


def _grad_bytes(storage, opt) -> int:
    """Bytes of gradient memory held: flat gradients, slice gradients, the storage's kept gradient memory."""
    held = sum(f.grad.nbytes for f in storage.flat_params if type(f.grad) is torch.Tensor)  # not placeholders
    held += sum(s.grad.nbytes for s in opt._ownership.shards if s.grad is not None)
    held += sum(k.nbytes() for g in core_of(storage).groups() for k in g.views.grads._kept)
    return held


def _scenario_buckets_and_memory(rank: int, world: int) -> dict[str, Any]:
    """Several bucket_cap_mb buckets; state and gradient bytes per rank after backward, both modes."""
    out: dict[str, Any] = {}
    for shard in (True, False):
        plain = mlp(depth=3, width=16)
        model = copy.deepcopy(plain)
        storage = register_flat_storage(model, bucket_cap_mb=1200 / 2**20)
        opt = ShardedOptimizer(storage, torch.optim.Adam, lr=0.01, shard_gradients=shard)
        ref = torch.optim.Adam(plain.parameters(), lr=0.01)
        in_flight: list[int] = []
        start = opt._reducer.start

        def counting_start(unit, *staged, start=start, storage=storage, opt=opt, in_flight=in_flight):
            started = start(unit, *staged)
            # full flat gradients alive once this bucket's reduction started
            alive = {id(f.grad) for f in storage.flat_params if type(f.grad) is torch.Tensor}
            pending = (*opt._reducer.pending, started)
            chunk = max(shard.chunk for shard in unit)
            alive |= {id(t) for p in pending for t in p.sent if t.numel() > chunk}
            in_flight.append(len(alive))
            return started

        opt._reducer.start = counting_start
        for step in range(3):
            x, y = torch.randn(2, BATCH, 16, generator=torch.Generator().manual_seed(step))
            (model(x[_mine(rank, world)]) - y[_mine(rank, world)]).pow(2).mean().backward()
            held = _grad_bytes(storage, opt)
            # ZeRO-2 shows a placeholder of the sharded gradient, which holds no values
            flat_grad_none = [isinstance(f.grad, ShardedGrad) for f in storage.flat_params]
            opt.step()
            opt.zero_grad()
            (plain(x) - y).pow(2).mean().backward()
            ref.step()
            ref.zero_grad()
        state_bytes = sum(v.nbytes for s in opt.state.values() for v in s.values() if v.dim() == 1)
        out[shard] = {
            "sharded": values(model),
            "plain": values(plain),
            "grad_bytes": held,
            "state_bytes": state_bytes,
            "full_bytes": sum(f.nbytes for f in storage.flat_params),
            "bucket_bytes": max(f.nbytes for f in storage.flat_params),
            "groups": len(storage.flat_params),
            "flat_grad_after": flat_grad_none,
            "in_flight": max(in_flight),
        }
    return out


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).double()).float()


def _scenario_mixed_dtypes(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    plain = _Mixed()
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)  # one group per dtype
    opt = ShardedOptimizer(storage, torch.optim.AdamW, lr=0.05)
    ref = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for step in range(STEPS):
        x = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(step))
        model(x[_mine(rank, world)]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        plain(x).pow(2).mean().backward()
        ref.step()
        ref.zero_grad()
    dtypes = [s.dtype for s in opt._ownership.shards]
    return {"sharded": values(model), "plain": values(plain), "dtypes": dtypes}


def _scenario_no_sync(rank: int, world: int) -> dict[str, Any]:
    """Two micro-batches, the first under no_sync; SGD(lr=1) makes the step the gradient itself."""
    out = {}
    for shard in (True, False):
        plain = mlp(depth=2, width=6)
        model = copy.deepcopy(plain)
        storage = register_flat_storage(model)
        opt = ShardedOptimizer(storage, torch.optim.SGD, lr=1.0, shard_gradients=shard)
        x, y = torch.randn(2, BATCH, 6, generator=torch.Generator().manual_seed(3))
        half = BATCH // world // 2
        first = slice(rank * 2 * half, rank * 2 * half + half)
        second = slice(rank * 2 * half + half, (rank + 1) * 2 * half)
        with opt.no_sync():
            ((model(x[first]) - y[first]).pow(2).mean() / 2).backward()
        local = storage["0"].grad.clone()
        ((model(x[second]) - y[second]).pow(2).mean() / 2).backward()
        opt.step()
        (plain(x) - y).pow(2).mean().backward()
        torch.optim.SGD(plain.parameters(), lr=1.0).step()
        out[shard] = {"sharded": values(model), "plain": values(plain), "local": local}
    return out


def _checkpoint_model() -> tuple[_Net, Any, ShardedOptimizer]:
    model = _net()
    storage = _register(model)
    opt = ShardedOptimizer(storage, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    return model, storage, opt


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> None:
    """Train on this rank's part of the batches of ``steps`` (backward, step, zero_grad)."""
    train_steps(model, opt, steps, lambda m, step: _lm_loss(m, step, _mine(rank, world)), zero_grad_last=True)


def _scenario_checkpoint_save(rank: int, world: int, outdir: Path) -> dict[str, Any]:
    """Save after 3 steps (gathered and sharded), then go on uninterrupted; compare with one process."""
    model, storage, opt = _checkpoint_model()
    _train_steps(model, opt, range(3), rank, world)
    gathered = opt.state_dict()
    torch.save(opt.sharded_state_dict(), outdir / f"sharded{world}.{rank}.pt")
    if rank == 0:
        torch.save({"optim": gathered, "model": storage.flat_state_dict()}, outdir / f"gathered{world}.pt")
    # one process over the same flat model, on the combined batch
    single = _net()
    single_storage = _register(single)
    single_opt = torch.optim.AdamW(single_storage.flat_params, lr=0.05, weight_decay=0.1)
    _train_steps(single, single_opt, range(3), 0, 1)
    plain = _net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.1)
    _train_steps(plain, plain_opt, range(3), 0, 1)
    uninterrupted = []
    for step in range(3, STEPS):
        _train_steps(model, opt, range(step, step + 1), rank, world)
        uninterrupted.append(values(model))
    return {
        "gathered": gathered,
        "single": single_opt.state_dict(),
        "as_plain": plain_optim_state_dict(storage, gathered),
        "plain": plain_opt.state_dict(),
        "uninterrupted": uninterrupted,
    }


def _scenario_checkpoint_resume(rank: int, world: int, outdir: Path, saved_dir: Path) -> dict[str, Any]:
    """Resume the 2-rank step-3 checkpoint, gathered and sharded; step 4 here, save again."""
    saved_world = 2
    saved = torch.load(saved_dir / f"gathered{saved_world}.pt", weights_only=False)
    out: dict[str, Any] = {}
    for how in ("gathered", "sharded"):
        model, storage, opt = _checkpoint_model()
        model.load_state_dict(saved["model"])
        if how == "gathered":
            opt.load_state_dict(saved["optim"])
        else:
            parts = [
                torch.load(saved_dir / f"sharded{saved_world}.{r}.pt", mmap=True) for r in range(saved_world)
            ]
            opt.load_sharded_state_dict(parts)
        _train_steps(model, opt, range(3, 4), rank, world)
        out[how] = values(model)
        if how == "sharded":
            torch.save(opt.sharded_state_dict(), outdir / f"sharded{world}.{rank}.pt")
            gathered = opt.state_dict()
            if rank == 0:
                torch.save(
                    {"optim": gathered, "model": storage.flat_state_dict()}, outdir / f"gathered{world}.pt"
                )
    return out


def _scenario_layout_mismatch(rank: int, world: int) -> dict[str, Any]:
    model = mlp(depth=2, width=4 + (rank == world - 1))
    storage = register_flat_storage(model)
    try:
        ShardedOptimizer(storage, torch.optim.SGD, lr=0.1)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def _scenario_engines(rank: int, world: int) -> dict[str, Any]:
    """A flattened and a plain model under FSDP2, and under ZeroRedundancyOptimizer + DDP."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    for engine in ("fully_shard", "ZeroRedundancyOptimizer"):
        for flat in (False, True):
            model = mlp(depth=3, width=6)
            initial = values(model)
            if flat:
                register_flat_storage(model)
            wrapped: nn.Module = model
            opt: torch.optim.Optimizer
            if engine == "fully_shard":
                fully_shard(model)
                opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            else:
                wrapped = DistributedDataParallel(model)
                opt = ZeroRedundancyOptimizer(
                    wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05
                )
            for step in range(3):
                x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(step))
                wrapped(x[_mine(rank, world)]).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            full = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in model.state_dict().items()}
            out[f"{engine}, flat={flat}"] = {k: v.detach().clone() for k, v in full.items()}
            out[f"{engine}, initial"] = initial
    return out


def _failing_rank(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=2))
    storage = register_flat_storage(nn.Linear(3, 2))
    if rank == 1:
        try:
            raise ValueError("rank 1 fails on purpose")
        finally:
            time.sleep(6)  # alive but gone from the collectives: only a timeout frees the others
    start = time.monotonic()
    try:
        ShardedOptimizer(storage, torch.optim.SGD, lr=0.1, process_group=group)
    except RuntimeError as error:
        return {"error": str(error)[:500], "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _scenario_outside_params(rank: int, world: int) -> dict[str, Any]:
    """The head left out of the groups, stepped by an optimizer of its own, in both modes, ZeRO-1 and 2:
    copied from rank 0 at construction, its gradients averaged when backward ends (as under DDP)."""
    results = {}
    for per_tensor in (False, True):
        for shard in (True, False):
            plain = _net()
            plain.head.weight = nn.Parameter(plain.head.weight.detach().clone())  # untied: the head apart
            model = copy.deepcopy(plain)
            if rank:
                with torch.no_grad():
                    model.head.weight.add_(1.0)  # every rank but 0 starts elsewhere
            storage = register_flat_storage(model, [["embed.*", "norm.*", "body.*", "scale"], ["frozen.*"]])
            if per_tensor:
                storage.unflatten()
            opt = ShardedOptimizer(storage, torch.optim.AdamW, lr=0.05, shard_gradients=shard)
            head_opt = torch.optim.AdamW([model.head.weight], lr=0.05)
            ref = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=0.05)
            for step in range(3):
                _lm_loss(model, step, _mine(rank, world)).backward()
                opt.step()
                head_opt.step()
                opt.zero_grad()
                head_opt.zero_grad()
                _lm_loss(plain, step).backward()
                ref.step()
                ref.zero_grad()
            if per_tensor:
                storage.flatten()
            results[f"per_tensor={per_tensor}, shard_gradients={shard}"] = {
                "sharded": values(model),
                "plain": values(plain),
            }
    return results


_SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "training": _scenario_training,
    "one_buffer_collectives": _scenario_one_buffer_collectives,
    "buckets_and_memory": _scenario_buckets_and_memory,
    "mixed_dtypes": _scenario_mixed_dtypes,
    "no_sync": _scenario_no_sync,
    "layout_mismatch": _scenario_layout_mismatch,
    "per_tensor": _scenario_per_tensor,
    "outside_params": _scenario_outside_params,
}


def _run_two(rank: int, world: int, outdir: Path) -> None:
    save_result(outdir, rank, "checkpoint", _scenario_checkpoint_save(rank, world, outdir))
    for name, scenario in _SCENARIOS.items():
        save_result(outdir, rank, name, scenario(rank, world))
    save_result(outdir, rank, "engines", _scenario_engines(rank, world))
    save_result(outdir, rank, "failing_rank", _failing_rank(rank, world))  # last: it ends the launch


def _run_three(saved_dir: Path, rank: int, world: int, outdir: Path) -> None:
    save_result(outdir, rank, "resume", _scenario_checkpoint_resume(rank, world, outdir, saved_dir))
    for name, scenario in _SCENARIOS.items():
        save_result(outdir, rank, name, scenario(rank, world))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of 2 ranks running every scenario; the last one makes rank 1 fail."""
    return launch_gloo(_run_two, tmp_path_factory.mktemp("ranks2"), world=2)


@pytest.fixture(scope="module")
def three_ranks(two_ranks: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of 3 ranks running every scenario, resuming the 2-rank checkpoint first."""
    worker = functools.partial(_run_three, two_ranks["outdir"])
    return {**launch_gloo(worker, tmp_path_factory.mktemp("ranks3"), world=3), "saved": two_ranks}


@pytest.fixture(params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request: pytest.FixtureRequest) -> dict[str, Any]:
    return request.getfixturevalue("two_ranks" if request.param == 2 else "three_ranks")


def _assert_trained_alike(result: dict[str, Any], msg: str = "") -> None:
    assert_same_values(result["sharded"], result["plain"], rtol=1e-6, atol=1e-6, msg=msg)


def _assert_ranks_equal(results: list[dict[str, Any]]) -> None:
    for other in results[1:]:
        assert_same_values(other["sharded"], results[0]["sharded"])


def _assert_every_config_trained_alike(results: list[dict[str, Any]]) -> None:
    """Each rank's result of each configuration is the plain model's, and the ranks are equal."""
    for config in results[0]:
        per_rank = [r[config] for r in results]
        for result in per_rank:
            _assert_trained_alike(result, config)
        _assert_ranks_equal(per_rank)


# ------------------------------------------------------------ training on 2 and 3 ranks


@pytest.mark.slow
def test_training_equals_one_process_on_the_combined_batch(ranks):
    """AdamW (default, foreach, fused) and SGD with momentum, ZeRO-1 and 2: 5 steps like one process."""
    _assert_every_config_trained_alike(launch_results(ranks, "training"))


@pytest.mark.slow
def test_per_tensor_mode_trains_like_the_plain_model_under_sharded_optimizer(ranks):
    """ZeRO-1 and ZeRO-2 over a model in per-tensor mode: the plain weights and clip norms on every rank."""
    results = launch_results(ranks, "per_tensor")
    for rank, result in enumerate(results):
        for config, run in result.items():
            _assert_trained_alike(run, msg=f"rank {rank}, {config}:")
            for norm, plain_norm in run["norms"]:
                assert norm == pytest.approx(plain_norm, rel=1e-6), (rank, config)


@pytest.mark.slow
def test_parameters_outside_the_groups_are_broadcast_and_averaged_as_under_ddp(ranks):
    """A head no group holds, stepped by its own AdamW: it trains like the plain model on every rank."""
    _assert_every_config_trained_alike(launch_results(ranks, "outside_params"))


@pytest.mark.slow
def test_clip_grad_norm_returns_the_unsharded_norm(ranks):
    """clip_grad_norm_ (2-norm and inf-norm) returns torch's norm of the averaged gradients (rel 1e-6)."""
    for config, result in launch_results(ranks, "training")[0].items():
        for norm, plain_norm in result["norms"]:
            assert norm == pytest.approx(plain_norm, rel=1e-6), config
        assert any(plain_norm > 0.5 for _, plain_norm in result["norms"]), "clipping never happened"


@pytest.mark.slow
def test_schedules_reach_the_inner_optimizer_and_frozen_groups_get_no_state(ranks):
    """An LR scheduler's changes reach the inner optimizer; a frozen flat parameter has no state."""
    for result in launch_results(ranks, "training")[0].values():
        outer, inner, plain = result["lr"]  # at the last step
        assert outer == inner == pytest.approx(plain)
        assert outer < result["first_lr"]
        assert result["frozen_state"] == 0


@pytest.mark.slow
def test_one_buffer_collectives_train_alike(ranks):
    """The reduce_scatter / all_gather path (NCCL's) trains like one process too (run here on gloo)."""
    results = launch_results(ranks, "one_buffer_collectives")
    for shard in (True, False):
        for result in results:
            _assert_trained_alike(result[shard], f"shard_gradients={shard}")
        _assert_ranks_equal([r[shard] for r in results])


@pytest.mark.slow
def test_buckets_train_alike_and_hold_a_slice_of_state_and_gradients(ranks):
    """Optimizer state per rank is its slices' (1/N, the last shorter); ZeRO-2 gradients 1/N, ZeRO-1 whole."""
    world = ranks["world"]
    results = launch_results(ranks, "buckets_and_memory")
    for shard in (True, False):
        full = results[0][shard]["full_bytes"]
        ceiling = results[0][shard]["groups"] * 4  # a slice is at most one element longer than 1/N
        states = [result[shard]["state_bytes"] for result in results]
        assert sum(states) == 2 * full and max(states) <= 2 * (full / world + ceiling), states
        for result in results:
            assert result[shard]["groups"] > 2
            _assert_trained_alike(result[shard])
    zero2 = [result[True] for result in results]
    assert all(all(r["flat_grad_after"]) and r["in_flight"] == 1 for r in zero2)  # one bucket in flight
    assert sum(r["grad_bytes"] for r in zero2) == zero2[0]["full_bytes"]
    assert max(r["grad_bytes"] for r in zero2) <= zero2[0]["full_bytes"] / world + zero2[0]["groups"] * 4
    assert all(not any(result[False]["flat_grad_after"]) for result in results)
    assert all(result[False]["grad_bytes"] >= result[False]["full_bytes"] for result in results)


@pytest.mark.slow
def test_mixed_dtypes_get_one_slice_per_group(ranks):
    """A float32 and a float64 group: each slice keeps its dtype; training matches."""
    for result in launch_results(ranks, "mixed_dtypes"):
        assert result["dtypes"] == [torch.float32, torch.float64]
        _assert_trained_alike(result)


@pytest.mark.slow
def test_no_sync_accumulates_and_the_last_backward_syncs_the_sum(ranks):
    """Micro-batches under no_sync stay local; the next backward averages their sum (ZeRO-1 and 2)."""
    results = launch_results(ranks, "no_sync")
    for shard in (True, False):
        assert not torch.allclose(results[0][shard]["local"], results[1][shard]["local"])
        for result in results:
            _assert_trained_alike(result[shard], f"shard_gradients={shard}")


@pytest.mark.slow
def test_different_layouts_on_ranks_raise_on_every_rank(ranks):
    """A rank with another layout makes construction raise a ValueError on every rank, no hang."""
    world = ranks["world"]
    for result in launch_results(ranks, "layout_mismatch"):
        assert result["error"] is not None
        assert f"ranks [{world - 1}] differ from rank 0" in result["error"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fully_shard", "ZeroRedundancyOptimizer"])
def test_flattened_model_trains_like_the_plain_one_under_other_engines(two_ranks, engine):
    """FSDP2's fully_shard and ZeroRedundancyOptimizer + DDP train a flattened model like the plain one."""
    for result in launch_results(two_ranks, "engines"):
        plain, flat, initial = (result[f"{engine}, {k}"] for k in ("flat=False", "flat=True", "initial"))
        for key, value in plain.items():
            assert not torch.allclose(value, initial[key]), key
        assert_same_values(flat, plain, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------- checkpoints


@pytest.mark.slow
def test_state_dict_is_the_single_process_format_on_every_rank(two_ranks):
    """state_dict() after 3 steps equals a single-process optimizer's over the same flat model."""
    for result in launch_results(two_ranks, "checkpoint"):
        assert_same_optim_state(result["gathered"], result["single"], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_state_dict_converts_to_the_plain_models_format(two_ranks):
    """plain_optim_state_dict turns the gathered state into the plain model's optimizer state."""
    result = launch_results(two_ranks, "checkpoint")[0]
    assert_same_optim_state(result["as_plain"], result["plain"], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_resharding_2_to_3_continues_like_an_uninterrupted_run(three_ranks):
    """The 2-rank checkpoint (gathered or sharded) resumed on 3 ranks gives the uninterrupted step."""
    uninterrupted = launch_results(three_ranks["saved"], "checkpoint")[0]["uninterrupted"][0]
    for result in launch_results(three_ranks, "resume"):
        for how in ("gathered", "sharded"):
            assert_same_values(result[how], uninterrupted, rtol=1e-6, atol=1e-6, msg=how)


@pytest.mark.slow
def test_resharding_3_to_1_continues_like_an_uninterrupted_run(three_ranks, world1):
    """The 3-rank checkpoint of step 4 resumed in one process gives the uninterrupted step 5."""
    outdir = three_ranks["outdir"]
    uninterrupted = launch_results(three_ranks["saved"], "checkpoint")[0]["uninterrupted"][1]
    saved = torch.load(outdir / "gathered3.pt", weights_only=False)
    for how in ("gathered", "sharded"):
        model, _, opt = _checkpoint_model()
        model.load_state_dict(saved["model"])
        if how == "gathered":
            opt.load_state_dict(saved["optim"])
        else:
            opt.load_sharded_state_dict(
                [torch.load(outdir / f"sharded3.{r}.pt", mmap=True) for r in range(3)]
            )
        _train_steps(model, opt, range(4, 5), 0, 1)
        assert_same_values(model, uninterrupted, rtol=1e-6, atol=1e-6, msg=how)


@pytest.mark.slow
def test_failing_rank_does_not_hang_the_others(two_ranks):
    """A rank that raises fails the launch; the other's construction raises after the group's timeout."""
    assert "ValueError: rank 1 fails on purpose" in two_ranks["failure"]
    survivor = torch.load(two_ranks["outdir"] / "failing_rank.0.pt", weights_only=False)
    assert survivor["error"] is not None
    assert survivor["seconds"] < 5  # the 2 s timeout, not rank 1's exit after 6 s


# ------------------------------------------------------------------- one process, world 1


def _small() -> tuple[nn.Module, Any]:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, register_flat_storage(model, [[model[0]], [model[2]]])


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 0) -> None:
    """One step (backward, step, zero_grad) on a batch drawn from ``seed``."""
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))
    train_steps(model, opt, [x], zero_grad_last=True)


def test_needs_an_initialized_process_group():
    """Without init_process_group construction raises and says to call it first."""
    _, storage = _small()
    with pytest.raises(RuntimeError, match=r"no.*initialized.*call torch\.distributed\.init_process_group"):
        ShardedOptimizer(storage, torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("shard", [True, False], ids=["ZeRO-2", "ZeRO-1"])
def test_one_rank_trains_like_the_plain_optimizer(world1, shard):
    """On one rank the sharded AdamW steps exactly like torch's AdamW on the plain model."""
    model, storage = _small()
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    plain.load_state_dict(model.state_dict())
    opt = ShardedOptimizer(storage, torch.optim.AdamW, lr=0.1, shard_gradients=shard)
    ref = torch.optim.AdamW(plain.parameters(), lr=0.1)
    for seed in range(3):
        _step(model, opt, seed)
        _step(plain, ref, seed)
    assert_same_values(model, plain, close=True)


def test_storage_must_be_a_flat_storage(world1):
    """The first argument is the FlatStorage, not the model."""
    model, _ = _small()
    with pytest.raises(TypeError, match=r"needs a FlatStorage; got Sequential; pass the result of register"):
        ShardedOptimizer(model, torch.optim.SGD, lr=0.1)


def test_optimizer_class_must_be_an_optimizer_class(world1):
    """An instance or a name is a TypeError."""
    _, storage = _small()
    with pytest.raises(TypeError, match=r"optimizer_class must be a torch.optim.Optimizer subclass; got str"):
        ShardedOptimizer(storage, "AdamW", lr=0.1)


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_optimizers_that_need_whole_tensors_are_refused(world1, cls):
    """LBFGS and SparseAdam are never element-wise, even with allow_unlisted=True."""
    _, storage = _small()
    with pytest.raises(ValueError, match=rf"{cls.__name__} is not element-wise.*use one of SGD, Adam"):
        ShardedOptimizer(storage, cls, allow_unlisted=True)


def test_unlisted_optimizers_need_opting_in(world1):
    """Adadelta is not listed: the error lists the allowed ones and allow_unlisted=True lets it in."""
    model, storage = _small()
    with pytest.raises(
        ValueError,
        match=r"optimizers only: SGD, .*RMSprop; got Adadelta; pass whole_tensors=True.*allow_unlis",
    ):
        ShardedOptimizer(storage, torch.optim.Adadelta)
    opt = ShardedOptimizer(storage, torch.optim.Adadelta, allow_unlisted=True)
    before = storage["0"].detach().clone()
    _step(model, opt)
    assert not torch.equal(storage["0"], before)


def test_params_must_be_flat_parameters_of_the_storage(world1):
    """A parameter of another model, a flat parameter listed twice, or a bare tensor are refused."""
    _, storage = _small()
    other = nn.Parameter(torch.zeros(3))
    with pytest.raises(
        ValueError, match=r"must be a flat parameter of the storage.*got Parameter of shape \(3,\)"
    ):
        ShardedOptimizer(storage, torch.optim.SGD, [other], lr=0.1)
    with pytest.raises(ValueError, match=r"flat parameter of group '0' appears in more than one"):
        ShardedOptimizer(
            storage, torch.optim.SGD, [{"params": [storage["0"]]}, {"params": [storage["0"]]}], lr=1
        )
    with pytest.raises(TypeError, match=r"params must be None or an iterable.*got FlatParameter"):
        ShardedOptimizer(storage, torch.optim.SGD, storage["0"], lr=0.1)
    with pytest.raises(TypeError, match=r"param group 0 must be a dict with a 'params' list"):
        ShardedOptimizer(storage, torch.optim.SGD, [{"lr": 0.1}], lr=0.1)


def test_the_storages_own_grad_sync_is_refused(world1):
    """Both syncing would reduce each gradient twice: the second is refused until the first stops."""
    model, storage = _small()
    storage.enable_grad_sync()
    with pytest.raises(RuntimeError, match=r"grad sync is enabled.*call storage.disable_grad_sync\(\)"):
        ShardedOptimizer(storage, torch.optim.SGD, lr=0.1)
    storage.disable_grad_sync()
    opt = ShardedOptimizer(storage, torch.optim.SGD, lr=0.1)
    with pytest.raises(
        RuntimeError, match=r"enable_grad_sync\(\) averages.*group '0' is already optimized by a"
    ):
        storage.enable_grad_sync()
    _step(model, opt)  # the optimizer syncs as before
    del opt
    storage.enable_grad_sync()


def test_param_groups_and_add_param_group(world1):
    """Param groups keep their hyperparameters; a group added later is trained and gets state."""
    model, storage = _small()
    opt = ShardedOptimizer(storage, torch.optim.Adam, [{"params": [storage["0"]], "lr": 0.1}], lr=0.5)
    second = storage["1"].detach().clone()
    _step(model, opt)
    assert torch.equal(storage["1"], second)
    opt.add_param_group({"params": [storage["1"]], "lr": 0.2})
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)
    _step(model, opt)
    assert not torch.equal(storage["1"], second)
    assert set(opt.state[storage["1"]]) == {"step", "exp_avg", "exp_avg_sq"}
    with pytest.raises(ValueError, match=r"appears in more than one"):
        opt.add_param_group({"params": [storage["1"]]})


def test_zero_grad_clears_flat_and_slice_gradients(world1):
    """After zero_grad neither the flat parameters nor the slices hold a gradient."""
    model, storage = _small()
    opt = ShardedOptimizer(storage, torch.optim.SGD, lr=0.1, shard_gradients=False)
    model(torch.ones(1, 3)).sum().backward()
    assert storage["0"].grad is not None and opt.local_optimizer.param_groups[0]["params"][0].grad is not None
    opt.zero_grad()
    assert storage["0"].grad is None
    assert all(p.grad is None for g in opt.local_optimizer.param_groups for p in g["params"])


def test_clip_grad_norm_checks_its_arguments(world1):
    """norm_type must be positive; a non-finite norm raises with error_if_nonfinite=True."""
    model, storage = _small()
    opt = ShardedOptimizer(storage, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"norm_type must be a positive number or inf; got 0"):
        opt.clip_grad_norm_(1.0, norm_type=0)
    (model(torch.ones(1, 3)).sum() * math.inf).backward()
    with pytest.raises(RuntimeError, match=r"non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)


def test_state_dict_runs_hooks_and_shares_nothing(world1):
    """state_dict hooks run; the result is new memory; loading leaves the given dict unchanged."""
    model, storage = _small()
    opt = ShardedOptimizer(storage, torch.optim.Adam, lr=0.1)
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    _step(model, opt)
    sd = opt.state_dict()
    assert sd["extra"] == 1
    live = opt.state[storage["0"]]["exp_avg"]
    assert sd["state"][0]["exp_avg"].data_ptr() != live.data_ptr()
    before = copy.deepcopy(sd)
    opt.load_state_dict(sd)
    _step(model, opt, seed=1)
    assert_same_values(sd["state"][0], before["state"][0])


def test_load_state_dict_checks_before_changing_anything(world1):
    """A wrong type, group sizes or element count raises, and the state is unchanged."""
    model, storage = _small()
    opt = ShardedOptimizer(storage, torch.optim.Adam, lr=0.1)
    _step(model, opt)
    sd = opt.state_dict()
    exp_avg = opt.state[storage["1"]]["exp_avg"].clone()
    with pytest.raises(TypeError, match=r"needs an optimizer state dict"):
        opt.load_state_dict([1, 2])
    with pytest.raises(ValueError, match=r"param groups hold \[1\] tensors, this optimizer's hold \[2\]"):
        opt.load_state_dict({"state": {}, "param_groups": [{**sd["param_groups"][0], "params": [0]}]})
    broken = {**sd, "state": {0: sd["state"][0], 1: {**sd["state"][1], "exp_avg": torch.zeros(3)}}}
    with pytest.raises(
        ValueError, match=r"state 'exp_avg' of parameter 1 has 3 elements, but the tensor has 10"
    ):
        opt.load_state_dict(broken)
    assert torch.equal(opt.state[storage["1"]]["exp_avg"], exp_avg)


def test_load_sharded_state_dict_checks_its_input(world1):
    """Another format, another rank's dict, a list out of order or another layout are refused."""
    model, storage = _small()
    opt = ShardedOptimizer(storage, torch.optim.Adam, lr=0.1)
    _step(model, opt)
    sd = opt.sharded_state_dict()
    with pytest.raises(TypeError, match=r"needs what sharded_state_dict\(\) returns.*call load_state_dict"):
        opt.load_sharded_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match=r"holds rank 1's part of a world of 2; this is rank 0 of 1"):
        opt.load_sharded_state_dict({**sd, "world_size": 2, "rank": 1})
    with pytest.raises(ValueError, match=r"every saving rank in rank order; got ranks \[1, 0\]"):
        opt.load_sharded_state_dict([{**sd, "world_size": 2, "rank": 1}, {**sd, "world_size": 2}])
    with pytest.raises(ValueError, match=r"saved for the tensors \[\(0, 0, 26, \(26,\)\).*this optimizer"):
        opt.load_sharded_state_dict({**sd, "entries": [(0, 0, 26, (26,)), (1, 0, 9, (9,))]})
    opt.load_sharded_state_dict(sd)
    assert opt.state[storage["0"]]["exp_avg"].data_ptr() != sd["state"][0][0][2]["exp_avg"].data_ptr()


def test_flat_buffer_moved_to_new_memory_is_followed(world1):
    """A flat parameter whose .data was replaced is stepped in its new memory."""
    model, storage = _small()
    opt = ShardedOptimizer(storage, torch.optim.SGD, lr=0.1)
    _step(model, opt)
    with torch.no_grad():
        storage["0"].data = storage["0"].data.clone()
    before = storage["0"].detach().clone()
    _step(model, opt, seed=1)
    assert not torch.equal(storage["0"], before)
    assert opt.local_optimizer.param_groups[0]["params"][0].data_ptr() == storage["0"].data_ptr()


def test_reentrant_checkpointing_is_refused(world1):
    """A flat gradient made by a nested backward raises and says to pass use_reentrant=False."""
    model, storage = _small()
    opt = ShardedOptimizer(storage, torch.optim.SGD, lr=0.1)
    x = torch.ones(2, 3, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True)
    with pytest.raises(RuntimeError, match=r"nested \(reentrant\) backward.*use_reentrant=False"):
        out.sum().backward()
    opt.zero_grad()
    model(x).sum().backward()  # the next backward syncs again
    assert opt.local_optimizer.param_groups[0]["params"][0].grad is not None


def test_a_flat_parameter_is_synced_by_one_optimizer_at_a_time(world1):
    """A second optimizer over the same flat parameter is refused until the first is deleted."""
    model, storage = _small()
    first = ShardedOptimizer(storage, torch.optim.SGD, [storage["0"]], lr=0.1)
    with pytest.raises(RuntimeError, match=r"group '0' is already optimized by a ShardedOptimizer"):
        ShardedOptimizer(storage, torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match=r"already optimized by a ShardedOptimizer"):
        ShardedOptimizer(storage, torch.optim.SGD, [storage["1"]], lr=0.1).add_param_group(
            {"params": [storage["0"]]}
        )
    second = ShardedOptimizer(storage, torch.optim.Adam, [storage["1"]], lr=0.1)  # other flat parameters
    del first
    third = ShardedOptimizer(storage, torch.optim.SGD, [storage["0"]], lr=0.1)
    _step(model, third)
    _step(model, second)


# ------------------------------------------------------------- on the core's seams only


def _hooks_on(storage) -> tuple[int, int]:
    """(post-accumulate-grad hooks on the flat parameters, flat-gradient hooks on the groups' buffers)."""
    flats = sum(len(f._post_accumulate_grad_hooks or {}) for f in storage.flat_params)
    return flats, sum(len(g.views.grads.hooks) for g in core_of(storage).groups())


@pytest.mark.parametrize("shard", [True, False], ids=["ZeRO-2", "ZeRO-1"])
def test_the_optimizer_is_a_feature_of_the_core_until_it_is_collected(world1, shard):
    """It joins the core's lifecycle and hooks its groups; collected, it leaves no hook, claim or keep=0."""
    model, storage = _small()
    core = core_of(storage)
    buffers = [g.views.grads for g in core.groups()]
    opt = ShardedOptimizer(storage, torch.optim.SGD, lr=0.1, shard_gradients=shard)
    assert [type(f).__name__ for f in core.features] == ["OptimizerShards"]
    assert _hooks_on(storage) == (2, 2)
    assert [b.keep for b in buffers] == ([0, 0] if shard else [2, 2])  # ZeRO-2 keeps no full gradient
    _step(model, opt)
    del opt
    assert core.features == [] and _hooks_on(storage) == (0, 0)
    assert [b.keep for b in buffers] == [2, 2]
    storage.enable_grad_sync()  # nothing claims the gradients any more


def test_remove_flat_storage_makes_the_optimizer_leave(world1):
    """remove_flat_storage (on_removed) removes the optimizer's hooks from the old flat parameters."""
    model, storage = _small()
    flats, core = storage.flat_params, core_of(storage)
    opt = ShardedOptimizer(storage, torch.optim.SGD, lr=0.1)
    remove_flat_storage(model)
    assert not any(f._post_accumulate_grad_hooks for f in flats)
    assert core.features == [] and opt.local_optimizer is not None


def test_replaced_flat_parameters_are_followed_before_the_next_backward(world1):
    """module.to() that replaces the flat parameter objects: the next backward already syncs the new ones."""
    model, storage = _small()
    plain = copy.deepcopy(model)
    remove_flat_storage(plain)
    opt = ShardedOptimizer(storage, torch.optim.SGD, lr=0.1)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    old = storage.flat_params
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.float()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert all(new is not f for new, f in zip(storage.flat_params, old))
    assert not any(f._post_accumulate_grad_hooks for f in old)
    assert [len(f._post_accumulate_grad_hooks or {}) for f in storage.flat_params] == [1, 1]
    model(torch.ones(2, 3)).sum().backward()  # before any step: the new flat parameters are synced
    assert all(p.grad is not None for p in opt.local_optimizer.param_groups[0]["params"])
    opt.step()
    plain(torch.ones(2, 3)).sum().backward()
    ref.step()
    for name, param in plain.named_parameters():
        torch.testing.assert_close(dict(storage.named_views())[name], param.detach(), msg=name)
