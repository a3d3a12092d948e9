"""Data-parallel training step: flat-storage gradient sync against ``DistributedDataParallel``.

Two gloo processes on 127.0.0.1 each train four copies of the same MLP on the
same batch (SGD; zero_grad, forward, backward with gradient sync, step):

* ``DDP``: ``DistributedDataParallel`` with its defaults (25 MiB buckets,
  gradients copied into its buckets), the baseline;
* ``DDP gradient_as_bucket_view``: DDP with gradients that are views of its
  buckets (no copy);
* ``flat, buckets``: ``register_flat_storage(model, bucket_cap_mb=cap)`` and
  ``storage.enable_grad_sync()``: one all-reduce per flat bucket, started
  from backward as soon as the bucket's gradient is final;
* ``flat, one group``: one flat parameter, reduced once backward ends (no
  overlap).

Contenders alternate in every round (forward order, then reverse), after a
warm-up; a round times the same number of steps on both ranks (the slower
rank's time counts). The table gives the median time per step over the
rounds, its ratio to DDP (target: ``flat, buckets`` <= 1.0) and, as a
diagnostic, the minor page faults per step (the larger count of the two
ranks): a gradient buffer that the C allocator hands back to the system at
``zero_grad()`` is faulted in again, page by page, by the next backward.
``--no-trim`` runs the ranks with glibc's ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` raised, so that freed buffers are reused; compare
both runs to see that cost.

Usage: ``python benchmarks/bench_ddp.py [--quick]`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = ["main"]

DDP, DDP_VIEW, FLAT, FLAT_ONE = "DDP", "DDP gradient_as_bucket_view", "flat, buckets", "flat, one group"
CONTENDERS = (DDP, DDP_VIEW, FLAT, FLAT_ONE)
WORLD = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/bench_ddp.py",
        description="Training-step time of flat-storage gradient sync against DistributedDataParallel "
        "(2 gloo processes on 127.0.0.1, CPU).",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, numbers mean nothing")
    parser.add_argument("--width", type=int, help="MLP width (default 1024; 256 with --quick)")
    parser.add_argument("--depth", type=int, help="number of Linear layers (default 12; 6 with --quick)")
    parser.add_argument("--batch", type=int, help="samples per rank (default 64; 16 with --quick)")
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        help="bucket size for DDP and flat, MiB (default 25; 1 with --quick)",
    )
    parser.add_argument("--rounds", type=int, help="timed rounds, at least 5 (default 9; 5 with --quick)")
    parser.add_argument("--steps", type=int, help="steps per contender per round (default 3; 2 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument(
        "--no-trim",
        action="store_true",
        help="run the ranks with glibc's MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ raised (diagnostic)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is abandoned")
    parser.add_argument("--worker", nargs=2, metavar=("RANK", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser


def _config(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    config = {
        "width": args.width or (256 if quick else 1024),
        "depth": args.depth or (6 if quick else 12),
        "batch": args.batch or (16 if quick else 64),
        "bucket_cap_mb": args.bucket_cap_mb or (1.0 if quick else 25.0),
        "rounds": args.rounds or (5 if quick else 9),
        "steps": args.steps or (2 if quick else 3),
        "warmup": 1 if quick else 2,
        "threads": args.threads,
        "quick": quick,
        "no_trim": args.no_trim,
    }
    if config["rounds"] < 5:
        raise SystemExit(f"--rounds must be at least 5 for a median; got {config['rounds']}")
    return config


# ----------------------------------------------------------------- one rank


def _worker(rank: int, port: int, config: dict[str, Any], result: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from flatten_parametrize import register_flat_storage

    torch.set_num_threads(config["threads"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    width, cap = config["width"], config["bucket_cap_mb"]
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(config["depth"]):
        layers += [nn.Linear(width, width), nn.ReLU()]
    base = nn.Sequential(*layers)
    x = torch.randn(config["batch"], width, generator=torch.Generator().manual_seed(rank))

    models: dict[str, nn.Module] = {
        DDP: DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap),
        DDP_VIEW: DistributedDataParallel(
            copy.deepcopy(base), bucket_cap_mb=cap, gradient_as_bucket_view=True
        ),
    }
    groups = {}
    for name, bucket_cap_mb in ((FLAT, cap), (FLAT_ONE, None)):
        model = copy.deepcopy(base)
        storage = register_flat_storage(model, bucket_cap_mb=bucket_cap_mb)
        storage.broadcast_params()
        storage.enable_grad_sync()
        models[name] = model
        groups[name] = len(storage.group_names)

    def step_fn(model: nn.Module) -> Callable[[], None]:
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

        return step

    steps = {name: step_fn(model) for name, model in models.items()}
    for _ in range(config["warmup"]):
        for step in steps.values():
            step()
    samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    faults: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for r in range(config["rounds"]):
        for name in CONTENDERS if r % 2 == 0 else reversed(CONTENDERS):
            dist.barrier()
            faults_before = _minor_faults()
            start = time.perf_counter()
            for _ in range(config["steps"]):
                steps[name]()
            elapsed = time.perf_counter() - start
            measured = torch.tensor([elapsed, _minor_faults() - faults_before], dtype=torch.float64)
            dist.all_reduce(measured, dist.ReduceOp.MAX)  # the slower rank's time counts
            samples[name].append(float(measured[0]) / config["steps"])
            faults[name].append(float(measured[1]) / config["steps"])
    params = sum(p.numel() for p in base.parameters())
    if rank == 0:
        result.write_text(
            json.dumps({"samples": samples, "faults": faults, "params": params, "groups": groups})
        )
    dist.destroy_process_group()


def _minor_faults() -> int:
    """Return this process's minor page faults so far (0 where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ------------------------------------------------------------------ launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_args(rank: int, port: int, result: Path) -> list[str]:
    return ["--worker", str(rank), str(port), "--result", str(result)]


def _launch(argv: Sequence[str], config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run both ranks as subprocesses of this script; return rank 0's measurements."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        procs = [
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), *argv, *_worker_args(rank, port, result)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": str(config["threads"]), **_malloc_env(config)},
            )
            for rank in range(WORLD)
        ]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                failed = [p for p in procs if p.returncode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        outputs = [p.communicate()[0] for p in procs]
        if any(p.returncode != 0 for p in procs) or not result.exists():
            report = "\n".join(
                f"--- rank {rank} (exit code {p.returncode}):\n{out[-3000:]}"
                for rank, (p, out) in enumerate(zip(procs, outputs))
            )
            raise RuntimeError(f"bench_ddp: a rank failed or the run passed {timeout:.0f} s\n{report}")
        return json.loads(result.read_text())  # type: ignore[no-any-return]


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
        _worker(int(args.worker[0]), int(args.worker[1]), config, args.result)
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
