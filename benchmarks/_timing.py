"""Shared measuring machinery: settings, interleaved rounds, medians, tables, target checks.

Every workload times its contenders *in one process, alternating*: one round
runs each contender once (a calibrated number of calls), in forward order on
even rounds and in reverse order on odd ones (A B C, C B A, ...), so that
drifting machine load hits every contender alike. A contender's figure is the
median over rounds of its time per call; the spread column is half the
interquartile range relative to the median, a direct view of the noise.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "Check",
    "Contender",
    "Report",
    "Samples",
    "Settings",
    "Table",
    "fmt_ratio",
    "fmt_time",
    "interleave",
    "call_by_call",
    "call_by_call_arguments",
    "print_call_by_call",
    "at_least",
    "at_most",
    "ratio",
    "set_threads",
    "timing_table",
]


@dataclass(frozen=True)
class Settings:
    """How a run measures.

    Attributes:
        quick: a smoke run with tiny sizes; its numbers mean nothing.
        rounds: timed rounds per contender (at least 5).
        warmup: untimed calls per contender before the first round.
        round_s: calls per round are calibrated to take about this long.
        threads: ``torch.set_num_threads`` for the whole run.
        out_dir: where plots and ``results.md`` are written.
        save_plot: also write the README plot ``benchmarks/depth_sweep.png``.
    """

    quick: bool = False
    rounds: int = 15
    warmup: int = 3
    round_s: float = 0.2
    threads: int = 2
    out_dir: Path = Path("benchmarks/out")
    save_plot: bool = False

    def __post_init__(self) -> None:
        if self.rounds < 5:
            raise ValueError(f"at least 5 timed rounds are needed for a median; got rounds={self.rounds}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1; got {self.threads}")


@dataclass
class Contender:
    """One way of doing the measured thing.

    Attributes:
        name: row label.
        fn: one call of the measured operation; ``None`` if unavailable.
        missing: why ``fn`` is ``None`` (e.g. ``"not installed"``).
    """

    name: str
    fn: Callable[[], object] | None
    missing: str = ""


@dataclass
class Samples:
    """Seconds per call, one value per timed round."""

    values: list[float]

    @property
    def median(self) -> float:
        """Return the median seconds per call."""
        return statistics.median(self.values)

    @property
    def spread(self) -> float:
        """Return half the interquartile range relative to the median (0.05 = +-5 %)."""
        if len(self.values) < 4:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.values, n=4)
        return (q3 - q1) / 2 / self.median


def _time_calls(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _calibrate(fn: Callable[[], object], round_s: float) -> int:
    once = _time_calls(fn, 1)
    return max(1, min(100_000, math.ceil(round_s / max(once, 1e-9))))


def interleave(
    contenders: Sequence[Contender], settings: Settings, rounds: int | None = None, calibrate: bool = True
) -> dict[str, Samples]:
    """Time ``contenders`` in alternating rounds and return their samples by name.

    Contenders without a function are skipped (they have no entry).

    Args:
        contenders: what to time; each ``fn`` is one call of the operation.
        settings: warm-up, rounds and round length.
        rounds: override ``settings.rounds`` (never below 5).
        calibrate: warm up and repeat each call to fill ``settings.round_s``;
            with ``False`` every round makes exactly one call per contender
            (for calls that time themselves) and there is no warm-up.
    """
    active = [(c.name, c.fn) for c in contenders if c.fn is not None]
    for _ in range(settings.warmup if calibrate else 0):
        for _, fn in active:
            fn()
    calls = {name: _calibrate(fn, settings.round_s) if calibrate else 1 for name, fn in active}
    samples: dict[str, list[float]] = {name: [] for name, _ in active}
    # A full collection over torch's heap takes ~0.2 s: do it once (not in a
    # smoke run), freeze the survivors, and collect only what the rounds leave.
    if not settings.quick:
        gc.collect()
    gc.freeze()
    try:
        for r in range(max(5, rounds or settings.rounds)):
            gc.collect(1)
            for name, fn in active if r % 2 == 0 else reversed(active):
                samples[name].append(_time_calls(fn, calls[name]))
    finally:
        gc.unfreeze()
    return {name: Samples(values) for name, values in samples.items()}


def call_by_call(calls: dict[str, Callable[[], object]], turns: int) -> dict[str, list[float]]:
    """Time one call of each contender per turn, the order alternating; return the seconds of each call."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for turn in range(turns):
        for name in names if turn % 2 == 0 else reversed(names):
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return times


def call_by_call_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, turns: int
) -> argparse.Namespace:
    """Add the options every call-by-call script takes, parse ``argv`` and set torch up for timing.

    The options are ``--turns`` (default ``turns``), ``--threads`` (torch's intra-op threads, default 2)
    and ``--quick``; denormals are flushed, as in ``python -m benchmarks``.
    """
    parser.add_argument("--turns", type=int, default=turns)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    torch.set_flush_denormal(True)
    return args


def print_call_by_call(times: dict[str, list[float]], base: str, ms_digits: int = 1) -> dict[str, float]:
    """Print the table of :func:`call_by_call`'s ``times``: each median and its two ratios to ``base``.

    Returns:
        Each contender's median of the per-turn ratios to ``base``.
    """
    print(f"| contender | median | / {base} (medians) | / {base} (median of per-turn ratios) |")
    print("|---|---:|---:|---:|")
    paired = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        paired[name] = statistics.median(a / b for a, b in zip(samples, times[base]))
        of_medians = median / statistics.median(times[base])
        print(f"| {name} | {median * 1e3:.{ms_digits}f} ms | {of_medians:.3f} | {paired[name]:.3f} |")
    return paired


def fmt_time(seconds: float) -> str:
    """Format a duration with a unit that keeps three significant digits."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def fmt_ratio(value: float | None) -> str:
    """Format a ratio (``-`` when unknown)."""
    return "-" if value is None else f"{value:.2f}"


def ratio(results: dict[str, Samples], name: str, baseline: str) -> float | None:
    """Return the median of ``name`` over the median of ``baseline`` (``None`` if either is missing)."""
    if name not in results or baseline not in results:
        return None
    return results[name].median / results[baseline].median


def paired_ratio(results: dict[str, Samples], name: str, baseline: str) -> float | None:
    """Return the median over rounds of ``name``'s time over ``baseline``'s in the same round.

    Both contenders' samples must be in round order (:func:`benchmarks._processes.time_in_turns`):
    a round's contenders run seconds apart, so load that drifts over the run cancels out of each
    ratio (``None`` if either is missing).
    """
    if name not in results or baseline not in results:
        return None
    pairs = zip(results[name].values, results[baseline].values)
    return statistics.median(a / b for a, b in pairs)


@dataclass
class Table:
    """A titled table, printed as Markdown so that ``RESULTS.md`` can take it as is."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        """Append a row (cells are formatted with ``str``)."""
        self.rows.append([str(c) for c in cells])

    def render(self) -> str:
        """Return the table as Markdown: a heading, the aligned table, then its notes."""
        widths = [len(c) for c in self.columns]
        for row in self.rows:
            widths = [max(w, len(cell)) for w, cell in zip(widths, row)]

        def line(cells: Sequence[str]) -> str:
            padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
            return "| " + " | ".join(padded) + " |"

        rule = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
        out = [f"### {self.title}", "", line(self.columns), rule, *(line(r) for r in self.rows)]
        if self.notes:
            out += ["", *self.notes]
        return "\n".join(out)


def timing_table(
    title: str, contenders: Sequence[Contender], results: dict[str, Samples], baseline: str
) -> Table:
    """Return the standard table: median, spread and ratio to ``baseline`` per contender."""
    table = Table(title, ["contender", "median", "spread", f"ratio to {baseline}"])
    for c in contenders:
        if c.name in results:
            s = results[c.name]
            table.add(
                c.name, fmt_time(s.median), f"+-{s.spread:.0%}", fmt_ratio(ratio(results, c.name, baseline))
            )
        else:
            table.add(c.name, c.missing or "not run", "-", "-")
    return table


@dataclass(frozen=True)
class Check:
    """One target of the issue, checked against a measured value.

    Attributes:
        what: the measured quantity.
        value: the measured value (``None`` when a contender was missing).
        target: the target in words, e.g. ``"<= 1.15"``.
        met: whether the target is met (``None`` when unknown).
    """

    what: str
    value: str
    target: str
    met: bool | None


def at_most(what: str, value: float | None, limit: float, unit: str = "") -> Check:
    """Return the check ``value <= limit``."""
    shown = "-" if value is None else f"{value:.3g}{unit}"
    return Check(what, shown, f"<= {limit:.3g}{unit}", None if value is None else value <= limit)


def at_least(what: str, value: float | None, limit: float, unit: str = "") -> Check:
    """Return the check ``value >= limit``."""
    shown = "-" if value is None else f"{value:.3g}{unit}"
    return Check(what, shown, f">= {limit:.3g}{unit}", None if value is None else value >= limit)


@dataclass
class Report:
    """What one workload produced: tables to print and targets to check."""

    tables: list[Table] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)


def set_threads(threads: int) -> None:
    """Fix torch's intra-op threads for the whole run."""
    torch.set_num_threads(threads)
