"""Registering on a wrapper (peft's PeftModel) registers on the model it wraps, which keeps working."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from torch import nn
from transformers import Trainer

from flatten_parametrize import (
    get_flat_storage,
    register_flat_storage,
    remove_flat_storage,
    weight_decay_groups,
)

from _helpers import mlp, train_steps
from _hf import gpt2, lm_loss, tokens


def _lora(seed: int = 0) -> PeftModel:
    """LoRA on the attention projections of the tiny GPT-2; B initialized nonzero so that merging matters."""
    config = LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(seed + 1)
    return get_peft_model(gpt2(seed), config)  # type: ignore[return-value]


def test_registering_on_a_peft_model_registers_on_the_wrapped_model():
    """The flat parameters live on base_model.model, which get_flat_storage and remove_flat_storage find."""
    model = _lora()
    inner = model.base_model.model
    storage = register_flat_storage(model)
    assert (
        storage.module is inner and get_flat_storage(model) is storage and get_flat_storage(inner) is storage
    )
    assert [n for n, _ in model.named_parameters()] == [
        "base_model.model.flat_param_0",
        "base_model.model.flat_param_1",
    ]
    assert storage.param_infos[0].name == "transformer.wte.weight"
    remove_flat_storage(model)
    assert get_flat_storage(model) is None and type(inner.transformer.h[0].ln_1) is nn.LayerNorm
    assert len(list(inner.parameters())) == len(list(_lora().base_model.model.parameters()))


def test_the_wrapped_model_keeps_working_as_the_plain_one(tmp_path: Path):
    """generate, device, dtype, num_parameters, LoRA training and save_pretrained give the plain results."""
    plain = _lora()
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    ids = tokens()
    inner, ref = model.base_model.model, plain.base_model.model
    assert (inner.device, inner.dtype, model.device, model.dtype) == (
        ref.device,
        ref.dtype,
        ref.device,
        ref.dtype,
    )
    assert inner.num_parameters() == ref.num_parameters()
    assert inner.num_parameters(only_trainable=True) == ref.num_parameters(only_trainable=True)
    assert model.get_nb_trainable_parameters() == plain.get_nb_trainable_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    batches = [tokens() for _ in range(3)]
    train_steps(model, opt, batches, lm_loss)
    train_steps(plain, ref_opt, batches, lm_loss)
    assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    generated = model.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, plain.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False))
    model.save_pretrained(tmp_path / "flat")
    plain.save_pretrained(tmp_path / "plain")
    saved = load_file(tmp_path / "flat" / "adapter_model.safetensors")
    expected = load_file(tmp_path / "plain" / "adapter_model.safetensors")
    assert len(saved) == len(expected) == 4 and all(torch.equal(saved[k], expected[k]) for k in expected)
    loaded = PeftModel.from_pretrained(gpt2(), tmp_path / "flat")
    assert torch.equal(loaded(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_merge_and_unload_gives_the_plain_merged_model():
    """merge_and_unload returns the flattened GPT-2 with the plain merged weights, outputs and keys.

    Each merged layer leaves its LoRA matrices' slots as dead space, said with a warning at the merge
    (names, bytes, the fix); the next flatten() lays the storage out again without it.
    """
    plain = _lora()
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    with pytest.warns(UserWarning, match="leaves 2 slot") as record:
        merged = model.merge_and_unload()
    ref = plain.merge_and_unload()
    dead = [str(w.message) for w in record if "dead space" in str(w.message)]
    assert len(dead) == 2  # one per merged layer
    assert dead[0].startswith(
        "a submodule replaced after registration leaves 2 slot(s) of the flat storage unused: "
        "transformer.h.0.attn.c_attn.lora_A.default.weight (64 elements, group '1'), "
        "transformer.h.0.attn.c_attn.lora_B.default.weight (192 elements, group '1'); 1,024 bytes of dead "
        "space in the flat buffer (storage.summary() marks it). Reclaim it with `storage.unflatten(); "
        "storage.flatten()`"
    )
    assert isinstance(merged, type(ref)) and type(merged).__name__ == type(ref).__name__
    assert get_flat_storage(merged) is storage
    ids = tokens()
    assert torch.equal(merged(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert list(merged.state_dict()) == list(ref.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), ref.state_dict().values()))
    assert merged.device == ref.device and merged.dtype == ref.dtype
    generated = merged.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, ref.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False))
    assert merged.num_parameters() > ref.num_parameters()  # dead space
    with storage.unflattened():  # the merged layers serve from their new paths
        assert [n for n, _ in merged.named_parameters()] == [n for n, _ in ref.named_parameters()]
        assert torch.equal(merged(input_ids=ids).logits, ref(input_ids=ids).logits)
    # The merged-away LoRA matrices were dead space in the flat buffer until unflattened() ended.
    assert merged.num_parameters() == ref.num_parameters()
    assert torch.equal(merged(input_ids=ids).logits, ref(input_ids=ids).logits)
    remove_flat_storage(merged)
    assert merged.num_parameters() == ref.num_parameters()
    assert [n for n, _ in merged.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), ref.state_dict().values()))


def test_registered_before_get_peft_model_trains_and_merges_as_the_plain_model():
    """Storage first, then LoRA: the adapters stay ordinary, merging leaves no dead space and says nothing."""
    config = LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False)
    base = gpt2()
    storage = register_flat_storage(base)
    plain_base = gpt2()
    torch.manual_seed(1)
    model = get_peft_model(base, config)
    torch.manual_seed(1)
    plain = get_peft_model(plain_base, config)
    batches = [tokens() for _ in range(3)]
    train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches, lm_loss)
    train_steps(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), batches, lm_loss)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="a submodule replaced after registration")
        merged = model.merge_and_unload()
    ref = plain.merge_and_unload()
    assert get_flat_storage(merged) is storage and merged.num_parameters() == ref.num_parameters()
    ids = tokens()
    assert torch.equal(merged(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_groups_name_parameters_as_the_wrapper_or_the_wrapped_model_sees_them():
    """Globs match names relative to the wrapper or to the wrapped model; exist_ok and weight decay work."""
    model = _lora()
    storage = register_flat_storage(
        model, {"lora": ["base_model.model.*.lora_*"], "ln": ["transformer.ln_f.*"]}
    )
    assert [info.name for info in storage.param_infos][:1] == [
        "transformer.h.0.attn.c_attn.lora_A.default.weight"
    ]
    assert [info.name for info in storage.param_infos][-1] == "transformer.ln_f.bias"
    same = {"lora": ["*.lora_*"], "ln": ["base_model.model.transformer.ln_f.*"]}
    assert register_flat_storage(model, same, exist_ok=True) is storage

    model = _lora()
    plain = _lora()
    decay = set(Trainer.get_decay_parameter_names(None, plain))  # type: ignore[arg-type]
    groups = weight_decay_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    trained = [
        p for group, params in groups.items() if group.startswith("decay") for p in params if p.requires_grad
    ]
    assert {names[id(p)] for p in trained} == {
        n for n, p in plain.named_parameters() if p.requires_grad and n in decay
    }
    storage = register_flat_storage(model, groups)
    assert register_flat_storage(model, weight_decay_groups(model), exist_ok=True) is storage


def test_an_ordinary_module_around_one_child_keeps_the_flat_parameters():
    """Only wrappers pass registration on: a module with all parameters in one child keeps flat_param_0."""
    for model in (nn.Sequential(nn.Linear(2, 2)), nn.Sequential(mlp())):
        storage = register_flat_storage(model)
        assert storage.module is model and [n for n, _ in model.named_parameters()] == ["flat_param_0"]


def test_a_module_around_a_hugging_face_model_passes_registration_on():
    """A module holding only a PreTrainedModel registers on it, so transformers' own code keeps working."""
    outer = nn.ModuleDict({"lm": gpt2()})
    storage = register_flat_storage(outer)
    assert storage.module is outer["lm"] and outer["lm"].device == torch.device("cpu")
    assert [n for n, _ in outer.named_parameters()] == ["lm.flat_param_0"]


def test_data_parallel_and_compiled_wrappers_pass_registration_on():
    """DataParallel's .module and a compiled model's _orig_mod take the registration."""
    parallel = nn.DataParallel(mlp())
    assert register_flat_storage(parallel).module is parallel.module
    compiled = torch.compile(mlp())
    assert register_flat_storage(compiled).module is compiled._orig_mod  # type: ignore[union-attr]
    assert get_flat_storage(compiled) is get_flat_storage(compiled._orig_mod)  # type: ignore[arg-type]


def test_registering_on_a_flattened_wrapped_model_raises():
    """Without exist_ok, a second registration through the wrapper is refused as on the model."""
    model = _lora()
    register_flat_storage(model.base_model.model)
    with pytest.raises(RuntimeError, match="already has one"):
        register_flat_storage(model)
