"""Workload: evaluation and training passes of a 12-layer ``nn.TransformerEncoder``.

d_model 64, 4 heads, feed-forward 256, batch 4 x 16 tokens. Rows:

* ``eval, no_grad``: eval-mode forward under ``torch.no_grad()``, weights
  unchanged (the flat model serves cached views);
* ``eval, inference_mode``: the same under ``torch.inference_mode()``;
* ``eval after update``: eval-mode forward under ``no_grad`` right after an
  in-place update of every parameter, as after each optimizer step (the
  version counters are bumped, which is what an in-place update does to them,
  without the update's own cost);
* ``train forward+backward``: train-mode forward and backward.

Contenders: the plain model, ``register_flat_storage`` and fairscale's
``FlattenParamsWrapper``, each in a process of its own (see
``benchmarks/_processes.py``: a shared C heap makes page faults, and with them
times, depend on the other contenders), timed in turns.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._contenders import FAIRSCALE, FAIRSCALE_MISSING
from benchmarks._processes import Worker, emit, serve, started, time_in_turns, time_round
from benchmarks._timing import (
    Report,
    Samples,
    Settings,
    Table,
    at_most,
    fmt_ratio,
    fmt_time,
    paired_ratio,
    ratio,
)

__all__ = ["ROWS", "run"]

PLAIN, FLAT = "plain", "register_flat_storage"
CONTENDERS = (PLAIN, FLAT, FAIRSCALE)
NO_GRAD, INFERENCE, AFTER_UPDATE, TRAIN = (
    "eval, no_grad",
    "eval, inference_mode",
    "eval after update",
    "train forward+backward",
)
#: Row -> (target for flat / plain or None, what the row measures).
ROWS: dict[str, tuple[float | None, str]] = {
    NO_GRAD: (1.03, "eval forward under no_grad, weights unchanged"),
    INFERENCE: (1.05, "eval forward under inference_mode, weights unchanged"),
    AFTER_UPDATE: (1.10, "eval forward under no_grad after an in-place update of the weights"),
    TRAIN: (None, "train forward+backward"),
}


def _size(quick: bool) -> dict[str, int]:
    if quick:
        return {"layers": 2, "d_model": 32, "heads": 2, "feedforward": 64, "batch": 2, "tokens": 8}
    return {"layers": 12, "d_model": 64, "heads": 4, "feedforward": 256, "batch": 4, "tokens": 16}


# ---------------------------------------------------------------- one worker


def _worker(contender: str, config: dict[str, Any]) -> None:
    """Build one contender, then answer ``go <row>`` lines (each row warmed up and calibrated at first)."""
    import torch
    from torch import nn
    from torch.autograd.graph import increment_version

    from benchmarks._contenders import fairscale_wrap
    from flatten_parametrize import register_flat_storage

    torch.set_num_threads(config["threads"])
    torch.set_flush_denormal(True)
    size = config["size"]
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        size["d_model"], size["heads"], size["feedforward"], dropout=0.0, batch_first=True
    )
    model: nn.Module = nn.TransformerEncoder(layer, size["layers"], enable_nested_tensor=False)
    if contender == FLAT:
        register_flat_storage(model)
    elif contender == FAIRSCALE:
        wrapped = fairscale_wrap(model)
        if wrapped is None:
            raise SystemExit(f"fairscale is {FAIRSCALE_MISSING}")
        model = wrapped
    elif contender != PLAIN:
        raise SystemExit(f"unknown contender {contender!r}; choose from {list(CONTENDERS)}")
    params = list(model.parameters())
    x = torch.randn(
        size["batch"], size["tokens"], size["d_model"], generator=torch.Generator().manual_seed(1)
    )

    def eval_no_grad() -> None:
        with torch.no_grad():
            model(x)

    def eval_inference() -> None:
        with torch.inference_mode():
            model(x)

    def eval_after_update() -> None:
        for p in params:
            increment_version(p)
        with torch.no_grad():
            model(x)

    def train() -> None:
        for p in params:
            p.grad = None
        model(x).square().mean().backward()

    def in_mode(training: bool, fn: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            model.train(training)
            fn()

        return call

    rows = {
        NO_GRAD: in_mode(False, eval_no_grad),
        INFERENCE: in_mode(False, eval_inference),
        AFTER_UPDATE: in_mode(False, eval_after_update),
        TRAIN: in_mode(True, train),
    }
    emit({"params": sum(p.numel() for p in params)})
    calls: dict[str, int] = {}

    def measure(row: str) -> dict[str, float]:
        return {"seconds": time_round(calls, row, rows[row], config["warmup"], config["round_s"])}

    serve(measure)


# ------------------------------------------------------------------ launcher


def run(settings: Settings) -> Report:
    """Time every row for every contender, each contender in its own process."""
    config = {
        "size": _size(settings.quick),
        "threads": settings.threads,
        "warmup": settings.warmup,
        "round_s": settings.round_s,
    }
    root = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(settings.threads),
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    names = [c for c in CONTENDERS if not (c == FAIRSCALE and FAIRSCALE_MISSING)]
    workers = {
        name: [
            Worker(
                [sys.executable, "-m", "benchmarks.bench_eval", "--worker", name, json.dumps(config)],
                f"bench_eval: {name!r}",
                env,
            )
        ]
        for name in names
    }
    results: dict[str, dict[str, Samples]] = {}
    with started([w for ws in workers.values() for w in ws], timeout=900):
        params = {name: ws[0].receive()["params"] for name, ws in workers.items()}
        for row in ROWS:
            found = time_in_turns(workers, row, settings.rounds)
            results[row] = {
                name: Samples([messages[0]["seconds"] for messages in rounds])
                for name, rounds in found.items()
            }
    size = config["size"]
    table = Table(
        f"TransformerEncoder passes, each contender in its own process ({size['layers']} layers, d_model "
        f"{size['d_model']}, batch {size['batch']} x {size['tokens']}, {params[PLAIN]:,} params)",
        [
            "row",
            *(f"{c} median" for c in CONTENDERS),
            "flat / plain",
            "fairscale / plain",
            "flat / plain (paired)",
            "target",
        ],
    )
    report = Report([table])
    for row, (target, what) in ROWS.items():
        res = results[row]
        cells = [fmt_time(res[c].median) + f" +-{res[c].spread:.0%}" if c in res else "-" for c in CONTENDERS]
        flat, fair = ratio(res, FLAT, PLAIN), ratio(res, FAIRSCALE, PLAIN)
        paired = paired_ratio(res, FLAT, PLAIN)
        limit = "-" if target is None else f"<= {target}"
        table.add(row, *cells, fmt_ratio(flat), fmt_ratio(fair), fmt_ratio(paired), limit)
        if target is not None:
            report.checks.append(at_most(f"TransformerEncoder {what}: flat / plain (paired)", paired, target))
    if FAIRSCALE_MISSING:
        table.notes.append(f"{FAIRSCALE}: {FAIRSCALE_MISSING}.")
    table.notes.append(
        f"{settings.rounds} rounds per row, contenders alternating (forward, then reverse order); median "
        "time per pass and half the interquartile range. `eval after update` bumps every parameter's "
        "version before each pass, as an optimizer step does. (paired): the median over rounds of the two "
        "contenders' times in the same round (load that drifts over the run cancels out); the targets are "
        "checked on it."
    )
    return report


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], json.loads(sys.argv[3]))
    else:
        raise SystemExit("bench_eval runs as a workload of `python -m benchmarks --only eval`")
