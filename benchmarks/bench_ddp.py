"""Data-parallel training step: flat-storage gradient sync against ``DistributedDataParallel``.

Each contender trains the same MLP on the same batches with 2 gloo processes on
127.0.0.1 (SGD; zero_grad, forward, backward with gradient sync, step):

* ``DDP``: ``DistributedDataParallel`` with its defaults (25 MiB buckets,
  gradients copied into its buckets), the baseline;
* ``DDP gradient_as_bucket_view``: DDP with gradients that are views of its
  buckets (no copy);
* ``flat, buckets``: ``register_flat_storage(model, bucket_cap_mb=cap)`` and
  ``storage.enable_grad_sync()``: one all-reduce per flat bucket, started
  from backward as soon as the bucket's gradient is final;
* ``flat, one group``: one flat parameter, reduced once backward ends (no
  overlap).

Every contender has a pair of processes of its own, and all pairs are alive
at once: the launcher times one pair at a time (the others wait on stdin),
alternating contenders in every round (forward order, then reverse) after a
warm-up; a round times the same number of steps on both ranks (the slower
rank's time counts). Separate processes matter: a process's C heap is shared
by everything in it, and a contender's page faults then depend on what the
others allocated (measured in one process, DDP took 0 faults per step next to
the flat models and about 12,000 alone).

The table gives the median time per step over the rounds, its ratio to DDP
(target: ``flat, buckets`` <= 1.0) and, as a diagnostic, the minor page faults
per step (the larger count of the two ranks): gradient memory that the C
allocator hands back to the system is faulted in again, page by page, by the
next backward. ``--no-trim`` runs the ranks with glibc's
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` raised, so that
freed buffers are reused; compare both runs to see that cost.

Usage: ``python benchmarks/bench_ddp.py [--quick]`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._processes import (
    Worker,
    add_run_arguments,
    emit,
    free_ports,
    join_gloo,
    rank_worker,
    run_config,
    serve,
    started,
    time_in_turns,
)

__all__ = ["main"]

DDP, DDP_VIEW, FLAT, FLAT_ONE = "DDP", "DDP gradient_as_bucket_view", "flat, buckets", "flat, one group"
CONTENDERS = (DDP, DDP_VIEW, FLAT, FLAT_ONE)
WORLD = 2


#: Timed rounds and steps per round (full run, ``--quick``) of the data-parallel MLP workloads.
ROUNDS, STEPS = 15, (3, 2)


def add_workload_arguments(parser: argparse.ArgumentParser, bucket_help: str, timeout: float) -> None:
    """Add the options of the data-parallel workloads' model, sizes and rounds (read by ``_config``)."""
    add_run_arguments(parser, rounds=ROUNDS, steps=STEPS, timeout=timeout, bucket_help=bucket_help)
    parser.add_argument("--width", type=int, help="MLP width (default 1024; 256 with --quick)")
    parser.add_argument("--depth", type=int, help="number of Linear layers (default 12; 6 with --quick)")
    parser.add_argument("--batch", type=int, help="samples per rank (default 64; 16 with --quick)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/bench_ddp.py",
        description="Training-step time of flat-storage gradient sync against DistributedDataParallel "
        "(2 gloo processes on 127.0.0.1, CPU).",
    )
    add_workload_arguments(parser, bucket_help="bucket size for DDP and flat, MiB", timeout=600.0)
    parser.add_argument(
        "--no-trim",
        action="store_true",
        help="run the ranks with glibc's MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ raised (diagnostic)",
    )
    return parser


def _config(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    return {
        "width": args.width or (256 if quick else 1024),
        "depth": args.depth or (6 if quick else 12),
        "batch": args.batch or (16 if quick else 64),
        **run_config(args, rounds=ROUNDS, steps=STEPS),
        "no_trim": args.no_trim,
    }


# ----------------------------------------------------------------- one rank


def setup_rank(rank: int, port: int, config: dict[str, Any], timeout_s: float) -> tuple[Any, Any]:
    """Join the gloo group as ``rank``; return the workload's MLP (same seed on every rank) and its batch."""
    import torch
    from torch import nn

    torch.set_num_threads(config["threads"])
    join_gloo(rank, WORLD, port, timeout_s)
    width = config["width"]
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(config["depth"]):
        layers += [nn.Linear(width, width), nn.ReLU()]
    x = torch.randn(config["batch"], width, generator=torch.Generator().manual_seed(rank))
    return nn.Sequential(*layers), x


def _worker(rank: int, port: int, contender: str, config: dict[str, Any]) -> None:
    """Build one contender on this rank, warm it up, then time ``steps`` steps per ``go`` line on stdin."""
    if contender not in CONTENDERS:
        raise SystemExit(f"unknown contender {contender!r}; choose from {list(CONTENDERS)}")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from flatten_parametrize import register_flat_storage

    model, x = setup_rank(rank, port, config, timeout_s=120)
    cap = config["bucket_cap_mb"]
    params = sum(p.numel() for p in model.parameters())
    groups = None
    if contender in (DDP, DDP_VIEW):
        model = DistributedDataParallel(
            model, bucket_cap_mb=cap, gradient_as_bucket_view=contender == DDP_VIEW
        )
    else:
        storage = register_flat_storage(model, bucket_cap_mb=cap if contender == FLAT else None)
        storage.broadcast_params()
        storage.enable_grad_sync()
        groups = len(storage.group_names)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    for _ in range(config["warmup"]):
        step()
    emit({"params": params, "groups": groups})

    def measure(what: str) -> dict[str, float]:
        dist.barrier()
        faults_before = _minor_faults()
        start = time.perf_counter()
        for _ in range(config["steps"]):
            step()
        elapsed = time.perf_counter() - start
        faults = _minor_faults() - faults_before
        return {"seconds": elapsed / config["steps"], "faults": faults / config["steps"]}

    serve(measure)
    dist.destroy_process_group()


def _minor_faults() -> int:
    """Return this process's minor page faults so far (0 where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ------------------------------------------------------------------ launcher


def _rank(argv: Sequence[str], rank: int, port: int, contender: str, env: dict[str, str]) -> Worker:
    """Start one rank of one contender."""
    return rank_worker(str(Path(__file__).resolve()), argv, rank, port, contender, env)


def _launch(argv: Sequence[str], config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Start both ranks of every contender, then time them in turns; return the measurements.

    Each contender has its own pair of processes, all alive at once: only the
    pair being timed runs (the others wait on stdin), so rounds alternate
    contenders as before while no contender shares a C heap with another.
    """
    env = {**os.environ, "OMP_NUM_THREADS": str(config["threads"]), **_malloc_env(config)}
    pairs = {
        name: [_rank(argv, rank, port, name, env) for rank in range(WORLD)]
        for name, port in zip(CONTENDERS, free_ports(len(CONTENDERS)))
    }
    with started([rank for pair in pairs.values() for rank in pair], timeout):
        ready = {}
        for name, pair in pairs.items():
            messages = [rank.receive() for rank in pair]  # both ranks are warm
            ready[name] = messages[0]
        found = time_in_turns(pairs, "step", config["rounds"])
    # The slower rank counts.
    samples = {name: [max(m["seconds"] for m in r) for r in rounds] for name, rounds in found.items()}
    faults = {name: [max(m["faults"] for m in r) for r in rounds] for name, rounds in found.items()}
    return {
        "samples": samples,
        "faults": faults,
        "params": ready[DDP]["params"],
        "groups": {name: ready[name]["groups"] for name in (FLAT, FLAT_ONE)},
    }


def _malloc_env(config: dict[str, Any]) -> dict[str, str]:
    if not config["no_trim"]:
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**32)}


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Time a data-parallel training step of each contender and print the table.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        ``{"median_s": {contender: seconds per step}, "ratio": {contender:
        ratio to DDP}, "target_met": bool, ...}``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    config = _config(args)
    if args.worker is not None:
        _worker(int(args.worker[0]), int(args.worker[1]), args.worker[2], config)
        return {}
    start = time.perf_counter()
    measured = _launch(argv, config, args.timeout)
    medians = {name: statistics.median(values) for name, values in measured["samples"].items()}
    ratios = {name: medians[name] / medians[DDP] for name in CONTENDERS}
    title = (
        f"Training step, 2 gloo ranks ({config['threads']} torch thread each): MLP {config['depth']} x "
        f"Linear({config['width']}, {config['width']}) ({measured['params'] / 1e6:.2f} M params), "
        f"batch {config['batch']} per rank, SGD, buckets of {config['bucket_cap_mb']:g} MiB"
    )
    rows = [["contender", "median / step", "spread", "ratio to DDP", "page faults / step"]]
    for name in CONTENDERS:
        values = measured["samples"][name]
        q1, _, q3 = statistics.quantiles(values, n=4)
        label = name if name not in measured["groups"] else f"{name} ({measured['groups'][name]} flat params)"
        spread = (q3 - q1) / 2 / medians[name]
        faults = statistics.median(measured["faults"][name])
        rows.append(
            [label, _fmt_ms(medians[name]), f"+-{spread:.0%}", f"{ratios[name]:.2f}", f"{faults:.0f}"]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"### {title}", ""]
    for i, row in enumerate(rows):
        cells = [c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))]
        lines.append("| " + " | ".join(cells) + " |")
        if i == 0:
            rules = ["-" * (w + 1) + (":" if j else "-") for j, w in enumerate(widths)]
            lines.append("|" + "|".join(rules) + "|")
    met = ratios[FLAT] <= 1.0
    lines += [
        "",
        f"{config['rounds']} rounds x {config['steps']} steps per contender, alternating, after "
        f"{config['warmup']} warm-up steps; median over rounds of the slower rank's time per step"
        + ("; --no-trim: glibc keeps freed memory" if config["no_trim"] else "")
        + ".",
        f"Target `{FLAT}` / DDP <= 1.00: {ratios[FLAT]:.2f}, {'met' if met else 'NOT met'}"
        + (" (--quick: sizes are tiny, the verdict means nothing)" if config["quick"] else "")
        + f". ({time.perf_counter() - start:.0f} s)",
    ]
    print("\n".join(lines), flush=True)
    return {
        "median_s": medians,
        "ratio": ratios,
        "target_met": met,
        "config": config,
        "groups": measured["groups"],
    }


if __name__ == "__main__":
    main()
