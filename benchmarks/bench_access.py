"""Workload 6: the cost of one ``layer.weight`` access.

Contenders: a plain ``nn.Linear``; the same layer inside a flattened model;
the trivial identity parametrization (the floor of any parametrize-based
design); fairscale's wrapper (after a forward its views are plain instance
attributes); the naive per-access slicing. Accesses are timed in a tight
``timeit`` loop with grad mode on (training); the loop's own overhead
(timing ``layer`` itself) is subtracted.
"""

from __future__ import annotations

import timeit
from collections.abc import Callable

import torch
from torch import nn

from benchmarks._contenders import (
    FAIRSCALE,
    FAIRSCALE_MISSING,
    fairscale_wrap,
    register_identity,
    register_naive_slices,
)
from benchmarks._timing import (
    Contender,
    Report,
    Samples,
    Settings,
    Table,
    at_most,
    fmt_ratio,
    interleave,
    ratio,
)
from flatten_parametrize import register_flat_storage

__all__ = ["run"]

PLAIN, FLAT, IDENTITY, NAIVE = "plain", "register_flat_storage", "identity parametrization", "naive slicing"


def _layers() -> dict[str, nn.Module | None]:
    """Return, per contender, the layer whose ``weight`` is read (``None`` if unavailable)."""
    plain = nn.Linear(64, 64)
    flat = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    register_flat_storage(flat)
    identity = nn.Linear(64, 64)
    register_identity(identity)
    naive = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    register_naive_slices(naive)
    inner = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    wrapped = fairscale_wrap(inner)
    if wrapped is not None:
        wrapped(torch.zeros(1, 64))  # its forward installs the views as plain attributes
    return {
        PLAIN: plain,
        FLAT: flat[1],
        IDENTITY: identity,
        FAIRSCALE: None if wrapped is None else inner[1],
        NAIVE: naive[1],
    }


def _per_access(layer: nn.Module, number: int) -> float:
    timer = timeit.Timer("layer.weight", globals={"layer": layer})
    empty = timeit.Timer("layer", globals={"layer": layer})
    return max(0.0, (timer.timeit(number) - empty.timeit(number)) / number)


def _recorder(layer: nn.Module, out: list[float], round_s: float) -> Callable[[], None]:
    """Return a call that times about ``round_s`` of accesses and appends the time per access."""
    _per_access(layer, 200)  # warm-up
    number = max(200, int(round_s / max(_per_access(layer, 200), 1e-8)))

    def record() -> None:
        out.append(_per_access(layer, number))

    return record


def run(settings: Settings) -> Report:
    """Run workload 6 and return its table and checks."""
    layers = _layers()
    samples: dict[str, list[float]] = {name: [] for name, layer in layers.items() if layer is not None}
    contenders = [
        Contender(name, None, FAIRSCALE_MISSING)
        if layer is None
        else Contender(name, _recorder(layer, samples[name], settings.round_s))
        for name, layer in layers.items()
    ]
    # Each call records the per-access time itself (the loop overhead subtracted);
    # interleave() supplies the alternating rounds.
    interleave(contenders, settings, calibrate=False)
    results = {name: Samples(values) for name, values in samples.items() if values}
    table = Table(
        "One `layer.weight` access (grad mode on, loop overhead subtracted)",
        ["contender", "median", "spread", "ratio to plain", "ratio to identity"],
    )
    for c in contenders:
        if c.name not in results:
            table.add(c.name, c.missing, "-", "-", "-")
            continue
        s = results[c.name]
        table.add(
            c.name,
            f"{s.median * 1e6:.2f} us",
            f"+-{s.spread:.0%}",
            fmt_ratio(ratio(results, c.name, PLAIN)),
            fmt_ratio(ratio(results, c.name, IDENTITY)),
        )
    flat_us = results[FLAT].median * 1e6
    return Report(
        [table],
        [
            at_most("access: flattened layer.weight", flat_us, 3.0, " us"),
            at_most("access: flattened / identity parametrization", ratio(results, FLAT, IDENTITY), 1.5),
        ],
    )
