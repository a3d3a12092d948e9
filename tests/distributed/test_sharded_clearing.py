"""``ShardedOptimizer``'s gradients as the model shows them: every way of clearing one, and clipping them.

ZeRO-2 keeps each rank's averaged part of a gradient only; the model's ``.grad`` (the flat parameter's
in flat mode, each leaf's in per-tensor mode) is then a placeholder of it (``ShardedGrad``), so that
torch's ways of clearing a gradient reach the part a rank keeps, and ``clip_grad_norm_`` through the
parameters clips by the global norm. ZeRO-1's slices take their gradients from the whole averaged flat
gradient at each step. Before, ``model.zero_grad()`` or ``p.grad = None`` left the owner's part in place
(each step added the new gradient to every old one: 0.14 off one process in the scenario below) and a
clip through the parameters clipped nothing.

Each scenario trains the flattened model on 2 and 3 gloo ranks (one launch each; every rank its part of
each micro-batch, two micro-batches per step that accumulate) and, in the same process, the plain model
on the whole batches, and compares the weights:

* ``clearing``: the loop of a plain script, clearing with each of torch's ways (``model.zero_grad()`` as
  transformers' ``Trainer`` and modded-nanogpt call it, ``set_to_none=False``, ``p.grad = None`` per
  parameter, the optimizer's own), in flat and per-tensor mode, element-wise ZeRO-2 and ZeRO-1 and whole
  tensors (torch's ``Muon`` on the matrices, ``SGD`` on the rest), and clipping through the parameters
  (``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``);
* ``frameworks``: the loops of accelerate (``accumulate``, ``clip_grad_norm_``), Lightning
  (``accumulate_grad_batches``, ``gradient_clip_val``) and transformers' ``Trainer``
  (``gradient_accumulation_steps``, ``max_grad_norm``, ``model.zero_grad()``), each driving the
  ``ShardedOptimizer`` in every rank against the same framework over the plain model in one process.
  The ranks are spawned processes with a gloo group of their own and none of torchrun's environment
  variables, so each framework runs its one-process loop (under torchrun they would wrap the model in
  DDP, which reduces the gradients a second time); the optimizer syncs the gradients itself.

The placeholder's own rules (what it refuses, its ``repr``, that it goes with its optimizer) are tested
in this process with a gloo world of one.
"""

from __future__ import annotations

import copy
import functools
import gc
import math
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from flatten_parametrize import ShardedOptimizer, get_flat_storage, register_flat_storage
from flatten_parametrize._distributed.sharded_grads import ShardedGrad

from _helpers import assert_same_values, launch_gloo, launch_results, save_result, values

pytestmark = pytest.mark.slow

BATCH, MICRO, STEPS = 12, 2, 3  # rows divisible by 2 and 3 ranks times 2 micro-batches
CLIP = 0.05  # below every gradient norm of the scenario: the clip scales each step


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 4, generator=gen)


def _rows(rank: int, world: int, micro: int) -> slice:
    """This rank's rows of micro-batch ``micro`` (the plain model takes every rank's: the whole one)."""
    per = BATCH // MICRO // world
    start = micro * BATCH // MICRO + rank * per
    return slice(start, start + per)


def _micro(micro: int) -> slice:
    return slice(micro * BATCH // MICRO, (micro + 1) * BATCH // MICRO)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean() / MICRO


# ---------------------------------------------------------------------------------------- clearing
def _clear_model(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.zero_grad()


def _clear_model_zeros(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.zero_grad(set_to_none=False)


def _clear_each(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = None


def _clear_opt_zeros(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=False)


CLEARS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], None]] = {
    "model.zero_grad()": _clear_model,
    "model.zero_grad(set_to_none=False)": _clear_model_zeros,
    "p.grad = None": _clear_each,
    "opt.zero_grad(set_to_none=False)": _clear_opt_zeros,
}

CLIPS: dict[str, Callable[[Any], Any]] = {
    "clip_grad_norm_": lambda params: torch.nn.utils.clip_grad_norm_(params, CLIP),
    "clip_grad_norm_(foreach=True)": lambda params: torch.nn.utils.clip_grad_norm_(
        params, CLIP, foreach=True
    ),
    "clip_grad_norm_(norm_type=inf)": lambda params: torch.nn.utils.clip_grad_norm_(params, CLIP, math.inf),
    "clip_grad_value_": lambda params: torch.nn.utils.clip_grad_value_(params, CLIP / 10),
}

SHARDINGS = ["ZeRO-2", "ZeRO-1", "ZeRO-2 whole tensors", "ZeRO-1 whole tensors"]


def _optimizers(model: nn.Module, plain: nn.Module, sharding: str) -> tuple[ShardedOptimizer, Any]:
    """The sharded optimizer over ``model``'s storage and the same optimizer(s) over ``plain``."""
    storage = get_flat_storage(model)
    assert storage is not None
    shard = sharding.startswith("ZeRO-2")
    if "whole" not in sharding:
        opt = ShardedOptimizer(storage, torch.optim.SGD, lr=0.1, momentum=0.9, shard_gradients=shard)
        return opt, [torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)]
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": matrices, "optimizer_class": torch.optim.Muon, "lr": 0.02}, {"params": rest}]
    opt = ShardedOptimizer(
        storage, torch.optim.SGD, groups, whole_tensors=True, shard_gradients=shard, lr=0.1, momentum=0.9
    )
    refs = [
        torch.optim.Muon([p for p in plain.parameters() if p.dim() == 2], lr=0.02),
        torch.optim.SGD([p for p in plain.parameters() if p.dim() != 2], lr=0.1, momentum=0.9),
    ]
    return opt, refs


def _train_clearing(
    rank: int, world: int, per_tensor: bool, sharding: str, clear: str, clip: str | None
) -> float:
    """Train the flattened model and the plain twin; return the largest weight difference."""
    plain = _net()
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    if per_tensor or "whole" in sharding:  # whole tensors step the leaves: per-tensor mode
        storage.unflatten()
    opt, refs = _optimizers(model, plain, sharding)
    norms = []
    for step in range(STEPS):
        x, y = _data(step)
        for micro in range(MICRO):
            rows = _rows(rank, world, micro)
            _loss(model, x[rows], y[rows]).backward()
            _loss(plain, x[_micro(micro)], y[_micro(micro)]).backward()
        if clip is not None:
            norms.append((CLIPS[clip](model.parameters()), CLIPS[clip](plain.parameters())))
        opt.step()
        for ref in refs:
            ref.step()
        CLEARS[clear](model, opt)
        plain.zero_grad()
    for mine, theirs in norms:
        if mine is not None:  # clip_grad_value_ returns nothing
            assert torch.allclose(mine, theirs, rtol=1e-5), (float(mine), float(theirs))
    if not storage.is_flattened:
        storage.flatten()
    return max((a - b).abs().max().item() for a, b in zip(values(model).values(), values(plain).values()))


def _scenario_clearing(rank: int, world: int) -> dict[str, float]:
    out = {}
    for sharding in SHARDINGS:
        for mode in ("flat", "per-tensor"):
            if "whole" in sharding and mode == "flat":
                continue
            for clear in CLEARS:
                key = f"{sharding}, {mode}, {clear}"
                out[key] = _train_clearing(rank, world, mode == "per-tensor", sharding, clear, None)
            for clip in CLIPS:
                key = f"{sharding}, {mode}, {clip}"
                out[key] = _train_clearing(
                    rank, world, mode == "per-tensor", sharding, "model.zero_grad()", clip
                )
    return out


def _scenario_mode_switch(rank: int, world: int) -> dict[str, float]:
    """Micro-batches that accumulate across a switch of mode between them, then a clear in the other mode."""
    out = {}
    for first in ("flat", "per-tensor"):
        plain = _net()
        model = copy.deepcopy(plain)
        storage = register_flat_storage(model)
        opt, (ref,) = _optimizers(model, plain, "ZeRO-2")
        for step in range(STEPS):
            x, y = _data(step)
            for micro in range(MICRO):
                if (micro == 0) == (first == "flat"):
                    storage.flatten()
                else:
                    storage.unflatten()
                _loss(model, x[_rows(rank, world, micro)], y[_rows(rank, world, micro)]).backward()
                _loss(plain, x[_micro(micro)], y[_micro(micro)]).backward()
            opt.step()
            ref.step()
            model.zero_grad()  # in the mode of the last micro-batch
            plain.zero_grad()
        storage.flatten()
        out[first] = max(
            (a - b).abs().max().item() for a, b in zip(values(model).values(), values(plain).values())
        )
    return out


# -------------------------------------------------------------------------------------- frameworks
class _Regressor(nn.Module):
    """The net with a loss, as transformers' ``Trainer`` wants a model (``labels`` in, ``loss`` out)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.net(x) - labels).pow(2).mean()}


def _micro_batches(rows: Callable[[int], slice]) -> list[dict[str, torch.Tensor]]:
    """Every micro-batch of every step, each as one item (so that a framework's sampler keeps them whole)."""
    items = []
    for step in range(STEPS):
        x, y = _data(step)
        items += [{"x": x[rows(micro)], "labels": y[rows(micro)]} for micro in range(MICRO)]
    return items


def _accelerate(model: _Regressor, items: list[dict[str, torch.Tensor]], sharded: bool) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=MICRO, cpu=True)
    if sharded:
        storage = register_flat_storage(model)
        opt: torch.optim.Optimizer = ShardedOptimizer(storage, torch.optim.SGD, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    for item in items:
        with accelerator.accumulate(model):
            accelerator.backward(model(**item)["loss"])
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()


def _lightning(model: _Regressor, items: list[dict[str, torch.Tensor]], sharded: bool, whole: bool) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.model(batch["x"][0], batch["labels"][0])["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if not sharded:
                return torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
            storage = register_flat_storage(self.model)
            if not whole:
                return ShardedOptimizer(storage, torch.optim.SGD, lr=0.1, momentum=0.9)
            storage.unflatten()
            return ShardedOptimizer(
                storage, torch.optim.SGD, self.model.parameters(), whole_tensors=True, lr=0.1, momentum=0.9
            )

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=MICRO,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(),
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(items, batch_size=1, shuffle=False))


def _transformers(model: _Regressor, items: list[dict[str, torch.Tensor]], sharded: bool) -> None:
    from transformers import Trainer, TrainingArguments

    if sharded:
        opt: torch.optim.Optimizer = ShardedOptimizer(
            register_flat_storage(model), torch.optim.SGD, lr=0.1, momentum=0.9
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=MICRO,
        max_steps=STEPS,
        max_grad_norm=CLIP,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )

    def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        (item,) = batch
        return item

    Trainer(
        model=model, args=args, train_dataset=items, data_collator=collate, optimizers=(opt, None)
    ).train()


FRAMEWORKS: dict[str, Callable[[_Regressor, list[dict[str, torch.Tensor]], bool], None]] = {
    "accelerate": _accelerate,
    "Lightning": functools.partial(_lightning, whole=False),
    "Lightning, whole tensors in per-tensor mode": functools.partial(_lightning, whole=True),
    "transformers' Trainer": _transformers,
}


def _scenario_frameworks(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out = {}
    for name, run in FRAMEWORKS.items():
        plain, model = _Regressor(), _Regressor()
        run(model, _micro_batches(lambda micro: _rows(rank, world, micro)), True)
        run(plain, _micro_batches(_micro), False)
        storage = get_flat_storage(model)
        if storage is not None and not storage.is_flattened:
            storage.flatten()
        out[name] = {"sharded": values(model), "plain": values(plain)}
    return out


SCENARIOS: dict[str, Callable[[int, int], Any]] = {
    "clearing": _scenario_clearing,
    "mode_switch": _scenario_mode_switch,
    "frameworks": _scenario_frameworks,
}


def _run(rank: int, world: int, outdir: Path) -> None:
    for name, scenario in SCENARIOS.items():
        save_result(outdir, rank, name, scenario(rank, world))


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch_gloo(_run, tmp_path_factory.mktemp(f"clearing{request.param}"), world=request.param)


def test_every_way_of_clearing_a_gradient_clears_the_owners_part_as_on_one_process(launch):
    """Each clear, mode and sharding trains as the plain model (before: each step added the old gradients)."""
    for result in launch_results(launch, "clearing"):
        off = {key: diff for key, diff in result.items() if not diff < 2e-5}
        assert off == {}, f"trained unlike the plain model (largest weight difference): {off}"


def test_micro_batches_accumulate_across_a_switch_of_mode_and_clear_in_either(launch):
    for result in launch_results(launch, "mode_switch"):
        assert all(diff < 2e-5 for diff in result.values()), result


def test_frameworks_loops_clear_and_clip_the_sharded_gradients_as_on_one_process(launch):
    """accelerate's, Lightning's and transformers' loops: micro-batches, a global-norm clip, clearing."""
    for result in launch_results(launch, "frameworks"):
        for name, trained in result.items():
            assert_same_values(trained["sharded"], trained["plain"], rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------------- in this process (world 1)
def _after_backward(world1: None) -> tuple[nn.Module, ShardedOptimizer]:
    model = _net()
    opt = ShardedOptimizer(register_flat_storage(model), torch.optim.SGD, lr=0.1)
    x, y = _data(0)
    _loss(model, x, y).backward()
    return model, opt


def test_a_sharded_gradient_refuses_reading_its_values_naming_what_works(world1):
    model, _ = _after_backward(world1)
    grad = model.flat_param_0.grad
    assert isinstance(grad, ShardedGrad) and grad.shape == model.flat_param_0.shape
    assert grad.untyped_storage().nbytes() <= grad.element_size()  # it holds no values
    with pytest.raises(
        RuntimeError, match=r"the gradient of the flat parameter of group '0' is sharded over"
    ):
        grad.sum()
    with pytest.raises(
        RuntimeError, match=r"so Tensor.add cannot.*clip_grad_norm_.*shard_gradients=False\) keeps whole"
    ):
        grad + 1
    with pytest.raises(RuntimeError, match=r"takes Tensor.mul_ but not with a tensor of several elements"):
        grad.mul_(torch.ones_like(model.flat_param_0))
    with pytest.raises(RuntimeError, match=r"takes torch.linalg.vector_norm but not with dim=0"):
        torch.linalg.vector_norm(grad, dim=0)
    assert "sharded over the ranks" in repr(grad)


def test_a_sharded_gradient_gives_the_global_norm_and_scales_this_ranks_part(world1):
    model, opt = _after_backward(world1)
    (part,) = [p.grad for g in opt.local_optimizer.param_groups for p in g["params"]]
    expected = torch.linalg.vector_norm(part[: model.flat_param_0.numel()])
    assert torch.allclose(torch.linalg.vector_norm(model.flat_param_0.grad), expected)
    assert torch.allclose(model.flat_param_0.grad.norm(), expected)
    before = part.clone()
    model.flat_param_0.grad.mul_(0.5)
    assert torch.equal(part, before * 0.5)


def test_a_placeholder_kept_after_its_gradient_was_cleared_says_so(world1):
    model, _ = _after_backward(world1)
    kept = model.flat_param_0.grad
    model.zero_grad()
    assert model.flat_param_0.grad is None
    with pytest.raises(
        RuntimeError, match=r"was cleared or replaced since; read the parameter's .grad again"
    ):
        kept.norm()


def test_the_placeholders_go_with_their_optimizer(world1):
    model, opt = _after_backward(world1)
    del opt
    gc.collect()
    assert model.flat_param_0.grad is None
