"""In-process A/B of per-tensor mode's forward+backward: the deep MLP of ``bench_mlp.py``, call by call.

Contenders, all in one process, taking turns after every call (the order alternating): the plain
model and per-tensor mode after ``zero_grad()``, the per-tensor floor (the plain step plus one
``_foreach_copy_`` of every gradient into one buffer, no library), and the plain model, per-tensor
mode and the plain model over one weight and one gradient buffer (per-tensor mode's layout by hand,
no library: its floor then) with gradients accumulating (no ``zero_grad()``). With ``--base DIR`` (a folder
holding another version's ``flatten_parametrize`` package, e.g. ``git archive <commit>
flatten_parametrize | tar -x -C DIR``) that version's per-tensor mode runs too, imported under
another name. Each line gives the median time per call (and the page faults per call, which glibc's
returning freed memory to the system shows as) and the paired ratios (the median over turns of the
two contenders' times in the same turn).

Run: ``PYTHONPATH=. python -m benchmarks.ab_per_tensor_mlp [--depths 50 200 800] [--threads 1]
[--turns 150] [--base DIR]``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

import flatten_parametrize
from benchmarks._contenders import import_base
from benchmarks._timing import call_by_call_arguments
from benchmarks.bench_mlp import over_one_buffer

WIDTH, BATCH = 64, 32


def _mlp(depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(depth)])


def _per_tensor(library: ModuleType, depth: int) -> nn.Module:
    model = _mlp(depth)
    library.register_flat_storage(model).unflatten()
    return model


def _step(model: nn.Module, x: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    model(x).sum().backward()


def _contenders(depth: int, base: ModuleType | None) -> dict[str, Callable[[], None]]:
    x = torch.randn(BATCH, WIDTH)
    plain, floor, per_tensor = _mlp(depth), _mlp(depth), _per_tensor(flatten_parametrize, depth)
    sizes = [p.numel() for p in floor.parameters()]
    slots = [s.view(p.shape) for s, p in zip(torch.empty(sum(sizes)).split(sizes), floor.parameters())]
    accumulating = {
        "plain": _mlp(depth),
        "per-tensor": _per_tensor(flatten_parametrize, depth),
        "one buffer": over_one_buffer(_mlp(depth)),
    }

    def landing() -> None:
        _step(floor, x)
        torch._foreach_copy_(slots, [p.grad for p in floor.parameters()])

    calls = {
        "plain": lambda: _step(plain, x),
        "floor": landing,
        "per-tensor": lambda: _step(per_tensor, x),
        "plain, accumulating": lambda: accumulating["plain"](x).sum().backward(),
        "per-tensor, accumulating": lambda: accumulating["per-tensor"](x).sum().backward(),
        "one buffer, accumulating": lambda: accumulating["one buffer"](x).sum().backward(),
    }
    if base is not None:
        before, before_accumulating = _per_tensor(base, depth), _per_tensor(base, depth)
        calls["base per-tensor"] = lambda: _step(before, x)
        calls["base per-tensor, accumulating"] = lambda: before_accumulating(x).sum().backward()
    return calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[50, 200, 800])
    parser.add_argument("--base", type=Path, default=None, help="folder holding another flatten_parametrize")
    args = call_by_call_arguments(parser, argv, turns=150)
    base = None if args.base is None else import_base(args.base)
    pairs = [("per-tensor", "floor"), ("per-tensor", "plain"), ("floor", "plain")]
    pairs.append(("per-tensor, accumulating", "plain, accumulating"))
    pairs.append(("one buffer, accumulating", "plain, accumulating"))
    if base is not None:
        pairs += [("base per-tensor", "floor"), ("base per-tensor, accumulating", "plain, accumulating")]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.turns} turns")
    for depth in [5] if args.quick else args.depths:
        calls = _contenders(depth, base)
        for call in calls.values():
            for _ in range(5):
                call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        faults: dict[str, list[int]] = {name: [] for name in calls}
        names = list(calls)
        for turn in range(args.turns):
            for name in names if turn % 2 == 0 else reversed(names):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - start)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        medians = ", ".join(
            f"{name} {statistics.median(t) * 1e3:.2f} ms ({statistics.mean(faults[name]):.0f} faults)"
            for name, t in times.items()
        )
        print(f"depth {depth}: {medians}")
        paired = [
            f"{a} / {b} {statistics.median(x / y for x, y in zip(times[a], times[b])):.3f}" for a, b in pairs
        ]
        print("  " + "; ".join(paired))


if __name__ == "__main__":
    main()
