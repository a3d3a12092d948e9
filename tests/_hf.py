"""A tiny GPT-2 built from a config (no download) and in-memory data, for the framework tests."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


def gpt2(seed: int = 0, tie: bool = True) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 with tied input/output embeddings and no dropout (so training is deterministic)."""
    config = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def tokens(batch: int = 2, length: int = 10) -> torch.Tensor:
    return torch.randint(3, 64, (batch, length))


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The language-modelling loss of ``model`` on ``ids`` (the labels are the inputs), for train_steps."""
    return model(input_ids=ids, labels=ids).loss


def lm_dataset(size: int = 8, length: int = 10, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Language-modelling examples (``input_ids`` and ``labels``); Trainer takes the list as a dataset."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (size, length), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def training_args(output_dir: object, **overrides: object) -> TrainingArguments:
    """Trainer arguments for a short deterministic CPU run that logs every step and reports nowhere."""
    options: dict[str, object] = {
        "per_device_train_batch_size": 2,
        "max_steps": 5,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
    }
    options.update(overrides)
    return TrainingArguments(output_dir=str(output_dir), **options)  # type: ignore[arg-type]


def losses(trainer: Trainer) -> list[float]:
    """The training losses that ``trainer`` logged, one per step."""
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]
