"""What optimizers keep in their param groups survives ``ShardedOptimizer``'s steps and checkpoints.

pytorch_optimizer's optimizers count their steps in ``group["step"]`` (AdaFactor's relative step size
and bias corrections read it), schedule-free AdamW keeps ``weight_sum``, ``lr_max`` and its mode there,
and needs ``opt.train()`` / ``opt.eval()``. Before, each ``step()`` copied the outer param groups over
the inner optimizers' (schedule-free's ``weight_sum`` went back to 0 at every step), ``state_dict()``
and DCP lost the step count (a resume was 9.75e-3 off an uninterrupted run; a checkpoint did not load
into a plain optimizer: "Missing key in checkpoint state_dict: app.optim.param_groups.0.step"), and
``opt.train()`` raised ``AttributeError``.

Each recipe trains the flattened model on 2 gloo ranks (every rank its part of the batch) and the
plain model with the plain optimizer in one process:

* uninterrupted, ``STEPS`` steps: equal;
* checkpointed after ``SAVED_AT`` steps with ``opt.state_dict()`` and with DCP (``get_state_dict`` /
  ``dcp.save``), then resumed from each and trained to the end: equal to the uninterrupted run. The
  2-rank checkpoints resume on 3 ranks (which save their own, resumed on 2 ranks: 2->3->2) and in this
  process on one rank and into the plain optimizer.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from flatten_parametrize import ShardedOptimizer, plain_optim_state_dict, register_flat_storage

from _helpers import assert_same_values, launch_gloo, launch_results, save_result, values

pytestmark = pytest.mark.slow

ROWS, STEPS, SAVED_AT = 12, 5, 2  # rows divisible by 2 and 3 ranks


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def _data(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(ROWS, 6, generator=gen), torch.randn(ROWS, 4, generator=gen)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    return x[rows], y[rows]


def _adafactor() -> type[torch.optim.Optimizer]:
    from pytorch_optimizer import AdaFactor

    return AdaFactor


def _came() -> type[torch.optim.Optimizer]:
    from pytorch_optimizer import CAME

    return CAME


def _schedule_free_po() -> type[torch.optim.Optimizer]:
    from pytorch_optimizer import ScheduleFreeAdamW

    return ScheduleFreeAdamW


def _schedule_free() -> type[torch.optim.Optimizer]:
    from schedulefree import AdamWScheduleFree

    return AdamWScheduleFree


#: name -> (optimizer class, keyword arguments, whole tensors (per-tensor mode) or slices)
RECIPES: dict[str, tuple[Callable[[], type[torch.optim.Optimizer]], dict[str, Any], bool]] = {
    "pytorch_optimizer AdaFactor, whole tensors": (_adafactor, {"lr": 1e-2}, True),
    "pytorch_optimizer CAME, whole tensors": (_came, {"lr": 1e-2}, True),
    "pytorch_optimizer ScheduleFreeAdamW, slices": (
        _schedule_free_po,
        {"lr": 1e-2, "warmup_steps": 2},
        False,
    ),
    "schedulefree AdamWScheduleFree, slices": (_schedule_free, {"lr": 1e-2, "warmup_steps": 2}, False),
}


def _build(recipe: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The flattened model and its ``ShardedOptimizer`` (on 1 rank too)."""
    make, kwargs, whole = RECIPES[recipe]
    model = _net()
    storage = register_flat_storage(model)
    if whole:
        storage.unflatten()
        opt = ShardedOptimizer(storage, make(), model.parameters(), whole_tensors=True, **kwargs)
    else:
        opt = ShardedOptimizer(storage, make(), allow_unlisted=True, **kwargs)
    return model, opt


def _plain(recipe: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    make, kwargs, _ = RECIPES[recipe]
    model = _net()
    return model, make()(model.parameters(), **kwargs)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> None:
    if hasattr(opt, "train"):  # schedule-free: the training mode (through ShardedOptimizer to the inner)
        opt.train()
    for step in steps:
        x, y = _data(step, rank, world)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _weights(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The weights to compare: schedule-free's evaluation weights (``opt.eval()``)."""
    if hasattr(opt, "eval"):
        opt.eval()
    return values(model)


def _reference(recipe: str) -> dict[str, torch.Tensor]:
    model, opt = _plain(recipe)
    _train(model, opt, range(STEPS), 0, 1)
    return _weights(model, opt)


class _App:
    """What ``dcp.save`` / ``dcp.load`` see: ``get_state_dict`` / ``set_state_dict``, as torch's recipe."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.opt, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


def _save(outdir: Path, recipe: str, world: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Checkpoint after ``SAVED_AT`` steps: the gathered state dict (rank 0) and DCP."""
    gathered = {"model": values(model), "optim": opt.state_dict()}
    key = recipe.replace(" ", "_").replace(",", "")
    if dist.get_rank() == 0:
        torch.save(gathered, outdir / f"{key}.{world}.pt")
    dcp.save({"app": _App(model, opt)}, checkpoint_id=str(outdir / f"{key}.{world}.dcp"))


def _resume(source: Path, recipe: str, form: str, world: int, rank: int, plain: bool = False) -> Any:
    """Build fresh, load the checkpoint of ``world`` ranks in ``form``, train to the end; the weights."""
    model, opt = _plain(recipe) if plain else _build(recipe)
    if hasattr(opt, "train"):  # schedulefree's optimizers step (DCP's first one too) in training mode only
        opt.train()
    key = recipe.replace(" ", "_").replace(",", "")
    try:
        if form == "state_dict":
            saved = torch.load(source / f"{key}.{world}.pt", weights_only=False)
            model.load_state_dict(saved["model"])
            if plain and not RECIPES[recipe][2]:  # the slices' state dict is the flat model's: converted
                flattened = _net()  # held while the storage converts
                saved["optim"] = plain_optim_state_dict(register_flat_storage(flattened), saved["optim"])
            opt.load_state_dict(saved["optim"])
        else:
            dcp.load({"app": _App(model, opt)}, checkpoint_id=str(source / f"{key}.{world}.dcp"))
    except BaseException as error:  # recorded (DCP's CheckpointException is a BaseException)
        return f"{type(error).__name__}: {error}"
    _train(model, opt, range(SAVED_AT, STEPS), rank, dist.get_world_size())
    return _weights(model, opt)


def _run(rank: int, world: int, outdir: Path, source: Path | None = None, saved_by: int = 2) -> None:
    """Train every recipe uninterrupted and checkpointed; resume the checkpoints ``saved_by`` ranks left
    in ``source`` (``None``: these ranks' own)."""
    out: dict[str, Any] = {}
    for recipe in RECIPES:
        out[f"{recipe}: reference"] = _reference(recipe)
        model, opt = _build(recipe)
        _train(model, opt, range(STEPS), rank, world)
        out[f"{recipe}: uninterrupted"] = _weights(model, opt)
        model, opt = _build(recipe)
        _train(model, opt, range(SAVED_AT), rank, world)
        _save(outdir, recipe, world, model, opt)
        for form in ("state_dict", "dcp"):
            got = _resume(source or outdir, recipe, form, saved_by, rank)
            out[f"{recipe}: resumed from {saved_by} ranks, {form}"] = got
    save_result(outdir, rank, "group_state", out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch_gloo(_run, tmp_path_factory.mktemp("group_state2"), world=2)


@pytest.fixture(scope="module")
def three_ranks(two_ranks: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    worker = functools.partial(_run, source=two_ranks["outdir"], saved_by=2)
    return launch_gloo(worker, tmp_path_factory.mktemp("group_state3"), world=3)


@pytest.fixture(scope="module")
def two_again(three_ranks: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    worker = functools.partial(_run, source=three_ranks["outdir"], saved_by=3)
    return launch_gloo(worker, tmp_path_factory.mktemp("group_state2b"), world=2)


def _check(result: dict[str, Any]) -> None:
    for key, got in result.items():
        if key.endswith(": reference"):
            continue
        recipe = key.split(": ")[0]
        assert not isinstance(got, str), f"{key}: {got}"
        assert_same_values(got, result[f"{recipe}: reference"], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("launch", ["two_ranks", "three_ranks", "two_again"], ids=["2", "2 -> 3", "3 -> 2"])
def test_state_kept_in_param_groups_trains_and_resumes_as_one_process(launch, request):
    """Uninterrupted, and resumed from ``opt.state_dict()`` and from DCP at another world size."""
    for result in launch_results(request.getfixturevalue(launch), "group_state"):
        _check(result)


@pytest.mark.parametrize("plain", [False, True], ids=["ShardedOptimizer on 1 rank", "the plain optimizer"])
def test_a_two_rank_checkpoint_resumes_on_one_rank_and_into_the_plain_optimizer(world1, two_ranks, plain):
    """Not DCP into a plain schedulefree optimizer: its ``train()`` leaves an empty state entry per tensor, so
    torch's ``_init_optim_state`` takes the fresh optimizer for one with state and its load keeps none (the
    same with the plain model alone; ``ShardedOptimizer`` counts an empty entry as none)."""
    outdir = two_ranks["outdir"]
    for recipe in RECIPES:
        for form in ("state_dict", "dcp"):
            if plain and form == "dcp" and recipe.startswith("schedulefree"):
                continue
            got = _resume(outdir, recipe, form, 2, 0, plain=plain)
            assert not isinstance(got, str), f"{recipe}, {form}: {got}"
            assert_same_values(got, _reference(recipe), rtol=1e-5, atol=1e-6, msg=f"{recipe}, {form}")


def test_an_inner_optimizers_own_methods_are_reached_and_others_are_not(world1):
    _model, opt = _build("pytorch_optimizer ScheduleFreeAdamW, slices")  # the model held: its storage lives
    assert callable(opt.train) and callable(opt.eval)
    opt.eval()
    assert opt.param_groups[0]["train_mode"] is False  # the inner optimizer's group entry, taken back
    with pytest.raises(AttributeError, match="'ShardedOptimizer' object has no attribute 'no_such_method'"):
        opt.no_such_method()
    _, opt = _build("pytorch_optimizer AdaFactor, whole tensors")
    assert not hasattr(opt, "train")
