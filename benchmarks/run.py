"""Command line of the benchmarks: ``python -m benchmarks`` or ``python benchmarks/run.py``.

Runs the workloads (all, or those named with ``--only``), prints one Markdown
table per measurement and a summary of the issue's targets, and writes the
same text to ``<out>/results.md`` (``--save-results`` also writes each workload's
section of ``benchmarks/RESULTS.md``, with the run's command, machine and date, and keeps the sections of
the workloads it did not run). ``--quick`` is the smoke run the test suite
executes: tiny sizes, meaningless numbers, every code path.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import io
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from benchmarks._timing import Check

__all__ = ["WORKLOADS", "main"]

#: Workload name -> (module, one-line description).
WORKLOADS: dict[str, tuple[str, str]] = {
    "mlp": ("benchmarks.bench_mlp", "deep MLP forward+backward, depth sweep and plot"),
    "transformer": ("benchmarks.bench_transformer", "TransformerEncoder training step with AdamW"),
    "optim": ("benchmarks.bench_optim", "optimizer step alone, per-parameter against flat"),
    "state_dict": ("benchmarks.bench_state_dict", "state_dict() and load_state_dict(): time, memory"),
    "register": ("benchmarks.bench_register", "register_flat_storage on a large model: time, peak RSS"),
    "access": ("benchmarks.bench_access", "cost of one layer.weight access"),
    "eval": ("benchmarks.bench_eval", "TransformerEncoder eval and train passes, one process per contender"),
    "mixed_precision": (
        "benchmarks.bench_mixed_precision",
        "bfloat16 training with float32 masters: autocast, pure bf16, mixed_precision=MixedPrecisionPolicy",
    ),
    "ddp": ("benchmarks.bench_ddp", "data-parallel gradient sync (benchmarks/bench_ddp.py)"),
    "zero": ("benchmarks.bench_zero", "sharded optimizers, ZeRO-1/2 (benchmarks/bench_zero.py)"),
    "zero_scale": (
        "benchmarks.bench_zero_scale",
        "whole-tensor ownership at 8 to 1024 ranks on meta-device models (benchmarks/bench_zero_scale.py)",
    ),
}
#: Workloads that are scripts of their own (``main(argv)``, process pairs); left out of ``--quick``.
SCRIPTS = ("ddp", "zero", "zero_scale")
#: Workloads of one process per contender that ``--quick`` runs only when named with ``--only``.
SEPARATE = ("mixed_precision",)
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_PREFACE = """
The current figures of each workload of `python -m benchmarks` (see `python -m benchmarks --help`): one
section per workload, its latest recorded run, each with the command, the machine and the date of that run.
`python -m benchmarks --save-results` writes the sections of the workloads it ran and keeps the others. Every
workload alternates its contenders in one process after a warm-up (forward order, then reverse) and reports
the median over the timed rounds, the spread (half the interquartile range relative to the median) and the
ratio to the plain model; only ratios within one table are comparable, since machine load drifts between
tables. Registration runs in fresh subprocesses; the eval workload gives each contender its own process and
the data-parallel workloads their own pair of processes (a shared C heap changes page faults). Earlier runs
are kept in `benchmarks/HISTORY.md`.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmarks of flatten_parametrize against the plain model, fairscale and "
        "parameters_to_vector. Workloads: "
        + "; ".join(f"{name}: {desc}" for name, (_, desc) in WORKLOADS.items()),
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, numbers mean nothing")
    parser.add_argument(
        "--only",
        action="append",
        metavar="WORKLOAD",
        help="run only these workloads (repeat or comma-separate): " + ", ".join(WORKLOADS),
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15; 5 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "out", help="folder for plots and results.md")
    parser.add_argument(
        "--save-plot", action="store_true", help="also write the README plot benchmarks/depth_sweep.png"
    )
    parser.add_argument(
        "--save-results",
        action="store_true",
        help="also write the run's sections of benchmarks/RESULTS.md (one per workload run)",
    )
    return parser


def _selected(only: list[str] | None, quick: bool) -> tuple[list[str], list[str]]:
    """Return (workloads to run, notes about skipped ones)."""
    if only is None:
        names = list(WORKLOADS)
        if quick:
            names = [n for n in names if n not in SCRIPTS + SEPARATE]
            return names, [
                f"{n}: skipped in --quick (run `python -m benchmarks --only {n} --quick`)"
                for n in SCRIPTS + SEPARATE
            ]
        return names, []
    names = [n.strip() for item in only for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    return names, []


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_gib() -> str:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    return "unknown"


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" (on {os.cpu_count()} CPUs)"
    except OSError:
        return "unknown"


def header(threads: int, quick: bool, argv: Sequence[str]) -> str:
    """Return the run's header: machine, versions, settings."""
    import torch

    from benchmarks._contenders import FAIRSCALE_MISSING

    try:
        from importlib.metadata import version

        fairscale = FAIRSCALE_MISSING or version("fairscale")
    except Exception:
        fairscale = FAIRSCALE_MISSING or "unknown version"
    lines = [
        f"- command: `{' '.join(['python -m benchmarks', *argv])}`",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {_cpu_model()}, {os.cpu_count()} logical CPUs, {_memory_gib()} RAM, "
        f"{platform.system()} {platform.release()}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, fairscale {fairscale}",
        f"- load average at start: {_load()}",
        f"- torch threads: {threads}; float32; flush denormals on; "
        f"{'--quick (smoke run: numbers mean nothing)' if quick else 'full run'}",
    ]
    return "\n".join(lines)


def _run_script(name: str, quick: bool) -> str:
    """Run a workload that is a script of its own (``main(argv)``) and return its output."""
    try:
        module = importlib.import_module(WORKLOADS[name][0])
    except ImportError as error:
        return f"{name}: not available ({error})"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        module.main(["--quick"] if quick else [])
    return buffer.getvalue().rstrip()


def _checks_table(checks: Sequence[Check], quick: bool) -> str:
    from benchmarks._timing import Table

    table = Table("Targets of the issue", ["check", "measured", "target", "met"])
    for c in checks:
        table.add(c.what, c.value, c.target, "-" if c.met is None else ("yes" if c.met else "NO"))
    if quick:
        table.notes.append("--quick: sizes are tiny and rounds short, so these verdicts mean nothing.")
    return table.render()


def results_file(old: str, ran: dict[str, str], run_header: str) -> str:
    """Return ``RESULTS.md`` with the sections of the workloads in ``ran`` replaced by this run's.

    One ``## <workload>: <description>`` section per workload, in ``WORKLOADS`` order: a workload this run
    ran gets the run's header (command, date, machine, ...) and its tables; any other keeps its section of
    ``old``.
    """
    kept: dict[str, str] = {}
    for chunk in re.split(r"^(?=## )", old, flags=re.MULTILINE)[1:]:
        name = chunk[3:].split(":", 1)[0].strip()
        if name in WORKLOADS:
            kept[name] = chunk.strip()
    for name, text in ran.items():
        kept[name] = f"## {name}: {WORKLOADS[name][1]}\n\n{run_header}\n\n{text.strip()}"
    parts = ["# flatten_parametrize benchmarks\n" + RESULTS_PREFACE.rstrip()]
    parts += [kept[name] for name in WORKLOADS if name in kept]
    return "\n\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    import torch

    from benchmarks._timing import Settings, set_threads

    # One thread in --quick: a smoke run on a busy machine stays fast and steady.
    threads = args.threads or (1 if args.quick else torch.get_num_threads())
    rounds = args.rounds or (5 if args.quick else 15)
    settings = Settings(
        quick=args.quick,
        rounds=rounds,
        warmup=1 if args.quick else 3,
        round_s=0.01 if args.quick else 0.2,
        threads=threads,
        out_dir=args.out,
        save_plot=args.save_plot,
    )
    set_threads(threads)
    torch.set_flush_denormal(True)
    names, notes = _selected(args.only, args.quick)
    run_header = header(threads, args.quick, argv)
    sections = ["# flatten_parametrize benchmarks", "", run_header]
    saved: dict[str, str] = {}
    print("\n".join(sections), flush=True)
    checks: list[Check] = []
    failed: list[str] = []
    for name in names:
        start = time.perf_counter()
        title = f"\n## {name}: {WORKLOADS[name][1]}\n"
        print(title, flush=True)
        sections.append(title)
        report_checks: list[Check] = []
        try:
            if name in SCRIPTS:
                text = _run_script(name, args.quick)
            else:
                report = importlib.import_module(WORKLOADS[name][0]).run(settings)
                checks += report.checks
                report_checks = list(report.checks)
                text = "\n\n".join(t.render() for t in report.tables)
        except Exception:  # report it, run the other workloads, exit non-zero
            failed.append(name)
            text = f"{name}: FAILED\n\n```\n{traceback.format_exc().rstrip()}\n```"
        text += f"\n\n({name}: {time.perf_counter() - start:.1f} s)"
        print(text, flush=True)
        sections.append(text)
        if report_checks:
            text += "\n\n" + _checks_table(report_checks, args.quick)
        saved[name] = text
    tail = [*notes, "", _checks_table(checks, args.quick)] if checks else notes
    if failed:
        tail += ["", f"FAILED workloads: {', '.join(failed)}"]
    print("\n" + "\n".join(tail), flush=True)
    sections += ["", *tail]
    text = "\n".join(sections) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    if args.save_results:
        path = BENCH_DIR / "RESULTS.md"
        path.write_text(results_file(path.read_text() if path.exists() else "", saved, run_header))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
