"""DistributedDataParallel over a flattened model: 2 gloo processes match one process on the whole batch."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from flatten_parametrize import register_flat_storage

from _models import TiedLM

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
    for tokens in batches:
        part = tokens.chunk(world)[rank]
        optimizer.zero_grad()
        model(part).pow(2).mean().backward()
        optimizer.step()


def _worker(rank: int, port: int, out: str) -> None:
    """One DDP rank: train its half of every batch, save the resulting state dict."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT),
        )
        try:
            model = _model()
            if rank == 1:  # different initial values: DDP must broadcast rank 0's flat buffers
                with torch.no_grad():
                    model.flat_param_decay.add_(1.0)
            ddp = DistributedDataParallel(model)
            _train(ddp, _batches(), rank, WORLD)
            torch.save(
                {k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, f"rank{rank}.pt")
            )
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_ranks(out: Path) -> None:
    """Start the ranks; fail as soon as one fails (killing the others) or the deadline passes."""
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [context.Process(target=_worker, args=(rank, port, str(out))) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + JOIN_TIMEOUT
    try:
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    errors = "\n".join(path.read_text() for path in sorted(out.glob("rank*.err")))
    codes = [proc.exitcode for proc in procs]
    assert codes == [0] * WORLD, f"exit codes {codes} (ranks {hung} killed)\n{errors}"


def test_ddp_on_two_gloo_processes_matches_one_process_on_the_whole_batch(tmp_path: Path):
    """DDP of a flattened model (2 ranks, half a batch each) ends at 1 process's weights on whole batches."""
    _run_ranks(tmp_path)
    single = _model()
    _train(single, _batches(), rank=0, world=1)
    expected = single.state_dict()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert list(got) == list(expected)
        for key in expected:
            torch.testing.assert_close(
                got[key], expected[key], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}"
            )
