"""``ShardedOptimizer(whole_tensors=True)`` with other optimizer classes, mixed dtypes and a policy.

Each recipe trains the GPT-like model of ``test_sharded_whole_tensors.py`` on 2 and 3 gloo ranks (one
launch each, every recipe with ZeRO-1 and ZeRO-2 in it) and, in the same process, the plain model with
the same optimizers, each step's gradient the average of every rank's accumulated gradient:

* ``kinds``: one optimizer class whose param groups carry their kind (``"kind": "muon"`` or
  ``"adamw"``), as nanochat's ``MuonAdamW`` does: :class:`_MuonAdamW` below, a user's class;
* ``soap``: pytorch_optimizer's ``SOAP`` on the blocks' matrices, ``AdamW`` on the rest;
* ``lamb``: timm's ``Lamb`` (``max_grad_norm=None``: timm's global clip would read every tensor) on
  the matrices. timm imports torchvision, whose only wheel for this torch is a CUDA build that does
  not load beside the CPU torch: ``tests/_side_packages.py`` installs both with ``pip --no-deps`` into
  a side folder, and each rank puts it first on ``sys.path`` after defining the two operators
  torchvision registers fake kernels for (timm's optimizers never call them);
* ``mixed_dtypes``: the second block in float64 (a bucket per dtype), torch's ``Muon`` on the
  matrices of both dtypes, ``AdamW`` on the rest;
* ``policy``: a bfloat16 ``MixedPrecisionPolicy`` (float32 reduction) in per-tensor mode; the reference
  casts each float32 weight to bfloat16 per forward (``_helpers.cast_per_forward``).

On 2 ranks the average is exact (a sum of two, a division by two), so the weights are equal bit for
bit; on 3 ranks gloo sums three in its own order, an ulp off, which the normalized updates (Newton-Schulz,
Lamb's trust ratio) carry into the weights relative to the update's size: within ``rtol=1e-5`` and an
``atol`` of ``1e-5`` of the learning rate (``1e-4`` for the bfloat16 forward of the policy). SOAP's
eigenbases of these tiny, rank-deficient preconditioners turn an ulp into a different basis, so on 3
ranks every rank trains on the same batches: a sum of three equal values is the same in any order, and
the weights are equal bit for bit (the cuts and owners are the 3-rank ones; the 2-rank run, with a batch
per rank, is the one that shows the averaging). SOAP's eigendecompositions run in MKL's LAPACK, whose
results by default depend on more than the values: on an AMD EPYC the 3-rank ZeRO-2 run's weights and the
reference's differed (on an Intel Xeon they were equal); the ranks run with ``MKL_CBWR=COMPATIBLE``
(MKL's conditional numerical reproducibility), which makes them equal on both.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable

import pytest
import torch
from _side_packages import define_torchvision_operators, timm_folder
from test_sharded_whole_tensors import _batch, _Gpt
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from flatten_parametrize import ShardedOptimizer, register_flat_storage

from _helpers import cast_per_forward, launch_gloo, launch_results, save_result

pytestmark = pytest.mark.slow

STEPS = 3
MATRIX_LR, REST_LR = 0.02, 1e-2


class _MuonAdamW(torch.optim.Optimizer):
    """One class, the update by each group's ``"kind"``: Muon's (momentum, Newton-Schulz) or AdamW's."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr, "kind": "adamw", "betas": (0.9, 0.95), "weight_decay": 0.01})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon if group["kind"] == "muon" else self._adamw)(p, self.state[p], group)

    @staticmethod
    def _muon(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
        buf.lerp_(p.grad, 0.05)
        x = p.grad.lerp(buf, 0.95)
        x = x / (x.norm() + 1e-7)
        wide = x.size(0) > x.size(1)
        x = x.mT if wide else x
        for _ in range(5):
            a = x @ x.mT
            x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
        x = x.mT if wide else x
        p.add_(x, alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)

    @staticmethod
    def _adamw(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        if not state:
            state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = float(state["step"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(1e-8)
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**step))


class _MixedGpt(_Gpt):
    """The second block in float64: a bucket per dtype, matrices of both dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[1].double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            dtype = block["up"].weight.dtype
            x = h.to(dtype)
            h = (x + block["down"](torch.tanh(block["up"](block["norm"](x))))).float()
        return self.head(self.frozen(h))


#: Recipe ``policy``: bfloat16 compute, float32 reduction (so the average is exact on 2 ranks).
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
RECIPES = ["kinds", "soap", "lamb", "mixed_dtypes", "policy"]


def _timm_lamb() -> type[torch.optim.Optimizer]:
    """timm's ``Lamb`` from its side folder (torchvision's operators defined first)."""
    from timm.optim import Lamb

    return Lamb  # type: ignore[no-any-return]


def _optimizers(
    model: nn.Module, recipe: str
) -> tuple[type[torch.optim.Optimizer], list[dict[str, Any]], dict[str, Any]]:
    """Return ``(class, param groups, keyword arguments)`` of ``recipe``: hidden matrices, then the rest.

    The groups name the matrices' class under ``"optimizer_class"`` (what ``ShardedOptimizer`` reads;
    a one-process reference builds one optimizer per group from it).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for n, p in named if not (p.ndim == 2 and n.startswith("blocks."))]
    if recipe == "kinds":
        groups = [
            {"params": matrices, "kind": "muon", "lr": MATRIX_LR},
            {"params": rest, "kind": "adamw", "lr": REST_LR},
        ]
        return _MuonAdamW, groups, {}
    if recipe == "lamb":  # timm's global clip (max_grad_norm) off: it would read every tensor
        groups = [
            {"params": matrices, "lr": MATRIX_LR},
            {"params": rest, "lr": REST_LR, "optimizer_class": torch.optim.AdamW},
        ]
        return _timm_lamb(), groups, {"max_grad_norm": None}
    if recipe == "soap":
        from pytorch_optimizer import SOAP

        matrix_class: type[torch.optim.Optimizer] = SOAP
    else:
        matrix_class = torch.optim.Muon
    groups = [
        {"params": matrices, "lr": MATRIX_LR, "optimizer_class": matrix_class},
        {"params": rest, "lr": REST_LR},
    ]
    return torch.optim.AdamW, groups, {}


def _model(recipe: str) -> nn.Module:
    return _MixedGpt() if recipe == "mixed_dtypes" else _Gpt()


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _data_rank(recipe: str, world: int, rank: int) -> int:
    """The rank whose batches ``rank`` trains on (SOAP on 3 ranks: rank 0's everywhere; see above)."""
    return 0 if recipe == "soap" and world == 3 else rank


def _sharded(rank: int, world: int, recipe: str, shard_gradients: bool) -> dict[str, Any]:
    model = _model(recipe)
    storage = register_flat_storage(model, mixed_precision=POLICY if recipe == "policy" else None)
    storage.unflatten()
    cls, groups, kwargs = _optimizers(model, recipe)
    opt = ShardedOptimizer(
        storage, cls, groups, whole_tensors=True, shard_gradients=shard_gradients, **kwargs
    )
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            with opt.no_sync() if micro == 0 else contextlib.nullcontext():
                _loss(model(_batch(step, micro, _data_rank(recipe, world, rank)))).backward()
        opt.step()
    return {
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "classes": sorted(type(o).__name__ for o in opt.local_optimizer.optimizers),
        "dtypes": sorted({str(f.dtype) for f in storage.flat_params}),
    }


def _reference(world: int, recipe: str, zero: int) -> dict[str, torch.Tensor]:
    """The plain model (cast per forward under the policy), one optimizer per group of the recipe.

    Each step's gradient is the ranks' average as ZeRO-``zero`` computes it: ZeRO-2 sums, then divides;
    ZeRO-1's all-reduce on gloo divides each rank's gradient first, then sums.
    """
    model = _model(recipe)
    forward = cast_per_forward(model) if recipe == "policy" else model
    cls, groups, kwargs = _optimizers(model, recipe)
    if cls is _MuonAdamW:  # one optimizer, the update by each group's kind
        optimizers = [cls(groups)]
    else:  # one per group, of its class
        optimizers = [
            g.pop("optimizer_class")([g]) if "optimizer_class" in g else cls([g], **kwargs) for g in groups
        ]
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            for p in params:
                p.grad = None
            for micro in range(2):
                _loss(forward(_batch(step, micro, _data_rank(recipe, world, rank)))).backward()
            for t, p in zip(total, params):
                t.add_(p.grad / world if zero == 1 else p.grad)
        for t, p in zip(total, params):
            p.grad = t if zero == 1 else t / world
        for opt in optimizers:
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _lamb_refusal() -> str:
    """What constructing with timm's Lamb at its default ``max_grad_norm=1.0`` says."""
    model = _Gpt()
    storage = register_flat_storage(model)
    storage.unflatten()
    try:
        ShardedOptimizer(storage, _timm_lamb(), list(model.parameters()), whole_tensors=True)
    except ValueError as error:
        return str(error)
    return "no error"


def _worker(rank: int, world: int, outdir: Any, timm: Any) -> None:
    torch.set_num_threads(1)
    define_torchvision_operators()
    sys.path.insert(0, str(timm))
    save_result(outdir, rank, "lamb_refused", _lamb_refusal())
    for recipe in RECIPES:
        for zero in (1, 2):
            name = f"{recipe}.zero{zero}"
            save_result(outdir, rank, name, _sharded(rank, world, recipe, shard_gradients=zero == 2))
            save_result(outdir, rank, f"{name}.reference", _reference(world, recipe, zero))


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    worker = functools.partial(_worker, timm=timm_folder())
    with pytest.MonkeyPatch.context() as env:  # the spawned ranks inherit it
        env.setenv("MKL_CBWR", "COMPATIBLE")  # SOAP's eigenbases bit for bit on every CPU: see above
        return launch_gloo(worker, tmp_path_factory.mktemp(f"recipes{request.param}"), world=request.param)


@pytest.mark.parametrize("zero", [1, 2], ids=["ZeRO-1", "ZeRO-2"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_trains_as_its_optimizers_in_one_process(launch, recipe, zero):
    """Every rank ends with the one-process weights: bit for bit on 2 ranks, within gloo's order on 3."""
    loose = 1e-4 if recipe == "policy" else 1e-5
    for result, reference in zip(
        launch_results(launch, f"{recipe}.zero{zero}"),
        launch_results(launch, f"{recipe}.zero{zero}.reference"),
    ):
        assert result["weights"].keys() == reference.keys()
        for name, value in reference.items():
            if launch["world"] == 2 or recipe == "soap":
                assert torch.equal(result["weights"][name], value), name
            else:
                torch.testing.assert_close(result["weights"][name], value, rtol=loose, atol=loose * MATRIX_LR)
    if recipe == "mixed_dtypes":
        assert result["dtypes"] == ["torch.float32", "torch.float64"]


def test_timms_lamb_with_its_global_clip_is_refused_with_the_setting_that_turns_it_off(launch):
    """timm's Lamb clips by the norm of all its tensors (max_grad_norm=1.0 by default): no rank holds them."""
    for message in launch_results(launch, "lamb_refused"):
        assert "timm.optim.lamb.Lamb with max_grad_norm=1.0 scales every gradient by the norm" in message
        assert "pass max_grad_norm=None and call opt.clip_grad_norm_(max_norm)" in message


def test_a_lamb_set_to_normalize_by_every_gradient_is_refused_and_nothing_changes(world1):
    """pytorch_optimizer's Lamb(pre_norm=True) reads every gradient: refused; then a valid one trains."""
    from pytorch_optimizer import Lamb

    model = _Gpt()
    storage = register_flat_storage(model)
    storage.unflatten()
    with pytest.raises(
        ValueError,
        match=r"optimizer\.lamb\.Lamb with pre_norm=True scales every gradient.*pass pre_norm=False",
    ):
        ShardedOptimizer(storage, Lamb, list(model.parameters()), whole_tensors=True, pre_norm=True)
    opt = ShardedOptimizer(storage, Lamb, list(model.parameters()), whole_tensors=True)
    before = model.blocks[0].up.weight.detach().clone()
    _loss(model(_batch(0, 0, 0))).backward()
    opt.step()
    assert not torch.equal(model.blocks[0].up.weight, before)
