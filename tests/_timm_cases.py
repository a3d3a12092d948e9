"""The timm cases of ``tests/interop/test_timm.py``, run in a subprocess with timm on ``sys.path``.

Usage: ``python tests/_timm_cases.py <timm folder> <output file>`` (see ``tests/_side_packages.py``
for why timm lives in a folder of its own). Every case trains a small transformer and its plain twin
from the same seed for 3 steps with a real timm optimizer, once with the flattened model in per-tensor
mode (``storage.unflatten()`` before building the optimizer) and once in flat mode, and records the
largest weight difference to the plain model and the warnings each first step gave.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flatten_parametrize import register_flat_storage


class _Net(nn.Module):
    """Matrices, biases and norms: a 2-layer encoder and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


Make = Callable[[nn.Module], torch.optim.Optimizer]


def _optimizers(timm_optim: Any) -> tuple[dict[str, Make], dict[str, Make]]:
    """Return the per-tensor cases (per-tensor mode equals the plain model; flat mode warns) and timm's
    element-wise optimizers (the library's allowlist: flat mode equals the plain model, no warning)."""
    per_tensor: dict[str, Make] = {
        "Lamb": lambda m: timm_optim.Lamb(m.parameters(), lr=1e-2),
        "Lars": lambda m: timm_optim.Lars(m.parameters(), lr=1e-2, weight_decay=1e-4),  # trust ratio on
        "Adafactor": lambda m: timm_optim.Adafactor(m.parameters(), lr=1e-2),
        "AdafactorBigVision": lambda m: timm_optim.AdafactorBigVision(m.parameters(), lr=1e-2),
        "create_optimizer_v2 muon": lambda m: timm_optim.create_optimizer_v2(m, "muon", lr=1e-2),
        "create_optimizer_v2 adamw weight_decay": lambda m: timm_optim.create_optimizer_v2(
            m, "adamw", lr=1e-2, weight_decay=0.05
        ),
        "param_groups_weight_decay + AdamW": lambda m: torch.optim.AdamW(
            timm_optim.param_groups_weight_decay(m, 0.05), lr=1e-2
        ),
    }
    names = (
        "AdaBelief", "AdamWLegacy", "Adan", "Adopt", "LaProp", "Lion", "MADGRAD",
        "NAdamLegacy", "NAdamW", "RAdamLegacy", "RMSpropTF", "SGDW",
    )  # fmt: skip
    elementwise: dict[str, Make] = {
        name: (lambda cls: lambda m: cls(m.parameters(), lr=1e-3))(getattr(timm_optim, name))
        for name in names
    }
    return per_tensor, elementwise


def _diff(weights: dict[str, torch.Tensor], plain: dict[str, torch.Tensor]) -> float:
    """The largest difference of any weight to the plain model's, matched by name."""
    assert weights.keys() == plain.keys(), (sorted(weights), sorted(plain))
    return max(float((weights[name] - plain[name].detach()).abs().max()) for name in plain)


def _ours(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith(("flat mode:", "weight decay:"))]


def _train(model: nn.Module, make: Make, mode: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    storage = register_flat_storage(model) if mode != "plain" else None
    if storage is not None and mode == "per-tensor":
        storage.unflatten()
    with warnings.catch_warnings(record=True) as record:  # building it, then its first step
        warnings.simplefilter("always")
        optimizer = make(model)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(2, 5, 16, generator=gen)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        if step == 0:
            record += caught
    if storage is not None:
        storage.flatten()
        weights = {name: view.detach().clone() for name, view in storage.named_views()}
    else:
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return weights, _ours(record)


def _case(make: Make) -> dict[str, Any]:
    plain, _ = _train(_Net(), make, "plain")
    out: dict[str, Any] = {}
    for mode in ("per-tensor", "flat"):
        weights, messages = _train(_Net(), make, mode)
        out[f"{mode} diff"] = _diff(weights, plain)
        out[f"{mode} warnings"] = messages
    return out


def _recipe(timm_optim: Any) -> dict[str, Any]:
    """weight_decay_groups with timm's rule and create_optimizer_v2 over groups by name: the plain decay."""
    from flatten_parametrize import weight_decay_groups

    plain = _Net()
    model = _Net()
    rule = lambda name, p: p.ndim <= 1 or name.endswith(".bias")  # noqa: E731 - timm's, as a callable
    storage = register_flat_storage(model, weight_decay_groups(model, no_decay=rule))
    groups = [
        {"params": [storage["decay"]], "weight_decay": 0.05},
        {"params": [storage["no_decay_bias"]], "weight_decay": 0.0},
    ]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        flat_opt = timm_optim.create_optimizer_v2(groups, "adamw", lr=1e-2, weight_decay=0.05)
        plain_opt = timm_optim.create_optimizer_v2(plain, "adamw", lr=1e-2, weight_decay=0.05)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(2, 5, 16, generator=gen)
            for m, opt in ((model, flat_opt), (plain, plain_opt)):
                opt.zero_grad()
                m(x).pow(2).mean().backward()
                opt.step()
    weights = {name: view.detach() for name, view in storage.named_views()}
    decayed_plain = sum(
        p.numel() for g in plain_opt.param_groups if g["weight_decay"] > 0 for p in g["params"]
    )
    return {
        "diff": _diff(weights, dict(plain.named_parameters())),
        "warnings": _ours(record),
        "decayed": storage["decay"].numel(),
        "decayed plain": decayed_plain,
    }


def _wrapper(module: Any) -> dict[str, Any]:
    """timm's ``param_groups_weight_decay`` as the package wraps it: the original's face and result, and a
    user's own wrapper of it, put after or before the package's, called with the package's warning."""
    from flatten_parametrize._outside.registry import OUTSIDE

    wrapped = module.param_groups_weight_decay
    original = wrapped.__wrapped__
    plain = _Net()
    both = (wrapped, original)
    out: dict[str, Any] = {
        "face": [(f.__name__, f.__qualname__, f.__doc__, str(inspect.signature(f))) for f in both],
        "groups": [_groups(f(plain, 0.05, no_weight_decay_list=("head.weight",))) for f in both],
    }
    (patch,) = [w.patch for w in OUTSIDE if w.functions[0][0] == module.__name__]
    for order, under in (("after ours", wrapped), ("before ours", original)):
        calls: list[str] = []
        module.param_groups_weight_decay = _users_wrapper(under, calls)
        if order == "before ours":
            patch(module)  # the package's wrapper around the user's
        flat = _Net()
        register_flat_storage(flat)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            module.param_groups_weight_decay(flat, 0.05)
        out[order] = {"calls": calls, "warnings": _ours(record)}
        module.param_groups_weight_decay = wrapped
    return out


def _users_wrapper(function: Callable[..., Any], calls: list[str]) -> Callable[..., Any]:
    """A user's own wrapper of ``function``: records each call in ``calls``."""

    @functools.wraps(function)
    def users_wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append("user's")
        return function(*args, **kwargs)

    return users_wrapper


def _groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups with each parameter by its ``id`` (the same objects compare equal)."""
    return [{k: [id(p) for p in v] if k == "params" else v for k, v in group.items()} for group in groups]


def main(folder: str, out: str) -> None:
    """Put timm on ``sys.path`` (after defining torchvision's operators), run every case, save the results.

    With ``FLATTEN_PARAMETRIZE_NO_PATCHES`` set, only whether timm's rule is wrapped is saved.
    """
    sys.path.insert(0, folder)
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    from _side_packages import define_torchvision_operators

    define_torchvision_operators()
    import timm
    import timm.optim as timm_optim

    from flatten_parametrize._outside.on_import import is_ours
    from flatten_parametrize._outside.registry import switched_off

    rule = sys.modules["timm.optim._param_groups"]
    wrapped = {"wrapped": is_ours(rule.param_groups_weight_decay), "timm": timm.__version__}
    if switched_off():
        torch.save(wrapped, out)
        return
    per_tensor, elementwise = _optimizers(timm_optim)
    results: dict[str, Any] = {**wrapped, "wrapper": _wrapper(rule), "recipe": _recipe(timm_optim)}
    for name, make in {**per_tensor, **elementwise}.items():
        results[name] = _case(make)
    results["per_tensor_names"] = list(per_tensor)
    results["elementwise_names"] = list(elementwise)
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
