"""storage.attach_optimizer: the optimizer saves the plain per-parameter format and loads both formats."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from accelerate import Accelerator
from torch import nn
from transformers import Trainer

from flatten_parametrize import get_flat_storage, register_flat_storage, weight_decay_groups

from _helpers import assert_same_optim_state, assert_same_values, mlp, train_steps, values
from _hf import gpt2, lm_dataset, lm_loss, losses, tokens, training_args
from _lightning import LitLM, loader
from _lightning import trainer as lightning_trainer


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """AdamW param groups with and without decay, as Trainer builds them, for the plain or flattened model."""
    storage = get_flat_storage(model)
    if storage is not None:
        decay, no_decay = [storage["decay"]], [storage["no_decay_bias"]]
    else:
        groups = weight_decay_groups(model)
        decay, no_decay = groups["decay"], groups["no_decay_bias"]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _pair() -> tuple[nn.Module, nn.Module]:
    """A plain GPT-2 and its flattened twin (weight-decay groups)."""
    plain = gpt2()
    model = copy.deepcopy(plain)
    register_flat_storage(model, weight_decay_groups(model))
    return plain, model


def _assert_all_alike(results: dict[Any, tuple[list[float], dict[str, torch.Tensor]]], steps: int) -> None:
    """Every resumed run (source form, resumed form) logged the same losses and ended with equal weights."""
    reference_losses, reference_weights = next(iter(results.values()))
    assert len(reference_losses) == steps
    for key, (logged, weights) in results.items():
        assert logged == reference_losses, key
        assert_same_values(weights, reference_weights, msg=str(key))


def test_state_dict_is_the_plain_optimizers():
    """After two steps the attached optimizer's state dict equals the plain optimizer's, entry for entry."""
    plain, model = _pair()
    ref = torch.optim.AdamW(_param_groups(plain), lr=1e-2)
    optimizer = torch.optim.AdamW(_param_groups(model), lr=1e-2)
    get_flat_storage(model).attach_optimizer(optimizer)  # type: ignore[union-attr]
    batches = [tokens() for _ in range(2)]
    assert train_steps(model, optimizer, batches, lm_loss) == train_steps(plain, ref, batches, lm_loss)
    assert_same_optim_state(optimizer.state_dict(), ref.state_dict())


def test_load_state_dict_takes_both_formats_and_training_continues_alike():
    """A plain state dict loads into the attached optimizer, its state dict into a plain one, its own too."""
    plain, model = _pair()
    ref = torch.optim.AdamW(_param_groups(plain), lr=1e-2)
    optimizer = torch.optim.AdamW(_param_groups(model), lr=1e-2)
    attachment = get_flat_storage(model).attach_optimizer(optimizer)  # type: ignore[union-attr]
    batches = [tokens() for _ in range(2)]
    train_steps(model, optimizer, batches, lm_loss)
    train_steps(plain, ref, batches, lm_loss)
    flat_resumed, plain_resumed = copy.deepcopy(model), copy.deepcopy(plain)
    flat_opt = torch.optim.AdamW(_param_groups(flat_resumed), lr=1e-2)
    get_flat_storage(flat_resumed).attach_optimizer(flat_opt)  # type: ignore[union-attr]
    flat_opt.load_state_dict(ref.state_dict())
    plain_opt = torch.optim.AdamW(_param_groups(plain_resumed), lr=1e-2)
    plain_opt.load_state_dict(optimizer.state_dict())
    attachment.remove()
    own = optimizer.state_dict()
    assert [len(g["params"]) for g in own["param_groups"]] == [1, 1]
    attachment = get_flat_storage(model).attach_optimizer(optimizer)  # type: ignore[union-attr]
    optimizer.load_state_dict(own)
    ids = [tokens()]
    runs = ((plain, ref), (model, optimizer), (flat_resumed, flat_opt), (plain_resumed, plain_opt))
    logged = [train_steps(m, o, ids, lm_loss) for m, o in runs]
    assert logged == [logged[0]] * 4
    for m in (model, flat_resumed, plain_resumed):
        assert_same_values(m, plain)


def test_attaching_again_returns_the_attachment_and_remove_detaches():
    """The same optimizer twice is one attachment; remove() gives the flat format back."""
    model = mlp()
    storage = register_flat_storage(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = storage.attach_optimizer(optimizer)
    assert storage.attach_optimizer(optimizer) is first
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    assert len(optimizer.state_dict()["state"]) == 6
    first.remove()
    assert len(optimizer.state_dict()["state"]) == 1


def test_attaching_to_another_storage_raises():
    """An optimizer converts for one storage only."""
    model, other = mlp(), mlp()
    storage, other_storage = register_flat_storage(model), register_flat_storage(other)
    optimizer = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"parameters of the flattened module only; param group 0 holds"):
        storage.attach_optimizer(optimizer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    storage.attach_optimizer(optimizer)
    with pytest.raises(RuntimeError, match="already attached to another flat storage"):
        other_storage.attach_optimizer(torch.optim.SGD(other.parameters(), lr=0.1)) and None
        other_storage.attach_optimizer(optimizer)


def test_a_non_optimizer_is_a_type_error():
    """Only optimizers (or frameworks' wrappers of one) can be attached."""
    storage = register_flat_storage(mlp())
    with pytest.raises(TypeError, match=r"needs a torch\.optim\.Optimizer; got list"):
        storage.attach_optimizer([])


def test_a_state_dict_of_another_layout_raises():
    """A plain state dict with other param group sizes than this optimizer's is refused, naming the sizes."""
    model = mlp()
    plain = copy.deepcopy(model)
    storage = register_flat_storage(model)
    optimizer = torch.optim.Adam(model.parameters())
    storage.attach_optimizer(optimizer)
    params = list(plain.parameters())
    other = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}])
    message = r"param groups of \[2, 4\] parameters, the optimizer \[1\] flat and \[6\]"
    with pytest.raises(ValueError, match=message):
        optimizer.load_state_dict(other.state_dict())


# ------------------------------------------------------------------------ Trainer
class FlatTrainer(Trainer):
    """The README recipe: attach the optimizer that Trainer builds."""

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().create_optimizer(*args, **kwargs)
        get_flat_storage(self.model).attach_optimizer(optimizer)  # type: ignore[union-attr]
        return optimizer


def _trainer(model: nn.Module, out: Path, max_steps: int) -> Trainer:
    cls = FlatTrainer if get_flat_storage(model) is not None else Trainer
    args = training_args(
        out, max_steps=max_steps, weight_decay=0.1, max_grad_norm=0.0, save_strategy="steps", save_steps=3
    )
    return cls(model=model, args=args, train_dataset=lm_dataset())


def test_trainer_resumes_across_forms_in_both_directions(tmp_path: Path):
    """Checkpoints of plain and flattened runs resume in either form with the same losses and weights."""
    plain, model = _pair()
    first = {}
    for name, m in (("plain", plain), ("flat", model)):
        trainer = _trainer(m, tmp_path / name, max_steps=3)
        trainer.train()
        first[name] = losses(trainer)
    assert first["plain"] == first["flat"]
    results = {}
    for source in ("plain", "flat"):
        for form in ("plain", "flat"):
            m = gpt2(seed=5)  # other weights: the checkpoint must bring them
            if form == "flat":
                register_flat_storage(m, weight_decay_groups(m))
            trainer = _trainer(m, tmp_path / f"{source}-{form}", max_steps=5)
            trainer.train(resume_from_checkpoint=str(tmp_path / source / "checkpoint-3"))
            results[source, form] = (losses(trainer), values(m))
    _assert_all_alike(results, steps=5)  # the 3 logged before the checkpoint, then 2


# ---------------------------------------------------------------------- Lightning
def test_lightning_resumes_across_forms_in_both_directions(tmp_path: Path):
    """fit(ckpt_path=...) from a plain or a flattened checkpoint: equal losses and weights in both forms."""
    for flat in (False, True):
        module = LitLM(flat)
        fit = lightning_trainer(max_steps=3)
        fit.fit(module, loader())
        fit.save_checkpoint(tmp_path / f"{flat}.ckpt")
    results = {}
    for source in (False, True):
        for flat in (False, True):
            module = LitLM(flat, seed=5)
            lightning_trainer(max_steps=5).fit(module, loader(), ckpt_path=tmp_path / f"{source}.ckpt")
            results[source, flat] = (module.losses, values(module.model))
    _assert_all_alike(results, steps=2)


# ------------------------------------------------------------- Fabric, accelerate
def _batches() -> list[torch.Tensor]:
    return [torch.stack([row["input_ids"] for row in lm_dataset()[i : i + 2]]) for i in range(0, 8, 2)]


def _run(flat: bool, steps: range, setup: Any, save: Any = None, load: Any = None) -> tuple[list[float], Any]:
    """Train the tiny GPT-2 (flattened or not) over ``steps`` of fixed batches through a framework's setup."""
    model = gpt2(seed=0 if load is None else 5)
    if flat:
        register_flat_storage(model, weight_decay_groups(model))
    optimizer = torch.optim.AdamW(_param_groups(model), lr=1e-2)
    if flat:
        get_flat_storage(model).attach_optimizer(optimizer)  # type: ignore[union-attr]
    model, optimizer, backward = setup(model, optimizer)
    if load is not None:
        load(model, optimizer)
        assert all(entry["step"] == 3 for entry in optimizer.state_dict()["state"].values())
    batches = _batches()
    logged = train_steps(
        model, optimizer, (batches[s % len(batches)] for s in steps), lm_loss, backward=backward
    )
    if save is not None:
        save(model, optimizer)
    return logged, model


def _check_resume_across_forms(setup: Any, save: Any, load: Any) -> None:
    for flat in (False, True):
        _run(flat, range(3), setup, save=lambda m, o, flat=flat: save(m, o, flat))
    results = {}
    for source in (False, True):
        for flat in (False, True):
            logged, model = _run(flat, range(3, 5), setup, load=lambda m, o, src=source: load(m, o, src))
            results[source, flat] = (logged, values(model))
    _assert_all_alike(results, steps=2)


def test_fabric_resumes_across_forms_in_both_directions(tmp_path: Path):
    """fabric.save / fabric.load of model and optimizer move between the plain and the flattened run."""
    fabric = L.Fabric(accelerator="cpu", devices=1)

    def setup(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        model, optimizer = fabric.setup(model, optimizer)
        return model, optimizer, fabric.backward

    _check_resume_across_forms(
        setup,
        lambda m, o, flat: fabric.save(tmp_path / f"{flat}.ckpt", {"model": m, "optimizer": o}),
        lambda m, o, flat: fabric.load(tmp_path / f"{flat}.ckpt", {"model": m, "optimizer": o}),
    )


def test_accelerate_resumes_across_forms_in_both_directions(tmp_path: Path):
    """Accelerator.save_state / load_state move model and optimizer between plain and flattened runs."""
    accelerator = Accelerator(cpu=True)

    def setup(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        accelerator._models.clear()
        accelerator._optimizers.clear()
        model, optimizer = accelerator.prepare(model, optimizer)
        return model, optimizer, accelerator.backward

    _check_resume_across_forms(
        setup,
        lambda m, o, flat: accelerator.save_state(tmp_path / str(flat), safe_serialization=False),
        lambda m, o, flat: accelerator.load_state(tmp_path / str(flat)),
    )


def test_named_optimizers_save_plain_names_with_their_prefix():
    """An optimizer built from named_parameters() saves plain names (with its own prefix) and loads them."""
    plain = nn.Sequential(mlp())
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model[0])
    optimizer = torch.optim.Adam(model.named_parameters(), lr=0.1)
    ref = torch.optim.Adam(plain.named_parameters(), lr=0.1)
    storage.attach_optimizer(optimizer)
    x = torch.randn(2, 5)
    for m, o in ((model, optimizer), (plain, ref)):
        m(x).sum().backward()
        o.step()
    saved = optimizer.state_dict()
    assert saved["param_groups"][0]["param_names"] == ref.state_dict()["param_groups"][0]["param_names"]
    assert_same_optim_state(saved, ref.state_dict())
    optimizer.load_state_dict(ref.state_dict())
    assert_same_optim_state(optimizer.state_dict(), ref.state_dict())
