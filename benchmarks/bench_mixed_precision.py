"""Workload: bfloat16 training steps with float32 masters, each contender in processes of its own.

Models: a 6-layer ``nn.TransformerEncoder`` (d_model 256, 4 heads, feed-forward
1024, batch 8 x 64) and a tiny GPT-2 built from a config (transformers). Rows
per model: a training step with fused AdamW over 1 and over 4 micro-batches,
and forward+backward alone. Contenders, each in :data:`PROCESSES` processes of
its own per model (the GPT-2's started after the encoder's have exited: a process
that ran the encoder's steps first times the GPT-2's up to 10% slower, the
per-tensor contenders more than the others), timed in turns, each round asking
the next of a contender's processes
(``benchmarks/_processes.py``, :func:`~benchmarks._processes.time_across_processes`), every
process with glibc's heap kept (:data:`~benchmarks._processes.STEADY_HEAP`: no page faults per step);
rounds of about 0.1 s, as many as fill :data:`ROW_SECONDS` per row, every call's time kept in
:data:`CALLS_FILE`:

* ``plain float32``: the plain model;
* ``plain autocast``: the plain model under ``torch.autocast("cpu", torch.bfloat16)``;
* ``flat autocast``: ``register_flat_storage(model)`` under the same autocast;
* ``plain bfloat16``: ``model.bfloat16()``, no float32 master (pure bf16);
* ``hand-written mixed``: the plain model's float32 masters cast by hand to
  bfloat16 leaves once per step (per-parameter casts), micro-batches through
  ``functional_call``, each bf16 gradient added into the master's float32 ``.grad``;
* ``lean mixed (floor)``: the floor of per-tensor mixed precision, no per-forward work at all:
  ``model.bfloat16()`` computes, a float32 master per parameter is cast into its weight once per
  step (one ``_foreach_copy_``), each micro-batch's bfloat16 gradients are added into the masters'
  float32 gradients (one foreach call), fused AdamW steps the masters. Any per-tensor scheme with
  float32 masters does at least this; not held to the targets;
* ``flat + policy``: ``register_flat_storage(model, mixed_precision=MixedPrecisionPolicy(bf16))``;
* ``per-tensor + policy``: the same, then ``storage.unflatten()`` for the whole run (float32 leaf
  parameters stepped by the optimizer, each forward computing with the bf16 compute copy).

Beside each contender: the bytes per parameter it keeps (master + compute copy
+ gradient). Quality: 300 AdamW steps (lr 1e-4) of the tiny GPT-2 on a fixed
synthetic corpus for float32, autocast plain, flat + policy and pure bfloat16:
the final loss and the fraction of weights that changed from their initial
value (pure bfloat16 loses the updates smaller than half its spacing).

On 2 gloo ranks (``benchmarks/_mixed_precision_ranks.py``, its own table): a
training step of the encoder under FSDP2 ``fully_shard(model,
mp_policy=policy)`` against the flattened model with ``mixed_precision=policy``
and ``storage.enable_grad_sync()``, and with ``ShardedOptimizer`` ZeRO-2; each
pair of ranks in its own processes, alternating rounds, medians, ratios to FSDP2.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _mixed_precision_ranks as ranks
from benchmarks._mixed_precision_models import build as _build
from benchmarks._mixed_precision_models import corpus as _corpus
from benchmarks._mixed_precision_models import size as _size
from benchmarks._processes import STEADY_HEAP, Worker, emit, serve, started, time_across_processes, time_calls
from benchmarks._timing import (
    Report,
    Samples,
    Settings,
    Table,
    at_least,
    at_most,
    fmt_ratio,
    fmt_time,
    paired_ratio,
)

__all__ = ["CONTENDERS", "run"]

FP32, AUTOCAST, FLAT_AUTOCAST, BF16, HAND, LEAN, POLICY, PT_POLICY = (
    "plain float32",
    "plain autocast",
    "flat autocast",
    "plain bfloat16",
    "hand-written mixed",
    "lean mixed (floor)",
    "flat + policy",
    "per-tensor + policy",
)
CONTENDERS = (FP32, AUTOCAST, FLAT_AUTOCAST, BF16, HAND, LEAN, POLICY, PT_POLICY)
#: The contenders held to :data:`TARGETS`.
CHECKED = (POLICY, PT_POLICY)
#: The contenders of the quality run.
QUALITY = (FP32, AUTOCAST, POLICY, BF16)
MODELS = ("encoder", "gpt2")
#: ``--quick`` times the encoder only and trains a torch-only stand-in of the GPT-2 (``lm``), so that
#: no worker imports transformers (seconds per process on a busy machine).
QUICK_MODELS = ("encoder",)
STEP1, STEP4, FWD_BWD = "step, 1 micro-batch", "step, 4 micro-batches", "forward+backward"
ROWS = (STEP1, STEP4, FWD_BWD)
#: Each round's length as a multiple of the run's ``round_s`` (0.1 s): one step of the 1-micro-batch and
#: forward+backward rows of the encoder, a few of the GPT-2's (after one untimed call), one 4-micro-batch
#: step. Short rounds keep the eight contenders of a round within about a second of each other: on a
#: 2-CPU VM a process's speed drifts by 10-30% over seconds (every contender alike), and a ratio of two
#: contenders timed seconds apart takes that drift in (rounds of 0.6 s: per-round ratios +-5-18%).
ROUND_FACTOR = 0.5
#: Seconds of timed rounds per row: the first round of a row (each process's warm-up and calibration)
#: is left out, and its length sets the row's rounds (:data:`MIN_ROUNDS` to :data:`MAX_ROUNDS`), so that
#: a row of short calls takes many rounds and the whole workload about 16 minutes on any machine.
ROW_SECONDS = 80
MIN_ROUNDS, MAX_ROUNDS = 9, 300
#: Where a run keeps every timed call (row -> contender -> round -> seconds), under ``--out``.
CALLS_FILE = "mixed_precision_calls.json"
#: Processes per contender (``--quick``: 1), asked in rotation (round r asks process r % 3): the
#: 1.00x targets below leave no room for one pair of processes' luck
#: (:func:`~benchmarks._processes.time_across_processes`).
PROCESSES = 3
QUICK_PROCESSES = 1
#: Targets, as ratios of flat + policy to a baseline of the same run: per step row at most plain
#: autocast's time and the hand-written loop's (+3%); forward+backward at most pure bfloat16's (+5%).
#: (Restated against the same run: on CPUs without AMX bfloat16 compute is barely faster than
#: float32, so a fixed speed-up over autocast measures the CPU, not the library.)
TARGETS = {
    STEP1: ((AUTOCAST, 1.00), (HAND, 1.03)),
    STEP4: ((AUTOCAST, 1.00), (HAND, 1.03)),
    FWD_BWD: ((BF16, 1.05),),
}


class _Trainer:
    """One contender's training step on one model."""

    def __init__(self, contender: str, model: Any, loss: Callable[[Any, Any], Any]) -> None:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from flatten_parametrize import register_flat_storage

        self.loss = loss
        self.autocast = contender in (AUTOCAST, FLAT_AUTOCAST)
        self.cast_batch = contender == BF16
        self.compute_bytes = 0
        self.hand = contender == HAND
        self.lean = contender == LEAN
        masters: list[Any] = []  # the lean loop's float32 masters (the optimizer's parameters)
        if contender == FLAT_AUTOCAST:
            register_flat_storage(model)
        elif contender in (POLICY, PT_POLICY):
            storage = register_flat_storage(
                model, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            )
            if contender == PT_POLICY:
                storage.unflatten()
            self.compute_bytes = 2
        elif contender == BF16:
            model = model.bfloat16()
        elif contender == HAND:
            self.compute_bytes = 2
        elif contender == LEAN:
            masters = [p.detach().clone().requires_grad_() for p in model.parameters() if p.requires_grad]
            model = model.bfloat16()
            self.cast_batch = True
            self.compute_bytes = 2
            #: The bfloat16 weights the model computes with, in the order of the masters.
            self.weights = [p for p in model.parameters() if p.requires_grad]
        elif contender not in (FP32, AUTOCAST):
            raise SystemExit(f"unknown contender {contender!r}; choose from {list(CONTENDERS)}")
        self.model = model
        self.params = masters if self.lean else [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, fused=True)
        if self.hand:
            named = dict(model.named_parameters())
            self.names = list(named)
            self.low = {
                n: torch.empty_like(p, dtype=torch.bfloat16).requires_grad_() for n, p in named.items()
            }

    def context(self) -> Any:
        import torch

        return torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def _batch(self, x: Any) -> Any:
        import torch

        return x.bfloat16() if self.cast_batch and torch.is_floating_point(x) else x

    def forward_backward(self, x: Any) -> Any:
        """One micro-batch: forward, loss, backward (gradients add up)."""
        import torch

        if self.hand:
            out = self.loss(self._hand_model, x)
            out.backward()
            with torch.no_grad():
                for name, p in zip(self.names, self.params):
                    low = self.low[name]
                    if low.grad is not None:
                        if p.grad is None:
                            p.grad = low.grad.float()
                        else:
                            p.grad.add_(low.grad)
                        low.grad = None
            return out
        with self.context():
            out = self.loss(self.model, self._batch(x))
        out.backward()
        if self.lean:
            self._lean_gradients()
        return out

    def _lean_gradients(self) -> None:
        """Add the bfloat16 weights' gradients into the float32 masters' (one foreach call), drop them."""
        import torch

        with torch.no_grad():
            pairs = [(m, w.grad) for m, w in zip(self.params, self.weights) if w.grad is not None]
            if all(m.grad is None for m, _ in pairs):
                for m, _ in pairs:
                    m.grad = torch.empty_like(m)
                torch._foreach_copy_([m.grad for m, _ in pairs], [g for _, g in pairs])
            else:
                for m, _ in pairs:
                    if m.grad is None:
                        m.grad = torch.zeros_like(m)
                torch._foreach_add_([m.grad for m, _ in pairs], [g for _, g in pairs])
            for w in self.weights:
                w.grad = None

    def _hand_model(self, *args: Any, **kwargs: Any) -> Any:
        """The plain model called with the bfloat16 copies of its weights (floating inputs cast too)."""
        import torch
        from torch.utils._pytree import tree_map_only

        def cast(t: Any) -> Any:
            return t.bfloat16() if torch.is_floating_point(t) else t

        args, kwargs = tree_map_only(torch.Tensor, cast, (args, kwargs))
        return torch.func.functional_call(self.model, self.low, args, kwargs)

    def cast_in(self) -> None:
        """Cast the float32 masters into the bfloat16 weights the loop computes with (hand-written, lean)."""
        import torch

        with torch.no_grad():
            if self.hand:
                for name, p in zip(self.names, self.params):
                    self.low[name].copy_(p)
            elif self.lean:
                torch._foreach_copy_(self.weights, self.params)

    def step(self, batches: list[Any]) -> Any:
        """One optimizer step over ``batches`` (micro-batches)."""

        self.opt.zero_grad()
        self.cast_in()
        for x in batches:
            out = self.forward_backward(x)
        self.opt.step()
        return out

    def bytes_per_param(self) -> dict[str, float]:
        n = sum(p.numel() for p in self.params)
        master = sum(p.numel() * p.element_size() for p in self.params) / n
        grad = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None) / n
        return {"master": master, "compute": float(self.compute_bytes), "grad": grad, "params": n}


def _changed_fraction(model: Any, initial: list[Any]) -> float:
    import torch

    changed = total = 0
    with torch.no_grad():
        for p, p0 in zip(_masters(model), initial):
            changed += int((p.float() != p0).sum())
            total += p.numel()
    return changed / total


def _masters(model: Any) -> list[Any]:
    return [v for v in model.state_dict().values() if v.is_floating_point()]


def _quality(contender: str, size: dict[str, Any]) -> dict[str, float]:
    """Train the tiny GPT-2 for ``quality_steps`` steps; return the final loss and the changed fraction."""
    import torch

    model, _, loss = _build("gpt2", size)
    trainer = _Trainer(contender, model, loss)
    initial = [v.detach().float().clone() for v in _masters(trainer.model)]
    steps = size["quality_steps"]
    s = size["gpt2"]
    last = []
    for i in range(steps):
        out = trainer.step([_corpus(s, 1000 + i)])
        if i >= steps - 10:
            last.append(float(out))
    with torch.no_grad():
        eval_loss = sum(float(loss_of(trainer, _corpus(s, j))) for j in range(4)) / 4
    return {
        "loss": eval_loss,
        "train_loss": sum(last) / len(last),
        "changed": _changed_fraction(trainer.model, initial),
    }


def loss_of(trainer: _Trainer, ids: Any) -> Any:
    """Evaluate the contender's loss on ``ids`` (its own compute path, no gradient)."""

    trainer.cast_in()
    if trainer.hand:
        return trainer.loss(trainer._hand_model, ids)
    with trainer.context():
        return trainer.loss(trainer.model, ids)


def _worker(contender: str, config: dict[str, Any]) -> None:
    """Build ``config["model"]`` for one contender, then answer ``go <model>/<row>`` and ``go quality``."""
    import torch

    torch.set_num_threads(config["threads"])
    torch.set_flush_denormal(True)
    size, name = config["size"], config["model"]
    model, batches, loss = _build(name, size)
    trainer = _Trainer(contender, model, loss)

    def fb() -> None:
        for p in trainer.params:
            p.grad = None
        if trainer.hand:  # the hand-written loop casts per forward+backward; the others have cast already
            trainer.cast_in()
        trainer.forward_backward(batches[0])

    rows: dict[str, Callable[[], None]] = {
        f"{name}/{STEP1}": lambda: trainer.step(batches[:1]),
        f"{name}/{STEP4}": lambda: trainer.step(batches),
        f"{name}/{FWD_BWD}": fb,
    }
    trainer.step(batches[:1])
    memory = {name: trainer.bytes_per_param()}
    emit({"memory": memory})
    calls: dict[str, int] = {}

    def measure(what: str) -> dict[str, Any]:
        if what == "quality":
            return _quality(contender, size)
        return {"calls": time_calls(calls, what, rows[what], config["warmup"], config["round_s"])}

    serve(measure)


# ------------------------------------------------------------------ launcher


def run(settings: Settings) -> Report:
    """Time every row of each model for every contender (processes per model), then the quality run."""
    size = _size(settings.quick)
    config = {
        "size": size,
        "threads": settings.threads,
        "warmup": settings.warmup,
        "round_s": settings.round_s * (1 if settings.quick else ROUND_FACTOR),
    }
    models = QUICK_MODELS if settings.quick else MODELS
    root = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        **STEADY_HEAP,
        "OMP_NUM_THREADS": str(settings.threads),
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    command = [sys.executable, "-m", "benchmarks.bench_mixed_precision", "--worker"]
    processes = QUICK_PROCESSES if settings.quick else PROCESSES

    def workers_of(model: str) -> dict[str, list[Worker]]:
        argument = json.dumps({**config, "model": model})
        return {
            name: [
                Worker([*command, name, argument], f"bench_mixed_precision: {name!r} {model} #{i}", env)
                for i in range(processes)
            ]
            for name in CONTENDERS
        }

    results: dict[str, dict[str, Samples]] = {}
    per_call: dict[str, dict[str, list[list[float]]]] = {}  # row -> contender -> round -> seconds per call
    rounds: dict[str, int] = {}
    memory: dict[str, dict[str, Any]] = {name: {} for name in CONTENDERS}
    quality = {}
    pairs = ranks.start(settings, size)  # built while the first model's workers are, timed last
    with started([w for pair in pairs.values() for w in pair], timeout=2400):
        ready: dict[str, list[dict[str, Any]]] | None = None
        for model in models:
            workers = workers_of(model)
            with started([w for ws in workers.values() for w in ws], timeout=1500):
                for name, ws in workers.items():
                    reports = [w.receive()["memory"] for w in ws]
                    memory[name].update(reports[0])  # a contender's processes agree
                if ready is None:
                    ready = ranks.wait_ready(pairs)  # nothing but the timed worker runs from here on
                for row in ROWS:
                    key = f"{model}/{row}"
                    rounds[key] = _rounds(workers, key, settings)
                    found = time_across_processes(workers, key, rounds[key])
                    per_call[key] = {n: [m["calls"] for m in answers] for n, answers in found.items()}
                    results[key] = {
                        n: Samples([statistics.median(c) for c in rs]) for n, rs in per_call[key].items()
                    }
                if model == models[-1]:
                    for name in QUALITY:  # one at a time: each trains on its own
                        workers[name][0].send("go quality")
                        quality[name] = workers[name][0].receive()
        assert ready is not None
        on_ranks = ranks.table(pairs, ready, settings, size)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    (settings.out_dir / CALLS_FILE).write_text(json.dumps(per_call))
    report = Report()
    for model in models:
        report.tables.append(
            _timing_table(model, size, results, memory[FP32][model]["params"], memory, rounds, processes)
        )
        for row in ROWS:
            res = results[f"{model}/{row}"]
            for name in CHECKED:
                for base, target in TARGETS[row]:
                    report.checks.append(
                        at_most(f"{model} {row}: {name} / {base}", paired_ratio(res, name, base), target)
                    )
    report.tables.append(_quality_table(quality, size["quality_steps"], settings.quick))
    report.tables.append(on_ranks)
    loss_ratio = quality[POLICY]["loss"] / quality[AUTOCAST]["loss"]
    report.checks.append(
        at_most("gpt2 quality: |final loss flat + policy / autocast - 1|", abs(loss_ratio - 1), 0.01)
    )
    changed = quality[POLICY]["changed"] / quality[FP32]["changed"]
    report.checks.append(at_least("gpt2 quality: weights changed, flat + policy / float32", changed, 0.99))
    return report


def _rounds(workers: dict[str, list[Worker]], key: str, settings: Settings) -> int:
    """Warm up and calibrate row ``key`` in every process (one untimed round); return its timed rounds.

    ``--quick`` times ``settings.rounds``; a full run fills :data:`ROW_SECONDS` with rounds as long as
    the slowest process's first round.
    """
    first: dict[str, list[float]] = {name: [] for name in workers}
    for name, processes in workers.items():
        for worker in processes:
            worker.send(f"go {key}")
            first[name].append(sum(worker.receive()["calls"]))
    if settings.quick:
        return settings.rounds
    cycle = sum(max(seconds) for seconds in first.values())
    return max(MIN_ROUNDS, min(MAX_ROUNDS, math.ceil(ROW_SECONDS / cycle)))


def _timing_table(
    model: str,
    size: dict[str, Any],
    results: dict[str, dict[str, Samples]],
    params: int,
    memory: dict[str, Any],
    rounds: dict[str, int],
    processes: int,
) -> Table:
    s = size[model]
    what = (
        f"{s['layers']} layers, d_model {s['d_model']}, batch {s['batch']} x {s['tokens']}"
        if model == "encoder"
        else f"GPT-2 from a config, {s['layers']} layers, n_embd {s['embd']}, vocab {s['vocab']}, "
        f"batch {s['batch']} x {s['tokens']}"
    )
    table = Table(
        f"Mixed precision, {model} ({what}, {params:,} params), fused AdamW",
        ["contender", *ROWS, "/ float32 (1 mb)", "/ autocast (1 mb)", "/ autocast (4 mb)",
         "/ hand-written (1 mb)", "/ hand-written (4 mb)", "/ floor (1 mb)", "fwd+bwd / bf16",
         "bytes/param (master + compute + grad)"],
    )  # fmt: skip
    for name in CONTENDERS:
        cells = []
        for row in ROWS:
            sample = results[f"{model}/{row}"][name]
            cells.append(f"{fmt_time(sample.median)} +-{sample.spread:.0%}")
        m = memory[name][model]
        table.add(
            name,
            *cells,
            fmt_ratio(paired_ratio(results[f"{model}/{STEP1}"], name, FP32)),
            fmt_ratio(paired_ratio(results[f"{model}/{STEP1}"], name, AUTOCAST)),
            fmt_ratio(paired_ratio(results[f"{model}/{STEP4}"], name, AUTOCAST)),
            fmt_ratio(paired_ratio(results[f"{model}/{STEP1}"], name, HAND)),
            fmt_ratio(paired_ratio(results[f"{model}/{STEP4}"], name, HAND)),
            fmt_ratio(paired_ratio(results[f"{model}/{STEP1}"], name, LEAN)),
            fmt_ratio(paired_ratio(results[f"{model}/{FWD_BWD}"], name, BF16)),
            _bytes(m),
        )
    counts = ", ".join(f"{row} {rounds[f'{model}/{row}']}" for row in ROWS)
    table.notes.append(
        f"Rounds per row: {counts} (after one untimed round), contenders alternating (forward, then "
        f"reverse order), each contender in {processes} processes of its own asked in rotation (a "
        "process's page faults and memory placement set its time for its whole life); a round's time "
        "is the median of its calls; median over rounds and half the interquartile range; ratios are "
        "the median over rounds of the contender's time over the baseline's in the same round (about "
        "a second apart, so that the machine's drifting load cancels), lower is faster. Autocast adds "
        "per-use casts that live until backward ends (not counted in bytes/param); AdamW state (8 "
        "bytes/param in the master's dtype, 4 for pure bfloat16) comes on top."
    )
    return table


def _bytes(m: dict[str, float]) -> str:
    total = m["master"] + m["compute"] + m["grad"]
    return f"{m['master']:.0f} + {m['compute']:.0f} + {m['grad']:.0f} = {total:.0f}"


def _quality_table(quality: dict[str, dict[str, float]], steps: int, quick: bool) -> Table:
    model = "a torch-only tiny LM (--quick)" if quick else "the tiny GPT-2"
    table = Table(
        f"Quality: {steps} AdamW steps (lr 1e-4) of {model} on a synthetic corpus",
        [
            "contender",
            "final eval loss",
            "/ autocast",
            "mean train loss (last 10)",
            "weights changed",
            "/ float32",
        ],
    )
    for name, q in quality.items():
        table.add(
            name,
            f"{q['loss']:.4f}",
            f"{q['loss'] / quality[AUTOCAST]['loss']:.4f}",
            f"{q['train_loss']:.4f}",
            f"{q['changed']:.2%}",
            f"{q['changed'] / quality[FP32]['changed']:.3f}",
        )
    table.notes.append(
        "Weights changed: the fraction of elements of the float32 masters (pure bfloat16: of its "
        "weights) whose value differs from the initial one; pure bfloat16 drops the updates below "
        "half its spacing."
    )
    return table


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], json.loads(sys.argv[3]))
    else:
        raise SystemExit(
            "bench_mixed_precision runs as a workload of `python -m benchmarks --only mixed_precision`"
        )
