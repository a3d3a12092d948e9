"""A LightningModule around the tiny GPT-2 that flattens it in ``configure_model``."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from flatten_parametrize import FlatStorage, get_flat_storage, register_flat_storage, weight_decay_groups

from _hf import gpt2, lm_dataset


class LitLM(L.LightningModule):
    """Trains a GPT-2 with AdamW; with ``flat=True`` its ``configure_model`` registers a flat storage.

    With ``per_tensor=True`` too, the storage trains in per-tensor mode (``storage.unflatten()``).
    """

    def __init__(self, flat: bool, seed: int = 0, per_tensor: bool = False) -> None:
        super().__init__()
        self.model = gpt2(seed)
        self.flat = flat
        self.per_tensor = per_tensor
        self.storages: list[FlatStorage] = []
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.flat:
            groups = weight_decay_groups(self.model)
            storage = register_flat_storage(self.model, groups, exist_ok=True)
            if self.per_tensor and storage.is_flattened:
                storage.unflatten()
            self.storages.append(storage)

    def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(**batch).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.0)
        storage = get_flat_storage(self.model)
        if storage is not None and storage.is_flattened:  # plain-format checkpoints; either format resumes
            storage.attach_optimizer(optimizer)
        return optimizer


def loader() -> DataLoader[Any]:
    return DataLoader(lm_dataset(), batch_size=2)  # type: ignore[arg-type]


def trainer(**overrides: Any) -> L.Trainer:
    """A quiet CPU Lightning trainer: no logger, progress bar, summary or checkpoint unless asked."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(overrides)
    return L.Trainer(**options)
