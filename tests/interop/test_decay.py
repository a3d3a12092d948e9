"""weight_decay_groups: decay / no-decay groups that transformers' Trainer classifies like the plain model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Trainer

from flatten_parametrize import register_flat_storage, weight_decay_groups

from _helpers import assert_same_values, twin
from _hf import gpt2, lm_dataset, losses, training_args


def _names(model: nn.Module, groups: dict[str, list[nn.Parameter]]) -> dict[str, list[str]]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {group: [by_id[id(p)] for p in params] for group, params in groups.items()}


def test_default_rule_is_transformers_own():
    """The default no-decay side is exactly what Trainer's rule leaves out of decay on the plain model."""
    model = gpt2()
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    names = _names(model, weight_decay_groups(model))
    assert set(names["decay"]) == {n for n, _ in model.named_parameters() if n in decay}
    assert set(names["no_decay_bias"]) == {n for n, _ in model.named_parameters() if n not in decay}
    assert names["no_decay_bias"] and names["decay"]


def test_trainer_classifies_the_flat_parameters_like_the_plain_model():
    """With the groups registered, Trainer's rule decays flat_param_decay and leaves the other one out."""
    model = gpt2()
    register_flat_storage(model, weight_decay_groups(model))
    assert Trainer.get_decay_parameter_names(None, model) == ["flat_param_decay"]  # type: ignore[arg-type]


def test_trainer_with_weight_decay_trains_like_the_plain_model(tmp_path: Path):
    """Trainer(weight_decay=0.1) building its own AdamW gives the plain model's losses and final weights.

    Gradient clipping is off: the norm of one flat gradient sums in another order than the norm of
    per-parameter norms (a last-bit difference that Adam amplifies on GPT-2's key biases, whose
    gradient is rounding noise).
    """

    plain = gpt2()
    model = twin(plain)
    register_flat_storage(model, weight_decay_groups(model))
    logged = []
    for m, out in ((model, tmp_path / "flat"), (plain, tmp_path / "plain")):
        args = training_args(out, weight_decay=0.1, max_grad_norm=0.0)
        trainer = Trainer(model=m, args=args, train_dataset=lm_dataset())
        trainer.train()
        logged.append(losses(trainer))
    assert len(logged[0]) == 5 and logged[0] == logged[1]
    assert_same_values(model, plain)


def test_trainer_with_clipping_differs_from_the_plain_model_only_by_adams_eps_on_key_biases(tmp_path: Path):
    """With clipping (max_grad_norm=1.0) the losses are the plain ones; weights within a measured bound.

    The global norm sums one flat gradient in another order than per-parameter norms: a last-bit
    difference. Adam divides it by ``sqrt(v) + eps`` where the gradient is rounding noise (~5e-12: the
    key-bias third of GPT-2's ``c_attn.bias``, which softmax cancels), so those 16 entries per layer
    move by up to 1e-5 (8.4e-6 measured) after 5 AdamW steps; every other value stays within 1e-7.
    """
    plain = gpt2()
    model = twin(plain)
    register_flat_storage(model, weight_decay_groups(model))
    logged = []
    for m, out in ((model, tmp_path / "flat"), (plain, tmp_path / "plain")):
        trainer = Trainer(
            model=m, args=training_args(out, weight_decay=0.1, max_grad_norm=1.0), train_dataset=lm_dataset()
        )
        trainer.train()
        logged.append(losses(trainer))
    assert len(logged[0]) == 5 and logged[0] == pytest.approx(logged[1], rel=1e-6)
    flat, ref = model.state_dict(), plain.state_dict()
    width = plain.config.n_embd
    for name, value in ref.items():
        diff = (flat[name] - value).abs().reshape(-1)
        if name.endswith("attn.c_attn.bias"):
            keys = diff[width : 2 * width]
            assert keys.max() <= 1e-5, name
            diff = torch.cat([diff[:width], diff[2 * width :]])
        assert diff.max() <= 1e-7, name


def test_no_decay_takes_a_callable_of_name_and_param():
    """A callable (name, param) -> bool decides the no-decay side; tied: its first name"""
    model = gpt2()
    seen: list[str] = []

    def one_dim(name: str, param: nn.Parameter) -> bool:
        seen.append(name)
        return param.ndim <= 1

    names = _names(model, weight_decay_groups(model, no_decay=one_dim))
    assert "lm_head.weight" not in seen and "transformer.wte.weight" in seen
    assert names["decay"] == [n for n, p in model.named_parameters() if p.ndim > 1]


def test_no_decay_takes_globs_matched_against_every_name():
    """Globs (one str or several) match any qualified name of a parameter, aliases included."""
    model = gpt2()
    assert _names(model, weight_decay_groups(model, no_decay="lm_head.*"))["no_decay_bias"] == [
        "transformer.wte.weight"
    ]
    names = _names(model, weight_decay_groups(model, no_decay=["*.bias", "*.ln_f.*"]))
    assert names["no_decay_bias"][-2:] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert "transformer.h.0.ln_1.weight" in names["decay"]


def test_an_empty_side_is_left_out():
    """A model without biases or norms gets only a decay group, which registers and trains."""
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False))
    groups = weight_decay_groups(model)
    assert list(groups) == ["decay"]
    register_flat_storage(model, groups)
    assert [n for n, _ in model.named_parameters()] == ["flat_param_decay"]


def test_each_side_is_split_by_dtype_and_requires_grad():
    """Like groups=None, each side gets one group per (device, dtype, requires_grad), suffixed _1, _2, ..."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64), nn.Linear(4, 2))
    model[2].requires_grad_(False)
    groups = weight_decay_groups(model)
    sides = ["decay", "decay_1", "decay_2"]
    assert list(groups) == [*sides, "no_decay_bias", "no_decay_bias_1", "no_decay_bias_2"]
    assert groups["decay_1"] == [model[1].weight] and groups["no_decay_bias_2"] == [model[2].bias]
    storage = register_flat_storage(model, groups)
    assert storage["decay_1"].dtype == torch.float64 and not storage["no_decay_bias_2"].requires_grad
    decay = Trainer.get_decay_parameter_names(None, model)  # type: ignore[arg-type]
    assert decay == [f"flat_param_{side}" for side in sides]


def test_a_flattened_module_gives_the_groups_it_was_registered_with():
    """On a flattened module the groups are made of the plain parameters, as before registration."""
    model = gpt2()
    before = weight_decay_groups(model)
    register_flat_storage(model, before)
    after = weight_decay_groups(model)
    assert {k: len(v) for k, v in after.items()} == {k: len(v) for k, v in before.items()}
    assert all(a is b for side in before for a, b in zip(after[side], before[side]))


@pytest.mark.parametrize("bad", [3, [b"*.bias"], ["*.bias", 1]])
def test_a_bad_no_decay_is_a_type_error(bad: object):
    """no_decay must be None, a callable, a glob or globs."""
    with pytest.raises(TypeError, match="no_decay"):
        weight_decay_groups(nn.Linear(2, 2), no_decay=bad)  # type: ignore[arg-type]


def test_a_non_module_is_a_type_error():
    """The module argument must be an nn.Module."""
    with pytest.raises(TypeError, match=r"needs an nn\.Module; got list"):
        weight_decay_groups([])  # type: ignore[arg-type]
