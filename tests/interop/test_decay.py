"""weight_decay_groups: decay / no-decay groups that transformers' Trainer classifies like the plain model."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Trainer

from flatten_parametrize import (
    FlatParameter,
    FlatStorage,
    ShardedOptimizer,
    register_flat_storage,
    weight_decay_groups,
)
from flatten_parametrize._guards import decay_check

from _helpers import assert_same_values, train_steps, twin
from _hf import gpt2, lm_dataset, lm_loss, losses, tokens, training_args


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
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for m, out in ((model, tmp_path / "flat"), (plain, tmp_path / "plain")):
            args = training_args(out, weight_decay=0.1, max_grad_norm=0.0)
            trainer = Trainer(model=m, args=args, train_dataset=lm_dataset())
            trainer.train()
            logged.append(losses(trainer))
    assert decay_warnings(record) == []
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


# ------------------------------------------------- rules that cannot see inside a flat parameter

_DIM_RULE = r"weight decay: a rule by p\.dim\(\)"
_NAME_RULE = r"weight decay: a rule by parameter name"


def nanogpt_optimizer(model: nn.Module, weight_decay: float, learning_rate: float) -> torch.optim.AdamW:
    """nanoGPT's ``GPT.configure_optimizers`` (karpathy/nanoGPT model.py) without prints and fused path."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [
        {"params": decay_params, "weight_decay": weight_decay},
        {"params": nodecay_params, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=(0.9, 0.95))


def by_group_name(storage: FlatStorage, weight_decay: float) -> list[dict[str, object]]:
    """The recipe: param groups built by the names weight_decay_groups gives."""
    return [
        {"params": [storage["decay"]], "weight_decay": weight_decay},
        {"params": [storage["no_decay_bias"]], "weight_decay": 0.0},
    ]


def decayed(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Plain name -> numel of every tensor that ``optimizer`` decays (flat parameters by their slots)."""
    out: dict[str, int] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        if group["weight_decay"] > 0:
            for p in group["params"]:
                if isinstance(p, FlatParameter):
                    slot_names, _, numels = p.metadata()
                    out.update(zip(slot_names, numels))
                else:
                    out[names[id(p)]] = p.numel()
    return out


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 1) -> list[float]:
    torch.manual_seed(1)
    return train_steps(model, optimizer, [tokens() for _ in range(steps)], lm_loss)


def decay_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("weight decay:")]


def assert_decays_and_trains_like_the_plain_model(
    model: nn.Module, flat_opt: torch.optim.Optimizer, plain: nn.Module, plain_opt: torch.optim.Optimizer
) -> None:
    """The same decayed tensors, the same losses over 3 steps, the same weights, and no decay warning."""
    assert decayed(model, flat_opt) == decayed(plain, plain_opt)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert one_step(model, flat_opt, 3) == one_step(plain, plain_opt, 3)
    assert decay_warnings(record) == []
    assert_same_values(model, plain)


@pytest.mark.parametrize("groups", ["none", "weight_decay_groups"])
def test_nanogpt_rule_on_a_flattened_model_decays_nothing_and_warns(groups: str):
    """nanoGPT's p.dim() >= 2 puts every (1-D) flat parameter on the no-decay side: warned before step 1."""
    plain = gpt2()
    model = twin(plain)
    register_flat_storage(model, weight_decay_groups(model) if groups != "none" else None)
    assert decayed(model, nanogpt_optimizer(model, 0.1, 1e-3)) == {}
    assert sum(decayed(plain, nanogpt_optimizer(plain, 0.1, 1e-3)).values()) > 0
    optimizer = nanogpt_optimizer(model, 0.1, 1e-3)
    where = r".*'transformer\.wte\.weight' \(64, 16\).*weight_decay_groups"
    with pytest.warns(UserWarning, match=_DIM_RULE + where):
        one_step(model, optimizer)


def test_transformers_rule_with_groups_none_warns(tmp_path: Path):
    """Trainer's name rule decays flat_param_0 whole (biases and norms included): warned before step 1."""
    model = gpt2()
    register_flat_storage(model)
    trainer = Trainer(model=model, args=training_args(tmp_path, weight_decay=0.1))
    optimizer = trainer.create_optimizer()
    assert "transformer.h.0.ln_1.weight" in decayed(model, optimizer)
    with pytest.warns(UserWarning, match=_NAME_RULE + r".*'transformer\.h\.0\.ln_1\.weight' \(16,\)"):
        one_step(model, optimizer)


def test_transformers_rule_with_weight_decay_groups_decays_the_plain_models_tensors_without_warning(
    tmp_path: Path,
):
    """With weight_decay_groups, Trainer's groups decay exactly the plain model's tensors; nothing warns."""
    plain = gpt2()
    model = twin(plain)
    register_flat_storage(model, weight_decay_groups(model))
    flat_opt = Trainer(model=model, args=training_args(tmp_path, weight_decay=0.1)).create_optimizer()
    plain_opt = Trainer(model=plain, args=training_args(tmp_path, weight_decay=0.1)).create_optimizer()
    assert_decays_and_trains_like_the_plain_model(model, flat_opt, plain, plain_opt)


def test_dim_rule_recipe_decays_the_plain_models_tensors_and_trains_like_it():
    """weight_decay_groups(no_decay=<dim rule>) + groups by name: the plain model's decay, losses, weights.

    (The same recipe with the real timm's rule and create_optimizer_v2: tests/interop/test_timm.py.)
    """
    plain = gpt2()
    model = twin(plain)
    no_decay = lambda name, p: p.dim() < 2  # noqa: E731
    plain_opt = nanogpt_optimizer(plain, 0.1, 1e-3)
    storage = register_flat_storage(model, weight_decay_groups(model, no_decay=no_decay))
    flat_opt = torch.optim.AdamW(by_group_name(storage, 0.1), lr=1e-3, betas=(0.9, 0.95))
    assert_decays_and_trains_like_the_plain_model(model, flat_opt, plain, plain_opt)


@pytest.mark.parametrize(
    "make",
    [
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1),
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-3),
        lambda m: torch.optim.AdamW(
            [{"params": [], "weight_decay": 0.1}, {"params": list(m.parameters())}], lr=1e-3
        ),
    ],
    ids=["uniform-decay", "no-decay", "empty-decay-group-and-default-decay"],
)
def test_uniform_decay_does_not_warn(make: Callable[[nn.Module], torch.optim.Optimizer]):
    """One decay for every parameter is the plain model's math under any rule: no warning."""
    model = gpt2()
    register_flat_storage(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        one_step(model, make(model))
    assert decay_warnings(record) == []


def test_an_optimizer_without_flat_parameters_does_not_warn():
    """nanoGPT's rule on the plain model (flat parameters elsewhere in the process) warns nothing."""
    register_flat_storage(gpt2())
    plain = gpt2()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        one_step(plain, nanogpt_optimizer(plain, 0.1, 1e-3))
    assert decay_warnings(record) == []


def test_the_check_warns_once_and_runs_once_per_optimizer(monkeypatch: pytest.MonkeyPatch):
    """Later steps neither warn again nor look at the groups again, until the groups change."""
    model = gpt2()
    storage = register_flat_storage(model, weight_decay_groups(model))
    calls: list[int] = []
    original = decay_check._mismatch

    def counted(groups: list[dict[str, object]], flat_type: type, *asked: object) -> str | None:
        calls.append(len(groups))
        return original(groups, flat_type, *asked)

    monkeypatch.setattr(decay_check, "_mismatch", counted)
    optimizer = torch.optim.AdamW(
        [{"params": [storage["decay"], storage["no_decay_bias"]], "weight_decay": 0.1}], lr=1e-3
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        one_step(model, optimizer, 3)
        assert calls == [1] and decay_warnings(record) == []  # uniform so far
        optimizer.add_param_group({"params": [], "weight_decay": 0.0})
        one_step(model, optimizer, 3)
    assert calls == [1, 2] and len(decay_warnings(record)) == 1
    assert "param groups [1] do not decay but hold no flat parameter" in decay_warnings(record)[0]


def test_attached_and_sharded_optimizers_are_checked(world1: None):
    """An attached optimizer and a ShardedOptimizer with nanoGPT's groups warn as a plain one does."""
    model = gpt2()
    storage = register_flat_storage(model)
    attached = nanogpt_optimizer(model, 0.1, 1e-3)
    storage.attach_optimizer(attached)
    with pytest.warns(UserWarning, match=_DIM_RULE):
        one_step(model, attached)
    model = gpt2()
    storage = register_flat_storage(model)
    groups = [{"params": [], "weight_decay": 0.1}, {"params": [storage["0"]], "weight_decay": 0.0}]
    sharded = ShardedOptimizer(storage, torch.optim.AdamW, groups, lr=1e-3)
    with pytest.warns(UserWarning, match=_DIM_RULE) as record:
        one_step(model, sharded)
    assert len(decay_warnings(list(record))) == 1  # the outer optimizer; the inner one holds slices
