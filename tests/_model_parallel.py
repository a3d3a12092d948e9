"""Lightning's ModelParallelStrategy on 2 CPU processes (gloo), FSDP2 applied in ``configure_model``.

Run by ``tests/distributed/test_engines.py`` as ``python -m torch.distributed.run --nproc_per_node 2
tests/_model_parallel.py OUTDIR``. For the plain and the flattened model (registered in
``configure_model``, then ``fully_shard``; the strategy calls ``.to(device)`` next):

- ``"<form> 6"``: 6 steps, a distributed checkpoint after step 4 (``ModelCheckpoint``);
- ``"<form> resumed"``: a new trainer resumed from that checkpoint to step 6;
- ``"<form> full file"``: what the single-file checkpoint (``save_distributed_checkpoint=False``) written
  after step 4 holds: its ``state_dict`` and ``optimizer_states`` (Lightning keys the optimizer state by
  parameter position);
- ``"<source> full -> <form>"``: a new trainer of ``<form>`` resumed from ``<source>``'s single-file
  checkpoint to step 6 (each form from its own and from the other's).

Each rank saves ``OUTDIR/result<rank>.pt``: the full tensors of ``model.state_dict()`` and the
steps each run trained (global step, batch index).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from flatten_parametrize import register_flat_storage

STEPS, SAVED_AT = 6, 4


class Net(L.LightningModule):
    def __init__(self, flat: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.flat = flat
        self.steps: list[tuple[int, int]] = []

    def configure_model(self) -> None:
        if self.flat:
            register_flat_storage(self.model, exist_ok=True)
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps.append((self.trainer.global_step, batch_idx))
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01)


def _loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(3 + int(os.environ["RANK"]))  # each rank its own data
    data = TensorDataset(torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator))
    return DataLoader(data, batch_size=4)


def _fit(
    flat: bool, ckpt_dir: Path | None = None, resume: Path | None = None, distributed: bool = True
) -> Any:
    module = Net(flat)
    callbacks = (
        []
        if ckpt_dir is None
        else [ModelCheckpoint(dirpath=ckpt_dir, filename="step", every_n_train_steps=SAVED_AT, save_top_k=-1)]
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed
        ),
        max_steps=STEPS,
        callbacks=callbacks,
        enable_checkpointing=ckpt_dir is not None,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, _loader(), ckpt_path=resume)
    weights = {k: v.full_tensor().detach().clone() for k, v in module.model.state_dict().items()}
    return {"weights": weights, "steps": module.steps}


def main(outdir: Path) -> None:
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    for flat in (False, True):
        form = "flat" if flat else "plain"
        ckpt = outdir / f"{form}-ckpt"
        result[f"{form} 6"] = _fit(flat, ckpt_dir=ckpt)
        result[f"{form} resumed"] = _fit(flat, resume=ckpt / "step.ckpt")
        _fit(flat, ckpt_dir=outdir / f"{form}-full", distributed=False)
        saved = torch.load(outdir / f"{form}-full" / "step.ckpt", weights_only=False)
        result[f"{form} full file"] = {key: saved[key] for key in ("state_dict", "optimizer_states")}
    for flat in (False, True):
        for source in ("plain", "flat"):
            resume = outdir / f"{source}-full" / "step.ckpt"
            result[f"{source} full -> {'flat' if flat else 'plain'}"] = _fit(flat, resume=resume)
    torch.save(result, outdir / f"result{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
