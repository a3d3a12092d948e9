"""Per-tensor optimizers sharded by whole tensors: ``ShardedOptimizer(whole_tensors=True)`` and its anchors.

A GPT-like model (token embedding tied to the head, ``--blocks`` pre-norm blocks of width ``--dim``: a
``(3d, d)`` attention projection, a ``(d, d)`` output, a ``(4d, d)`` and a ``(d, 4d)`` MLP matrix, two
LayerNorms) trains with torch's ``Muon`` on the blocks' matrices and ``AdamW`` on the rest (torch's Muon
docstring split), on 2 gloo ranks, each contender in its own pair of processes:

* (a) ``DDP, replicated``: ``DistributedDataParallel`` and both optimizers on every rank (the baseline);
* (b) ``DDP + ZeroRedundancyOptimizer``: one ``ZeroRedundancyOptimizer`` per class (torch's ZeRO-1 over
  whole parameters: every rank holds all averaged gradients, updated parameters are broadcast);
* (c) ``layer-wise by hand (floor)``: what Megatron's layer-wise optimizer does, written here with no
  library: DDP all-reduces the gradients, each rank steps the tensors it owns (balanced by elements),
  each tensor is broadcast from its owner;
* (d) ``whole tensors, ZeRO-1`` and (e) ``whole tensors, ZeRO-2``: ``register_flat_storage(model,
  bucket_cap_mb=...)``, ``storage.unflatten()``, ``ShardedOptimizer(storage, AdamW, [{"params":
  matrices, "optimizer_class": Muon, ...}, {"params": rest}], whole_tensors=True, shard_gradients=...)``;
* (f) ``nanochat's scheme``: what nanochat's ``DistMuonAdamW`` does, written here from its description
  (:class:`_NanochatScheme`): after backward, the matrices of each shape are stacked, their gradients
  reduce-scattered so that each rank gets ``ceil(K / W)`` of the ``K``, each rank steps those with Muon,
  and the stacks are all-gathered; AdamW's tensors whose first dimension divides by ``W`` are
  reduce-scattered by rows, stepped by slice and all-gathered, the others all-reduced and stepped on
  every rank.

Per contender (the larger or slower of the two ranks): the time of a training step, of the optimizers'
local compute alone (their ``step`` calls, no collective), the optimizer state and gradients held after
backward, the bytes each rank gives to collectives per step (counted by wrapping
``torch.distributed``'s functions; DDP's all-reduce runs in C++ and is counted as the gradient bytes
it reduces), the peak resident set; the load balance (largest over mean elements and Newton-Schulz
flops, ``m * n * min(m, n)`` per matrix, per rank) and the padding of the whole-tensor cut (none in the
layout: the ranges are uneven; NCCL's one-buffer path pads each to the largest, which is reported).
The last row, ``element-wise ZeRO-2, AdamW``: the bytes ``ShardedOptimizer`` with
AdamW everywhere moves on the same model (the yardstick of the bytes target).

Usage: ``python benchmarks/bench_zero_whole.py [--quick]``; ``python -m benchmarks --only zero`` runs it
after ``bench_zero.py``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._memory import held_bytes
from benchmarks._processes import (
    add_run_arguments,
    emit,
    free_ports,
    join_gloo,
    rank_worker,
    run_config,
    serve,
    started,
    time_in_turns,
)
from benchmarks._timing import Table

__all__ = ["main"]

REPLICATED, ZRO, FLOOR, WHOLE1, WHOLE2, NANOCHAT = (
    "(a) DDP, replicated",
    "(b) DDP + ZeroRedundancyOptimizer",
    "(c) layer-wise by hand (floor)",
    "(d) whole tensors, ZeRO-1",
    "(e) whole tensors, ZeRO-2",
    "(f) nanochat's scheme",
)
CONTENDERS = (REPLICATED, ZRO, FLOOR, WHOLE1, WHOLE2, NANOCHAT)
ELEMENTWISE = "element-wise ZeRO-2, AdamW"
WORLD = 2
MIB = 2**20
#: Timed rounds and steps per round (full run, ``--quick``).
ROUNDS, STEPS = 9, (2, 1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/bench_zero_whole.py",
        description="Muon + AdamW sharded by whole tensors against DDP, ZeroRedundancyOptimizer and a "
        "layer-wise floor (2 gloo processes on 127.0.0.1, CPU).",
    )
    add_run_arguments(parser, rounds=ROUNDS, steps=STEPS, timeout=1200.0, bucket_help="bucket size, MiB")
    parser.add_argument("--blocks", type=int, help="transformer blocks (default 6; 2 with --quick)")
    parser.add_argument("--dim", type=int, help="model width (default 384; 32 with --quick)")
    parser.add_argument("--vocab", type=int, help="vocabulary (default 8192; 128 with --quick)")
    parser.add_argument("--tokens", type=int, help="tokens per sequence (default 64; 16 with --quick)")
    parser.add_argument("--batch", type=int, help="sequences per rank (default 8; 2 with --quick)")
    return parser


def _config(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    return {
        "blocks": args.blocks or (2 if quick else 6),
        "dim": args.dim or (32 if quick else 384),
        "vocab": args.vocab or (128 if quick else 8192),
        "tokens": args.tokens or (16 if quick else 64),
        "batch": args.batch or (2 if quick else 8),
        **run_config(args, rounds=ROUNDS, steps=STEPS),
    }


# ----------------------------------------------------------------- one rank


def _model(config: dict[str, Any]) -> Any:
    """Return the GPT-like model (same seed on every rank)."""
    import torch
    from torch import nn

    d = config["dim"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            b, t, _ = h.shape
            q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
            attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + self.out(attn.transpose(1, 2).reshape(b, t, d))
            return h + self.down(nn.functional.gelu(self.up(self.norm2(h))))

    class Gpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(config["vocab"], d)
            self.blocks = nn.ModuleList(Block() for _ in range(config["blocks"]))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, config["vocab"], bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return Gpt()


def _split(model: Any) -> tuple[list[Any], list[Any]]:
    """Return (the blocks' matrices, the rest): torch's Muon docstring split."""
    named = list(model.named_parameters())
    matrices = [p for n, p in named if p.ndim == 2 and n.startswith("blocks.")]
    return matrices, [p for n, p in named if not (p.ndim == 2 and n.startswith("blocks."))]


def _count_collectives() -> dict[str, int]:
    """Wrap ``torch.distributed``'s collectives so that the bytes of their tensors are counted."""
    import torch
    import torch.distributed as dist

    counted = {"bytes": 0}

    def counting(fn: Any, first: int) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensors = args[first] if len(args) > first else next(iter(kwargs.values()))
            for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
                if isinstance(t, torch.Tensor):
                    counted["bytes"] += t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return wrapper

    for name, first in (
        ("broadcast", 0),
        ("reduce", 0),
        ("all_reduce", 0),
        ("all_gather_into_tensor", 1),
        ("reduce_scatter_tensor", 1),
    ):
        setattr(dist, name, counting(getattr(dist, name), first))
    return counted


class _NanochatScheme:
    """nanochat's ``DistMuonAdamW`` from its description: stack, reduce-scatter, step a share, gather.

    Args:
        matrices: the matrices Muon steps; those of one shape are stacked, ``ceil(K / W)`` per rank.
        rest: AdamW's tensors; those whose first dimension divides by ``W`` are sharded by rows.
        rank: this rank.
        world: the number of ranks.
    """

    def __init__(self, matrices: Sequence[Any], rest: Sequence[Any], rank: int, world: int) -> None:
        import torch

        self.rank, self.world = rank, world
        shapes: dict[tuple[int, ...], list[Any]] = {}
        for p in matrices:
            shapes.setdefault(tuple(p.shape), []).append(p)
        #: Per shape: its matrices and the number each rank steps.
        self.stacks = [(group, -(-len(group) // world)) for group in shapes.values()]
        owned = [p for group, share in self.stacks for p in group[rank * share : (rank + 1) * share]]
        self.sharded = [p for p in rest if p.shape[0] % world == 0]
        self.replicated = [p for p in rest if p.shape[0] % world != 0]
        #: This rank's rows of each sharded AdamW tensor: views of the parameter that AdamW steps in place.
        self.slices = [p.detach().chunk(world)[rank] for p in self.sharded]
        self.optimizers = [
            cls(params, lr=lr)
            for cls, params, lr in (
                (torch.optim.Muon, owned, 0.02),
                (torch.optim.AdamW, [*self.slices, *self.replicated], 3e-4),
            )
            if params
        ]
        self.owned = owned

    def zero_grad(self) -> None:
        """Drop every gradient."""
        for opt in self.optimizers:
            opt.zero_grad()
        for group, _ in self.stacks:
            for p in group:
                p.grad = None
        for p in [*self.sharded, *self.replicated]:
            p.grad = None

    def step(self) -> None:
        """Reduce-scatter the gradients, step this rank's share, all-gather the updated values."""
        import torch
        import torch.distributed as dist

        world, rank = self.world, self.rank
        works, outs = [], []
        for group, share in self.stacks:
            stacked = torch.zeros((share * world, *group[0].shape))
            torch.stack([p.grad for p in group], out=stacked[: len(group)])
            out = torch.empty((share, *group[0].shape))
            works.append(dist.reduce_scatter_tensor(out, stacked, async_op=True))
            outs.append(out)
        rows = []
        for p in self.sharded:
            out = torch.empty_like(p.grad.chunk(world)[rank])
            works.append(dist.reduce_scatter_tensor(out, p.grad.contiguous(), async_op=True))
            rows.append(out)
        works += [dist.all_reduce(p.grad, async_op=True) for p in self.replicated]
        for work in works:
            work.wait()
        for (group, share), out in zip(self.stacks, outs):
            for p, grad in zip(group[rank * share : (rank + 1) * share], out.div_(world)):
                p.grad = grad
        for piece, grad in zip(self.slices, rows):
            piece.grad = grad.div_(world)
        for p in self.replicated:
            p.grad.div_(world)
        for opt in self.optimizers:
            opt.step()
        with torch.no_grad():
            works = []
            for group, share in self.stacks:
                mine = torch.zeros((share, *group[0].shape))
                for i, p in enumerate(group[rank * share : (rank + 1) * share]):
                    mine[i].copy_(p)
                gathered = torch.empty((share * world, *group[0].shape))
                works.append((dist.all_gather_into_tensor(gathered, mine, async_op=True), group, gathered))
            for p, piece in zip(self.sharded, self.slices):
                dist.all_gather_into_tensor(p.detach(), piece.clone(), async_op=False)
            for work, group, gathered in works:
                work.wait()
                for p, value in zip(group, gathered):
                    p.copy_(value)

    def state(self) -> list[Any]:
        """Return the inner optimizers' state dicts."""
        return [opt.state for opt in self.optimizers]


def _timed(opt: Any, spent: list[float]) -> None:
    """Make ``opt.step`` add its seconds to ``spent[0]``."""
    inner = opt.step

    def step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    opt.step = step


def _worker(rank: int, port: int, contender: str, config: dict[str, Any]) -> None:
    """Build one contender on this rank, warm it up, then time ``steps`` steps per ``go`` line on stdin."""
    if contender not in CONTENDERS:
        raise SystemExit(f"unknown contender {contender!r}; choose from {list(CONTENDERS)}")
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks._memory import peak_bytes, reset_peak, rss_bytes, trim
    from flatten_parametrize import ShardedOptimizer, register_flat_storage

    torch.set_num_threads(config["threads"])
    join_gloo(rank, WORLD, port, 300)
    counted = _count_collectives()
    model = _model(config)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, config["vocab"], (config["batch"], config["tokens"]), generator=gen)
    trim()
    base = rss_bytes() or 0
    spent = [0.0]
    cap = config["bucket_cap_mb"]
    state_of: list[Any] = []
    grads_of: list[Any] = []
    after_step: Any = None
    ddp_bytes = 0
    balance: dict[str, Any] = {}
    if contender in (REPLICATED, ZRO, FLOOR):
        model = DistributedDataParallel(model, bucket_cap_mb=cap)
        ddp_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # C++ all-reduce
        matrices, rest = _split(model.module)
        if contender == ZRO:
            opts: list[Any] = [
                ZeroRedundancyOptimizer(matrices, optimizer_class=torch.optim.Muon, lr=0.02),
                ZeroRedundancyOptimizer(rest, optimizer_class=torch.optim.AdamW, lr=3e-4),
            ]
            inner = [o.optim for o in opts]
        elif contender == REPLICATED:
            opts = inner = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-4)]
        else:
            owner = _owners([*matrices, *rest])
            mine = [p for p in matrices if owner[id(p)] == rank], [p for p in rest if owner[id(p)] == rank]
            opts = inner = [  # torch's optimizers refuse an empty list: a rank may own no tensor of a kind
                cls(params, lr=lr)
                for cls, params, lr in ((torch.optim.Muon, mine[0], 0.02), (torch.optim.AdamW, mine[1], 3e-4))
                if params
            ]
            every = [*matrices, *rest]

            def broadcast_from_owners() -> None:
                with torch.no_grad():
                    works = [dist.broadcast(p.detach(), owner[id(p)], async_op=True) for p in every]
                    for work in works:
                        work.wait()

            after_step = broadcast_from_owners

        for o in inner:
            _timed(o, spent)
        state_of = [o.state for o in inner]
        grads_of = list(model.parameters())
    elif contender == NANOCHAT:
        matrices, rest = _split(model)
        scheme = _NanochatScheme(matrices, rest, rank, WORLD)
        opts = [scheme]
        for o in scheme.optimizers:
            _timed(o, spent)
        state_of = scheme.state()
        grads_of = list(model.parameters())
    else:
        storage = register_flat_storage(model, bucket_cap_mb=cap)
        storage.unflatten()
        matrices, rest = _split(model)
        opt = ShardedOptimizer(
            storage,
            torch.optim.AdamW,
            [{"params": matrices, "optimizer_class": torch.optim.Muon, "lr": 0.02}, {"params": rest}],
            whole_tensors=True,
            shard_gradients=contender == WHOLE2,
            lr=3e-4,
        )
        opts = [opt]
        _timed(opt.local_optimizer, spent)
        state_of = [opt.local_optimizer.state]
        pieces = [piece for s in opt._ownership.shards for piece in s.pieces.values()]
        grads_of = [*model.parameters(), *pieces]
        balance = _balance(opt._ownership.shards, storage)
    params = sum(p.numel() for p in model.parameters())

    def step(count: bool = False) -> tuple[int, int]:
        for o in opts:
            o.zero_grad()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        held = held_bytes(p.grad for p in grads_of if p.grad is not None) if count else 0
        for o in opts:
            o.step()
        if after_step is not None:
            after_step()
        if not count:
            return 0, 0
        return held, held_bytes(v for s in state_of for e in s.values() for v in e.values() if v.dim() > 0)

    for _ in range(config["warmup"] - 1):
        step()
    before = counted["bytes"]
    grad_bytes, state_bytes = step(count=True)
    collective_bytes = counted["bytes"] - before + ddp_bytes
    emit(
        {
            "params": params,
            "grad_bytes": grad_bytes,
            "state_bytes": state_bytes,
            "collective_bytes": collective_bytes,
            **balance,
        }
    )
    reset_peak()

    def measure(what: str) -> dict[str, float]:
        dist.barrier()
        spent[0] = 0.0
        start = time.perf_counter()
        for _ in range(config["steps"]):
            step()
        elapsed = time.perf_counter() - start
        return {
            "seconds": elapsed / config["steps"],
            "optimizer": spent[0] / config["steps"],
            "peak_above_model": (peak_bytes() or 0) - base,
        }

    serve(measure)
    dist.destroy_process_group()


def _owners(params: Sequence[Any]) -> dict[int, int]:
    """Return ``id(param) -> rank``: the largest first, each to the rank with the fewest elements."""
    load = [0] * WORLD
    owner = {}
    for p in sorted(params, key=lambda p: -p.numel()):
        rank = load.index(min(load))
        owner[id(p)] = rank
        load[rank] += p.numel()
    return owner


def _balance(shards: Sequence[Any], storage: Any) -> dict[str, Any]:
    """Return this rank's elements and Newton-Schulz flops, every rank's ranges, the padding and the numel."""
    elements = sum(s.owned for s in shards)
    flops = sum(
        spec.shape[0] * spec.shape[1] * min(spec.shape)
        for s in shards
        for spec in s.specs
        if len(spec.shape) == 2 and spec.shape[0] > 1 and spec.shape[1] > 1
    )
    return {
        "elements": elements,
        "flops": flops,
        # what NCCL's one-buffer path would pad (each range to the largest) per bucket, in bucket order
        "paddings": [s.chunk * len(s.ranges) - s.numel for s in shards],
        "numels": [s.numel for s in shards],
        "flat_numel": sum(f.numel() for f in storage.flat_params if f.requires_grad),
    }


# ------------------------------------------------------------------ launcher


def _launch(argv: Sequence[str], config: dict[str, Any], timeout: float) -> dict[str, Any]:
    script = str(Path(__file__).resolve())
    env = {**os.environ, "OMP_NUM_THREADS": str(config["threads"])}
    pairs = {
        name: [rank_worker(script, argv, rank, port, name, env) for rank in range(WORLD)]
        for name, port in zip(CONTENDERS, free_ports(len(CONTENDERS)))
    }
    with started([rank for pair in pairs.values() for rank in pair], timeout):
        ready = {name: [rank.receive() for rank in pair] for name, pair in pairs.items()}
        found = time_in_turns(pairs, "step", config["rounds"])
    return {"ready": ready, "found": found}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Time and count each contender, print the table and the targets.

    Returns:
        ``{"ratio", "targets", "config"}``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    config = _config(args)
    if args.worker is not None:
        _worker(int(args.worker[0]), int(args.worker[1]), args.worker[2], config)
        return {}
    start = time.perf_counter()
    measured = _launch(argv, config, args.timeout)
    ready, found = measured["ready"], measured["found"]
    step = {n: statistics.median(max(m["seconds"] for m in r) for r in rounds) for n, rounds in found.items()}
    local = {
        n: statistics.median(max(m["optimizer"] for m in r) for r in rounds) for n, rounds in found.items()
    }
    peak = {n: max(m["peak_above_model"] for r in rounds for m in r) for n, rounds in found.items()}
    held = {n: max(m["grad_bytes"] + m["state_bytes"] for m in ms) for n, ms in ready.items()}
    moved = {n: max(m["collective_bytes"] for m in ms) for n, ms in ready.items()}
    flat_numel = ready[WHOLE2][0]["flat_numel"]
    moved[ELEMENTWISE] = 2 * flat_numel * 4  # reduce to the owners + broadcast from them, by owner (gloo)
    elements = [m["elements"] for m in ready[WHOLE2]]
    flops = [m["flops"] for m in ready[WHOLE2]]
    from flatten_parametrize._distributed.sharded_collectives import MAX_PADDING

    paddings, numels = ready[WHOLE2][0]["paddings"], ready[WHOLE2][0]["numels"]
    padded = [(pad, n) for pad, n in zip(paddings, numels) if pad <= MAX_PADDING * n]
    base = REPLICATED
    table = Table(
        f"Muon on the blocks' matrices + AdamW on the rest, 2 gloo ranks ({config['threads']} torch thread "
        f"each): GPT-like, {config['blocks']} blocks, d={config['dim']}, vocab {config['vocab']} "
        f"({ready[base][0]['params'] / 1e6:.2f} M params), batch {config['batch']} x {config['tokens']} "
        "per rank",
        [
            "contender",
            "step",
            "/ (a)",
            "optimizer compute",
            "/ (a)",
            "state + grads / rank",
            "/ (a)",
            "collective bytes / rank / step",
            "/ element-wise ZeRO-2",
            "peak RSS / rank",
        ],
    )
    for name in CONTENDERS:
        table.add(
            name,
            f"{step[name] * 1e3:.0f} ms",
            f"{step[name] / step[base]:.2f}",
            f"{local[name] * 1e3:.0f} ms",
            f"{local[name] / local[base]:.2f}",
            f"{held[name] / MIB:.1f} MiB",
            f"{held[name] / held[base]:.2f}",
            f"{moved[name] / MIB:.1f} MiB",
            f"{moved[name] / moved[ELEMENTWISE]:.2f}",
            f"{peak[name] / MIB:.0f} MiB",
        )
    table.add(ELEMENTWISE, "-", "-", "-", "-", "-", "-", f"{moved[ELEMENTWISE] / MIB:.1f} MiB", "1.00", "-")
    fastest_anchor = min(step[ZRO], step[FLOOR])
    targets = {
        "(e) step <= 1.00x (f)": step[WHOLE2] <= step[NANOCHAT],
        "(e) state + grads <= (f)": held[WHOLE2] <= held[NANOCHAT],
        "(e) step <= 1.00x the faster of (b) and (c)": step[WHOLE2] <= fastest_anchor,
        "(e) optimizer compute <= 0.55x (a)": local[WHOLE2] <= 0.55 * local[base],
        "(e) state + grads <= 0.55x (a)": held[WHOLE2] <= 0.55 * held[base],
        "(e) collective bytes <= 1.05x element-wise ZeRO-2": moved[WHOLE2] <= 1.05 * moved[ELEMENTWISE],
        "(e) peak RSS <= (b)": peak[WHOLE2] <= peak[ZRO],
    }
    verdicts = ", ".join(f"{what}: {'met' if ok else 'NOT met'}" for what, ok in targets.items())
    table.notes += [
        f"{config['rounds']} rounds x {config['steps']} steps per contender, alternating, after "
        f"{config['warmup']} warm-up steps; medians over rounds of the slower rank. `optimizer compute`: the "
        "optimizers' own step calls (no collective); `state + grads`: optimizer state and gradient tensors "
        "held after backward, larger rank; `collective bytes`: tensor bytes this rank gives to collectives "
        "in one step (DDP's C++ all-reduce counted as its gradient bytes).",
        f"Whole-tensor cut: elements per rank {elements} (largest / mean "
        f"{max(elements) / statistics.mean(elements):.3f}), Newton-Schulz flops per rank {flops} (largest / "
        f"mean {max(flops) / max(statistics.mean(flops), 1):.3f}); no padding in the layout (gloo moves the "
        f"uneven ranges by owner). NCCL's one-buffer path would pad bucket by bucket {paddings} elements "
        f"(of {numels}); it takes the {len(padded)} bucket(s) padded by at most {MAX_PADDING:.0%} "
        f"({sum(p for p, _ in padded)} elements, {sum(p for p, _ in padded) / max(flat_numel, 1):.2e} of the "
        f"{flat_numel}), the others move by owner.",
        f"Targets: {verdicts}"
        + (" (--quick: sizes are tiny, the verdicts mean nothing)" if config["quick"] else "")
        + f". ({time.perf_counter() - start:.0f} s)",
    ]
    print(table.render(), flush=True)
    return {"ratio": {n: step[n] / step[base] for n in CONTENDERS}, "targets": targets, "config": config}


if __name__ == "__main__":
    main()
