"""DistributedDataParallel over a flattened model: 2 gloo processes match one process on the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import TiedLM, assert_same_values, mean_square, spawn_gloo, train_steps

pytestmark = pytest.mark.slow  # subprocesses

WORLD = 2
STEPS = 3
#: Seconds all ranks may take together (start, import, train); once a rank fails, the
#: others are killed at once. A rank stuck in a collective fails after the gloo timeout.
JOIN_TIMEOUT = 120
COLLECTIVE_TIMEOUT = 30


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 11, (2 * WORLD, 5), generator=generator) for _ in range(STEPS)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = TiedLM()
    register_flat_storage(model, {"decay": ["body.weight", "embed.weight"], "rest": ["norm.*", "body.bias"]})
    return model


def _train(model: nn.Module, batches: list[torch.Tensor], rank: int, world: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    train_steps(model, optimizer, batches, lambda m, tokens: mean_square(m, tokens.chunk(world)[rank]))


def _worker(rank: int, world: int, out: Path) -> None:
    """One DDP rank: train its half of every batch, save the resulting state dict."""
    model = _model()
    if rank == 1:  # different initial values: DDP must broadcast rank 0's flat buffers
        with torch.no_grad():
            model.flat_param_decay.add_(1.0)
    ddp = DistributedDataParallel(model)
    _train(ddp, _batches(), rank, world)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / f"rank{rank}.pt")


def _run_ranks(out: Path) -> None:
    """Start the ranks; fail as soon as one fails (killing the others) or the deadline passes."""
    spawn_gloo(
        _worker, out, world=WORLD, deadline_s=JOIN_TIMEOUT, grace_s=0, collective_timeout_s=COLLECTIVE_TIMEOUT
    )


def test_ddp_on_two_gloo_processes_matches_one_process_on_the_whole_batch(tmp_path: Path):
    """DDP of a flattened model (2 ranks, half a batch each) ends at 1 process's weights on whole batches."""
    _run_ranks(tmp_path)
    single = _model()
    _train(single, _batches(), rank=0, world=1)
    expected = single.state_dict()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert_same_values(got, expected, rtol=1e-5, atol=1e-6, msg=f"rank {rank}:")


# ------------------------------------------------------------------ per-tensor mode under DDP


def _plain() -> nn.Module:
    torch.manual_seed(0)
    return TiedLM()


def _train_per_tensor(model: nn.Module, batches: list[torch.Tensor], rank: int, world: int) -> None:
    optimizer = torch.optim.Adafactor(model.parameters(), lr=0.05)  # per tensor: factored moments
    train_steps(model, optimizer, batches, lambda m, tokens: mean_square(m, tokens.chunk(world)[rank]))


def _per_tensor_worker(rank: int, world: int, out: Path, as_bucket_view: bool) -> None:
    """One DDP rank over a flattened model in per-tensor mode (leaves, gradients in the flat buffers)."""
    model = _model()
    storage = get_flat_storage(model)
    storage.unflatten()
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=as_bucket_view)
    _train_per_tensor(ddp, _batches(), rank, world)
    flat_grads = [g.clone() for g in (f.grad for f in storage.flat_params) if g is not None]
    leaf_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"state": {k: v.clone() for k, v in model.state_dict().items()}, "flat_grads": flat_grads,
                "leaf_grads": leaf_grads, "views": dict(storage.views_of([g for g in flat_grads]))
                if len(flat_grads) == len(storage.flat_params) else {}},
               out / f"rank{rank}.pt")  # fmt: skip


def _per_tensor_worker_copy(rank: int, world: int, out: Path) -> None:
    _per_tensor_worker(rank, world, out, as_bucket_view=False)


def _per_tensor_worker_view(rank: int, world: int, out: Path) -> None:
    _per_tensor_worker(rank, world, out, as_bucket_view=True)


@pytest.mark.parametrize("as_bucket_view", [False, True], ids=["bucket-copy", "gradient_as_bucket_view"])
def test_ddp_wraps_the_per_tensor_mode_as_a_plain_model(tmp_path: Path, as_bucket_view: bool):
    """DDP over a per-tensor model with Adafactor (2 ranks, half batches) ends at the plain weights."""
    worker = _per_tensor_worker_view if as_bucket_view else _per_tensor_worker_copy
    timeouts = {"deadline_s": JOIN_TIMEOUT, "grace_s": 0, "collective_timeout_s": COLLECTIVE_TIMEOUT}
    spawn_gloo(worker, tmp_path, world=WORLD, **timeouts)
    single = _plain()
    _train_per_tensor(single, _batches(), rank=0, world=1)
    expected = single.state_dict()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert_same_values(got["state"], expected, rtol=1e-5, atol=1e-6, msg=f"rank {rank}:")
        for name, grad in got["views"].items():  # the flat gradient holds what the leaves hold
            torch.testing.assert_close(grad, got["leaf_grads"][name], rtol=0, atol=0)


def _powersgd_worker(rank: int, world: int, out: Path) -> None:
    """DDP with PowerSGD over the plain model and over the flattened one in per-tensor mode, same seeds."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    results = {}
    for form in ("plain", "per-tensor", "flat"):
        model = _plain()
        if form != "plain":
            storage = register_flat_storage(model)
            if form == "per-tensor":
                storage.unflatten()
        ddp = DistributedDataParallel(model)
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        _train(ddp, _batches() * 2, rank, world)
        results[form] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(results, out / f"rank{rank}.pt")


def test_powersgd_compresses_the_per_tensor_mode_as_the_plain_model(tmp_path: Path):
    """DDP's powerSGD_hook over a per-tensor model gives the plain model's weights (matrices compressed)."""
    timeouts = {"deadline_s": JOIN_TIMEOUT, "grace_s": 0, "collective_timeout_s": COLLECTIVE_TIMEOUT}
    spawn_gloo(_powersgd_worker, tmp_path, world=WORLD, **timeouts)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert_same_values(got["per-tensor"], got["plain"], msg=f"rank {rank}:")
        # In flat mode each bucket tensor is one 1-D flat parameter, which PowerSGD sends uncompressed:
        # another result (docs/per-tensor.md gives the per-tensor recipe).
        assert not torch.allclose(got["flat"]["body.weight"], got["plain"]["body.weight"])
