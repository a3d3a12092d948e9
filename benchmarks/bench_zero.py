"""Sharded optimizers: ``ShardedOptimizer`` (ZeRO-1/2 over flat buckets) against DDP, torch's ZeRO and FSDP2.

Each contender trains the same MLP as ``bench_ddp.py`` with AdamW on the same
batches, with 2 gloo processes on 127.0.0.1 (zero_grad, forward, backward with
gradient sync, step):

* ``DDP + AdamW``: ``DistributedDataParallel`` with its defaults, the baseline;
* ``flat buckets + AdamW``: ``register_flat_storage(model, bucket_cap_mb=cap)``
  and ``storage.enable_grad_sync()``, every rank stepping the whole model;
* ``flat buckets + AdamW, per-tensor mode``: the same, with ``storage.unflatten()``
  before building the optimizer (AdamW steps the plain model's tensors, whose
  gradients are views of the flat buckets);
* ``flat buffers by hand + AdamW (floor)``: the floor of the flat mode, with
  no library: the same bucket layout as flat buffers written by hand (one
  ``nn.Parameter`` per bucket, the layers' weights given as views of one
  ``split`` per bucket through ``torch.func.functional_call``, each flat
  gradient all-reduced by a post-accumulate-grad hook), AdamW over the flat
  buffers: the memory any flat-buffer implementation at least holds, so that
  the storage's own memory is ``flat buckets`` minus this row (its time is
  no floor: each all-reduce blocks in its hook);
* ``DDP + AdamW fused`` / ``flat buckets + AdamW fused``: both with
  ``AdamW(fused=True)``, which allocates no temporaries (the default AdamW
  on CPU allocates two the size of each tensor it steps, so of each flat
  parameter in flat mode);
* ``ShardedOptimizer ZeRO-1`` / ``ZeRO-2``: the same buckets with
  ``ShardedOptimizer(storage, AdamW, shard_gradients=False / True)``;
* ``ZeroRedundancyOptimizer + DDP``: torch's ZeRO-1, whole parameters per rank;
* ``FSDP2 fully_shard``: every Linear and the root under ``fully_shard``.

The processes and the timing are those of ``bench_ddp.py``: one process pair
per contender, all alive at once, timed one pair at a time, alternating
contenders in every round after a warm-up; a round counts the slower rank.

Memory, per rank (the larger of the two):

* ``state + grads``: bytes of the optimizer state tensors and of the
  gradients held after backward, counted from the tensors' memory (views
  once; this rank's local shards for the sharded contenders; DDP's own bucket
  copy of the gradients is not a tensor we can see and is not counted);
* ``peak RSS``: the peak resident set during the timed steps minus the
  resident set of the built model before its first step (so state, gradients,
  activations, communication buffers and allocator overhead).

Usage: ``python benchmarks/bench_zero.py [--quick]`` (``--help`` for sizes).
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

from benchmarks import bench_zero_whole
from benchmarks._memory import held_bytes
from benchmarks._processes import (
    Worker,
    emit,
    free_ports,
    join_gloo,
    rank_worker,
    serve,
    started,
    time_in_turns,
)
from benchmarks._timing import Table
from benchmarks.bench_ddp import (
    _config,
    _fmt_ms,
    _malloc_env,
    _minor_faults,
    add_workload_arguments,
    setup_rank,
)

__all__ = ["main"]

DDP, FLAT, ZERO1, ZERO2 = (
    "DDP + AdamW",
    "flat buckets + AdamW",
    "ShardedOptimizer ZeRO-1",
    "ShardedOptimizer ZeRO-2",
)
ZRO, FSDP = "ZeroRedundancyOptimizer + DDP", "FSDP2 fully_shard"
PER_TENSOR = "flat buckets + AdamW, per-tensor mode"
DDP_FUSED, FLAT_FUSED = "DDP + AdamW fused", "flat buckets + AdamW fused"
FLOOR = "flat buffers by hand + AdamW (floor)"
CONTENDERS = (DDP, FLAT, FLOOR, PER_TENSOR, DDP_FUSED, FLAT_FUSED, ZERO1, ZERO2, ZRO, FSDP)
WORLD = 2
MIB = 2**20


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/bench_zero.py",
        description="Training step and memory of ShardedOptimizer against DDP, ZeroRedundancyOptimizer and "
        "FSDP2 (2 gloo processes on 127.0.0.1, CPU, AdamW).",
    )
    add_workload_arguments(parser, bucket_help="bucket size, MiB", timeout=900.0)
    parser.add_argument("--no-trim", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--collectives",
        type=int,
        metavar="WORLD",
        help="instead: time the collectives that move slices, on WORLD gloo ranks (one flat buffer)",
    )
    return parser


# ----------------------------------------------------------------- one rank


def _by_hand(model: Any, cap: float) -> Any:
    """Return ``model`` trained through flat buffers written by hand in the storage's bucket layout.

    The layout comes from the library's pure layout function (it allocates nothing); everything
    else is plain torch: the layers' own parameters are emptied, every forward splits each flat
    buffer once and calls the model functionally on the views, and each flat gradient is
    all-reduced when it is complete.
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    from flatten_parametrize._install.grouping import bucket_groups, resolve_groups

    named = dict(model.named_parameters())
    specs = bucket_groups(model, resolve_groups(model, None), cap)
    buckets = [[slot.name for slot in spec.slots] for spec in specs]
    shapes = {name: named[name].shape for name in named}
    numels = [[shapes[name].numel() for name in names] for names in buckets]

    def all_reduce(flat: torch.Tensor) -> None:
        assert flat.grad is not None
        dist.all_reduce(flat.grad)
        flat.grad.div_(dist.get_world_size())

    class ByHand(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.flats = nn.ParameterList(
                torch.cat([named[name].detach().reshape(-1) for name in names]) for names in buckets
            )
            for flat in self.flats:
                flat.register_post_accumulate_grad_hook(all_reduce)
            self.inner = (model,)  # not a submodule: parameters() yields the flat buffers only

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            views = {}
            for names, sizes, flat in zip(buckets, numels, self.flats):
                for name, view in zip(names, flat.split(sizes)):
                    views[name] = view.view(shapes[name])
            return torch.func.functional_call(self.inner[0], views, (x,))

    wrapper = ByHand()
    for param in named.values():
        param.data = torch.empty(0)
    return wrapper


def _worker(rank: int, port: int, contender: str, config: dict[str, Any]) -> None:
    """Build one contender on this rank, warm it up, then time ``steps`` steps per ``go`` line on stdin."""
    if contender not in CONTENDERS:
        raise SystemExit(f"unknown contender {contender!r}; choose from {list(CONTENDERS)}")
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks._memory import peak_bytes, reset_peak, rss_bytes, trim
    from flatten_parametrize import ShardedOptimizer, register_flat_storage

    model, x = setup_rank(rank, port, config, timeout_s=300)
    cap = config["bucket_cap_mb"]
    params = sum(p.numel() for p in model.parameters())
    trim()
    base = rss_bytes() or 0
    opt: torch.optim.Optimizer
    state_of = None
    grads_of = None
    fused = contender in (DDP_FUSED, FLAT_FUSED) or None
    if contender in (DDP, DDP_FUSED, ZRO):
        model = DistributedDataParallel(model, bucket_cap_mb=cap)
        if contender != ZRO:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        else:
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
            state_of = opt.optim.state
    elif contender == FSDP:
        for layer in model.children():
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif contender == FLOOR:
        model = _by_hand(model, cap)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        storage = register_flat_storage(model, bucket_cap_mb=cap)
        if contender in (FLAT, PER_TENSOR, FLAT_FUSED):
            storage.broadcast_params()
            storage.enable_grad_sync()
            if contender == PER_TENSOR:
                storage.unflatten()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        else:
            opt = ShardedOptimizer(storage, torch.optim.AdamW, lr=1e-4, shard_gradients=contender == ZERO2)
            shards = [p for g in opt.local_optimizer.param_groups for p in g["params"]]
            grads_of = [*model.parameters(), *shards]
    state_of = opt.state if state_of is None else state_of
    grads_of = list(model.parameters()) if grads_of is None else grads_of

    def step(count: bool = False) -> tuple[int, int]:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        held = held_bytes(p.grad for p in grads_of if p.grad is not None) if count else 0
        opt.step()
        state = held_bytes(v for s in state_of.values() for v in s.values() if v.dim() > 0) if count else 0
        return held, state

    for _ in range(config["warmup"] - 1):
        step()
    grad_bytes, state_bytes = step(count=True)
    emit({"params": params, "grad_bytes": grad_bytes, "state_bytes": state_bytes})
    reset_peak()

    def measure(what: str) -> dict[str, float]:
        dist.barrier()
        faults_before = _minor_faults()
        start = time.perf_counter()
        for _ in range(config["steps"]):
            step()
        elapsed = time.perf_counter() - start
        return {
            "seconds": elapsed / config["steps"],
            "faults": (_minor_faults() - faults_before) / config["steps"],
            "peak_above_model": (peak_bytes() or 0) - base,
        }

    serve(measure)
    dist.destroy_process_group()


# ------------------------------------------------------------------ launcher


def _rank(argv: Sequence[str], rank: int, port: int, contender: str, env: dict[str, str]) -> Worker:
    """Start one rank of one contender."""
    return rank_worker(str(Path(__file__).resolve()), argv, rank, port, contender, env)


def _launch(argv: Sequence[str], config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Start both ranks of every contender, then time them in turns; return the measurements."""
    env = {**os.environ, "OMP_NUM_THREADS": str(config["threads"]), **_malloc_env(config)}
    pairs = {
        name: [_rank(argv, rank, port, name, env) for rank in range(WORLD)]
        for name, port in zip(CONTENDERS, free_ports(len(CONTENDERS)))
    }
    with started([rank for pair in pairs.values() for rank in pair], timeout):
        ready = {name: [rank.receive() for rank in pair] for name, pair in pairs.items()}
        found = time_in_turns(pairs, "step", config["rounds"])
    # The slower rank counts; memory is the larger rank's.
    return {
        "samples": {name: [max(m["seconds"] for m in r) for r in rounds] for name, rounds in found.items()},
        "peaks": {
            name: max(m["peak_above_model"] for r in rounds for m in r) for name, rounds in found.items()
        },
        "counted": {name: max(m["grad_bytes"] + m["state_bytes"] for m in ms) for name, ms in ready.items()},
        "params": ready[DDP][0]["params"],
    }


# ---------------------------------------------------------- collectives alone


def _collectives_rank(rank: int, world: int, port: int, numel: int, rounds: int, out: Any) -> None:
    """Time each way of moving slices of one flat buffer; rank 0 puts ``{name: [seconds]}`` in ``out``."""
    import torch
    import torch.distributed as dist

    from flatten_parametrize._distributed.sharded_collectives import all_gather, reduce_scatter

    torch.set_num_threads(1)
    join_gloo(rank, world, port, 300)
    chunk = -(-numel // world)
    flat, padded = torch.randn(numel), torch.zeros(chunk * world)
    mine = padded[rank * chunk : (rank + 1) * chunk]
    ranges = [(min(o * chunk, numel), min((o + 1) * chunk, numel)) for o in range(world)]

    def each_owner(op: Any) -> None:
        works = [op(flat[lo:hi], owner, async_op=True) for owner, (lo, hi) in enumerate(ranges) if hi > lo]
        for work in works:
            work.wait()

    def zero_padded_all_reduce() -> None:
        lo, hi = ranges[rank]
        flat[:lo].zero_()
        flat[hi:].zero_()
        dist.all_reduce(flat)

    ways = {
        "gather: broadcast from each owner (used on gloo)": lambda: each_owner(dist.broadcast),
        "gather: all_gather_into_tensor, padded (used on NCCL)": lambda: (
            all_gather(padded, mine),
            flat.copy_(padded[:numel]),
        ),
        "gather: all_reduce of a zero-padded buffer": zero_padded_all_reduce,
        "reduce: reduce to each owner (used on gloo)": lambda: each_owner(dist.reduce),
        "reduce: reduce_scatter_tensor, padded (used on NCCL)": lambda: (
            padded[:numel].copy_(flat),
            reduce_scatter(mine.clone(), padded),
        ),
        "reduce: all_reduce (ZeRO-1)": lambda: dist.all_reduce(flat),
    }
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds + 1):  # the first round warms up
        for name in ways if r % 2 == 0 else reversed(list(ways)):
            dist.barrier()
            start = time.perf_counter()
            ways[name]()
            dist.barrier()
            if r:
                samples[name].append(time.perf_counter() - start)
    if rank == 0:
        out.put(samples)
    dist.destroy_process_group()


def _collectives(world: int, config: dict[str, Any]) -> dict[str, Any]:
    """Time the collectives that move slices on ``world`` gloo ranks and print the table."""
    import multiprocessing

    numel = int(config["bucket_cap_mb"] * MIB // 4) + 1  # not a multiple of the world size: padded
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    (port,) = free_ports(1)
    procs = [
        ctx.Process(target=_collectives_rank, args=(rank, world, port, numel, config["rounds"], out))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    samples = out.get(timeout=600)
    for proc in procs:
        proc.join(60)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    table = Table(
        f"Moving the slices of one flat buffer of {numel * 4 / MIB:.0f} MiB (float32, {numel} elements) "
        f"between {world} gloo ranks",
        ["collective", "median", "ratio to the one used on gloo"],
    )
    for name, median in medians.items():
        used = next(m for n, m in medians.items() if n.split(":")[0] == name.split(":")[0] and "gloo" in n)
        table.add(name, _fmt_ms(median), f"{median / used:.2f}")
    table.notes.append(
        f"{config['rounds']} rounds after one warm-up round, alternating; median over rounds; the gathers "
        "include the copy out of the padded buffer, the reduce-scatter the copy into it."
    )
    print(table.render(), flush=True)
    return {"median_s": medians}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Time a training step of each contender, count its memory, and print the table.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        ``{"median_s", "ratio", "counted_ratio", "peak_ratio", "targets", "config"}``, each by contender
        where it applies.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    config = _config(args)
    if args.worker is not None:
        _worker(int(args.worker[0]), int(args.worker[1]), args.worker[2], config)
        return {}
    if args.collectives is not None:
        return _collectives(args.collectives, config)
    start = time.perf_counter()
    measured = _launch(argv, config, args.timeout)
    medians = {name: statistics.median(values) for name, values in measured["samples"].items()}
    ratio = {name: medians[name] / medians[DDP] for name in CONTENDERS}
    counted = measured["counted"]
    counted_ratio = {name: counted[name] / counted[DDP] for name in CONTENDERS}
    peaks = measured["peaks"]
    peak_ratio = {name: peaks[name] / peaks[DDP] if peaks[DDP] > 0 else float("nan") for name in CONTENDERS}
    table = Table(
        f"Training step with AdamW, 2 gloo ranks ({config['threads']} torch thread each): MLP "
        f"{config['depth']} x Linear({config['width']}, {config['width']}) ({measured['params'] / 1e6:.2f} M "
        f"params), batch {config['batch']} per rank, buckets of {config['bucket_cap_mb']:g} MiB",
        [
            "contender",
            "median / step",
            "spread",
            "ratio to DDP",
            "state + grads / rank",
            "ratio to DDP",
            "peak RSS / rank",
            "ratio to DDP",
        ],
    )
    for name in CONTENDERS:
        q1, _, q3 = statistics.quantiles(measured["samples"][name], n=4)
        table.add(
            name,
            _fmt_ms(medians[name]),
            f"+-{(q3 - q1) / 2 / medians[name]:.0%}",
            f"{ratio[name]:.2f}",
            f"{counted[name] / MIB:.1f} MiB",
            f"{counted_ratio[name]:.2f}",
            f"{peaks[name] / MIB:.0f} MiB",
            f"{peak_ratio[name]:.2f}",
        )
    targets = {
        "ZeRO-2 step <= 1.10x DDP": ratio[ZERO2] <= 1.10,
        "ZeRO-2 faster than ZeroRedundancyOptimizer": medians[ZERO2] < medians[ZRO],
        "ZeRO-2 faster than FSDP2": medians[ZERO2] < medians[FSDP],
        "ZeRO-2 state + grads <= 0.55x DDP": counted_ratio[ZERO2] <= 0.55,
        "flat buckets peak RSS <= 1.00x DDP": peak_ratio[FLAT] <= 1.00,
        "its floor (flat buffers by hand) peak RSS <= 1.00x DDP": peak_ratio[FLOOR] <= 1.00,
        "flat buckets fused peak RSS <= 1.00x DDP fused": peaks[FLAT_FUSED] <= peaks[DDP_FUSED],
        "per-tensor mode peak RSS <= 1.00x DDP": peak_ratio[PER_TENSOR] <= 1.00,
        "per-tensor mode step <= 1.05x DDP": ratio[PER_TENSOR] <= 1.05,
    }
    verdicts = ", ".join(f"{what}: {'met' if ok else 'NOT met'}" for what, ok in targets.items())
    table.notes += [
        f"{config['rounds']} rounds x {config['steps']} steps per contender, alternating, after "
        f"{config['warmup']} warm-up steps; median over rounds of the slower rank's time per step. "
        "`state + grads`: optimizer state and gradient tensors held after backward on the larger rank "
        "(DDP's bucket copy not counted); `peak RSS`: peak resident set during the timed steps above the "
        "built model's."
        + "".join(
            f" glibc: {key}={os.environ[key]} (from the environment)."
            for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
            if key in os.environ
        ),
        f"Targets: {verdicts}"
        + (" (--quick: sizes are tiny, the verdicts mean nothing)" if config["quick"] else "")
        + f". ({time.perf_counter() - start:.0f} s)",
    ]
    print(table.render(), flush=True)
    whole = bench_zero_whole.main(["--quick"] if config["quick"] else [])  # per-tensor optimizers
    return {
        "whole_tensors": whole,
        "median_s": medians,
        "ratio": ratio,
        "counted_ratio": counted_ratio,
        "peak_ratio": peak_ratio,
        "targets": targets,
        "config": config,
    }


if __name__ == "__main__":
    main()
