"""Hugging Face transformers (a small GPT-2 built from a config, no download) and safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2LMHeadModel

from flatten_parametrize import register_flat_storage

from _helpers import assert_same_values, mlp, train_steps, twin
from _hf import gpt2 as _gpt2
from _hf import lm_loss
from _hf import tokens as _tokens


def test_gpt2_flattens_with_its_tie_kept():
    """The tied embedding and LM head are one slot: a name and an alias, one memory, tied after training."""
    model = _gpt2()
    storage = register_flat_storage(model)
    first = storage.param_infos[0]
    assert (first.name, first.aliases) == ("transformer.wte.weight", ("lm_head.weight",))
    assert [n for n, _ in model.named_parameters()] == ["flat_param_0"]
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = _tokens()
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    assert type(model).__name__ == "GPT2LMHeadModel" and isinstance(model, GPT2LMHeadModel)


def test_gpt2_trains_like_the_plain_model():
    """AdamW on the flattened GPT-2 gives the plain model's losses and weights."""
    plain = _gpt2()
    model = twin(plain)
    register_flat_storage(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    batches = [_tokens() for _ in range(3)]
    losses = train_steps(model, opt, batches, lm_loss)
    assert losses == pytest.approx(train_steps(plain, ref, batches, lm_loss), rel=1e-6)
    assert_same_values(model, plain, rtol=1e-5, atol=1e-6)


def test_generate_matches_the_plain_model():
    """Greedy generate() on the flattened GPT-2 gives the plain model's tokens."""
    plain = _gpt2().eval()
    model = twin(plain)
    register_flat_storage(model)
    prompt = _tokens(2, 4)
    kwargs = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 6, "do_sample": False}
    out = model.generate(prompt, **kwargs)
    assert out.shape == (2, 10)
    assert torch.equal(out, plain.generate(prompt, **kwargs))


def test_save_pretrained_and_from_pretrained_round_trip(tmp_path: Path):
    """save_pretrained of the flattened model loads with from_pretrained: same weights, tie, class name."""
    model = _gpt2()
    storage = register_flat_storage(model)
    with torch.no_grad():
        storage["0"].add_(0.01)  # values that a fresh model does not have
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert_same_values(loaded, model)
    ids = _tokens()
    model.eval()
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    register_flat_storage(loaded)  # and the loaded model flattens again
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_safetensors_save_file_accepts_the_flattened_state_dict(tmp_path: Path):
    """save_file(model.state_dict()) works for a flattened model without ties; a plain model loads it."""
    model = mlp()
    register_flat_storage(model, align=4)
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    plain = mlp(seed=1)
    plain.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert_same_values(plain, model)
    untied = _gpt2(tie=False)
    register_flat_storage(untied)
    save_file(untied.state_dict(), tmp_path / "gpt2.safetensors")
    assert list(load_file(tmp_path / "gpt2.safetensors")) == sorted(untied.state_dict())


def test_safetensors_refuses_tied_weights_as_for_the_plain_model(tmp_path: Path):
    """save_file refuses a flattened tied model's state dict with the same error as the plain tied model's."""
    plain = _gpt2()
    model = twin(plain)
    register_flat_storage(model)
    errors = []
    for m in (plain, model):
        with pytest.raises(RuntimeError, match="Some tensors share memory") as info:
            save_file(m.state_dict(), tmp_path / "tied.safetensors")
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "lm_head.weight" in errors[0]


def test_tied_model_saves_with_the_flat_state_dict(tmp_path: Path):
    """The documented one-liner save_file(storage.flat_state_dict(), path) saves a tied model, loads back."""
    model = _gpt2()
    storage = register_flat_storage(model)
    with torch.no_grad():
        storage["0"].mul_(0.5)
    save_file(storage.flat_state_dict(), tmp_path / "flat.safetensors")
    fresh = _gpt2(seed=1)
    register_flat_storage(fresh)
    fresh.load_state_dict(load_file(tmp_path / "flat.safetensors"))
    assert torch.equal(fresh.flat_param_0, model.flat_param_0)
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()


def test_tied_model_saves_plain_keys_without_aliases(tmp_path: Path):
    """Dropping the aliases (ParamInfo.aliases) saves plain keys; loading refills the tie on both sides."""
    model = _gpt2()
    storage = register_flat_storage(model)
    aliases = {alias for info in storage.param_infos for alias in info.aliases}
    save_file(
        {k: v for k, v in model.state_dict().items() if k not in aliases}, tmp_path / "plain.safetensors"
    )
    flattened = _gpt2(seed=2)
    register_flat_storage(flattened)
    for target in (_gpt2(seed=1), flattened):
        result = target.load_state_dict(load_file(tmp_path / "plain.safetensors"), strict=False)
        assert result.missing_keys == ["lm_head.weight"] and result.unexpected_keys == []
        assert torch.equal(target.lm_head.weight, model.lm_head.weight)
