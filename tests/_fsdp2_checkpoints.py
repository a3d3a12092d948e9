"""FSDP2 state dicts and distributed checkpoints of a flattened model against its plain twin.

Run by ``tests/distributed/test_fsdp2_checkpoints.py`` with the real launcher, twice on one OUTDIR::

    python -m torch.distributed.run --nproc_per_node 2 tests/_fsdp2_checkpoints.py train OUTDIR
    python -m torch.distributed.run --nproc_per_node 1 tests/_fsdp2_checkpoints.py load OUTDIR

``train`` (2 gloo ranks), for the plain model and the flattened one, each under ``fully_shard``:

- ``"values"``: after 3 AdamW steps (state dicts taken after step 1 first, so that any cache has seen
  them), what each way of taking a state dict gives under grad mode, ``no_grad`` and ``inference_mode``:
  ``model.state_dict()``, ``get_model_state_dict`` (sharded and full), ``storage.flat_state_dict()``;
  per entry the full tensor, the placements, the local shape and the mesh; or the error;
- ``"checkpoints"``: 3 SGD steps, then the model saved three ways (``dcp.save`` of ``model.state_dict()``,
  ``dcp.save`` of ``get_model_state_dict``, ``torch.save`` of the full state dict), 2 more steps (the
  uninterrupted run: losses and weights); then every checkpoint loaded into a fresh model of each form
  (``load_state_dict`` after ``dcp.load``, ``set_model_state_dict`` sharded, full, and full with
  ``broadcast_from_rank0=True`` from rank 0's dict alone): the weights after loading, 2 more steps
  (losses and weights).

``load`` (1 rank): the same checkpoints loaded into each form under ``fully_shard`` on one rank and
into models without FSDP, then 2 steps on both ranks' batches at once (FSDP2 averages the ranks'
gradients of equal batches: the same gradient).

Each rank saves ``OUTDIR/<scenario>.<rank>.pt``.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from flatten_parametrize import get_flat_storage, register_flat_storage

FORMS = ("plain", "flat")
SAVED = ("state_dict", "sharded", "full")  # how the step-3 checkpoint was written
LOADS = {  # how a checkpoint is loaded -> the checkpoint it reads
    "load_state_dict": "state_dict",
    "set_model_state_dict": "sharded",
    "full": "full",
    "broadcast_from_rank0": "full",  # rank 0 holds the full dict, the other ranks an empty one
}
LR = 0.1
FULL = StateDictOptions(full_state_dict=True)


class Traffic:
    """Counts, while active, ``all_to_all_single`` calls with the elements each rank sent (to itself
    included and apart) and ``DTensor.full_tensor`` calls (a gather of a whole tensor)."""

    def __init__(self) -> None:
        self.counts = {"all_to_all": 0, "sent": 0, "sent to itself": 0, "full_tensor": 0}

    def __enter__(self) -> dict[str, int]:
        counts, self._a2a, self._full = self.counts, dist.all_to_all_single, DTensor.full_tensor
        a2a, full_tensor = self._a2a, self._full

        def counted_a2a(output: Any, input: Any, output_split_sizes: Any, input_split_sizes: Any,
                        *args: Any, **kwargs: Any) -> Any:  # fmt: skip
            counts["all_to_all"] += 1
            counts["sent"] += input.numel()
            counts["sent to itself"] += input_split_sizes[dist.get_rank(kwargs.get("group"))]
            return a2a(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

        def counted_full(self: Any, *args: Any, **kwargs: Any) -> Any:
            counts["full_tensor"] += 1
            return full_tensor(self, *args, **kwargs)

        dist.all_to_all_single = counted_a2a  # type: ignore[assignment]
        DTensor.full_tensor = counted_full  # type: ignore[method-assign]
        return counts

    def __exit__(self, *exc: Any) -> None:
        dist.all_to_all_single = self._a2a
        DTensor.full_tensor = self._full  # type: ignore[method-assign]


def build(form: str, seed: int = 0, shard: bool = True) -> nn.Module:
    """Three layers whose slots cross the ranks' shards of the flat buffer."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 3))
    if form == "flat":
        register_flat_storage(model)
    if shard:
        fully_shard(model)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=generator), torch.randn(4, 3, generator=generator)


def full(value: Any) -> Any:
    return value.full_tensor().detach().clone() if isinstance(value, DTensor) else value.detach().clone()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights under the plain model's names (a collective under FSDP2)."""
    return {key: full(value) for key, value in model.state_dict().items()}


def describe(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Per entry: full values, placements, local shape, local bytes, mesh (None for a plain tensor)."""
    out = {}
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            local = value.to_local()
            out[key] = {
                "full": full(value),
                "placements": tuple(str(p) for p in value.placements),
                "local shape": tuple(local.shape),
                "local bytes": local.nbytes,
                "mesh": value.device_mesh.mesh.tolist(),
            }
        else:
            out[key] = {"full": full(value), "placements": None, "local shape": tuple(value.shape),
                        "local bytes": value.nbytes, "mesh": None}  # fmt: skip
    return out


def sgd_steps(model: nn.Module, steps: range, rank: int, ranks: tuple[int, ...]) -> list[float]:
    """SGD steps (stateless: the model alone resumes them) on the batches of ``ranks`` concatenated."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in steps:
        pairs = [batch(step, r) for r in ranks]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# -------------------------------------------------------------------------------------- train


def dcp_collectives(model: nn.Module) -> dict[str, dict[str, int]]:
    """The collectives of each DCP state-dict call (by op name, as ``CommDebugMode`` counts them)."""
    calls: dict[str, Callable[[], Any]] = {
        "get_model_state_dict": lambda: get_model_state_dict(model),
        "get_model_state_dict, full": lambda: get_model_state_dict(model, options=FULL),
        "set_model_state_dict": lambda: set_model_state_dict(model, get_model_state_dict(model)),
        "set_model_state_dict, full": lambda: set_model_state_dict(
            model, get_model_state_dict(model, options=FULL), options=FULL
        ),
    }
    out = {}
    for name, call in calls.items():
        call()  # the counted call runs after one whose caches it may use
        with CommDebugMode() as comm:
            call()
        out[name] = {str(op): count for op, count in comm.get_comm_counts().items()}
    return out


def values_scenario(rank: int) -> dict[str, Any]:
    getters: dict[str, Callable[[nn.Module], dict[str, Any]]] = {
        "model.state_dict()": lambda m: m.state_dict(),
        "get_model_state_dict": lambda m: get_model_state_dict(m),
        "get_model_state_dict, full": lambda m: get_model_state_dict(
            m, options=StateDictOptions(full_state_dict=True)
        ),
        "flat_state_dict()": lambda m: get_flat_storage(m).flat_state_dict(),  # type: ignore[union-attr]
    }
    modes: dict[str, Callable[[], Any]] = {
        "grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
    }  # fmt: skip
    out: dict[str, Any] = {}
    for form in FORMS:
        model = build(form)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        for step in range(3):
            x, y = batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            for name, getter in getters.items():
                if step == 0 and (form == "flat" or name != "flat_state_dict()"):
                    for mode in modes.values():
                        with mode():
                            try:
                                getter(model)
                            except RuntimeError:
                                pass  # recorded below, after step 3
        for name, getter in getters.items():
            if form == "plain" and name == "flat_state_dict()":
                continue
            for mode_name, mode in modes.items():
                try:
                    with mode():
                        taken = getter(model)
                    out[f"{form}, {name}, {mode_name}"] = describe(taken)
                except RuntimeError as error:
                    out[f"{form}, {name}, {mode_name}"] = f"RuntimeError: {error}"
        out[f"{form}, trained"] = weights(model)
        out[f"{form}, DCP collectives"] = dcp_collectives(model)
        with Traffic() as saving:
            taken = model.state_dict()
        out[f"{form}, saving traffic"] = saving
        fresh = build(form, seed=3)
        with Traffic() as loading:
            fresh.load_state_dict(taken)
        out[f"{form}, loading traffic"] = loading
        out[f"{form}, loaded"] = weights(fresh)
        probe = weakref.ref(taken["0.weight"])
        del taken
        gc.collect()
        out[f"{form}, freed with its state dict"] = probe() is None
    return out


def checkpoints_scenario(rank: int, outdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for form in FORMS:
        model = build(form)
        sgd_steps(model, range(3), rank, (rank,))
        out[f"{form}, saved"] = weights(model)
        dcp.save(model.state_dict(), checkpoint_id=outdir / f"{form}-state_dict")
        dcp.save(get_model_state_dict(model), checkpoint_id=outdir / f"{form}-sharded")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full_sd = get_model_state_dict(model, options=options)
        if rank == 0:
            torch.save(full_sd, outdir / f"{form}-full.pt")
        out[f"{form}, uninterrupted"] = {
            "losses": sgd_steps(model, range(3, 5), rank, (rank,)), "weights": weights(model),
        }  # fmt: skip
    dist.barrier()
    for src in FORMS:
        for dst in FORMS:
            for how in LOADS:
                model = build(dst, seed=7)
                load_sharded(model, how, outdir / f"{src}-{LOADS[how]}")
                loaded = weights(model)
                out[f"{src} -> {dst}, {how}"] = {
                    "loaded": loaded,
                    "losses": sgd_steps(model, range(3, 5), rank, (rank,)),
                    "weights": weights(model),
                }
    return out


def load_sharded(model: nn.Module, how: str, path: Path) -> None:
    """Load a step-3 checkpoint into ``model`` under ``fully_shard``, as ``how`` says."""
    if how == "load_state_dict":
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd)
    elif how == "set_model_state_dict":
        sd = get_model_state_dict(model)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd)
    elif how == "full":
        full_sd = torch.load(path.with_suffix(".pt"), weights_only=True)
        set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True))
    else:
        full_sd = torch.load(path.with_suffix(".pt"), weights_only=True) if dist.get_rank() == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full_sd, options=options)


# --------------------------------------------------------------------------------------- load


def load_scenario(outdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for src in FORMS:
        for dst in FORMS:
            for how in LOADS:
                model = build(dst, seed=7)
                load_sharded(model, how, outdir / f"{src}-{LOADS[how]}")
                out[f"{src} -> {dst}, {how}"] = {
                    "loaded": weights(model),
                    "losses": sgd_steps(model, range(3, 5), 0, (0, 1)),
                    "weights": weights(model),
                }
            for saved in SAVED:  # no FSDP: the model's own tensors (views of the flat buffer)
                model = build(dst, seed=7, shard=False)
                if saved == "full":
                    sd: dict[str, Any] = torch.load(outdir / f"{src}-full.pt", weights_only=True)
                else:
                    sd = model.state_dict()
                    dcp.load(sd, checkpoint_id=outdir / f"{src}-{saved}")
                model.load_state_dict(sd)
                out[f"{src} -> {dst}, no FSDP, {saved}"] = {
                    "loaded": weights(model),
                    "losses": sgd_steps(model, range(3, 5), 0, (0, 1)),
                    "weights": weights(model),
                }
    return out


def main(mode: str, outdir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "train":
        scenarios: dict[str, Callable[[], Any]] = {
            "values": lambda: values_scenario(rank),
            "checkpoints": lambda: checkpoints_scenario(rank, outdir),
        }
    else:
        scenarios = {"load": lambda: load_scenario(outdir)}
    try:
        for name, scenario in scenarios.items():
            result = scenario()
            torch.save(result, outdir / f"{name}.{rank}.tmp")
            (outdir / f"{name}.{rank}.tmp").rename(outdir / f"{name}.{rank}.pt")
    except BaseException:
        (outdir / f"{mode}.{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], Path(sys.argv[2]))
