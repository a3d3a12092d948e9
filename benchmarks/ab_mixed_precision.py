"""In-process A/B of the mixed-precision rows: the contenders of ``bench_mixed_precision.py`` call by call.

``python -m benchmarks --only mixed_precision`` runs each contender in a process
of its own and times rounds of calls in turns; on a 2-CPU virtual machine its
per-run ratios move by up to 0.1. Here all contenders live in one process and
take turns after every call (the order alternates), so that each comparison is
between calls a few milliseconds apart; the table gives the median time per
call and two ratios to the baseline: of the medians, and the median of the
per-turn ratios.

Run: ``PYTHONPATH=. python -m benchmarks.ab_mixed_precision --model gpt2 --row 1``
(``--row``: ``1`` or ``4`` micro-batches per step, ``fb`` for forward+backward).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks import _mixed_precision_models as models
from benchmarks import bench_mixed_precision as bench
from benchmarks._timing import call_by_call, call_by_call_arguments, print_call_by_call

ROWS = {"1": bench.STEP1, "4": bench.STEP4, "fb": bench.FWD_BWD}


def _call(trainer: bench._Trainer, batches: list[torch.Tensor], row: str) -> Callable[[], object]:
    if row == bench.STEP1:
        return lambda: trainer.step(batches[:1])
    if row == bench.STEP4:
        return lambda: trainer.step(batches)

    def forward_backward() -> None:
        trainer.opt.zero_grad()
        if trainer.hand:  # as the workload's forward+backward row
            trainer.cast_in()
        trainer.forward_backward(batches[0])

    return forward_backward


def main(argv: list[str] | None = None) -> None:
    """Print the median time per call of each contender and its ratios to the baseline."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=bench.MODELS, default="gpt2")
    parser.add_argument("--row", choices=sorted(ROWS), default="1")
    args = call_by_call_arguments(parser, argv, turns=30)
    row = ROWS[args.row]
    names = [bench.AUTOCAST, bench.BF16, bench.HAND, bench.LEAN, bench.POLICY, bench.PT_POLICY]
    base = bench.BF16 if row == bench.FWD_BWD else bench.AUTOCAST
    size = models.size(args.quick)  # --quick: the GPT-2 is a torch-only stand-in
    calls = {}
    for name in names:
        model, batches, loss = models.build(args.model, size)
        calls[name] = _call(bench._Trainer(name, model, loss), batches, row)
        for _ in range(3):
            calls[name]()
    times = call_by_call(calls, args.turns)
    print(
        f"{args.model}, {row}, {args.turns} turns, {args.threads} threads; ratios to {base} (lower is faster)"
    )
    print_call_by_call(times, base, ms_digits=2)


if __name__ == "__main__":
    main()
