"""Workload 5: flattening a ~1 GiB float32 model: wall time and peak resident memory.

Each measurement runs in a fresh subprocess (``python -m
benchmarks.bench_register --child ...``): it records the resident set before
building the model, builds ``16 x Linear(4096, 4096)`` (1.0 GiB, every page
written), flattens it and reports the wall time of the flattening and the
peak resident set above that baseline (``VmHWM``) as a multiple of the
model's bytes (after a warm-up on a tiny model, so that one-time costs such
as lazy imports and thread pools are not counted). Contenders:
``register_flat_storage``, fairscale's wrapper and ``parameters_to_vector``
followed by ``vector_to_parameters`` (which points the parameters at the
vector). ``--quick`` uses one child and a 16 MB model,
resetting the peak between contenders.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from benchmarks._contenders import FAIRSCALE, FAIRSCALE_MISSING, fairscale_wrap
from benchmarks._memory import peak_bytes, reset_peak, rss_bytes, trim
from benchmarks._timing import Report, Settings, Table, at_most
from flatten_parametrize import register_flat_storage, remove_flat_storage

__all__ = ["run", "build"]

FLAT, VECTOR = "register_flat_storage", "parameters_to_vector"
CONTENDERS = [FLAT, FAIRSCALE, VECTOR]
ROOT = Path(__file__).resolve().parent.parent


def build(layers: int, width: int) -> nn.Sequential:
    """Return ``layers`` x ``Linear(width, width)`` with every parameter page written."""
    model = nn.Sequential(*[nn.Linear(width, width, device="meta") for _ in range(layers)]).to_empty(
        device="cpu"
    )
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(1e-3 * (i + 1))
    return model


def _vector(model: nn.Module) -> object:
    vec = parameters_to_vector(model.parameters())
    vector_to_parameters(vec, model.parameters())
    return vec


def _flattener(name: str) -> Callable[[nn.Module], object] | None:
    if name == FLAT:
        return register_flat_storage
    if name == VECTOR:
        return _vector
    return fairscale_wrap if FAIRSCALE_MISSING == "" else None


def _measure(name: str, layers: int, width: int) -> dict[str, object]:
    """Build, flatten and measure in this process (the child's work)."""
    flatten = _flattener(name)
    if flatten is None:
        return {"name": name, "missing": FAIRSCALE_MISSING}
    flatten(build(2, 64))  # one-time costs (lazy imports, thread pools, arenas) before the baseline
    trim()
    base = rss_bytes()
    reset_ok = reset_peak()
    model = build(layers, width)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    start = time.perf_counter()
    kept = flatten(model)
    wall = time.perf_counter() - start
    trim()
    after, peak = rss_bytes(), peak_bytes()
    removed = None
    if name == FLAT:  # removed, the storage still held by the user: the parameters own the values again
        remove_flat_storage(model)
        trim()
        removed = rss_bytes()
    del kept, model
    trim()
    if base is None or after is None or peak is None or not reset_ok:
        return {"name": name, "wall": wall, "model_bytes": model_bytes}
    return {
        "name": name,
        "wall": wall,
        "model_bytes": model_bytes,
        "peak": (peak - base) / model_bytes,
        "after": (after - base) / model_bytes,
        "removed": None if removed is None else (removed - base) / model_bytes,
    }


def _children(names: Sequence[str], layers: int, width: int, threads: int) -> list[dict[str, object]]:
    cmd = [sys.executable, "-m", "benchmarks.bench_register", "--child", ",".join(names)]
    cmd += ["--layers", str(layers), "--width", str(width), "--threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def run(settings: Settings) -> Report:
    """Run workload 5 and return its table and checks."""
    layers, width = (4, 1024) if settings.quick else (16, 4096)
    found: dict[str, list[dict[str, object]]] = {name: [] for name in CONTENDERS}
    if settings.quick:
        for row in _children(CONTENDERS, layers, width, settings.threads):
            found[str(row["name"])].append(row)
    else:
        for _ in range(3):  # alternate the contenders, one fresh process each
            for name in CONTENDERS:
                for row in _children([name], layers, width, settings.threads):
                    found[name].append(row)
    model_bytes = 4 * layers * (width * width + width)
    table = Table(
        f"Flattening {layers} x Linear({width}, {width}) ({model_bytes / 2**30:.3g} GiB float32), "
        "fresh subprocesses",
        [
            "contender",
            "wall time",
            "peak RSS / model bytes",
            "RSS after / model bytes",
            "RSS after removal, storage held / model bytes",
            "runs",
        ],
    )
    report = Report([table])
    for name, rows in found.items():
        if not rows or "missing" in rows[0]:
            table.add(name, rows[0]["missing"] if rows else "not run", "-", "-", "-", "-")
            continue
        wall = statistics.median(float(r["wall"]) for r in rows)  # type: ignore[arg-type]
        peaks = [float(r["peak"]) for r in rows if "peak" in r]  # type: ignore[arg-type]
        afters = [float(r["after"]) for r in rows if "after" in r]  # type: ignore[arg-type]
        removals = [float(r["removed"]) for r in rows if r.get("removed") is not None]  # type: ignore[arg-type]
        peak = max(peaks) if peaks else None
        removal = max(removals) if removals else None
        table.add(
            name,
            f"{wall:.3g} s",
            "n/a" if peak is None else f"{peak:.2f}x",
            f"{statistics.median(afters):.2f}x" if afters else "n/a",
            "-" if removal is None else f"{removal:.2f}x",
            len(rows),
        )
        if name == FLAT:
            # The weights, the largest tensor (one of the equal layers' weights) and 5%.
            bound = 1 + (width * width) / (layers * (width * width + width)) + 0.05
            report.checks.append(
                at_most("register_flat_storage: peak RSS / model bytes", peak, round(bound, 3), "x")
            )
            report.checks.append(
                at_most("remove_flat_storage, storage still held: RSS / model bytes", removal, 1.05, "x")
            )
    table.notes.append(
        "Peak and final resident set are above the resident set before the model was built; "
        "the peak is the worst run, the wall time the median. register_flat_storage fills the buffer "
        "while releasing each original as its slot is written (target: the weights + the largest "
        "tensor + 5%); after remove_flat_storage(model) the FlatStorage still held keeps no buffer."
    )
    return report


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="child process of the registration benchmark")
    parser.add_argument("--child", required=True, help="comma-separated contenders")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.child.split(","):
        print(json.dumps(_measure(name, args.layers, args.width)), flush=True)


if __name__ == "__main__":
    _main()
