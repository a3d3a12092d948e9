"""One element, one optimizer: memory reachable through two optimizers is warned about at the first step.

In per-tensor mode the flat parameters (``storage.flat_params``) and the leaves
(``model.parameters()``) are the same memory, so an optimizer over each steps
that memory twice. ``_guards/step_checks.py`` records what each optimizer steps
at its first step and warns there, before the second optimizer changes
anything; the legitimate setups stay silent. And the recipe the docs give:
``AdamW(storage.flat_params)`` alone in per-tensor mode is the plain model's AdamW.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from flatten_parametrize import FlatStorage, ShardedOptimizer, register_flat_storage

from _helpers import twin, values

TWICE = r"two optimizers: each element of a flat storage is stepped by one optimizer"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _backward(model: nn.Module, seed: int) -> None:
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int = 3) -> None:
    for seed in range(steps):
        _backward(model, seed)
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()


def _matrices(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.ndim == 2]


def _others(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.ndim != 2]


def test_adamw_over_flat_params_with_muon_over_the_matrices_warns_before_muon_steps_them_again():
    """The reported case: ``AdamW(storage.flat_params)`` + ``Muon([p ... if p.ndim == 2])``, per-tensor mode.

    The user meant AdamW over the other parameters and Muon over the matrices (the
    plain twin of the next test); but ``flat_params`` holds every tensor, so the matrices
    were stepped by both, with no word (measured: dw 6.6e-2 against the
    intended split). Now Muon's first step warns before it changes anything: as an
    error, the weights are those AdamW's step left.
    """
    model = _model()
    storage = register_flat_storage(model)
    storage.unflatten()
    adamw = torch.optim.AdamW(storage.flat_params, lr=1e-2)
    muon = torch.optim.Muon(_matrices(model), lr=1e-2)
    _backward(model, 0)
    adamw.step()
    after_adamw = values(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=TWICE + r".*Muon \(through its leaf\) and AdamW "):
            muon.step()
    for name, value in values(model).items():
        assert torch.equal(value, after_adamw[name]), name


def test_the_double_step_differs_from_the_intended_split_when_the_warning_is_ignored():
    """Ignored, the warning's case steps the matrices by both optimizers: far from the intended split.

    The plain twin trains what the user meant (AdamW over the other parameters, Muon
    over the matrices); the double step is the difference the library used to leave
    silent. The fix the message names gives the plain twin's weights bit for bit.
    """
    plain = _model()
    model = twin(plain)
    storage = register_flat_storage(model)
    storage.unflatten()
    _train(plain, [torch.optim.AdamW(_others(plain), lr=1e-2), torch.optim.Muon(_matrices(plain), lr=1e-2)])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="two optimizers: ")
        _train(
            model,
            [torch.optim.AdamW(storage.flat_params, lr=1e-2), torch.optim.Muon(_matrices(model), lr=1e-2)],
        )
    gap = max((p - q).abs().max().item() for p, q in zip(model.parameters(), plain.parameters()))
    assert gap > 1e-3

    fixed = _model()  # the fix the warning names: the same split as the plain twin, over the leaves
    fixed_storage = register_flat_storage(fixed)
    fixed_storage.unflatten()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(
            fixed, [torch.optim.AdamW(_others(fixed), lr=1e-2), torch.optim.Muon(_matrices(fixed), lr=1e-2)]
        )
    for (name, p), q in zip(fixed.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


def _flat_and_leaves(model: nn.Module, storage: FlatStorage) -> list[torch.optim.Optimizer]:
    storage.unflatten()
    return [torch.optim.AdamW(storage.flat_params, lr=1e-2), torch.optim.Muon(_matrices(model), lr=1e-2)]


def _two_over_leaves(model: nn.Module, storage: FlatStorage) -> list[torch.optim.Optimizer]:
    storage.unflatten()
    return [torch.optim.Muon(_matrices(model), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)]


def _one_in_each_mode(model: nn.Module, storage: FlatStorage) -> list[torch.optim.Optimizer]:
    flat = torch.optim.SGD(model.parameters(), lr=1e-2)  # built in flat mode: the flat parameters
    storage.unflatten()
    return [flat, torch.optim.Adam(model[0].parameters(), lr=1e-2)]


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (
            _flat_and_leaves,
            r"Muon \(through its leaf\) and AdamW \(through a flat parameter\) both step '0\.weight'",
        ),
        (_two_over_leaves, r"AdamW \(through its leaf\) and Muon \(through its leaf\) both step '0\.weight'"),
        (
            _one_in_each_mode,
            r"Adam \(through its leaf\) and SGD \(through a flat parameter\) both step '0\.weight'",
        ),
    ],
    ids=["flat-params-and-leaves", "two-over-leaves", "one-built-in-each-mode"],
)
def test_an_element_reached_by_two_optimizers_warns_once_at_the_first_step_with_the_fix(build, names):
    """Each way of reaching an element twice warns once, naming both optimizers, the tensor and the fix."""
    model = _model()
    storage = register_flat_storage(model)
    optimizers = build(model, storage)
    fix = r".*Build the optimizers over disjoint parts.*drop the old one"
    with pytest.warns(UserWarning, match=TWICE + r".*" + names + fix):
        _train(model, optimizers, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flat mode: ")
            _train(model, optimizers, steps=2)


def test_the_warning_is_silenced_by_its_documented_filter():
    """``warnings.filterwarnings('ignore', message='two optimizers: ')`` silences it, as the message says."""
    model = _model()
    optimizers = _two_over_leaves(model, register_flat_storage(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="two optimizers: ")
        _train(model, optimizers, steps=1)


def _silent_flat_mode(model: nn.Module, storage: FlatStorage) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(model.parameters(), lr=1e-2)]


def _silent_per_tensor(model: nn.Module, storage: FlatStorage) -> list[torch.optim.Optimizer]:
    storage.unflatten()
    return [torch.optim.AdamW(model.parameters(), lr=1e-2)]


def _muon_split_done_right(model: nn.Module, storage: FlatStorage) -> list[torch.optim.Optimizer]:
    storage.unflatten()
    return [torch.optim.Muon(_matrices(model), lr=1e-2), torch.optim.AdamW(_others(model), lr=1e-2)]


def _attached(model: nn.Module, storage: FlatStorage) -> list[torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    storage.attach_optimizer(opt)
    return [opt]


def _disjoint_groups(model: nn.Module, storage: FlatStorage) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD([storage["matrices"]], lr=1e-2), torch.optim.AdamW([storage["others"]], lr=1e-2)]


def _rebuilt(model: nn.Module, storage: FlatStorage) -> list[torch.optim.Optimizer]:
    storage.unflatten()
    first = torch.optim.AdamW(storage.flat_params, lr=1e-2)
    _train(model, [first], steps=1)
    first.cycle = first  # type: ignore[attr-defined] - only the cycle collector frees it
    del first
    return [torch.optim.AdamW(model.parameters(), lr=1e-2)]


@pytest.mark.parametrize(
    "build",
    [_silent_flat_mode, _silent_per_tensor, _muon_split_done_right, _attached, _disjoint_groups, _rebuilt],
    ids=[
        "one-optimizer-flat-mode",
        "one-optimizer-per-tensor-mode",
        "muon-docstring-split",
        "attach-optimizer",
        "disjoint-groups",
        "rebuilt-after-the-first-is-gone",
    ],
)
def test_one_optimizer_per_element_stays_silent(build: Callable[..., list[torch.optim.Optimizer]]):
    """One optimizer per element, however the optimizers are built, gives no warning at all."""
    model = _model()
    groups = {"matrices": _matrices(model), "others": _others(model)} if build is _disjoint_groups else None
    storage = register_flat_storage(model, groups)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizers = build(model, storage)
        _train(model, optimizers)
        gc.collect()


def test_an_ema_updating_with_lerp_beside_the_optimizer_stays_silent():
    """An EMA over ``flat_params`` updates with ``lerp_`` under no_grad: it is no optimizer, nothing warns."""
    model = _model()
    storage = register_flat_storage(model)
    storage.unflatten()
    ema = [flat.detach().clone() for flat in storage.flat_params]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            _train(model, [opt], steps=1)
            with torch.no_grad():
                for average, flat in zip(ema, storage.flat_params):
                    average.lerp_(flat, 0.1)
                    flat.lerp_(average, 0.5)  # an EMA written back (post-hoc averaging)


class _Lookahead(torch.optim.Optimizer):
    """A wrapper as timm's Lookahead: the inner optimizer's param groups, its step inside this one's."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        super().__init__([{"params": [p for group in inner.param_groups for p in group["params"]]}], {})
        self.inner = inner
        self.param_groups = inner.param_groups

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.inner.step()
        for group in self.param_groups:
            for param in group["params"]:
                param.mul_(0.999)  # the slow weights' pull, element-wise


@pytest.mark.parametrize("per_tensor", [False, True], ids=["flat-mode", "per-tensor-mode"])
def test_a_wrapper_sharing_the_param_groups_of_its_inner_optimizer_stays_silent(per_tensor):
    """A wrapper that steps its inner optimizer over the same parameters is one optimizer."""
    model = _model()
    storage = register_flat_storage(model)
    if per_tensor:
        storage.unflatten()
    opt = _Lookahead(torch.optim.AdamW(model.parameters(), lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="flat mode: ")  # no listed element-wise class
        _train(model, [opt])


@pytest.mark.parametrize("per_tensor", [False, True], ids=["flat-mode", "per-tensor-mode"])
def test_sharded_and_zero_optimizers_stepping_an_inner_optimizer_stay_silent(world1, per_tensor):
    """``ShardedOptimizer`` and torch's ZeroRedundancyOptimizer step an inner optimizer over their memory."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    for engine in ("sharded", "zero"):
        model = _model()
        storage = register_flat_storage(model)
        if engine == "sharded":
            opt: torch.optim.Optimizer = ShardedOptimizer(storage, torch.optim.AdamW, lr=1e-2)
        else:
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        if per_tensor:
            storage.unflatten()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", message="flat mode: ")  # ZeRO is no listed element-wise class
            _train(model, [opt])


def test_adamw_over_flat_params_alone_in_per_tensor_mode_is_the_plain_models_adamw():
    """The docs' recipe: ``AdamW(storage.flat_params)`` in per-tensor mode is bit-equal to plain AdamW."""
    plain = _model()
    model = twin(plain)
    storage = register_flat_storage(model)
    storage.unflatten()
    _train(model, [torch.optim.AdamW(storage.flat_params, lr=1e-2, weight_decay=0.1)], steps=4)
    _train(plain, [torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)], steps=4)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
