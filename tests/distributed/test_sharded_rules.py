"""What ``ShardedOptimizer`` can shard (``_distributed/sharded_rules.py``), checked when it is built.

* **Cuts**: with ``whole_tensors=True`` only the listed element-wise classes are cut between ranks.
  Before, ``allow_unlisted=True`` let torch's ``Adafactor`` over a 64x256 weight be split between two
  ranks and stepped as two vectors (3.07e-3 off one process).
* **Settings a class reads when constructed**: each group's class is constructed with its group's
  settings. Before, pytorch_optimizer's ``Shampoo`` as a group's class ignored that group's
  ``preconditioning_compute_steps`` (1.48e-2 off one process). Over slices, where one inner optimizer
  serves every group, such a setting is refused with the ways that work.
* **Steps that read several tensors, closures**: refused when the optimizer is built, found by stepping
  the class on two tensors together and each alone. Before, pytorch_optimizer's ``Prodigy`` was
  accepted (7.39e-3 off one process) and ``AliG`` failed at its first ``step`` with its own
  ``NoClosureError``.

Every refusal's way out is followed to the end: on 2 gloo ranks against one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatten_parametrize import ShardedOptimizer, register_flat_storage, remove_flat_storage

from _helpers import assert_same_values, launch_gloo, launch_results, save_result, values

ROWS, STEPS = 8, 4


class _Net(nn.Module):
    """A 64x256 matrix (Adafactor factors it), a bias and a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(256, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.wide(x)))


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _data(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(ROWS, 256, generator=gen), torch.randn(ROWS, 4, generator=gen)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    return x[rows], y[rows]


def _loss(model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = _data(step, rank, world)
    return (model(x) - y).pow(2).mean()


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, closure: bool = False
) -> None:
    for step in range(STEPS):
        if closure:

            def evaluate(step: int = step) -> torch.Tensor:
                with torch.enable_grad():  # optimizers call it under no_grad
                    opt.zero_grad()
                    loss = _loss(model, step, rank, world)
                    loss.backward()
                if world > 1:  # the loss of every rank's batch, as the gradients are averaged
                    loss = loss.detach().clone()
                    dist.all_reduce(loss)
                    loss /= world
                return loss

            opt.step(evaluate)
        else:
            _loss(model, step, rank, world).backward()
            opt.step()
            opt.zero_grad()


def _plain(make: Callable[[nn.Module], torch.optim.Optimizer], closure: bool = False) -> dict[str, Any]:
    model = _net()
    _train(model, make(model), 0, 1, closure)
    return values(model)


# ---------------------------------------------------------------------------------------------- scenarios
def _adafactor(rank: int, world: int) -> dict[str, Any]:
    """torch's Adafactor with allow_unlisted=True: the 64x256 weight stays whole on one rank."""
    model = _net()
    storage = register_flat_storage(model)
    storage.unflatten()
    opt = ShardedOptimizer(
        storage, torch.optim.Adafactor, model.parameters(), whole_tensors=True, allow_unlisted=True, lr=1e-2
    )
    (shard,) = opt._ownership.shards
    cuts = [lo for owner in shard.ranges for lo, _ in owner]
    _train(model, opt, rank, world)
    storage.flatten()
    plain = _plain(lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2))
    return {"cuts": cuts, "weight": (0, 64 * 256), "sharded": values(model), "plain": plain}


def _shampoo(rank: int, world: int) -> dict[str, Any]:
    """pytorch_optimizer's Shampoo as the matrix group's class, with a setting read when constructed.

    Every rank trains on the whole batches (an average of equal gradients is exact): the inverse roots
    of these rank-deficient statistics would turn the ulp of another summation order into 0.2.
    """
    from pytorch_optimizer import Shampoo

    out = {}
    for steps in (1, 3):
        model = _net()
        storage = register_flat_storage(model)
        storage.unflatten()
        groups = [
            {
                "params": [model.wide.weight],
                "optimizer_class": Shampoo,
                "lr": 1e-2,  # a group's class has its own defaults: lr=1e-3 for Shampoo
                "preconditioning_compute_steps": steps,
            },
            {"params": [model.wide.bias, *model.head.parameters()]},
        ]
        opt = ShardedOptimizer(storage, torch.optim.AdamW, groups, whole_tensors=True, lr=1e-2)
        _train(model, opt, 0, 1)
        storage.flatten()

        def make(m: nn.Module, steps: int = steps) -> torch.optim.Optimizer:
            return _Both(
                Shampoo([m.wide.weight], lr=1e-2, preconditioning_compute_steps=steps),
                torch.optim.AdamW([m.wide.bias, *m.head.parameters()], lr=1e-2),
            )

        out[steps] = {"sharded": values(model), "plain": _plain(make)}
    return out


class _Both(torch.optim.Optimizer):
    """Two optimizers stepped as one (the one-process twin of per-group classes)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})

    def step(self, closure: Any = None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)


class _ScaledSign(torch.optim.Optimizer):
    """An element-wise optimizer that reads ``scale`` when it is constructed (not from its groups)."""

    def __init__(self, params: Any, lr: float = 0.01, scale: float = 1.0) -> None:
        super().__init__(params, {"lr": lr})
        self.scale = scale

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"] * self.scale)


def _slice_setting_routes(rank: int, world: int) -> dict[str, Any]:
    """The routes of the refusal of a group setting read when constructed, over slices."""
    model = _net()
    storage = register_flat_storage(model)
    opt = ShardedOptimizer(storage, _ScaledSign, allow_unlisted=True, lr=1e-2, scale=0.5)  # the constructor's
    _train(model, opt, rank, world)
    first = values(model)
    model = _net()
    storage = register_flat_storage(model)
    storage.unflatten()
    groups = [
        {"params": [model.wide.weight], "scale": 0.5},
        {"params": [model.wide.bias, *model.head.parameters()]},
    ]
    opt = ShardedOptimizer(storage, _ScaledSign, groups, whole_tensors=True, lr=1e-2)  # a class per group
    _train(model, opt, rank, world)
    storage.flatten()

    def make(m: nn.Module) -> torch.optim.Optimizer:
        return _Both(
            _ScaledSign([m.wide.weight], lr=1e-2, scale=0.5),
            _ScaledSign([m.wide.bias, *m.head.parameters()], lr=1e-2),
        )

    return {
        "constructor": {
            "sharded": first,
            "plain": _plain(lambda m: _ScaledSign(m.parameters(), lr=1e-2, scale=0.5)),
        },
        "whole tensors": {"sharded": values(model), "plain": _plain(make)},
    }


def _grad_sync_routes(rank: int, world: int) -> dict[str, Any]:
    """The way out of the refusals of Prodigy and AliG: grad sync, the optimizer in per-tensor mode."""
    from pytorch_optimizer import AliG, Prodigy

    out = {}
    for name, make, closure in (
        ("Prodigy", lambda params: Prodigy(params), False),
        ("AliG", lambda params: AliG(params, max_lr=0.1), True),
    ):
        model = _net()
        storage = register_flat_storage(model)
        storage.enable_grad_sync()
        storage.unflatten()
        _train(model, make(model.parameters()), rank, world, closure)
        storage.flatten()
        out[name] = {
            "sharded": values(model),
            "plain": _plain(lambda m, make=make: make(m.parameters()), closure),
        }
    return out


SCENARIOS: dict[str, Callable[[int, int], Any]] = {
    "adafactor": _adafactor,
    "shampoo": _shampoo,
    "slice_setting_routes": _slice_setting_routes,
    "grad_sync_routes": _grad_sync_routes,
}


def _run(rank: int, world: int, outdir: Path) -> None:
    for name, scenario in SCENARIOS.items():
        save_result(outdir, rank, name, scenario(rank, world))


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch_gloo(_run, tmp_path_factory.mktemp("rules"), world=2)


def _alike(result: dict[str, Any], msg: str) -> None:
    assert_same_values(result["sharded"], result["plain"], rtol=1e-5, atol=1e-6, msg=msg)


@pytest.mark.slow
def test_whole_tensors_never_cut_a_tensor_of_an_unlisted_class_even_with_allow_unlisted(launch):
    for result in launch_results(launch, "adafactor"):
        start, stop = result["weight"]
        assert not any(start < cut < stop for cut in result["cuts"]), result["cuts"]
        _alike(result, "Adafactor")


@pytest.mark.slow
def test_a_groups_class_is_constructed_with_the_groups_settings(launch):
    """Shampoo reads preconditioning_compute_steps when constructed: each group's value takes effect."""
    for result in launch_results(launch, "shampoo"):
        for steps, trained in result.items():
            _alike(trained, f"preconditioning_compute_steps={steps}")
        assert not torch.equal(result[1]["plain"]["wide.weight"], result[3]["plain"]["wide.weight"])


@pytest.mark.slow
def test_the_ways_out_of_a_slice_setting_refusal_train_as_one_process(launch):
    for result in launch_results(launch, "slice_setting_routes"):
        for route, trained in result.items():
            _alike(trained, route)


@pytest.mark.slow
def test_the_way_out_of_a_cross_tensor_or_closure_refusal_trains_as_one_process(launch):
    """Grad sync with Prodigy and AliG (a closure) over model.parameters() in per-tensor mode."""
    for result in launch_results(launch, "grad_sync_routes"):
        for name, trained in result.items():
            _alike(trained, name)


# ------------------------------------------------------------------------- refusals (this process)
def _per_tensor() -> tuple[nn.Module, Any]:
    model = _net()
    storage = register_flat_storage(model)
    storage.unflatten()
    return model, storage


@pytest.mark.parametrize(
    "name, kwargs",
    [("Prodigy", {}), ("DAdaptAdam", {}), ("DAdaptSGD", {}), ("Lamb", {"pre_norm": True})],
)
def test_a_class_whose_step_reads_several_tensors_is_refused_before_anything_changes(world1, name, kwargs):
    import pytorch_optimizer

    model, storage = _per_tensor()
    before = values(model)
    with pytest.raises(ValueError, match=r"steps each rank's own tensors, so their optimizer must"):
        ShardedOptimizer(
            storage, getattr(pytorch_optimizer, name), model.parameters(), whole_tensors=True, **kwargs
        )
    assert_same_values(values(model), before)
    assert not storage.is_flattened and len(storage.flat_params) == 1


def test_the_refusal_of_a_step_that_reads_across_tensors_names_the_class_and_the_way_out(world1):
    from pytorch_optimizer import Prodigy

    model, storage = _per_tensor()
    groups = [{"params": [model.wide.weight], "optimizer_class": Prodigy}, {"params": [model.wide.bias]}]
    with pytest.raises(
        ValueError,
        match=r"pytorch_optimizer\.optimizer\.prodigy\.Prodigy does not: stepped on two tensors together it "
        r"updates each differently.*storage\.enable_grad_sync\(\)",
    ):
        ShardedOptimizer(storage, torch.optim.AdamW, groups, whole_tensors=True)


def test_a_closure_optimizer_is_refused_when_built_not_at_its_first_step(world1):
    from pytorch_optimizer import AliG

    model, storage = _per_tensor()
    with pytest.raises(
        ValueError, match=r"must step without a closure; pytorch_optimizer\.optimizer\.alig\.AliG"
    ):
        ShardedOptimizer(storage, AliG, model.parameters(), whole_tensors=True)


def test_a_class_that_draws_random_numbers_is_not_refused_and_the_users_generator_goes_on(world1):
    """PSGD's Kron samples in its step: the two runs cannot be compared, so it is left to its tensors."""
    from pytorch_optimizer import Kron

    model, storage = _per_tensor()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    ShardedOptimizer(storage, Kron, model.parameters(), whole_tensors=True)
    assert torch.equal(torch.rand(3), expected)


def test_per_tensor_classes_that_step_each_tensor_alone_are_accepted(world1):
    import pytorch_optimizer

    for name in ("AdaFactor", "CAME", "SOAP", "Shampoo", "ScheduleFreeAdamW", "Lion", "Lamb"):
        model, storage = _per_tensor()
        ShardedOptimizer(storage, getattr(pytorch_optimizer, name), model.parameters(), whole_tensors=True)
        remove_flat_storage(model)
    model, storage = _per_tensor()
    ShardedOptimizer(storage, torch.optim.Muon, [model.wide.weight], whole_tensors=True)


def test_a_group_setting_read_when_constructed_is_refused_over_slices_with_the_ways_out(world1):
    model = _net()
    storage = register_flat_storage(model, [[model.wide], [model.head]])
    groups = [{"params": [storage["0"]], "scale": 0.5}, {"params": [storage["1"]]}]
    with pytest.raises(
        ValueError,
        match=r"_ScaledSign reads scale when it is constructed, not from its param groups, so param group "
        r"0's scale=0.5 would not take effect; pass scale= to ShardedOptimizer.*or pass whole_tensors=True",
    ):
        ShardedOptimizer(storage, _ScaledSign, groups, allow_unlisted=True)
    ShardedOptimizer(storage, _ScaledSign, groups, allow_unlisted=True, scale=0.5)  # the same value: taken


def test_a_model_parameter_no_group_holds_is_refused_naming_it_and_the_ways(world1):
    """A head registered after the storage: an optimizer of its own, or registering it."""
    model = _net()
    storage = register_flat_storage(model, [model.wide])
    storage.unflatten()
    with pytest.raises(
        ValueError,
        match=r"head\.weight in param group 0 is a parameter of the model that no group of the storage "
        r"holds.*step it with an optimizer of its own.*or register it: remove_flat_storage\(model\)",
    ):
        ShardedOptimizer(storage, torch.optim.AdamW, model.parameters(), whole_tensors=True)
    # the second way, to the end: registered again, every parameter is the storage's
    remove_flat_storage(model)
    storage = register_flat_storage(model)
    storage.unflatten()
    opt = ShardedOptimizer(storage, torch.optim.AdamW, model.parameters(), whole_tensors=True)
    _train(model, opt, 0, 1)
    storage.flatten()
    assert_same_values(
        values(model), _plain(lambda m: torch.optim.AdamW(m.parameters())), rtol=1e-6, atol=1e-7
    )
