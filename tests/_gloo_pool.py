"""Warm gloo ranks shared by the multi-process tests of a session (``spawn_gloo`` in ``_helpers.py``).

Starting a rank costs seconds (a spawned interpreter imports torch and the test module), and the
suite launches ranks a few dozen times. A pool keeps ``world`` spawned processes per world size
alive between launches: each launch sends every rank the worker to run (pickled by reference, as a
``Process`` target is) with a fresh port, and each rank joins a new process group for it, runs it
and leaves the group. A launch in which any rank fails, hangs or dies retires the whole pool of
that world size (a rank that saw a failed collective is not trusted again); the next launch starts
a new one. Ranks read the environment when they start (MKL reads ``MKL_CBWR`` once, say), so a launch
under another environment than the pool's (``PYTEST_CURRENT_TEST`` aside) gets new ranks. A worker
that needs an interpreter of its own (one that patches libraries for good, as DeepSpeed's
``init_distributed`` does) asks for ``fresh=True``.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["Launch", "free_port", "run_ranks"]

Worker = Callable[[int, int, Path], None]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(worker: Worker, rank: int, world: int, port: int, outdir: str, timeout_s: float) -> None:
    """Join a gloo group on ``port``, run ``worker(rank, world, outdir)``, leave the group.

    A failure is written to ``outdir/rank<rank>.err`` (the launcher reports it) and raised.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        worker(rank, world, Path(outdir))
    except BaseException:
        (Path(outdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    dist.destroy_process_group()


def _serve(rank: int, world: int, conn: Connection) -> None:
    """A warm rank: run each job sent on ``conn`` and answer ``True``; on a failure answer ``False`` and exit.

    Each job starts from the state the process began with: its torch seed (a new interpreter draws one
    at random), the default dtype and grad mode.
    """
    seed, dtype = torch.initial_seed(), torch.get_default_dtype()
    while True:
        job = conn.recv()
        if job is None:
            return
        worker, port, outdir, timeout_s = job
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(True)
        try:
            run_job(worker, rank, world, port, outdir, timeout_s)
        except BaseException:
            conn.send(False)
            return
        conn.send(True)


@dataclass
class _Rank:
    process: Any  # a spawned multiprocessing.Process
    conn: Connection
    done: bool | None = None  # this launch: True ok, False failed, None still running


@dataclass
class Launch:
    """How a launch ended: per rank ``"ok"``, ``"failed"`` (it wrote ``rank<r>.err``) or why it stopped."""

    ends: list[str] = field(default_factory=list)


def _environment() -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))


class _Pool:
    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.environment = _environment()
        self.ranks: list[_Rank] = []
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(rank, world, theirs), daemon=True)
            process.start()
            theirs.close()
            self.ranks.append(_Rank(process, ours))

    def close(self, kill: bool = False) -> None:
        for rank in self.ranks:
            if not kill and rank.process.is_alive():
                try:
                    rank.conn.send(None)
                except OSError:
                    pass
            rank.process.join(0 if kill else 5)
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join(10)
            rank.conn.close()


_POOLS: dict[int, _Pool] = {}


def _send(pool: _Pool, job: tuple[Any, ...]) -> None:
    for rank in pool.ranks:
        rank.done = None
        rank.conn.send(job)


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def run_ranks(
    worker: Worker,
    outdir: Path,
    *,
    world: int,
    deadline_s: float,
    grace_s: float,
    collective_timeout_s: float,
    fresh: bool = False,
) -> Launch:
    """Run ``worker`` on ``world`` ranks of the pool (a new pool where there is none, or ``fresh``).

    As soon as one rank fails, the others get ``grace_s`` seconds to finish; after that, or after
    ``deadline_s`` in all, the ranks still running are killed. Any failure retires the pool.
    """
    pool = None if fresh else _POOLS.pop(world, None)
    if pool is not None and not all(rank.process.is_alive() for rank in pool.ranks):
        pool.close(kill=True)  # a kept rank died since the last launch (a send to it may still succeed)
        pool = None
    if pool is not None and pool.environment != _environment():
        pool.close()
        pool = None
    pool = pool or _Pool(world)
    job = (worker, free_port(), str(outdir), collective_timeout_s)
    try:
        _send(pool, job)
    except OSError:  # a kept rank died since the last launch: start new ones
        pool.close(kill=True)
        pool = _Pool(world)
        _send(pool, job)
    start, failed_at = time.monotonic(), None
    while any(rank.done is None for rank in pool.ranks):
        now = time.monotonic()
        if now - start > deadline_s or (failed_at is not None and now - failed_at > grace_s):
            break
        waiting = {rank.conn: rank for rank in pool.ranks if rank.done is None}
        for conn in wait(list(waiting), timeout=0.05):
            rank = waiting[conn]
            try:
                rank.done = bool(conn.recv())
            except (EOFError, ConnectionResetError):  # the process died (a reset: with a job unread)
                rank.process.join(5)
                rank.done = False
            if not rank.done and failed_at is None:
                failed_at = time.monotonic()
    ends = []
    for rank in pool.ranks:
        if rank.done:
            ends.append("ok")
        elif rank.done is None:
            ends.append("killed: still running at the deadline or after another rank failed")
        elif rank.process.is_alive() or rank.process.exitcode in (None, 0):
            ends.append("failed")
        else:
            ends.append(f"ended with exit code {rank.process.exitcode} (killed if negative)")
    if fresh or not all(rank.done for rank in pool.ranks):
        pool.close(kill=not all(rank.done for rank in pool.ranks))
    else:
        _POOLS[world] = pool
    return Launch(ends)
