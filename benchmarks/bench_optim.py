"""Workload 3: the optimizer step alone, per-parameter against one flat parameter.

Two parameter sets: 200 parameters of mixed small shapes, and 4 large ones
(20M elements, 80 MB, in all). Each is stepped as separate parameters and as
one flat parameter (``register_flat_storage``; fairscale's wrapper and a
``parameters_to_vector`` copy for the small set) with SGD+momentum, Adam and
AdamW, in torch's default implementation (on CPU the per-tensor loop),
``foreach=True`` and ``fused=True``. Achieved bandwidth counts the bytes an
ideal element-wise step must move (SGD+momentum: read param, grad, buffer;
write buffer, param = 5 x 4 bytes per element; Adam/AdamW: 7 x 4 bytes) and is
compared with the machine's measured bandwidth over the same bytes:
``dst.copy_(src)`` (counted as read + write, like STREAM's copy; the target is
stated against it) and ``a.add_(b)`` (2 reads + 1 write). ``copy_`` understates
the limit for tensors that do not fit in cache: its stores to ``dst`` first read
each line (write-allocate), a third access that the count leaves out, while an
optimizer step writes lines it has just read, so a fused step can exceed 100 %
of ``copy_``.

The allocator table runs in subprocesses, one per allocator setting (in this
process with ``--quick``), and
counts minor page faults per step: glibc serves each allocation above its mmap
threshold (at most 32 MiB by default) with a fresh ``mmap``, so a step whose
temporaries are that large faults in every page on every step.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._contenders import FAIRSCALE, FAIRSCALE_MISSING, VectorCopy, fairscale_wrap
from benchmarks._timing import (
    Contender,
    Report,
    Samples,
    Settings,
    Table,
    at_least,
    at_most,
    fmt_ratio,
    fmt_time,
    interleave,
    ratio,
)
from flatten_parametrize import register_flat_storage

__all__ = ["run", "small_shapes", "optimizer_paths"]

PER_PARAM, FLAT, VECTOR = "per-parameter", "register_flat_storage", "parameters_to_vector"
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], int]] = {
    # name -> (class, arguments, bytes moved per element by an ideal step)
    "SGD+momentum": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}, 5 * 4),
    "Adam": (torch.optim.Adam, {"lr": 1e-3}, 7 * 4),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3}, 7 * 4),
}
IMPLS: dict[str, dict[str, Any]] = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
_SHAPES = [(64, 64), (64,), (128, 32), (32,), (16, 16, 3, 3), (256,), (96, 48), (48,), (512,), (32, 8)]
ROOT = Path(__file__).resolve().parent.parent


def small_shapes(count: int = 200) -> list[tuple[int, ...]]:
    """Return ``count`` mixed small shapes (weights, biases, conv kernels)."""
    return [_SHAPES[i % len(_SHAPES)] for i in range(count)]


def _holder(shapes: Sequence[tuple[int, ...]], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    holder = nn.Module()
    for i, shape in enumerate(shapes):
        holder.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape)))
    return holder


def _with_grads(params: list[nn.Parameter]) -> list[nn.Parameter]:
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _param_sets(shapes: Sequence[tuple[int, ...]], with_fairscale: bool) -> dict[str, object]:
    """Return, per contender, what its optimizer steps: a parameter list or a ``VectorCopy``."""
    flat = _holder(shapes)
    register_flat_storage(flat)
    sets: dict[str, object] = {
        PER_PARAM: _with_grads(list(_holder(shapes).parameters())),
        FLAT: _with_grads(list(flat.parameters())),
    }
    if with_fairscale:
        wrapped = fairscale_wrap(_holder(shapes))
        sets[FAIRSCALE] = None if wrapped is None else _with_grads(list(wrapped.parameters()))
        vec = VectorCopy(_holder(shapes).parameters())
        _with_grads(vec.params)
        sets[VECTOR] = vec
    return sets


def _stepper(target: object, optimizer: str, impl: str) -> Callable[[], None]:
    cls, kwargs, _ = OPTIMIZERS[optimizer]
    if isinstance(target, VectorCopy):
        opt = cls([target.flat], **kwargs, **IMPLS[impl])

        def vector_step() -> None:
            target.gather_grads()
            opt.step()
            target.scatter()

        return vector_step
    return cls(target, **kwargs, **IMPLS[impl]).step  # type: ignore[arg-type]


def bandwidth(numel: int, settings: Settings) -> tuple[float, float]:
    """Return GB/s of ``copy_`` (read + write) and of ``add_`` (2 reads + 1 write) on ``numel`` floats."""
    a, b = torch.randn(numel), torch.randn(numel)
    res = interleave([Contender("copy_", lambda: a.copy_(b)), Contender("add_", lambda: a.add_(b))], settings)
    return 2 * 4 * numel / res["copy_"].median / 1e9, 3 * 4 * numel / res["add_"].median / 1e9


def _case_table(
    title: str, numel: int, sets: dict[str, object], settings: Settings, report: Report, small: bool
) -> Table:
    copy_gbs, add_gbs = bandwidth(numel, settings)
    table = Table(
        title,
        [
            "optimizer",
            "implementation",
            "contender",
            "median",
            "spread",
            "ratio to per-parameter",
            "GB/s",
            "of copy_",
            "of add_",
        ],
    )
    for optimizer in ["AdamW"] if settings.quick else OPTIMIZERS:
        bytes_per = OPTIMIZERS[optimizer][2]
        for impl in IMPLS:
            contenders = [
                Contender(name, None, FAIRSCALE_MISSING)
                if target is None
                else Contender(name, _stepper(target, optimizer, impl))
                for name, target in sets.items()
            ]
            res = interleave(contenders, settings)
            for c in contenders:
                if c.name not in res:
                    table.add(optimizer, impl, c.name, c.missing, "-", "-", "-", "-", "-")
                    continue
                s = res[c.name]
                gbs = bytes_per * numel / s.median / 1e9
                table.add(
                    optimizer,
                    impl,
                    c.name,
                    fmt_time(s.median),
                    f"+-{s.spread:.0%}",
                    fmt_ratio(ratio(res, c.name, PER_PARAM)),
                    f"{gbs:.1f}",
                    f"{gbs / copy_gbs:.0%}",
                    f"{gbs / add_gbs:.0%}",
                )
            _checks(report, res, optimizer, impl, small, bytes_per * numel, copy_gbs)
    table.notes.append(
        f"GB/s counts the bytes an ideal step moves. Measured over the same bytes: "
        f"copy_ {copy_gbs:.1f} GB/s (read + write), add_ {add_gbs:.1f} GB/s (2 reads + 1 write)."
    )
    return table


def _checks(
    report: Report,
    res: dict[str, Samples],
    optimizer: str,
    impl: str,
    small: bool,
    nbytes: int,
    copy_gbs: float,
) -> None:
    what = f"{optimizer} {impl}, {'small' if small else 'large'} params: flat / per-parameter"
    if small:
        report.checks.append(at_most(what, ratio(res, FLAT, PER_PARAM), 0.5))
    else:
        report.checks.append(at_most(what + " (no slower, 5% noise)", ratio(res, FLAT, PER_PARAM), 1.05))
    if impl in ("default", "fused") and FLAT in res:
        share = nbytes / res[FLAT].median / 1e9 / copy_gbs
        size = "small" if small else "large"
        what = f"{optimizer} {impl}, {size}: flat step GB/s / copy_ GB/s"
        report.checks.append(at_least(what, share, 0.5))


def optimizer_paths() -> Table:
    """Return which implementation torch's optimizers pick by default for each parameter type."""
    from torch.optim.optimizer import _default_to_fused_or_foreach, _foreach_supported_types

    table = Table(
        "Implementation torch picks when none is asked for (`_default_to_fused_or_foreach`)",
        ["parameter", "device", "foreach by default", "fused=True accepted"],
    )
    flat = _holder([(4,)])
    register_flat_storage(flat)
    wrapped = fairscale_wrap(_holder([(4,)]))
    candidates = [("nn.Parameter", nn.Parameter(torch.zeros(4))), ("FlatParameter", next(flat.parameters()))]
    if wrapped is not None:
        candidates.append(("fairscale FlatParameter", next(wrapped.parameters())))
    for label, p in candidates:
        # The type test is device independent: report what a CUDA tensor of this type would get.
        on_cuda = type(p) in _foreach_supported_types
        _, foreach_cpu = _default_to_fused_or_foreach([p], differentiable=False)
        try:
            torch.optim.AdamW([p], fused=True)
            fused = "yes"
        except RuntimeError as error:
            fused = f"no ({error})"
        table.add(label, "cpu", "yes" if foreach_cpu else "no (per-tensor loop)", fused)
        table.add(label, "cuda", "yes" if on_cuda else "no (per-tensor loop: not an exact Parameter)", fused)
    table.notes.append(
        "On CPU torch never defaults to foreach; on CUDA only exact Tensor/Parameter types get it. "
        "With one flat tensor per group the per-tensor loop runs once, so it is nearly as good as foreach."
    )
    return table


# ---------------------------------------------------------------- allocator trap (subprocesses)
ALLOCATOR_ENVS: dict[str, dict[str, str]] = {
    "glibc defaults": {},
    "MALLOC_MMAP_THRESHOLD_ only": {"MALLOC_MMAP_THRESHOLD_": str(2**30)},
    "MALLOC_MMAP_THRESHOLD_ + MALLOC_TRIM_THRESHOLD_": {
        "MALLOC_MMAP_THRESHOLD_": str(2**30),
        "MALLOC_TRIM_THRESHOLD_": str(2**31),
    },
    "THP_MEM_ALLOC_ENABLE=1 (torch: 2 MiB huge pages)": {"THP_MEM_ALLOC_ENABLE": "1"},
}


def _trap_child(numel: int, pieces: Sequence[int], steps: int, threads: int) -> None:
    """Print one JSON line per (pieces, impl): median ms per Adam step and minor faults per step."""
    torch.set_num_threads(threads)
    for k in pieces:
        for impl in IMPLS:
            params = _with_grads([nn.Parameter(torch.randn(numel // k)) for _ in range(k)])
            opt = torch.optim.Adam(params, lr=1e-3, **IMPLS[impl])
            for _ in range(2):
                opt.step()
            times = []
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(steps):
                start = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - start)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            times.sort()
            print(
                json.dumps(
                    {"pieces": k, "impl": impl, "ms": times[len(times) // 2] * 1e3, "faults": faults / steps}
                )
            )
            del opt, params


def _trap_rows(numel: int, pieces: Sequence[int], steps: int, threads: int) -> list[dict[str, float]]:
    """Run the allocator measurement in this process (``--quick``: no subprocess to start)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        _trap_child(numel, pieces, steps, threads)
    torch.set_num_threads(threads)
    return [json.loads(line) for line in buffer.getvalue().splitlines() if line.startswith("{")]


def _run_trap(
    env: dict[str, str], numel: int, pieces: Sequence[int], steps: int, threads: int
) -> list[dict[str, float]]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_optim",
        "--trap-child",
        str(numel),
        str(steps),
        str(threads),
    ]
    cmd += [str(k) for k in pieces]
    full_env = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=900, check=True
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def allocator_table(settings: Settings) -> Table:
    """Return Adam step time and page faults for one flat tensor against pieces, per allocator setting."""
    numel, pieces, steps = (250_000, [1, 4], 3) if settings.quick else (20_000_000, [1, 4, 16], 7)
    envs = {"this process (--quick)": {}} if settings.quick else ALLOCATOR_ENVS
    table = Table(
        f"Adam step on {numel * 4 / 1e6:.0f} MB as one tensor or in pieces, "
        "per allocator setting (subprocesses)",
        ["allocator setting", "tensors", "implementation", "median", "minor page faults per step"],
    )
    for label, env in envs.items():
        if settings.quick:
            rows = _trap_rows(numel, pieces, steps, settings.threads)
        else:
            rows = _run_trap(env, numel, pieces, steps, settings.threads)
        for row in rows:
            size = numel * 4 / row["pieces"] / 1e6
            table.add(
                label,
                f"{row['pieces']} x {size:.0f} MB",
                row["impl"],
                f"{row['ms']:.1f} ms",
                f"{row['faults']:.0f}",
            )
    table.notes += [
        "A fault maps one 4 KiB page (2 MiB with huge pages); a step that faults in N MB pays for "
        "zeroing N MB of fresh pages plus one kernel entry per page.",
        "The default and foreach steps allocate temporaries the size of each tensor; glibc returns "
        "them to the system when freed (mmap above its threshold, heap trimming below it) and "
        "faults them in again on the next step. fused=True allocates none. Raising "
        "MALLOC_MMAP_THRESHOLD_ alone is not enough: the freed top of the heap is then trimmed.",
    ]
    return table


def run(settings: Settings) -> Report:
    """Run workload 3 and return its tables and checks."""
    report = Report()
    count, large = (20, [(16_000,)] * 4) if settings.quick else (200, [(5_000_000,)] * 4)
    shapes = small_shapes(count)
    numel = sum(torch.Size(s).numel() for s in shapes)
    report.tables.append(
        _case_table(
            f"Optimizer step, {count} small parameters ({numel * 4 / 1e6:.1f} MB)",
            numel,
            _param_sets(shapes, with_fairscale=True),
            settings,
            report,
            small=True,
        )
    )
    numel = sum(torch.Size(s).numel() for s in large)
    # Large steps take long: fewer rounds (still at least 5).
    big = replace(settings, rounds=max(5, settings.rounds // 2))
    report.tables.append(
        _case_table(
            f"Optimizer step, {len(large)} large parameters ({numel * 4 / 1e6:.0f} MB)",
            numel,
            _param_sets(large, with_fairscale=False),
            big,
            report,
            small=False,
        )
    )
    report.tables.append(optimizer_paths())
    report.tables.append(allocator_table(settings))
    return report


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="child process of the allocator table")
    parser.add_argument("--trap-child", nargs="+", type=int, required=True, metavar="N")
    numel, steps, threads, *pieces = parser.parse_args(argv).trap_child
    _trap_child(numel, pieces, steps, threads)


if __name__ == "__main__":
    _main()
