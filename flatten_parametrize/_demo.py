"""The demo behind ``python -m flatten_parametrize demo``: flat and plain training side by side.

A small transformer language model (``nn.Embedding``, a 6-layer
``nn.TransformerEncoder``, a ``nn.Linear`` head: 75 parameter tensors) is copied
before registration; one copy gets a flat storage, the other stays plain. Both
train with ``AdamW`` over ``model.parameters()`` on the same synthetic
next-token batches. The steps run in rounds of a few steps, the two models
taking turns and alternating which goes first, so that both see the same load
of the machine; the demo prints both losses, the median time per step of
each, the gain (the median over rounds of plain time / flat time), a note
when the machine was busy, and checks that the losses agree.

The gain comes from the parameter count: the plain model's ``AdamW`` step
(on CPU torch loops over the tensors), ``zero_grad`` and gradient
accumulation do per-tensor work 75 times per step, the flat model's once.
"""

from __future__ import annotations

import copy
import os
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
D_MODEL = 32
LAYERS = 6
SEQ_LEN = 16
BATCH = 8
TOLERANCE = 1e-5
#: Steps of each model per round; the first round is a warm-up, not timed.
ROUND_STEPS = 4
#: Default threads: the model is small, so one thread is about as fast as two, and on a
#: 2-core machine a second thread of each step would compete with any other work.
THREADS = 1
#: Below this share of its threads' CPU time during the timed rounds, the machine was busy.
BUSY_CPU_SHARE = 0.9


class TinyLM(nn.Module):
    """A causal transformer language model built from ``torch.nn`` parts only.

    Args:
        vocab: vocabulary size. Default: ``64``.
        d_model: width of the model. Default: ``32``.
        layers: encoder layers. Default: ``6``.
    """

    def __init__(self, vocab: int = VOCAB, d_model: int = D_MODEL, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
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


def usable_cpus() -> int:
    """Return the number of CPUs this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


@dataclass
class DemoResult:
    """Losses of both runs, their time per step in each timed round, and what the machine was doing."""

    flat_losses: list[float] = field(default_factory=list)
    plain_losses: list[float] = field(default_factory=list)
    #: Seconds per step of each timed round (the same rounds, the same batches, for both).
    flat_times: list[float] = field(default_factory=list)
    plain_times: list[float] = field(default_factory=list)
    max_weight_diff: float = 0.0
    same_keys: bool = True
    #: CPU time the process got during the timed rounds, as a share of wall time x threads.
    cpu_share: float = 1.0
    #: The 1-minute load average when the demo started (``None`` where the OS has none).
    load_average: float | None = None
    cpus: int = 1
    threads: int = 1

    @property
    def max_loss_diff(self) -> float:
        """Return the largest absolute difference between the two loss curves."""
        return max((abs(a - b) for a, b in zip(self.flat_losses, self.plain_losses)), default=0.0)

    @property
    def ratios(self) -> list[float]:
        """Return plain time / flat time of each timed round (above 1: the flat model was faster)."""
        return [plain / flat for flat, plain in zip(self.flat_times, self.plain_times)]

    @property
    def gain(self) -> float:
        """Return the median over the timed rounds of plain time / flat time (``nan`` without rounds)."""
        return statistics.median(self.ratios) if self.ratios else float("nan")

    @property
    def busy(self) -> bool:
        """Return whether other work competed for the CPUs (so that the times are noisy)."""
        loaded = self.load_average is not None and self.load_average > self.cpus - self.threads + 0.5
        return self.cpu_share < BUSY_CPU_SHARE or loaded or self.threads > self.cpus

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


def _busy_note(result: DemoResult) -> str:
    load = "" if result.load_average is None else f"load average {result.load_average:.1f} on "
    threads = "this process" if result.threads == 1 else f"its {result.threads} threads"
    parts = [f"{load}{result.cpus} CPUs", f"{threads} got the CPU {result.cpu_share:.0%} of the time"]
    if result.threads > result.cpus:
        parts.append(f"{result.threads} threads oversubscribe them")
    return (
        f"note: the machine is busy ({'; '.join(parts)}):\n"
        "      the times are noisy; the gain compares rounds in which both models met the same load"
    )


def run_demo(
    steps: int = 60,
    *,
    seed: int = 0,
    threads: int | None = THREADS,
    every: int = 10,
    out: TextIO | None = None,
) -> DemoResult:
    """Train the flat and the plain model side by side and print the comparison.

    Args:
        steps: training steps of each model. Default: ``60``.
        seed: seed of the initial weights and of the data. Default: ``0``.
        threads: ``torch.set_num_threads`` for the run (restored afterwards);
            ``None`` keeps the current setting. Default: ``1``.
        every: print the losses every ``every`` steps (and the first and last step). Default: ``10``.
        out: where to print. Default: ``sys.stdout``.

    Returns:
        The losses, the times of the timed rounds and what the machine was doing.

    Raises:
        ValueError: if ``steps``, ``threads`` or ``every`` is below 1.

    Example:
        >>> import io
        >>> result = run_demo(2, out=io.StringIO())
        >>> result.ok(), result.flat_losses == result.plain_losses
        (True, True)
    """
    for name, value in (("steps", steps), ("threads", threads), ("every", every)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    out = sys.stdout if out is None else out
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        result = DemoResult(cpus=usable_cpus(), threads=torch.get_num_threads())
        if hasattr(os, "getloadavg"):
            result.load_average = os.getloadavg()[0]
        torch.manual_seed(seed)
        flat_model = TinyLM()
        plain_model = copy.deepcopy(flat_model)  # same initial weights
        storage = register_flat_storage(flat_model)
        flat_opt = torch.optim.AdamW(flat_model.parameters(), lr=3e-3)
        plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=3e-3)
        batches = make_batches(steps, seed)
        tensors = len(list(plain_model.parameters()))
        count = sum(p.numel() for p in plain_model.parameters())
        thread_word = "thread" if result.threads == 1 else "threads"

        print(
            f"flatten_parametrize demo: {type(flat_model).__name__} ({count:,} parameters in {tensors} "
            f"tensors), AdamW, {steps} steps, {result.threads} {thread_word} of {result.cpus} CPUs",
            file=out,
        )
        print(
            f"parameter tensors seen by the optimizer: flat {len(list(flat_model.parameters()))}, "
            f"plain {tensors}",
            file=out,
        )
        print(file=out)
        print(repr(storage), file=out)
        print(file=out)
        print(f"{'step':>5}  {'loss (flat)':>12}  {'loss (plain)':>12}  {'|diff|':>8}", file=out)

        runs = (
            (flat_model, flat_opt, result.flat_losses, result.flat_times),
            (plain_model, plain_opt, result.plain_losses, result.plain_times),
        )
        rounds = [batches[i : i + ROUND_STEPS] for i in range(0, steps, ROUND_STEPS)]
        timed_wall = timed_cpu = 0.0
        for number, round_batches in enumerate(rounds):
            timed = number > 0 or len(rounds) == 1  # the first round warms up, unless it is the only one
            wall, cpu = time.perf_counter(), time.process_time()
            # The two models take turns, the first one alternating, so that both see the same load.
            for model, optimizer, losses, times in runs if number % 2 == 0 else runs[::-1]:
                start = time.perf_counter()
                for batch in round_batches:
                    losses.append(_train_step(model, optimizer, batch))
                if timed:
                    times.append((time.perf_counter() - start) / len(round_batches))
            if timed:
                timed_wall += time.perf_counter() - wall
                timed_cpu += time.process_time() - cpu
            first = number * ROUND_STEPS + 1
            for step in range(first, first + len(round_batches)):
                if step == 1 or step % every == 0 or step == steps:
                    flat_loss, plain_loss = result.flat_losses[step - 1], result.plain_losses[step - 1]
                    diff = abs(flat_loss - plain_loss)
                    print(f"{step:>5}  {flat_loss:>12.6f}  {plain_loss:>12.6f}  {diff:>8.1e}", file=out)
        if timed_wall > 0:
            result.cpu_share = timed_cpu / (timed_wall * result.threads)

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
        ratios = result.ratios
        print(file=out)
        print(
            f"median time per step: flat {flat_ms:.1f} ms, plain {plain_ms:.1f} ms "
            f"({len(ratios)} timed rounds of up to {ROUND_STEPS} steps, the models in turns)",
            file=out,
        )
        print(
            f"gain: flat trains {result.gain:.2f}x as fast as plain "
            f"(median of the rounds' plain/flat times; range {min(ratios):.2f}-{max(ratios):.2f})",
            file=out,
        )
        if result.busy:
            print(_busy_note(result), file=out)
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


def main(steps: int = 60, *, threads: int | None = THREADS, out: TextIO | None = None) -> int:
    """Run the demo; return the exit status (``0`` when flat and plain agree, ``1`` otherwise).

    Args:
        steps: training steps of each model. Default: ``60``.
        threads: ``torch.set_num_threads`` for the run; ``None`` keeps the current setting. Default: ``1``.
        out: where to print. Default: ``sys.stdout``.

    Returns:
        The exit status of ``python -m flatten_parametrize demo``.

    Example:
        >>> import io
        >>> main(2, out=io.StringIO())
        0
    """
    return 0 if run_demo(steps, threads=threads, out=out).ok() else 1
