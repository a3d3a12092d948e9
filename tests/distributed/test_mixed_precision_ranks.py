"""Mixed precision on 2 gloo ranks: grad sync, ``ShardedOptimizer`` and FSDP2's ``mp_policy``.

One launch of 2 spawned ranks runs every scenario; the tests compare each with one process training the
same policy on the combined batch, and check that every state dict holds exact float32 masters. The FSDP2
scenarios run ``fully_shard(model, mp_policy=...)`` on the flattened model (with and without the library's
``mixed_precision=``) against the plain model under the same ``fully_shard``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from flatten_parametrize import ShardedOptimizer, register_flat_storage

from _helpers import launch_gloo, launch_results, save_result

pytestmark = pytest.mark.slow

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
BF16_FP32_REDUCE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
SCENARIOS = {
    "grad_sync": BF16_FP32_REDUCE,
    "grad_sync_bf16_reduce": BF16,
    "zero1": BF16_FP32_REDUCE,
    "zero2": BF16_FP32_REDUCE,
    "zero2_bf16_reduce": BF16,
}
STEPS = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(10 + step))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def _train(name: str, rank: int, world: int) -> dict[str, Any]:
    model = _net()
    storage = register_flat_storage(model, mixed_precision=SCENARIOS[name])
    if name.startswith("grad_sync"):
        storage.enable_grad_sync()
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = ShardedOptimizer(storage, torch.optim.AdamW, shard_gradients=name.startswith("zero2"), lr=1e-2)
    rows = 8 // world
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, _batch(step)[rank * rows : (rank + 1) * rows]).backward()
        opt.step()
    result = {"state": {k: v.clone() for k, v in model.state_dict().items()}}
    if not name.startswith("grad_sync"):
        result["optim"] = opt.state_dict()
        result["sharded"] = opt.sharded_state_dict()
    return result


#: FSDP2 scenarios: (flatten first, the library's ``mixed_precision=``, FSDP2's ``mp_policy``).
FSDP2 = {
    "fsdp2_plain": (False, None, BF16_FP32_REDUCE),
    "fsdp2_flat": (True, None, BF16_FP32_REDUCE),
    "fsdp2_flat_both": (True, BF16_FP32_REDUCE, BF16_FP32_REDUCE),
    "fsdp2_flat_library_only": (True, BF16_FP32_REDUCE, None),
}
FP16 = MixedPrecisionPolicy(param_dtype=torch.float16)
DISAGREE = (
    "group '0' computes in torch.float16 .* but fully_shard's mp_policy gathers "
    "flat_param_0 in torch.bfloat16"
)


def _fsdp2(name: str, rank: int, world: int) -> dict[str, Any]:
    flat, library, fsdp2 = FSDP2[name]
    model = _net()
    if flat:
        register_flat_storage(model, mixed_precision=library)
    fully_shard(model) if fsdp2 is None else fully_shard(model, mp_policy=fsdp2)
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(module.weight.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows, losses = 8 // world, []
    for step in range(STEPS):
        opt.zero_grad()
        loss = _loss(model, _batch(step)[rank * rows : (rank + 1) * rows])
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return {
        "losses": losses,
        "weights": {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()},
        "compute": seen,
        "registered": [(type(p).__name__, p.dtype) for p in model.parameters()],
    }


def _fsdp2_disagreeing(rank: int, world: int) -> str:
    model = _net()
    register_flat_storage(model, mixed_precision=FP16)
    fully_shard(model, mp_policy=BF16)
    with pytest.raises(RuntimeError, match=DISAGREE) as caught:
        model(_batch(0))
    return str(caught.value)


def _worker(rank: int, world: int, outdir: Path) -> None:
    for name in SCENARIOS:
        save_result(outdir, rank, name, _train(name, rank, world))
    for name in FSDP2:
        save_result(outdir, rank, name, _fsdp2(name, rank, world))
    save_result(outdir, rank, "fsdp2_disagreeing", _fsdp2_disagreeing(rank, world))


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch_gloo(_worker, tmp_path_factory.mktemp("mixed_precision"), world=2)


def _one_process(policy: MixedPrecisionPolicy) -> dict[str, torch.Tensor]:
    model = _net()
    register_flat_storage(model, mixed_precision=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, _batch(step)).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_match_one_process_on_the_combined_batch(launch, name):
    """Every rank ends at one process's float32 masters (same policy, combined batch); ranks agree exactly."""
    results = launch_results(launch, name)
    expected = _one_process(SCENARIOS[name])
    first = results[0]["state"]
    for result in results:
        for key, value in result["state"].items():
            assert value.dtype == torch.float32
            assert torch.equal(value, first[key]), key  # every rank holds the same exact masters
    tol = 2e-4 if SCENARIOS[name].reduce_dtype == torch.float32 else 2e-2
    for key, value in first.items():
        # bf16 compute on half batches rounds differently from the whole batch: bf16-level agreement
        torch.testing.assert_close(value, expected[key], rtol=tol, atol=tol, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2_bf16_reduce"])
def test_sharded_checkpoints_hold_float32_masters(launch, name):
    """``opt.state_dict()`` and ``sharded_state_dict()`` hold float32 state; the model's are the masters."""
    for result in launch_results(launch, name):
        state = result["optim"]["state"]
        assert state and all(
            v.dtype == torch.float32
            for s in state.values()
            for v in s.values()
            if v.is_floating_point() and v.dim()
        )
        assert result["sharded"]


@pytest.mark.parametrize("name", ["fsdp2_flat", "fsdp2_flat_both", "fsdp2_flat_library_only"])
def test_fsdp2_mp_policy_on_a_flattened_model_trains_like_the_plain_model(launch, name):
    """fully_shard(mp_policy=bf16) after registration: the plain model's losses and weights, bit for bit.

    Both cast the same float32 values to bfloat16 (before or after the all-gather: element-wise, the same
    values), compute with the same ops and reduce-scatter the same gradients in float32, so nothing may
    differ. Also with the library's own policy (the same param_dtype) on top of FSDP2's, or instead of it.
    """
    plains = launch_results(launch, "fsdp2_plain")
    for plain, flat in zip(plains, launch_results(launch, name)):
        assert plain["compute"] == flat["compute"] == [torch.bfloat16] * STEPS
        assert flat["registered"] == [("DTensor", torch.float32)]  # FSDP2's sharded float32 master
        assert [float(x) for x in flat["losses"]] == [float(x) for x in plain["losses"]]
        assert list(flat["weights"]) == list(plain["weights"])
        for key, value in plain["weights"].items():
            assert flat["weights"][key].dtype == torch.float32
            assert torch.equal(flat["weights"][key], value), key
    assert not torch.equal(plains[0]["weights"]["0.weight"], _net()[0].weight)  # it trained


def test_fsdp2_mp_policy_disagreeing_with_the_library_policy_raises(launch):
    """The library's float16 policy under FSDP2's bfloat16 mp_policy: the first forward raises, every rank."""
    for message in launch_results(launch, "fsdp2_disagreeing"):
        assert re.search(DISAGREE, message)
        assert "drop mixed_precision= from register_flat_storage" in message
