"""The cases of ``tests/interop/test_torchtune.py``, run in a subprocess with torchtune on ``sys.path``.

Usage: ``python tests/_torchtune_cases.py <torchtune folder> <timm folder> <output file>`` (see
``tests/_side_packages.py`` for why torchtune lives in a folder of its own, and why torchvision from
the timm folder comes too). A small model of torchtune's own ``LoRALinear`` layers and its plain twin
from the same seed go through torchtune's ``get_adapter_params`` / ``set_trainable_params`` and its
optimizer-in-backward helpers (``register_optim_in_bwd_hooks``, ``create_optim_in_bwd_wrapper``),
once with the flattened model in per-tensor mode and once in flat mode; what each gave is recorded.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flatten_parametrize import register_flat_storage


def _net(lora: Any) -> nn.Module:
    """Two LoRA layers with a non-zero ``lora_b`` (torchtune starts it at zero), seeded."""
    torch.manual_seed(0)
    net = nn.Sequential(
        lora.LoRALinear(8, 16, rank=2, alpha=4.0), nn.ReLU(), lora.LoRALinear(16, 4, rank=2, alpha=4.0)
    )
    for layer in (net[0], net[2]):
        nn.init.normal_(layer.lora_b.weight)
    return net


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _flattened(model: nn.Module, mode: str) -> nn.Module:
    if mode != "plain":
        storage = register_flat_storage(model)
        if mode == "per-tensor":
            storage.unflatten()
    return model


def _lora(peft: Any, lora: Any, mode: str) -> dict[str, Any]:
    """torchtune's LoRA recipe: adapters trainable, the base frozen, AdamW over the adapters, 3 steps."""
    model = _flattened(_net(lora), mode)
    try:
        adapter = peft.get_adapter_params(model)
    except AssertionError as exc:
        return {"adapter names": None, "error": str(exc)}
    peft.set_trainable_params(model, adapter)
    optimizer = torch.optim.AdamW(adapter.values(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 8, generator=gen)).square().mean().backward()
        optimizer.step()
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    return {"adapter names": sorted(adapter), "trainable": trainable, "weights": _weights(model)}


def _in_backward(training: Any, lora: Any, mode: str) -> dict[str, Any]:
    """torchtune's optimizer in backward: one AdamW per parameter, stepped by its grad hook, checkpointed."""
    model = _flattened(_net(lora), mode)
    optimizers = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}
    training.register_optim_in_bwd_hooks(model, optimizers)
    wrapper = training.create_optim_in_bwd_wrapper(model, optimizers)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(5, 8, generator=gen)).square().mean().backward()
    saved = wrapper.state_dict()
    # Resume: a fresh wrapper over the same parameters loads the checkpoint and steps on alike.
    fresh = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}
    training.create_optim_in_bwd_wrapper(model, fresh).load_state_dict(saved)
    reloaded = {p: fresh[p].state_dict()["state"] for p in model.parameters()}
    same = all(
        torch.equal(reloaded[p][0][key], optimizers[p].state_dict()["state"][0][key])
        for p in model.parameters()
        for key in ("exp_avg", "exp_avg_sq")
    )
    shapes = {name: tuple(state["state"][0]["exp_avg"].shape) for name, state in saved.items()}
    return {
        "keys": sorted(saved),
        "state shapes": shapes,
        "resumed state equal": same,
        "weights": _weights(model),
    }


def main(folder: str, timm_folder: str, out: str) -> None:
    """Put torchtune on ``sys.path`` (torchvision's operators first), run the cases, save the results."""
    sys.path[:0] = [folder, timm_folder, str(Path(__file__).resolve().parent)]
    from _side_packages import define_torchvision_operators

    define_torchvision_operators()
    import torchtune
    import torchtune.modules.peft as peft
    import torchtune.training as training

    results: dict[str, Any] = {"torchtune": torchtune.__version__}
    for mode in ("plain", "per-tensor", "flat"):
        results[f"lora {mode}"] = _lora(peft, peft, mode)
        results[f"in backward {mode}"] = _in_backward(training, peft, mode)
    torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
