"""Contenders in processes of their own, timed in turns over a line protocol.

A process's C heap is shared by everything in it, so a contender's page
faults (and with them its time) depend on what the others allocated: measured
in one process, DDP took 0 faults per step next to the flat models and about
12,000 alone. Workloads that care start one worker process (or one per rank)
per contender, keep all of them alive at once and let only one run at a time:

* the launcher writes ``go <what>`` to a contender's workers;
* each worker measures ``<what>`` and prints one line ``@bench {json}``;
* ``stop`` (or the end of stdin) ends a worker.

Anything else a worker prints is kept (the last 40 lines) for the error that
reports a worker which ended before answering.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "STEADY_HEAP",
    "TAG",
    "Worker",
    "add_run_arguments",
    "calls_per_round",
    "emit",
    "free_ports",
    "join_gloo",
    "rank_worker",
    "run_config",
    "serve",
    "started",
    "time_across_processes",
    "time_calls",
    "time_in_turns",
    "time_round",
]

#: Lines of the protocol start with this (anything else a worker prints is passed over).
TAG = "@bench "

#: glibc malloc settings for workers whose step allocates and frees megabytes (the environment of
#: their processes). By default glibc moves its mmap threshold with what a process freed so far and
#: hands the top of the heap back to the system, so a step takes its large buffers from fresh pages:
#: about 2,000 page faults per step of the mixed-precision GPT-2 row (1,860 to 2,290 from one
#: process to the next, for every contender alike), about a tenth of the step, and which processes
#: fault more is luck (:func:`time_across_processes`). With the threshold fixed at glibc's largest
#: (32 MiB) and no trimming, a step keeps its memory (0 to 70 faults). PyTorch's CPU tuning guide
#: gives the same advice (an allocator that keeps freed memory: jemalloc, tcmalloc).
STEADY_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


def add_run_arguments(
    parser: argparse.ArgumentParser, *, rounds: int, steps: tuple[int, int], timeout: float, bucket_help: str
) -> None:
    """Add the options of a benchmark of rank pairs timed in turns (read by :func:`run_config`).

    ``rounds`` and ``steps`` (full run, ``--quick``) are the defaults; ``--quick`` runs 5 rounds.
    """
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, numbers mean nothing")
    parser.add_argument("--bucket-cap-mb", type=float, help=f"{bucket_help} (default 25; 1 with --quick)")
    parser.add_argument(
        "--rounds", type=int, help=f"timed rounds, at least 5 (default {rounds}; 5 with --quick)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        help=f"steps per contender per round (default {steps[0]}; {steps[1]} with --quick)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds before the run is abandoned")
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "CONTENDER"), help=argparse.SUPPRESS)


def run_config(args: argparse.Namespace, *, rounds: int, steps: tuple[int, int]) -> dict[str, Any]:
    """Return the run's settings from the options of :func:`add_run_arguments` (the same defaults).

    Raises:
        SystemExit: if fewer than 5 rounds are asked for (no median).
    """
    quick = args.quick
    config = {
        "bucket_cap_mb": args.bucket_cap_mb or (1.0 if quick else 25.0),
        "rounds": args.rounds or (5 if quick else rounds),
        "steps": args.steps or (steps[1] if quick else steps[0]),
        "warmup": 1 if quick else 2,
        "threads": args.threads,
        "quick": quick,
    }
    if config["rounds"] < 5:
        raise SystemExit(f"--rounds must be at least 5 for a median; got {config['rounds']}")
    return config


def emit(message: Mapping[str, Any]) -> None:
    """Print one protocol message (from a worker)."""
    print(TAG + json.dumps(dict(message)), flush=True)


def serve(measure: Callable[[str], Mapping[str, Any]]) -> None:
    """Answer each ``go <what>`` line on stdin with ``measure(what)``; return on ``stop`` or EOF."""
    for line in sys.stdin:
        words = line.split(maxsplit=1)
        if not words or words[0] != "go":
            return
        emit(measure(words[1].strip() if len(words) > 1 else ""))


def calls_per_round(
    calls: dict[str, int],
    what: str,
    fn: Callable[[], object],
    warmup: int,
    round_s: float,
    agree: Callable[[float], float] = lambda seconds: seconds,
) -> int:
    """Return how many calls of ``fn`` make a round of row ``what``, calibrated at its first request.

    The workers of a workload build at once; a row calibrated then times one call among all their
    builds (on 2 CPUs several times its time alone, so rounds of one call). At a ``go`` line the
    worker runs alone: the first request of each row runs ``warmup`` calls and times one more.
    ``agree`` makes the ranks of one contender agree on the time of that call (the slowest).
    """
    n = calls.get(what)
    if n is None:
        for _ in range(warmup):
            fn()
        start = time.perf_counter()
        fn()
        once = agree(time.perf_counter() - start)
        n = calls[what] = max(1, min(10_000, math.ceil(round_s / max(once, 1e-9))))
    return n


def time_round(
    calls: dict[str, int], what: str, fn: Callable[[], object], warmup: int, round_s: float
) -> float:
    """Return the seconds per call of one round of row ``what`` (calibrated by :func:`calls_per_round`).

    The mean of :func:`time_calls`.
    """
    return statistics.fmean(time_calls(calls, what, fn, warmup, round_s))


def time_calls(
    calls: dict[str, int], what: str, fn: Callable[[], object], warmup: int, round_s: float
) -> list[float]:
    """Return the seconds of each call of one round of row ``what`` (calibrated by :func:`calls_per_round`).

    A round of several calls starts with one untimed call: the first pass after another row
    (or a mode switch) pays for that switch. A row of one call per round is timed as it comes.
    """
    n = calls_per_round(calls, what, fn, warmup, round_s)
    if n > 1:
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def free_ports(n: int) -> list[int]:
    """Return ``n`` distinct free ports (all probe sockets stay open until each has its port)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


class Worker:
    """One worker process that answers each ``go`` line with one measurement.

    Args:
        command: the command line of the worker.
        name: how errors name it (e.g. ``"'DDP' rank 0"``).
        env: its environment.
    """

    def __init__(self, command: Sequence[str], name: str, env: Mapping[str, str]) -> None:
        self.name = name
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(env),
        )

    def send(self, line: str) -> None:
        """Write one protocol line to the worker."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:  # the worker is gone: report what it printed
            self.receive()
            raise

    def receive(self) -> dict[str, Any]:
        """Return the worker's next protocol message (other output is kept for error reports)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG) :])  # type: ignore[no-any-return]
            self.log = [*self.log[-40:], line.rstrip()]
        raise RuntimeError(
            f"{self.name} ended (exit code {self.proc.wait()}) or was stopped at the "
            "time limit; its last output:\n" + "\n".join(self.log)
        )


def join_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join (as ``rank`` of ``world``) the gloo group of the workers that share ``port`` on 127.0.0.1."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def rank_worker(
    script: str, argv: Sequence[str], rank: int, port: int, contender: str, env: Mapping[str, str]
) -> Worker:
    """Start rank ``rank`` of ``contender`` as ``python <script> <argv> --worker RANK PORT CONTENDER``."""
    command = [sys.executable, script, *argv, "--worker", str(rank), str(port), contender]
    name = f"{Path(script).stem}: {contender!r} rank {rank}"
    return Worker(command, name, env)


@contextlib.contextmanager
def started(workers: Sequence[Worker], timeout: float) -> Iterator[None]:
    """Kill every worker after ``timeout`` seconds; on exit stop them and wait for them."""

    def kill_all() -> None:
        for worker in workers:
            worker.proc.kill()

    watchdog = threading.Timer(timeout, kill_all)
    watchdog.start()
    try:
        yield
        for worker in workers:
            worker.send("stop")
        for worker in workers:
            worker.proc.wait()
    finally:
        watchdog.cancel()
        for worker in workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
            worker.proc.wait()


def time_in_turns(
    contenders: Mapping[str, Sequence[Worker]], what: str, rounds: int
) -> dict[str, list[list[dict[str, Any]]]]:
    """Ask every contender to measure ``what``, one contender at a time, alternating the order.

    Rounds go in forward order, then reverse (A B C, C B A, ...), so that
    drifting machine load hits every contender alike.

    Returns:
        Per contender, one list per round of its workers' messages.
    """

    def ask(name: str, _round: int) -> list[dict[str, Any]]:
        for worker in contenders[name]:
            worker.send(f"go {what}")
        return [worker.receive() for worker in contenders[name]]

    return _in_turns(list(contenders), rounds, ask)


def time_across_processes(
    contenders: Mapping[str, Sequence[Worker]], what: str, rounds: int
) -> dict[str, list[dict[str, Any]]]:
    """Ask every contender to measure ``what`` in turns, as :func:`time_in_turns`, rotating its processes.

    Each contender has several interchangeable processes (of one rank each); round ``r`` asks its
    process ``r % len(processes)``. A process is a draw: its page faults (:data:`STEADY_HEAP`) and
    where its tensors land in memory set its step time for its whole life. Three processes of one
    contender, in turns on a 2-CPU virtual machine, were up to 14% apart with glibc's defaults and
    within 1.5% with the heap kept; a ratio between two processes measures the two draws as well as
    the two contenders. Rotating spreads each contender's rounds over several draws, so that a
    ratio's median is not one pair's luck.

    Returns:
        Per contender, one message per round.
    """

    def ask(name: str, r: int) -> dict[str, Any]:
        processes = contenders[name]
        worker = processes[r % len(processes)]
        worker.send(f"go {what}")
        return worker.receive()

    return _in_turns(list(contenders), rounds, ask)


def _in_turns(names: list[str], rounds: int, ask: Callable[[str, int], Any]) -> dict[str, list[Any]]:
    """Call ``ask(name, round)`` for every name, round after round, alternating the order."""
    found: dict[str, list[Any]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            found[name].append(ask(name, r))
    return found
