"""DistributedDataParallel over a flattened model: 2 gloo processes match one process on the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from flatten_parametrize import register_flat_storage

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
