"""Workload 2: a full training step of a small ``nn.TransformerEncoder`` with AdamW.

6 layers, d_model 128, 4 heads (feed-forward 2048, dropout 0.1: torch's
defaults), batch 8 x 32 tokens. One step is ``zero_grad``, forward, MSE
loss, backward and ``optimizer.step()``, with AdamW's default implementation
(on CPU the per-tensor loop) and with ``fused=True``. A second table splits
the step into forward+backward and the optimizer step alone. The last tables
time the step in per-tensor mode (``storage.unflatten()`` for the run: the
optimizer over the leaf parameters, their gradients in the flat buffers)
against the plain model and flat mode, with AdamW ``foreach=True``, AdamW
``fused=True`` and Adafactor (whose math is per tensor: in flat mode it
computes something else, timed for comparison only).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn

from benchmarks._contenders import FAIRSCALE, FAIRSCALE_MISSING, VectorCopy, fairscale_wrap
from benchmarks._timing import Contender, Report, Settings, at_most, interleave, ratio, timing_table
from flatten_parametrize import register_flat_storage

__all__ = ["run", "encoder"]

PLAIN, FLAT, VECTOR = "plain", "register_flat_storage", "parameters_to_vector"
PER_TENSOR = "per-tensor mode"
#: The optimizers of the per-tensor tables.
PER_TENSOR_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "AdamW foreach=True": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
    "AdamW fused=True": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
    "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-4),
}


def encoder(
    layers: int = 6, d_model: int = 128, heads: int = 4, feedforward: int = 2048, seed: int = 0
) -> nn.TransformerEncoder:
    """Return the workload's encoder (batch first) with a fixed seed."""
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model, heads, feedforward, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _adamw(params: Iterable[torch.Tensor], fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-4, fused=True) if fused else torch.optim.AdamW(params, lr=1e-4)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _vector_step(
    model: nn.Module, vec: VectorCopy, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    for p in vec.params:
        p.grad = None
    nn.functional.mse_loss(model(x), y).backward()
    vec.gather_grads()
    opt.step()
    vec.scatter()


def _fwd_bwd(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    nn.functional.mse_loss(model(x), y).backward()


def _models(quick: bool) -> dict[str, nn.Module | None]:
    size = {"layers": 2, "d_model": 32, "feedforward": 64} if quick else {}
    plain = encoder(**size)
    flat = encoder(**size)
    register_flat_storage(flat)
    return {PLAIN: plain, FLAT: flat, FAIRSCALE: fairscale_wrap(encoder(**size)), VECTOR: encoder(**size)}


def _step_contenders(fused: bool, quick: bool, x: torch.Tensor, y: torch.Tensor) -> list[Contender]:
    out = []
    for name, model in _models(quick).items():
        if model is None:
            out.append(Contender(name, None, FAIRSCALE_MISSING))
            continue
        step: Callable[[], None]
        if name == VECTOR:
            vec = VectorCopy(model.parameters())
            step = _bind_vector(model, vec, _adamw([vec.flat], fused), x, y)
        else:
            step = _bind(model, _adamw(model.parameters(), fused), x, y)
        out.append(Contender(name, step))
    return out


def _bind(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], None]:
    return lambda: _train_step(model, opt, x, y)


def _bind_vector(
    model: nn.Module, vec: VectorCopy, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], None]:
    return lambda: _vector_step(model, vec, opt, x, y)


def _bind_fwd_bwd(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    return lambda: _fwd_bwd(model, x, y)


def _split_contenders(quick: bool, x: torch.Tensor, y: torch.Tensor) -> list[Contender]:
    """Forward+backward alone and the default AdamW step alone, plain against flat."""
    models = _models(quick)
    out = []
    for name in (PLAIN, FLAT):
        model = models[name]
        assert model is not None
        opt = _adamw(model.parameters(), fused=False)
        _train_step(model, opt, x, y)  # creates the optimizer state and the gradients
        out.append(Contender(f"{name}: forward+backward", _bind_fwd_bwd(model, x, y)))
        _fwd_bwd(model, x, y)
        out.append(Contender(f"{name}: AdamW step (default)", opt.step))
        fused = _adamw(model.parameters(), fused=True)
        fused.step()
        out.append(Contender(f"{name}: AdamW step (fused)", fused.step))
    return out


MakeOptimizer = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


def _per_tensor_contenders(
    make: MakeOptimizer, quick: bool, x: torch.Tensor, y: torch.Tensor
) -> list[Contender]:
    """The plain model, the flattened one in per-tensor mode and in flat mode, each with ``make``'s."""
    size = {"layers": 2, "d_model": 32, "feedforward": 64} if quick else {}
    out = []
    for name in (PLAIN, PER_TENSOR, FLAT):
        model = encoder(**size)
        if name != PLAIN:
            storage = register_flat_storage(model)
            if name == PER_TENSOR:
                storage.unflatten()
        opt = make(model.parameters())
        with warnings.catch_warnings():  # flat mode + Adafactor: the library's warning says what differs
            warnings.simplefilter("ignore")
            _train_step(model, opt, x, y)
        out.append(Contender(name, _bind(model, opt, x, y)))
    return out


def run(settings: Settings) -> Report:
    """Run workload 2 and return its tables and checks."""
    batch, tokens = (2, 8) if settings.quick else (8, 32)
    d_model = 32 if settings.quick else 128
    torch.manual_seed(1)
    x, y = torch.randn(batch, tokens, d_model), torch.randn(batch, tokens, d_model)
    shape = "2 layers, d_model 32, batch 2 x 8" if settings.quick else "6 layers, d_model 128, batch 8 x 32"
    report = Report()
    for fused in (False, True):
        impl = "fused=True" if fused else "default (per-tensor loop)"
        contenders = _step_contenders(fused, settings.quick, x, y)
        res = interleave(contenders, settings)
        report.tables.append(
            timing_table(f"Transformer training step, AdamW {impl} ({shape})", contenders, res, PLAIN)
        )
        flat = ratio(res, FLAT, PLAIN)
        report.checks.append(at_most(f"transformer step, AdamW {impl}: flat / plain", flat, 0.90))
        fair = ratio(res, FAIRSCALE, PLAIN)
        if fair is not None:
            report.checks.append(at_most(f"transformer step, AdamW {impl}: flat vs fairscale", flat, fair))
    parts = _split_contenders(settings.quick, x, y)
    res = interleave(parts, settings)
    table = timing_table(
        f"Transformer step split into its parts ({shape})", parts, res, f"{PLAIN}: forward+backward"
    )
    table.notes.append("Ratios here are to the plain forward+backward.")
    report.tables.append(table)
    for label, make in PER_TENSOR_OPTIMIZERS.items():
        contenders = _per_tensor_contenders(make, settings.quick, x, y)
        res = interleave(contenders, settings)
        title = f"Transformer training step in per-tensor mode, {label} ({shape})"
        table = timing_table(title, contenders, res, PLAIN)
        if label == "Adafactor":
            table.notes.append("Adafactor in flat mode factors nothing (a 1-D tensor per group): timed only.")
        report.tables.append(table)
        report.checks.append(
            at_most(
                f"transformer step, {label}: per-tensor mode / plain", ratio(res, PER_TENSOR, PLAIN), 1.05
            )
        )
    return report
