"""In-process A/B of the eval forward: plain against flattened ``nn.TransformerEncoder``, alternating rounds.

12 layers, d_model 64, 4 heads, feed-forward 256, batch 4 x 16, eval mode,
``torch.no_grad()``, 2 torch threads (``--threads``). Each round times
``--calls`` forwards of each model in turn (the order alternates between
rounds); the median time per forward over ``--rounds`` rounds is reported per
row, with the ratio flat / plain. Rows: weights unchanged, and after an
in-place update (every parameter's version bumped before each forward, as an
optimizer step does). Besides the plain model and flat mode, the floor runs:
per-tensor mode's forward (``storage.unflatten()``: the plain module's reads of
leaf parameters over the same flat buffer), and with ``--base DIR`` (a folder
holding another version's ``flatten_parametrize`` package) that version's flat
mode, imported under another name. Also reports the per-forward cost of the
write check (the registered module's pre-hook work that decides whether
anything was written) and how many ``_parameters`` dicts and cached views that
check visits per clean forward.

Run: ``PYTHONPATH=. python -m benchmarks.ab_eval [--base DIR]`` (any checkout of
the library: the counts use whatever the imported version exposes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import increment_version

import flatten_parametrize
from benchmarks._contenders import import_base
from flatten_parametrize import get_flat_storage, register_flat_storage


def _model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False).eval()


def _time(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _view_cache_module() -> Any:
    """The view-cache module of the imported library version (it moved into ``_core``)."""
    try:
        from flatten_parametrize._core import view_cache
    except ImportError:  # a version before the sub-packages
        from flatten_parametrize import _view_cache as view_cache  # type: ignore[attr-defined,no-redef]
    return view_cache


def _core(storage: Any) -> Any:
    """The object with ``sync_writes``: the private core behind the facade, or (before it) the storage."""
    try:
        from flatten_parametrize._core.names import core_behind
    except ImportError:
        return storage
    return core_behind(storage, "ab_eval")


def _forward_check_kind() -> bool:
    """Whether the imported library version has a forward-only write check (``sync_writes(forward=True)``)."""
    return hasattr(_view_cache_module(), "WRITE_SCANS")


def _write_check(storage: Any) -> Callable[[], None]:
    """The per-forward write check of the imported library version (what the forward pre-hook runs)."""
    core = _core(storage)
    if _forward_check_kind():
        return lambda: core.sync_writes(forward=True)
    return core.sync_writes  # type: ignore[no-any-return]


def _visits(storage: Any, forward: Callable[[], None]) -> tuple[int, int]:
    """``_parameters`` dicts and cached views the write check visits during one clean forward."""
    counter = getattr(_view_cache_module(), "WRITE_SCANS", None)
    if counter is not None:  # the library's own count
        before = dict(counter)
        forward()
        return counter["parameters"] - before["parameters"], counter["views"] - before["views"]
    # The base version: every forward's sync_writes scans every member and every cached view.
    calls = []
    original = storage.sync_writes

    def counted() -> None:
        members = len(storage.members())
        views = sum(len(e.views) for g in storage.groups() for e in list(g.views._entries))
        calls.append((members, views))
        original()

    storage.sync_writes = counted
    try:
        forward()
    finally:
        del storage.sync_writes
    return sum(c[0] for c in calls), sum(c[1] for c in calls)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--base", type=Path, default=None, help="folder holding another flatten_parametrize")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    plain, flat, per_tensor = _model(), _model(), _model()
    storage = register_flat_storage(flat)
    register_flat_storage(per_tensor).unflatten()
    models = {"plain": plain, "flat": flat, "per-tensor (floor)": per_tensor}
    if args.base is not None:
        base = _model()
        import_base(args.base).register_flat_storage(base)
        models["base flat"] = base
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for model in models.values():
            torch.testing.assert_close(model(x), plain(x))
    params = {name: list(model.parameters()) for name, model in models.items()}

    def unchanged(name: str) -> Callable[[], None]:
        model = models[name]

        def run() -> None:
            with torch.no_grad():
                model(x)

        return run

    def updated(name: str) -> Callable[[], None]:
        model, ps = models[name], params[name]

        def run() -> None:
            for p in ps:
                increment_version(p)
            with torch.no_grad():
                model(x)

        return run

    print(
        f"torch {torch.__version__}, {args.threads} threads, flatten_parametrize from "
        f"{flatten_parametrize.__file__}"
    )
    for row, make in (("eval, no_grad", unchanged), ("eval after update", updated)):
        fns = {name: make(name) for name in models}
        for fn in fns.values():
            for _ in range(20):
                fn()
        times: dict[str, list[float]] = {name: [] for name in models}
        names = list(models)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else reversed(names):
                times[name].append(_time(fns[name], args.calls))
        p = statistics.median(times["plain"])
        for name in names[1:]:
            ratios = [a / b for a, b in zip(times[name], times["plain"])]
            f = statistics.median(times[name])
            low, _, high = statistics.quantiles(ratios, n=4)
            paired = statistics.median(ratios)
            print(
                f"{row:18s} plain {p * 1e3:.3f} ms  {name} {f * 1e3:.3f} ms  {name}/plain {f / p:.3f} "
                f"(median of per-round ratios {paired:.3f}; quartiles {low:.3f}-{high:.3f})"
            )
    check = _write_check(get_flat_storage(flat))
    for _ in range(1000):
        check()
    samples = [_time(check, 2000) for _ in range(15)]
    kind = "sync_writes(forward=True)" if _forward_check_kind() else "sync_writes()"
    print(f"write check per forward: {statistics.median(samples) * 1e6:.2f} us ({kind})")
    dicts, views = _visits(storage, unchanged("flat"))
    print(
        f"clean no_grad forward: the write check visited {dicts} _parameters dicts and {views} cached views"
    )


if __name__ == "__main__":
    main()
