"""Workload 1: forward+backward of a deep MLP of ``Linear(64, 64)`` layers, batch 32.

The main table is at depth 400. The sweep times depth 50 / 200 / 800 for the
plain model, ``register_flat_storage`` (flat mode, and per-tensor mode:
``storage.unflatten()``, whose forward is the plain one and whose backward
lands each leaf's gradient in the flat one), the per-tensor floor (the plain
step and one copy of every gradient into one buffer, no library), the plain
model and per-tensor mode with gradients accumulating (no ``zero_grad()``
between passes), fairscale's wrapper and a naive parametrization that slices
the flat parameter at every access (capped in depth: its backward is
quadratic), and plots time against depth.

``register_flat_storage`` reuses its views while the flat parameter is
unchanged, so repeated forward+backward passes split it only once. In
training an optimizer step changes it in place before every pass; the
contender "views rebuilt" reproduces that (the version counter is bumped
before each pass) and pays one split per pass.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.autograd.graph import increment_version

from benchmarks._contenders import (
    FAIRSCALE,
    FAIRSCALE_MISSING,
    fairscale_wrap,
    register_naive_slices,
    zero_grad,
)
from benchmarks._timing import (
    Contender,
    Report,
    Samples,
    Settings,
    Table,
    at_most,
    fmt_ratio,
    fmt_time,
    interleave,
    paired_ratio,
    ratio,
    timing_table,
)
from flatten_parametrize import register_flat_storage

__all__ = ["run", "mlp", "contenders", "over_one_buffer"]

WIDTH, BATCH = 64, 32
PLAIN, FLAT, NAIVE = "plain", "register_flat_storage", "naive slicing"
REBUILT = "register_flat_storage, views rebuilt"
PER_TENSOR = "register_flat_storage, per-tensor mode"
FLOOR = "plain + gradients copied into one buffer (per-tensor floor)"
PLAIN_ACCUMULATING = "plain, gradients accumulating"
PER_TENSOR_ACCUMULATING = "register_flat_storage, per-tensor mode, gradients accumulating"
ONE_BUFFER_ACCUMULATING = "plain over one weight and one gradient buffer, accumulating (per-tensor floor)"
#: Forward+backward, flat mode and per-tensor mode: contender / plain at every depth of the sweep.
TARGET = 1.05
#: Forward+backward in per-tensor mode after ``zero_grad()``: per-tensor / its floor at every depth.
FLOOR_TARGET = 1.03
#: Forward+backward with the views rebuilt every pass, as in training: flat / plain at every depth.
REBUILT_TARGET = 1.10


def mlp(depth: int, seed: int = 0) -> nn.Sequential:
    """Return ``depth`` x ``Linear(64, 64)`` with a fixed seed."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(depth)])


def _step(model: nn.Module, x: torch.Tensor) -> None:
    zero_grad(model.parameters())
    model(x).sum().backward()


def _accumulate(model: nn.Module, x: torch.Tensor) -> None:
    """Forward+backward adding to the gradients of the passes before (micro-batches): no ``zero_grad()``."""
    model(x).sum().backward()


def over_one_buffer(model: nn.Module) -> nn.Module:
    """Put ``model``'s parameters into one buffer and their gradients into another, as leaves, no library.

    Per-tensor mode's memory layout (each leaf a view of one flat buffer, its ``.grad`` a view of one
    flat gradient) by hand: the least per-tensor mode can cost when gradients accumulate in place.
    """
    params = list(model.parameters())
    weights = torch.cat([p.detach().reshape(-1) for p in params])
    grads = torch.zeros_like(weights)
    offset = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            end = offset + param.numel()
            leaf = nn.Parameter(weights[offset:end].view(param.shape))
            leaf.grad = grads[offset:end].view(param.shape)
            module._parameters[name] = leaf
            offset = end
    return model


def _step_after_update(model: nn.Module, x: torch.Tensor) -> None:
    """Forward+backward as in training: an optimizer step changed the flat parameter before it."""
    for p in model.parameters():
        increment_version(p)  # what an in-place update does to the version, without the update
    _step(model, x)


def _step_landing(model: nn.Module, x: torch.Tensor, slots: list[torch.Tensor]) -> None:
    """The plain step, then every gradient copied into its slot of one flat buffer (one ``_foreach_copy_``).

    The least that per-tensor mode can cost after ``zero_grad()``: autograd hands each leaf fresh
    gradient memory, and per-tensor mode keeps the gradients in the flat gradient, so one memory pass
    over them is owed; this contender pays it without the library (no hooks, no Python per tensor beyond
    the list of gradients).
    """
    _step(model, x)
    torch._foreach_copy_(slots, [p.grad for p in model.parameters()])


def contenders(depth: int, naive: bool) -> list[Contender]:
    """Return the forward+backward of each contender at ``depth`` (naive slicing only if asked)."""
    x = torch.randn(BATCH, WIDTH)
    plain = mlp(depth)
    flat = mlp(depth)
    register_flat_storage(flat)
    rebuilt = mlp(depth)
    register_flat_storage(rebuilt)
    per_tensor = mlp(depth)
    register_flat_storage(per_tensor).unflatten()
    landing = mlp(depth)
    sizes = [p.numel() for p in landing.parameters()]
    slots = [s.view(p.shape) for s, p in zip(torch.empty(sum(sizes)).split(sizes), landing.parameters())]
    plain_accumulating = mlp(depth)
    per_tensor_accumulating = mlp(depth)
    register_flat_storage(per_tensor_accumulating).unflatten()
    one_buffer_accumulating = over_one_buffer(mlp(depth))
    out = [
        Contender(PLAIN, lambda: _step(plain, x)),
        Contender(FLAT, lambda: _step(flat, x)),
        Contender(REBUILT, lambda: _step_after_update(rebuilt, x)),
        Contender(PER_TENSOR, lambda: _step(per_tensor, x)),
        Contender(FLOOR, lambda: _step_landing(landing, x, slots)),
        Contender(PLAIN_ACCUMULATING, lambda: _accumulate(plain_accumulating, x)),
        Contender(PER_TENSOR_ACCUMULATING, lambda: _accumulate(per_tensor_accumulating, x)),
        Contender(ONE_BUFFER_ACCUMULATING, lambda: _accumulate(one_buffer_accumulating, x)),
    ]
    wrapped = fairscale_wrap(mlp(depth))
    out.append(
        Contender(FAIRSCALE, None, FAIRSCALE_MISSING)
        if wrapped is None
        else Contender(FAIRSCALE, lambda: _step(wrapped, x))
    )
    if naive:
        sliced = mlp(depth)
        register_naive_slices(sliced)
        out.append(Contender(NAIVE, lambda: _step(sliced, x)))
    return out


def _sweep(settings: Settings, depths: list[int], naive_cap: int) -> dict[int, dict[str, Samples]]:
    return {depth: interleave(contenders(depth, naive=depth <= naive_cap), settings) for depth in depths}


def _sweep_table(found: dict[int, dict[str, Samples]], naive_cap: int) -> Table:
    table = Table(
        "MLP forward+backward against depth (Linear(64, 64), batch 32)",
        [
            "depth",
            PLAIN,
            FLAT,
            "flat, rebuilt",
            "per-tensor",
            "per-tensor floor",
            "plain, accumulating",
            "per-tensor, accumulating",
            FAIRSCALE,
            NAIVE,
            "flat / plain",
            "rebuilt / plain",
            "per-tensor / plain",
            "floor / plain",
            "fairscale / plain",
            "naive / plain",
            "per-tensor / floor (paired)",
            "per-tensor / plain, accumulating (paired)",
            "one buffer / plain, accumulating (paired)",
        ],
    )
    for depth, res in found.items():
        cells = [
            fmt_time(res[n].median) if n in res else "-"
            for n in (
                PLAIN,
                FLAT,
                REBUILT,
                PER_TENSOR,
                FLOOR,
                PLAIN_ACCUMULATING,
                PER_TENSOR_ACCUMULATING,
                FAIRSCALE,
                NAIVE,
            )
        ]
        compared = (FLAT, REBUILT, PER_TENSOR, FLOOR, FAIRSCALE, NAIVE)
        ratios = [fmt_ratio(ratio(res, n, PLAIN)) for n in compared]
        paired = [
            fmt_ratio(paired_ratio(res, PER_TENSOR, FLOOR)),
            fmt_ratio(paired_ratio(res, PER_TENSOR_ACCUMULATING, PLAIN_ACCUMULATING)),
            fmt_ratio(paired_ratio(res, ONE_BUFFER_ACCUMULATING, PLAIN_ACCUMULATING)),
        ]
        table.add(depth, *cells, *ratios, *paired)
    table.notes += [
        f"Naive slicing is run up to depth {naive_cap} only (its backward is quadratic in depth).",
        f'`{REBUILT}` ("flat, rebuilt"): before each pass the flat parameter\'s version is bumped, as '
        "an optimizer step does, so the views are rebuilt (one split per pass) as they are in training.",
        f'`{PER_TENSOR}` ("per-tensor"): `storage.unflatten()` after registering; the forward reads '
        "plain parameters, the backward lands each leaf's gradient in the flat gradient.",
        f'`{FLOOR}` ("per-tensor floor"): the plain step and one `_foreach_copy_` of every gradient into '
        "one flat buffer, no library: the memory pass per-tensor mode owes after `zero_grad()` (autograd "
        "gives each leaf fresh gradient memory), and so the least per-tensor mode can cost here.",
        '"accumulating": no `zero_grad()` between passes (micro-batches): the gradients are added into the '
        "plain model's own and into per-tensor mode's slots in place. \"one buffer\": the plain model with "
        "its weights in one buffer and its gradients in another (per-tensor mode's layout by hand, no "
        "library), the floor of per-tensor mode when gradients accumulate.",
        "(paired): the median over rounds of the two contenders' times in the same round; the other "
        "ratios are of the medians.",
    ]
    return table


def plot(found: dict[int, dict[str, Samples]], paths: list[Path]) -> str:
    """Plot median time against depth for each contender into ``paths``; return a note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {
        PLAIN: ("o-", "C0", PLAIN),
        FLAT: ("s-", "C1", FLAT),
        REBUILT: ("s--", "C1", f"{FLAT}, views rebuilt each pass (training)"),
        PER_TENSOR: ("D-", "C4", PER_TENSOR),
        FAIRSCALE: ("^-.", "C2", FAIRSCALE),
        NAIVE: ("x:", "C3", f"{NAIVE} (quadratic)"),
    }
    for name, (style, color, label) in styles.items():
        points = [(d, res[name].median * 1e3) for d, res in found.items() if name in res]
        if points:
            ax.plot(*zip(*points), style, color=color, label=label, alpha=0.55 if name == REBUILT else 1.0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    depths = list(found)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("depth (Linear(64, 64) layers)")
    ax.set_ylabel("forward+backward, ms (median)")
    threads = torch.get_num_threads()
    ax.set_title(f"Deep MLP, batch 32, {threads} CPU thread{'s' if threads > 1 else ''}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return "plot written to " + ", ".join(_shown(p) for p in paths)


def _shown(path: Path) -> str:
    """Return ``path`` relative to the working directory when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def run(settings: Settings) -> Report:
    """Run workload 1 and return its tables and checks."""
    depth = 25 if settings.quick else 400
    depths, naive_cap = ([5, 10, 20], 10) if settings.quick else ([50, 200, 800], 200)
    main = contenders(depth, naive=False)
    res = interleave(main, settings)
    report = Report(
        [timing_table(f"MLP forward+backward, depth {depth} (Linear(64, 64), batch 32)", main, res, PLAIN)]
    )
    found = _sweep(settings, depths, naive_cap)
    table = _sweep_table(found, naive_cap)
    paths = [settings.out_dir / "depth_sweep.png"]
    if settings.save_plot:
        paths.append(Path(__file__).resolve().parent / "depth_sweep.png")
    table.notes.append(plot(found, paths))
    report.tables.append(table)
    for d, res_d in found.items():
        flat = ratio(res_d, FLAT, PLAIN)
        report.checks.append(at_most(f"MLP depth {d}: flat / plain", flat, TARGET))
        per_tensor = ratio(res_d, PER_TENSOR, PLAIN)
        report.checks.append(at_most(f"MLP depth {d}: per-tensor mode / plain", per_tensor, TARGET))
        floor = ratio(res_d, FLOOR, PLAIN)
        report.checks.append(at_most(f"MLP depth {d}: per-tensor floor (no library) / plain", floor, TARGET))
        over_floor = paired_ratio(res_d, PER_TENSOR, FLOOR)
        report.checks.append(at_most(f"MLP depth {d}: per-tensor mode / its floor", over_floor, FLOOR_TARGET))
        accumulating = paired_ratio(res_d, PER_TENSOR_ACCUMULATING, PLAIN_ACCUMULATING)
        report.checks.append(
            at_most(f"MLP depth {d}: per-tensor mode / plain, gradients accumulating", accumulating, TARGET)
        )
        layout = paired_ratio(res_d, ONE_BUFFER_ACCUMULATING, PLAIN_ACCUMULATING)
        report.checks.append(
            at_most(f"MLP depth {d}: one buffer (no library) / plain, gradients accumulating", layout, TARGET)
        )
        rebuilt = ratio(res_d, REBUILT, PLAIN)
        report.checks.append(
            at_most(f"MLP depth {d}: flat / plain, views rebuilt as in training", rebuilt, REBUILT_TARGET)
        )
        fair = ratio(res_d, FAIRSCALE, PLAIN)
        if fair is not None:
            report.checks.append(at_most(f"MLP depth {d}: flat / plain vs fairscale / plain", flat, fair))
    return report
