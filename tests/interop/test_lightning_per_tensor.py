"""Lightning's Trainer over a flattened model in per-tensor mode, and its plain twin from the same seed."""

from __future__ import annotations

from pathlib import Path

import torch

from _helpers import assert_same_values
from _lightning import LitLM, loader, trainer


def test_lightning_trains_and_checkpoints_a_per_tensor_model_as_the_plain_one(tmp_path: Path) -> None:
    """fit() gives the plain losses and weights; save_checkpoint writes the plain keys, and they resume."""
    runs = {}
    for per_tensor in (True, False):
        module = LitLM(flat=per_tensor, per_tensor=per_tensor)
        fit = trainer(max_steps=3)
        fit.fit(module, loader())
        fit.save_checkpoint(tmp_path / f"{per_tensor}.ckpt")
        runs[per_tensor] = module
    module, plain = runs[True], runs[False]
    assert not module.storages[0].is_flattened
    assert module.losses == plain.losses and len(module.losses) == 3
    assert_same_values(module.model, plain.model)
    saved = torch.load(tmp_path / "True.ckpt", weights_only=False)
    plain_saved = torch.load(tmp_path / "False.ckpt", weights_only=False)
    assert saved["state_dict"].keys() == plain_saved["state_dict"].keys()
    resumed = LitLM(flat=True, per_tensor=True)
    trainer(max_steps=4).fit(resumed, loader(), ckpt_path=tmp_path / "True.ckpt")
    plain_resumed = LitLM(flat=False)
    trainer(max_steps=4).fit(plain_resumed, loader(), ckpt_path=tmp_path / "False.ckpt")
    assert resumed.losses == plain_resumed.losses and len(resumed.losses) == 1
    assert_same_values(resumed.model, plain_resumed.model)
