"""Workload 4: ``state_dict()`` and ``load_state_dict()``: time and extra memory against plain.

The model is an MLP of ``Linear(512, 512)`` layers (105 MB at depth 100).
``state_dict()`` must be zero copy: its tensors share memory with the model.
Extra memory is measured two ways: the bytes of state-dict tensors that do
not live in the model's own storages ("copied"), and the peak resident set
above the resident set before the call (``/proc/self/status``, Linux only).
``load_state_dict`` loads a plain state dict held in separate memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from benchmarks._contenders import FAIRSCALE, FAIRSCALE_MISSING, fairscale_wrap
from benchmarks._memory import extra_peak
from benchmarks._timing import (
    Contender,
    Report,
    Settings,
    Table,
    at_most,
    fmt_ratio,
    fmt_time,
    interleave,
    ratio,
)
from flatten_parametrize import register_flat_storage

__all__ = ["run", "copied_bytes"]

PLAIN, FLAT = "plain", "register_flat_storage"


def _model(depth: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _storage_ranges(module: nn.Module) -> list[tuple[int, int]]:
    tensors = [*module.parameters(), *module.buffers()]
    storages = [t.untyped_storage() for t in tensors]
    return [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages]


def copied_bytes(state: Mapping[str, object], module: nn.Module) -> int:
    """Return the bytes of ``state``'s tensor storages that lie outside ``module``'s storages."""
    own = _storage_ranges(module)
    seen: dict[int, int] = {}
    for value in state.values():
        if isinstance(value, Tensor):
            storage = value.untyped_storage()
            start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
            if not any(lo <= start and end <= hi for lo, hi in own):
                seen[start] = storage.nbytes()
    return sum(seen.values())


def _percent(nbytes: int | None, total: int) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 1e6:.2f} MB ({nbytes / total:.2%})"


def run(settings: Settings) -> Report:
    """Run workload 4 and return its table and checks."""
    depth, width = (10, 64) if settings.quick else (100, 512)
    plain = _model(depth, width)
    model_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    flat = _model(depth, width)
    register_flat_storage(flat)
    models: dict[str, nn.Module | None] = {
        PLAIN: plain,
        FLAT: flat,
        FAIRSCALE: fairscale_wrap(_model(depth, width)),
    }
    source = {k: v.clone() for k, v in plain.state_dict().items()}
    saves = [_contender(name, m, lambda m: m.state_dict) for name, m in models.items()]
    loads = [_contender(name, m, lambda m: _loader(m, source)) for name, m in models.items()]
    save_res = interleave(saves, settings)
    load_res = interleave(loads, settings)
    table = Table(
        f"state_dict() and load_state_dict(), MLP {depth} x Linear({width}, {width}) "
        f"({model_bytes / 1e6:.0f} MB)",
        [
            "contender",
            "state_dict()",
            "ratio",
            "copied",
            "peak RSS extra",
            "load_state_dict()",
            "ratio",
            "peak RSS extra",
        ],
    )
    report = Report([table])
    for name, module in models.items():
        if module is None:
            table.add(name, FAIRSCALE_MISSING, "-", "-", "-", "-", "-", "-")
            continue
        save_peak, state = extra_peak(module.state_dict)
        copied = copied_bytes(state, module)  # type: ignore[arg-type]
        del state
        load_peak, _ = extra_peak(_loader(module, source))
        table.add(
            name,
            fmt_time(save_res[name].median),
            fmt_ratio(ratio(save_res, name, PLAIN)),
            _percent(copied, model_bytes),
            _percent(save_peak, model_bytes),
            fmt_time(load_res[name].median),
            fmt_ratio(ratio(load_res, name, PLAIN)),
            _percent(load_peak, model_bytes),
        )
        if name == FLAT:
            worst = max(copied, save_peak or 0)
            report.checks.append(
                at_most("state_dict(): extra memory / model bytes", worst / model_bytes * 100, 1, " %")
            )
    table.notes.append("Ratios are to the plain model; percentages are of the model's parameter bytes.")
    return report


def _loader(module: nn.Module, source: Mapping[str, Tensor]) -> Callable[[], object]:
    return lambda: module.load_state_dict(source)


def _contender(
    name: str, module: nn.Module | None, call: Callable[[nn.Module], Callable[[], object]]
) -> Contender:
    if module is None:
        return Contender(name, None, FAIRSCALE_MISSING)
    return Contender(name, call(module))
