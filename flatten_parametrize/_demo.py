"""The demo behind ``python -m flatten_parametrize demo``: flat and plain training side by side.

A small transformer language model (``nn.Embedding``, a 2-layer
``nn.TransformerEncoder``, a ``nn.Linear`` head) is copied before
registration; one copy gets a flat storage, the other stays plain. Both train
with ``AdamW`` over ``model.parameters()`` on the same synthetic next-token
batches, step by step in turn; the demo prints both losses, the median time
per step of each and their ratio, and checks that the losses agree.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import torch
from torch import Tensor, nn

from ._api import register_flat_storage

__all__ = ["TinyLM", "DemoResult", "make_batches", "run_demo", "main"]

VOCAB = 64
D_MODEL = 64
SEQ_LEN = 32
BATCH = 16
TOLERANCE = 1e-5


class TinyLM(nn.Module):
    """A causal transformer language model built from ``torch.nn`` parts only.

    Args:
        vocab: vocabulary size. Default: ``64``.
        d_model: width of the model. Default: ``64``.
    """

    def __init__(self, vocab: int = VOCAB, d_model: int = D_MODEL) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


def make_batches(steps: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Return ``steps`` batches of ``(inputs, targets)`` drawn from a fixed ``torch.Generator``.

    Each sequence counts modulo the vocabulary from a random start with a
    random stride in ``{1, 2, 3}``; the targets are the inputs shifted by one.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
        stride = torch.randint(1, 4, (BATCH, 1), generator=generator)
        sequence = (start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB
        batches.append((sequence[:, :-1], sequence[:, 1:]))
    return batches


@dataclass
class DemoResult:
    """Losses and step times of both runs, and the largest differences seen."""

    flat_losses: list[float] = field(default_factory=list)
    plain_losses: list[float] = field(default_factory=list)
    flat_times: list[float] = field(default_factory=list)
    plain_times: list[float] = field(default_factory=list)
    max_weight_diff: float = 0.0
    same_keys: bool = True

    @property
    def max_loss_diff(self) -> float:
        """Return the largest absolute difference between the two loss curves."""
        return max((abs(a - b) for a, b in zip(self.flat_losses, self.plain_losses)), default=0.0)

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        """Return whether state-dict keys match and losses and final weights agree within ``tolerance``."""
        return self.same_keys and self.max_loss_diff <= tolerance and self.max_weight_diff <= tolerance


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor]) -> float:
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss.item()


def run_demo(
    steps: int = 40, *, seed: int = 0, threads: int | None = 2, every: int = 5, out: TextIO | None = None
) -> DemoResult:
    """Train the flat and the plain model side by side and print the comparison.

    Args:
        steps: training steps of each model. Default: ``40``.
        seed: seed of the initial weights and of the data. Default: ``0``.
        threads: ``torch.set_num_threads`` for the run (restored afterwards);
            ``None`` keeps the current setting. Default: ``2``.
        every: print the losses every ``every`` steps (and the last step). Default: ``5``.
        out: where to print. Default: ``sys.stdout``.

    Returns:
        The losses, step times and differences of both runs.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    out = sys.stdout if out is None else out
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        flat_model = TinyLM()
        plain_model = copy.deepcopy(flat_model)  # same initial weights
        storage = register_flat_storage(flat_model)
        flat_opt = torch.optim.AdamW(flat_model.parameters(), lr=3e-3)
        plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=3e-3)
        batches = make_batches(steps, seed)
        count = sum(p.numel() for p in plain_model.parameters())

        print(
            f"flatten_parametrize demo: {type(flat_model).__name__} ({count:,} parameters), "
            f"AdamW, {steps} steps, {torch.get_num_threads()} threads",
            file=out,
        )
        print(
            f"parameter tensors seen by the optimizer: flat {len(list(flat_model.parameters()))}, "
            f"plain {len(list(plain_model.parameters()))}",
            file=out,
        )
        print(file=out)
        print(repr(storage), file=out)
        print(file=out)
        print(f"{'step':>5}  {'loss (flat)':>12}  {'loss (plain)':>12}  {'|diff|':>8}", file=out)

        result = DemoResult()
        for step, batch in enumerate(batches, start=1):
            # The two models take turns at every step, so that both see the same machine load.
            for model, optimizer, losses, times in (
                (flat_model, flat_opt, result.flat_losses, result.flat_times),
                (plain_model, plain_opt, result.plain_losses, result.plain_times),
            ):
                start = time.perf_counter()
                losses.append(_train_step(model, optimizer, batch))
                times.append(time.perf_counter() - start)
            if step == 1 or step % every == 0 or step == steps:
                flat_loss, plain_loss = result.flat_losses[-1], result.plain_losses[-1]
                diff = abs(flat_loss - plain_loss)
                print(f"{step:>5}  {flat_loss:>12.6f}  {plain_loss:>12.6f}  {diff:>8.1e}", file=out)

        plain_state = plain_model.state_dict()
        flat_state = flat_model.state_dict()  # the plain model's keys, views of the flat buffer
        result.same_keys = list(flat_state) == list(plain_state)
        result.max_weight_diff = max(
            (
                (flat_state[k] - plain_state[k]).abs().max().item() if k in flat_state else float("inf")
                for k in plain_state
            ),
            default=0.0,
        )

        flat_ms = statistics.median(result.flat_times) * 1e3
        plain_ms = statistics.median(result.plain_times) * 1e3
        print(file=out)
        print(
            f"median time per step: flat {flat_ms:.2f} ms, plain {plain_ms:.2f} ms, "
            f"ratio flat/plain {flat_ms / plain_ms:.2f}",
            file=out,
        )
        print(
            f"max |diff|: losses {result.max_loss_diff:.1e}, final weights {result.max_weight_diff:.1e} "
            f"({'same' if result.same_keys else 'DIFFERENT'} {len(plain_state)} state_dict keys)",
            file=out,
        )
        if result.ok():
            print(f"OK: flat and plain training agree within {TOLERANCE:g}", file=out)
        else:
            print(f"MISMATCH: flat and plain training differ by more than {TOLERANCE:g}", file=out)
        return result
    finally:
        torch.set_num_threads(previous_threads)


def main(steps: int = 40, *, threads: int | None = 2, out: TextIO | None = None) -> int:
    """Run the demo; return the exit status (``0`` when flat and plain agree, ``1`` otherwise)."""
    return 0 if run_demo(steps, threads=threads, out=out).ok() else 1
