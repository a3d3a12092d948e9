"""In-process A/B of the per-tensor rows of ``bench_transformer.py``: plain, per-tensor, flat, step by step.

``python -m benchmarks --only transformer`` times rounds of steps per contender; on a shared 2-CPU virtual
machine its ratios move by 0.1 or more from run to run. Here the three contenders of each per-tensor table
(the same models, optimizers and batches) take turns after every training step, the order alternating, so
that each comparison is between steps a few milliseconds apart; the table gives the median time per step
and two ratios to the plain model: of the medians, and the median of the per-turn ratios.

Run: ``PYTHONPATH=. python -m benchmarks.ab_per_tensor [--turns 40] [--threads 2]``.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import bench_transformer as bench
from benchmarks._timing import call_by_call, call_by_call_arguments, print_call_by_call


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Print, per optimizer, the median step of each contender and its ratios to the plain model.

    Returns:
        ``{optimizer: {contender: median of the per-turn ratios to plain}}``.
    """
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    args = call_by_call_arguments(parser, argv, turns=40)
    batch, tokens, d_model = (2, 8, 32) if args.quick else (8, 32, 128)
    torch.manual_seed(1)
    x, y = torch.randn(batch, tokens, d_model), torch.randn(batch, tokens, d_model)
    out: dict[str, dict[str, float]] = {}
    for label, make in bench.PER_TENSOR_OPTIMIZERS.items():
        contenders = bench._per_tensor_contenders(make, args.quick, x, y)
        times = call_by_call({c.name: c.fn for c in contenders if c.fn is not None}, args.turns)
        print(f"\n{label}: {args.turns} turns, {args.threads} threads; ratios to plain (lower is faster)")
        out[label] = print_call_by_call(times, bench.PLAIN)
    return out


if __name__ == "__main__":
    main()
