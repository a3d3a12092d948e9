"""Per-tensor mode on 2 gloo ranks: a bf16 policy under DDP (with and without compress hooks), and a
parameter replaced on the model (nanoGPT's ``crop_block_size``) under the storage's grad sync.

One launch of 2 spawned ranks runs every scenario. The mixed-precision scenarios compare with the
hand-written reference under the same DDP and hook: a plain model whose float32 weights are cast to bf16
in each forward (``torch.func.functional_call``), bit for bit. The crop scenario compares with the plain
model cropped and then wrapped in DDP, as nanoGPT's ``train.py`` does it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from flatten_parametrize import register_flat_storage

from _helpers import launch_gloo, launch_results, save_result

pytestmark = pytest.mark.slow

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _bf16_compress(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook``, which DDP refuses on CPU by name: the same body, ``_compress_hook``."""
    return default_hooks._compress_hook(torch.bfloat16, state, bucket)


# DDP checks the annotations as objects (this module's are strings: ``from __future__ import annotations``).
_bf16_compress.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


HOOKS = {"no_hook": None, "bf16_compress": _bf16_compress, "fp16_compress": default_hooks.fp16_compress_hook}
STEPS = 3


class _Net(nn.Module):
    def __init__(self, block_size: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(11, 8)
        self.wpe = nn.Embedding(block_size, 8)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        return self.head(self.norm(torch.tanh(self.fc(h))))


class _CastPerForward(nn.Module):
    """The hand-written reference: float32 parameters, each cast to bf16 for the forward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weights = {name: p.to(torch.bfloat16) for name, p in self.inner.named_parameters()}
        return torch.func.functional_call(self.inner, weights, (tokens,))


def crop_block_size(model: _Net, block_size: int) -> None:
    """nanoGPT's ``GPT.crop_block_size`` (karpathy/nanoGPT, model.py): its line that replaces ``wpe``."""
    model.wpe.weight = nn.Parameter(model.wpe.weight[:block_size])


def _batch(step: int, length: int = 8) -> torch.Tensor:
    return torch.randint(0, 11, (4, length), generator=torch.Generator().manual_seed(10 + step))


def _train(module: nn.Module, params: Any, rank: int, world: int, length: int = 8) -> dict[str, Any]:
    opt = torch.optim.AdamW(params, lr=1e-2)
    rows, losses = 4 // world, []
    for step in range(STEPS):
        opt.zero_grad()
        loss = module(_batch(step, length)[rank * rows : (rank + 1) * rows]).float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return {"losses": losses}


def _mixed_precision(hook_name: str, flattened: bool, rank: int, world: int) -> dict[str, Any]:
    model = _Net()
    if flattened:
        register_flat_storage(model, mixed_precision=BF16).unflatten()
        ddp = DistributedDataParallel(model)
    else:
        ddp = DistributedDataParallel(_CastPerForward(model))
    if HOOKS[hook_name] is not None:
        ddp.register_comm_hook(None, HOOKS[hook_name])
    result = _train(ddp, ddp.parameters(), rank, world)
    result["weights"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return result


def _crop(flattened: bool, rank: int, world: int) -> dict[str, Any]:
    model = _Net()
    if flattened:
        storage = register_flat_storage(model)
        storage.unflatten()
        storage.enable_grad_sync()
        crop_block_size(model, 8)
        module: nn.Module = model
        params = storage.flat_params  # laid out again here, the cropped wpe in it
    else:
        crop_block_size(model, 8)
        module = DistributedDataParallel(model)
        params = model.parameters()
    result = _train(module, params, rank, world)
    result["weights"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return result


def _worker(rank: int, world: int, outdir: Path) -> None:
    for hook_name in HOOKS:
        for flattened in (True, False):
            name = f"{hook_name}.{'flat' if flattened else 'reference'}"
            save_result(outdir, rank, name, _mixed_precision(hook_name, flattened, rank, world))
    for flattened in (True, False):
        save_result(outdir, rank, f"crop.{'flat' if flattened else 'ddp'}", _crop(flattened, rank, world))


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch_gloo(_worker, tmp_path_factory.mktemp("per_tensor_ranks"), world=2)


@pytest.mark.parametrize("hook_name", list(HOOKS))
def test_a_bf16_policy_in_per_tensor_mode_under_ddp_matches_the_hand_written_reference(launch, hook_name):
    """DDP over per-tensor mode, bf16 policy (and a compress hook): the reference's losses and weights."""
    for flat, reference in zip(
        launch_results(launch, f"{hook_name}.flat"), launch_results(launch, f"{hook_name}.reference")
    ):
        assert [float(x) for x in flat["losses"]] == [float(x) for x in reference["losses"]]
        assert set(flat["weights"]) == set(reference["weights"])
        for name, value in reference["weights"].items():
            assert torch.equal(flat["weights"][name], value), name


def test_crop_block_size_under_grad_sync_trains_on_two_ranks_as_the_plain_model_under_ddp(launch):
    """The cropped wpe joins the storage before the first forward: reduced, ranks agree, DDP's weights."""
    flats, plains = launch_results(launch, "crop.flat"), launch_results(launch, "crop.ddp")
    assert flats[0]["weights"]["wpe.weight"].shape == (8, 8)
    for name, value in flats[0]["weights"].items():
        assert torch.equal(flats[1]["weights"][name], value), name  # no rank drifts
        torch.testing.assert_close(value, plains[0]["weights"][name], rtol=1e-6, atol=1e-6)
    for flat, plain in zip(flats, plains):
        torch.testing.assert_close(
            torch.stack(flat["losses"]), torch.stack(plain["losses"]), rtol=1e-6, atol=1e-7
        )
