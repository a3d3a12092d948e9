"""The 2-rank gloo row of ``bench_mixed_precision.py``: the flattened model's policy against FSDP2's.

The encoder of ``bench_mixed_precision.py`` (the same size; ``--quick``: the
tiny one), one training step per call on 2 gloo ranks on 127.0.0.1, each rank
its own micro-batch (zero_grad, forward, backward with the gradients reduced
across the ranks, AdamW step), one policy for everyone:
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (``reduce_dtype`` None:
gradients travel in bfloat16 for every contender). Contenders, each a pair of
processes of its own, all alive at once and timed one pair at a time in
alternating rounds (``benchmarks/_processes.py``):

* ``FSDP2 + mp_policy``: the plain model with ``fully_shard(layer,
  mp_policy=policy)`` on each encoder layer, then on the root (FSDP2's recipe);
* ``flat + policy + grad sync``: ``register_flat_storage(model,
  mixed_precision=policy)``, ``storage.enable_grad_sync()``, every rank
  stepping the whole model;
* ``flat + policy + ZeRO-2``: the same storage under
  ``ShardedOptimizer(storage, AdamW, shard_gradients=True)``.

A round counts the slower rank. ``held / rank``: bytes of the parameters,
gradients and optimizer state this rank holds after a step (a ``DTensor``'s
local shard; views once), compute copies included.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._memory import held_bytes
from benchmarks._processes import (
    STEADY_HEAP,
    Worker,
    calls_per_round,
    emit,
    free_ports,
    join_gloo,
    serve,
    time_in_turns,
)
from benchmarks._timing import Table, fmt_time

__all__ = ["CONTENDERS", "start", "table", "wait_ready"]

FSDP2, FLAT_SYNC, FLAT_ZERO2 = "FSDP2 + mp_policy", "flat + policy + grad sync", "flat + policy + ZeRO-2"
CONTENDERS = (FSDP2, FLAT_SYNC, FLAT_ZERO2)
WORLD = 2
#: Timed rounds at most (a round is about a second of steps per contender in a full run).
ROUNDS = 7


def _worker(rank: int, port: int, contender: str, config: dict[str, Any]) -> None:
    """Build one contender on this rank, then time a round of steps per ``go`` line (calibrated at first)."""
    if contender not in CONTENDERS:
        raise SystemExit(f"unknown contender {contender!r}; choose from {list(CONTENDERS)}")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from benchmarks._mixed_precision_models import build
    from flatten_parametrize import ShardedOptimizer, register_flat_storage

    torch.set_num_threads(config["threads"])
    torch.set_flush_denormal(True)
    join_gloo(rank, WORLD, port, 300)
    model, batches, loss = build("encoder", config["size"])
    x = batches[rank]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    opt: torch.optim.Optimizer
    held: list[Any] = []  # tensors this rank holds besides the parameters, gradients and state
    if contender == FSDP2:
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        grads_of: list[Any] = list(model.parameters())
    else:
        storage = register_flat_storage(model, mixed_precision=policy)
        if contender == FLAT_SYNC:
            storage.enable_grad_sync()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            grads_of = list(model.parameters())
        else:
            opt = ShardedOptimizer(storage, torch.optim.AdamW, lr=1e-4, shard_gradients=True)
            shards = [p for g in opt.local_optimizer.param_groups for p in g["params"]]
            grads_of = [*model.parameters(), *shards]
        with torch.no_grad():
            held = [v for _, v in storage.named_views()]  # the bfloat16 compute copies

    def step() -> None:
        opt.zero_grad()
        loss(model, x).backward()
        opt.step()

    step()  # the gradients and optimizer state exist from here on
    state = opt.state if contender != FLAT_ZERO2 else opt.local_optimizer.state  # type: ignore[attr-defined]
    nbytes = held_bytes(
        [
            *grads_of,
            *(p.grad for p in grads_of if p.grad is not None),
            *(v for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
            *held,
        ]
    )
    emit({"params": sum(p.numel() for p in model.parameters()), "held": nbytes})
    calls: dict[str, int] = {}

    def slowest(seconds: float) -> float:  # every rank runs the same number of steps
        once = torch.tensor([seconds])
        dist.all_reduce(once, op=dist.ReduceOp.MAX)
        return float(once)

    def measure(what: str) -> dict[str, float]:
        n = calls_per_round(calls, what, step, config["warmup"], config["round_s"], slowest)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            step()
        return {"seconds": (time.perf_counter() - start) / n, "calls": n}

    serve(measure)
    dist.destroy_process_group()


def _threads(settings: Any) -> int:
    return max(1, settings.threads // WORLD)


def start(settings: Any, size: dict[str, Any]) -> dict[str, list[Worker]]:
    """Start both ranks of every contender; they build and take one step, then wait for ``go`` lines.

    Args:
        settings: the run's :class:`benchmarks._timing.Settings` (each rank gets half its threads).
        size: the sizes of ``bench_mixed_precision.py`` (its ``"encoder"`` entry is used).

    Returns:
        The pair of workers of every contender, for :func:`table` (and for ``started``).
    """
    threads = _threads(settings)
    config = {
        "size": size,
        "threads": threads,
        "warmup": settings.warmup,
        "round_s": settings.round_s * 4,  # a step of two ranks varies more than one process's
    }
    root = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        **STEADY_HEAP,  # as the one-process contenders (bench_mixed_precision.py)
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    pairs = {
        name: [
            Worker(
                [sys.executable, "-m", "benchmarks._mixed_precision_ranks", "--worker", str(rank), str(port),
                 name, json.dumps(config)],
                f"_mixed_precision_ranks: {name!r} rank {rank}",
                env,
            )
            for rank in range(WORLD)
        ]
        for name, port in zip(CONTENDERS, free_ports(len(CONTENDERS)))
    }  # fmt: skip
    return pairs


def wait_ready(pairs: dict[str, list[Worker]]) -> dict[str, list[dict[str, Any]]]:
    """Wait until every started rank has built its contender (then idles); return their first messages.

    Call it before timing anything else: a rank still building takes the CPUs that the other
    timings measure on.
    """
    return {name: [w.receive() for w in pair] for name, pair in pairs.items()}


def table(
    pairs: dict[str, list[Worker]],
    ready: dict[str, list[dict[str, Any]]],
    settings: Any,
    size: dict[str, Any],
) -> Table:
    """Time the ready pairs in alternating rounds; return the table of medians, ratios to FSDP2, memory."""
    threads = _threads(settings)
    rounds = min(settings.rounds, ROUNDS)
    found = time_in_turns(pairs, "step", rounds)
    samples = {name: [max(m["seconds"] for m in r) for r in per_round] for name, per_round in found.items()}
    medians = {name: statistics.median(values) for name, values in samples.items()}
    held = {name: max(m["held"] for m in ms) for name, ms in ready.items()}
    s = size["encoder"]
    out = Table(
        f"Mixed precision on 2 gloo ranks ({threads} torch thread each), encoder ({s['layers']} layers, "
        f"d_model {s['d_model']}, batch {s['batch']} x {s['tokens']} per rank, "
        f"{ready[FSDP2][0]['params']:,} params), MixedPrecisionPolicy(param_dtype=torch.bfloat16), AdamW",
        ["contender", "median / step", "spread", "ratio to FSDP2", "held / rank", "ratio to FSDP2"],
    )
    for name in CONTENDERS:
        q1, _, q3 = statistics.quantiles(samples[name], n=4)
        out.add(
            name,
            fmt_time(medians[name]),
            f"+-{(q3 - q1) / 2 / medians[name]:.0%}",
            f"{medians[name] / medians[FSDP2]:.2f}",
            _fmt_bytes(held[name]),
            f"{held[name] / held[FSDP2]:.2f}",
        )
    calls = sorted({r[0]["calls"] for per_round in found.values() for r in per_round})
    out.notes.append(
        f"{rounds} rounds of {'-'.join(map(str, calls[:: max(1, len(calls) - 1)]))} steps, "
        "contenders alternating (forward, then reverse order), each a pair of processes of its own; median "
        "over rounds of the slower rank's time per step. FSDP2 shards each encoder layer and the root and "
        "all-gathers in bfloat16; the flat contenders keep float32 masters and one bfloat16 compute copy per "
        "group (held / rank: parameters, compute copies, gradients and AdamW state on the larger rank). "
        "AdamW in torch's default implementation for all three."
    )
    return out


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))
    else:
        raise SystemExit("_mixed_precision_ranks runs inside `python -m benchmarks --only mixed_precision`")
