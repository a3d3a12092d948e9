"""``torch.distributed.checkpoint`` of plain and flattened models under every engine, run by torchrun.

Run by ``tests/distributed/test_dcp.py`` as ``python -m torch.distributed.run --nproc_per_node N
tests/_dcp_checkpoints.py OUTDIR MODE``:

- ``MODE=save`` (2 ranks): the reference (the plain model under DDP with Adam, 5 steps on a global
  batch of 6 rows), and every source setup of :data:`SOURCES` trained 3 steps and checkpointed with
  ``dcp.save`` (or ``dcp.async_save``) of ``get_state_dict(model, optimizer)``, plus ``dcp.save`` of
  ``model.state_dict()``; then the resumes of :data:`RESUMES_2`.
- ``MODE=resume`` (1 or 3 ranks): the resumes of :data:`RESUMES_OTHER` from those checkpoints.

A resume builds the target setup fresh, ``dcp.load``\\ s a checkpoint (``set_state_dict`` through a
``Stateful``), records the loaded weights, then trains steps 4 and 5 and records losses and weights.
Rank 0 saves ``OUTDIR/<MODE>-<world>.pt``. ``flatten_parametrize`` is imported before DCP, so its
post-import wrap of DCP's ``state_dict`` module is what runs (``"wrapped"`` records it).
"""

# ruff: noqa: E402  (flatten_parametrize is imported before DCP on purpose: its post-import wrap runs)
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flatten_parametrize
from flatten_parametrize import ShardedOptimizer, get_flat_storage, register_flat_storage
from flatten_parametrize._outside.on_import import is_ours

DCP_BEFORE = "torch.distributed.checkpoint.state_dict" in sys.modules  # False: the post-import wrap runs

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

STEPS, SAVED_AT, ROWS = 5, 3, 6
LR = 0.05

#: name -> (form, engine, optimizer, save options, saver). Engines: ddp (DistributedDataParallel),
#: sync (the storage's enable_grad_sync), zero1 / zero2 (ShardedOptimizer), fsdp2 (fully_shard).
SOURCES: dict[str, tuple[str, str, str, dict[str, Any], str]] = {
    "plain-ddp": ("plain", "ddp", "adam", {}, "save"),
    "flat-ddp": ("flat", "ddp", "adam", {}, "save"),
    "flat-ddp-attached": ("flat", "ddp", "attached", {}, "async_save"),
    "flat-sync": ("flat", "sync", "adam", {"flatten_optimizer_state_dict": True}, "save"),
    "flat-zero1": ("flat", "zero1", "sharded", {"full_state_dict": True}, "save"),
    "flat-zero2": ("flat", "zero2", "sharded", {}, "async_save"),
    "plain-fsdp2": ("plain", "fsdp2", "adam", {}, "save"),
    "flat-fsdp2": ("flat", "fsdp2", "adam", {}, "save"),
}
#: Targets (same names as the sources: the setup rebuilt) with load options; ``flatten_optimizer_state_dict``
#: is the source's (DCP reads a checkpoint in the form it was written in, for the plain model too).
TARGETS: dict[str, dict[str, Any]] = {
    "plain-ddp": {},
    "flat-ddp": {"strict": False},
    "flat-ddp-attached": {},
    "flat-sync": {},
    "flat-zero1": {"full_state_dict": True},
    "flat-zero2": {},
    "plain-fsdp2": {},
    "flat-fsdp2": {"strict": False},
}
#: (source checkpoint, target) resumed on 2 ranks: each target from its own checkpoint and across forms.
RESUMES_2 = [(name, name) for name in SOURCES] + [
    ("plain-ddp", "flat-ddp-attached"), ("plain-ddp", "flat-zero1"), ("plain-ddp", "flat-fsdp2"),
    ("flat-zero2", "plain-ddp"), ("flat-zero2", "plain-fsdp2"), ("flat-fsdp2", "plain-fsdp2"),
    ("plain-fsdp2", "flat-fsdp2"), ("flat-ddp-attached", "plain-ddp"),
]  # fmt: skip
#: Resumed on 1 and on 3 ranks: every checkpoint into the flattened DDP model, and a few more.
RESUMES_OTHER = [(name, "flat-ddp") for name in SOURCES] + [
    ("flat-zero2", "plain-ddp"), ("plain-ddp", "flat-zero2"), ("plain-fsdp2", "flat-zero1"),
    ("plain-ddp", "flat-fsdp2"), ("flat-zero1", "plain-fsdp2"),
]  # fmt: skip
#: Full state dicts (``get_state_dict(..., full_state_dict=True, cpu_offload=True)``, saved by rank 0)
#: loaded with ``broadcast_from_rank0=True`` on 2 ranks: (source, target, how, strict). ``how``: "rank 0 only"
#: (``set_model_state_dict`` then ``set_optimizer_state_dict``, the other ranks given empty dicts), or
#: "set_state_dict" (every rank loads the file, as Lightning does; only rank 0's values count).
BROADCASTS = [
    (source, target, how, strict)
    for source in ("plain-fsdp2", "flat-fsdp2")
    for target in ("plain-fsdp2", "flat-fsdp2")
    for how, strict in (("rank 0 only", True), ("set_state_dict", False))
]
#: Checkpoints of ``model.state_dict()`` alone (dcp.save / dcp.load in place), and where they load.
WEIGHTS = ["plain-ddp", "flat-ddp"]


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(ROWS, 4, generator=generator), torch.randn(ROWS, 3, generator=generator)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    return x[rows], y[rows]


def _build(name: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """Return ``(model as trained, the inner module, optimizer)`` of setup ``name``."""
    form, engine, kind, _, _ = SOURCES[name]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    storage = register_flat_storage(net) if form == "flat" else None
    model: nn.Module = net
    if engine == "ddp":
        model = DistributedDataParallel(net)
    elif engine == "fsdp2":
        fully_shard(net)
    elif engine == "sync":
        assert storage is not None
        storage.broadcast_params(src=0)
        storage.enable_grad_sync()
    if kind == "sharded":
        assert storage is not None
        optimizer: torch.optim.Optimizer = ShardedOptimizer(
            storage, torch.optim.Adam, lr=LR, shard_gradients=engine == "zero2"
        )
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        if kind == "attached":
            assert storage is not None
            storage.attach_optimizer(optimizer)
    return model, net, optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _batch(step, rank, world)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone() / world
    dist.all_reduce(total)
    return float(total)


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


def _weights(net: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights by plain name; of a flattened model, read from its flat parameters themselves."""
    storage = get_flat_storage(net)
    if storage is None:
        return {key: _full(value) for key, value in net.state_dict().items()}
    views = storage.views_of([_full(flat) for flat in net.parameters()])
    return {key: views[key].clone() for key in net.state_dict()}


class _App(Stateful):
    """What ``dcp.save`` / ``dcp.load`` see: the torch recipe's ``get_state_dict`` / ``set_state_dict``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, options: dict[str, Any]) -> None:
        self.model, self.optimizer, self.options = model, optimizer, StateDictOptions(**options)

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=self.options,
        )


def _optim_tensors(path: Path) -> dict[str, list[str]]:
    """Return the checkpoint's optimizer tensor keys (``state.*``), from its metadata."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {"keys": sorted(k for k in metadata.state_dict_metadata if k.startswith("app.optim.state"))}


def _save_all(outdir: Path, result: dict[str, Any]) -> None:
    model, net, optimizer = _build("plain-ddp")  # the reference, uninterrupted
    losses, saved = [], {}
    for step in range(STEPS):
        losses.append(_step(model, optimizer, step))
        if step == SAVED_AT - 1:
            saved = _weights(net)
    result["reference"] = {"losses": losses, "saved": saved, "weights": _weights(net)}
    for name, (_, _, _, options, saver) in SOURCES.items():
        model, net, optimizer = _build(name)
        result[f"trained {name}"] = [_step(model, optimizer, step) for step in range(SAVED_AT)]
        state = {"app": _App(model, optimizer, options)}
        path = outdir / "ckpt" / name
        if saver == "async_save":
            dcp.async_save(state, checkpoint_id=str(path)).result()
        else:
            dcp.save(state, checkpoint_id=str(path))
        dist.barrier()
        result[f"tensors {name}"] = _optim_tensors(path)
        if any(source == name for source, *_ in BROADCASTS):
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full_state = get_state_dict(model, optimizer, options=options)
            if dist.get_rank() == 0:
                (outdir / "full").mkdir(exist_ok=True)
                torch.save(full_state, outdir / "full" / f"{name}.pt")
        if name in WEIGHTS:
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(outdir / "weights" / name))
    dist.barrier()


def _resume(outdir: Path, source: str, target: str) -> dict[str, Any]:
    model, net, optimizer = _build(target)
    flatten = SOURCES[source][3].get("flatten_optimizer_state_dict", False)
    options = {**TARGETS[target], "flatten_optimizer_state_dict": flatten}
    try:
        dcp.load({"app": _App(model, optimizer, options)}, checkpoint_id=str(outdir / "ckpt" / source))
    except BaseException as error:  # recorded (DCP's CheckpointException is a BaseException)
        return {"error": f"{type(error).__name__}: {error}"}
    loaded = _weights(net)
    losses = [_step(model, optimizer, step) for step in range(SAVED_AT, STEPS)]
    return {"loaded": loaded, "losses": losses, "weights": _weights(net)}


def _resume_broadcast(outdir: Path, source: str, target: str, how: str, strict: bool) -> dict[str, Any]:
    model, net, optimizer = _build(target)
    rank0 = dist.get_rank() == 0
    path = outdir / "full" / f"{source}.pt"
    model_sd, optim_sd = torch.load(path, weights_only=False) if rank0 else ({}, {})
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    try:
        if how == "rank 0 only":
            set_model_state_dict(model, model_sd, options=options)
            set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
        else:
            if not rank0:  # the other ranks' copies: zeros of the same entries (broadcast overwrites them)
                model_sd, optim_sd = torch.load(path, weights_only=False)
                model_sd = {k: torch.zeros_like(v) for k, v in model_sd.items()}
                optim_sd["state"] = {
                    k: {n: torch.zeros_like(v) for n, v in entry.items()}
                    for k, entry in optim_sd["state"].items()
                }
            set_state_dict(
                model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
            )
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    loaded = _weights(net)
    losses = [_step(model, optimizer, step) for step in range(SAVED_AT, STEPS)]
    return {"loaded": loaded, "losses": losses, "weights": _weights(net)}


def _broadcast_refused(outdir: Path) -> list[str]:
    """Rank 0's dict cannot become one flat state (unequal ``step``\\ s in a group): each rank's error."""
    model, _, optimizer = _build("flat-fsdp2")
    rank0 = dist.get_rank() == 0
    optim_sd: dict[str, Any] = {}
    if rank0:
        _, optim_sd = torch.load(outdir / "full" / "plain-fsdp2.pt", weights_only=False)
        optim_sd["state"]["0.bias"]["step"] = optim_sd["state"]["0.bias"]["step"] + 1
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    try:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
        error = "loaded"
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def _weights_only(outdir: Path, source: str, target: str) -> dict[str, Any]:
    model, net, _ = _build(target)
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(outdir / "weights" / source))
    except BaseException as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"loaded": _weights(net)}


def main(outdir: Path, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    import torch.distributed.checkpoint.state_dict as dsd

    result: dict[str, Any] = {"world": world, "wrapped": is_ours(dsd._get_optim_state_dict)}
    result["library"] = flatten_parametrize.__file__
    result["dcp imported before"] = DCP_BEFORE
    if mode == "save":
        _save_all(outdir, result)
        resumes = RESUMES_2
    else:
        resumes = RESUMES_OTHER
    for source, target in resumes:
        result[f"resume {source} -> {target}"] = _resume(outdir, source, target)
    if mode == "save":
        for source, target, how, strict in BROADCASTS:
            key = f"resume {source} -> {target}, broadcast_from_rank0, {how}, strict={strict}"
            result[key] = _resume_broadcast(outdir, source, target, how, strict)
        result["broadcast refused"] = _broadcast_refused(outdir)
    for source in WEIGHTS:
        for target in WEIGHTS:
            result[f"weights {source} -> {target}"] = _weights_only(outdir, source, target)
    if dist.get_rank() == 0:
        torch.save(result, outdir / f"{mode}-{world}.tmp")
        (outdir / f"{mode}-{world}.tmp").rename(outdir / f"{mode}-{world}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
