"""Engines composed around a flattened model, each against the plain twin under the same engine.

- FSDP2 applied after registration, then ``.to()`` / ``.double()`` / ``to_empty()``, and its state
  dicts loaded across forms (2 gloo ranks).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import mlp, save_result, spawn_gloo

# ------------------------------------------------------------------------------- FSDP2 (2 ranks)


def _fsdp2_worker(rank: int, world: int, outdir: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    def build(flat: bool, seed: int = 0, align: int = 1) -> nn.Module:
        model = mlp(depth=3, width=6, seed=seed)
        if flat:
            register_flat_storage(model, align=align)
        fully_shard(model)
        return model

    def full(model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}

    out: dict[str, Any] = {}
    for flat in (False, True):  # .to() then .double() after fully_shard, then training
        model = build(flat, align=4)
        model.to("cpu")
        model.double()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        for step in range(3):
            generator = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(4, 6, dtype=torch.float64, generator=generator)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out[f"double, flat={flat}"] = full(model)
        if flat:
            storage = get_flat_storage(model)
            assert storage is not None
            out["flattened"] = {
                "registered": type(model.flat_param_0).__name__,
                "dtype": model.flat_param_0.dtype,
                "view": model[0].weight.dtype,
                "storage": [p.dtype for p in storage.flat_params],
            }
    model = build(True, align=16)  # to_empty() after fully_shard: the local shard's padding is zeroed
    storage = get_flat_storage(model)
    assert storage is not None
    torch.full((4096,), float("nan")).sum()  # leave NaNs in freed memory for to_empty to pick up
    model.to_empty(device="cpu")
    numel = model.flat_param_0.shape[0]
    padding = torch.ones(numel, dtype=torch.bool)
    for info in storage.param_infos:
        padding[info.offset : info.offset + info.numel] = False
    local = model.flat_param_0.to_local().detach()
    start = rank * math.ceil(numel / world)  # FSDP2 shards dim 0 in torch.chunk's pieces
    out["padding"] = local[padding[start : start + local.numel()]].clone()
    for src in (False, True):  # state dicts across forms, both ways of loading them
        for dst in (False, True):
            for how in ("load_state_dict", "set_model_state_dict"):
                a, b = build(src, seed=1), build(dst, seed=2)
                sd = get_model_state_dict(a)
                if how == "load_state_dict":
                    b.load_state_dict(sd)
                else:
                    set_model_state_dict(b, sd)
                out[f"{how}, flat={src} -> flat={dst}"] = (full(a), full(b))
    save_result(outdir, rank, "fsdp2", out)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    outdir = tmp_path_factory.mktemp("fsdp2")
    spawn_gloo(_fsdp2_worker, outdir, world=2)
    return [torch.load(outdir / f"fsdp2.{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.slow
def test_fsdp2_then_to_and_double_trains_like_the_plain_model(fsdp2):
    """register, fully_shard, .to("cpu"), .double(), 3 AdamW steps: the plain twin's weights; DTensor kept."""
    for result in fsdp2:
        plain, flat = result["double, flat=False"], result["double, flat=True"]
        assert list(flat) == list(plain)
        for key, value in plain.items():
            assert value.dtype == torch.float64
            torch.testing.assert_close(flat[key], value, rtol=1e-6, atol=1e-6, msg=key)
        assert result["flattened"] == {
            "registered": "DTensor",  # FSDP2's sharded parameter stays FSDP2's
            "dtype": torch.float64,
            "view": torch.float64,
            "storage": [torch.float64],
        }


@pytest.mark.slow
def test_fsdp2_then_to_empty_zeroes_the_padding_of_each_local_shard(fsdp2):
    for result in fsdp2:
        assert result["padding"].numel() > 0
        assert torch.equal(result["padding"], torch.zeros_like(result["padding"]))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["load_state_dict", "set_model_state_dict"])
@pytest.mark.parametrize(("src", "dst"), [(False, True), (True, False), (True, True)])
def test_fsdp2_state_dicts_load_across_forms(fsdp2, how, src, dst):
    """get_model_state_dict of one form loads into the other under FSDP2: the same full weights."""
    for result in fsdp2:
        saved, loaded = result[f"{how}, flat={src} -> flat={dst}"]
        assert list(saved) == list(loaded)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
