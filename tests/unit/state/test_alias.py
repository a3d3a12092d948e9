"""State-dict values alias the flat buffer through storages of their own: savers keep every weight."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file, load_model, save_model

from flatten_parametrize import register_flat_storage
from flatten_parametrize._state.alias import own_storage_alias

from _helpers import assert_same_values
from _hf import gpt2


def _covers_its_storage(tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    return tensor.data_ptr() == storage.data_ptr() and tensor.nbytes == storage.nbytes()


def test_an_alias_is_zero_copy_and_keeps_the_buffer_alive():
    """The alias covers exactly its view, writes land in the buffer, and it outlives every other reference."""
    buffer = torch.arange(10.0)
    alias = own_storage_alias(buffer[2:6].view(2, 2))
    assert _covers_its_storage(alias) and alias.shape == (2, 2) and alias.data_ptr() == buffer[2:].data_ptr()
    alias[0, 0] = 100.0
    assert buffer[2] == 100.0
    del buffer
    gc.collect()
    assert alias.tolist() == [[100.0, 3.0], [4.0, 5.0]]
    meta = torch.empty(4, device="meta")[1:3]
    assert own_storage_alias(meta) is meta


@pytest.mark.parametrize("flat", [True, False], ids=["flat mode", "unflattened mode"])
def test_state_dict_values_cover_their_own_storage_in_both_modes(flat: bool):
    """Every value aliases its slot through its own storage; a tied slot's names get one tensor."""
    model = gpt2()
    storage = register_flat_storage(model)
    if not flat:
        storage.unflatten()
    buffer = storage["0"]
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes
    state = model.state_dict()
    assert all(_covers_its_storage(v) and start <= v.data_ptr() < end for v in state.values())
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    sub = model.transformer.h[0].state_dict()["ln_1.weight"]
    assert sub.data_ptr() == state["transformer.h.0.ln_1.weight"].data_ptr()
    # In unflattened mode a submodule is a plain module (its original class): its own state
    # dict holds its leaf parameters, which share the flat buffer; the registered module's
    # state dict is the one that savers get.
    assert _covers_its_storage(sub) is flat


def test_torch_save_of_the_state_dict_keeps_the_tie(tmp_path: Path):
    """torch.save / torch.load of the state dict: one tensor for both tied names, as for the plain model."""
    model = gpt2()
    register_flat_storage(model)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "sd.pt")
    assert loaded["lm_head.weight"].data_ptr() == loaded["transformer.wte.weight"].data_ptr()
    assert_same_values(loaded, model)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_safetensors_save_model_and_load_model_keep_every_weight(tmp_path: Path, tie: bool):
    """save_model writes the plain model's tensors; load_model restores them, also across forms."""
    plain = gpt2(tie=tie)
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    save_model(plain, str(tmp_path / "plain.safetensors"))
    save_model(model, str(tmp_path / "flat.safetensors"))
    written, expected = load_file(tmp_path / "flat.safetensors"), load_file(tmp_path / "plain.safetensors")
    assert len(written) == len(expected) == (28 if tie else 29)
    assert_same_values(written, expected)
    for source in ("plain", "flat"):
        for flat in (False, True):
            target = gpt2(seed=3, tie=tie)
            if flat:
                register_flat_storage(target)
            assert load_model(target, str(tmp_path / f"{source}.safetensors")) == (set(), [])
            assert_same_values(target, plain, msg=f"{source} flat={flat}")


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_accelerate_save_state_and_save_model_keep_every_weight(tmp_path: Path, tie: bool):
    """save_state (safetensors) and save_model write the plain tensors; load_state restores them."""
    accelerator = Accelerator(cpu=True)
    plain = gpt2(tie=tie)
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    for name, m in (("plain", plain), ("flat", model)):
        accelerator._models.clear()
        prepared = accelerator.prepare(m)
        accelerator.save_state(tmp_path / name / "state")
        accelerator.save_model(prepared, tmp_path / name / "model")
    for what in ("state/model.safetensors", "model/model.safetensors"):
        written, expected = load_file(tmp_path / "flat" / what), load_file(tmp_path / "plain" / what)
        assert len(written) == len(expected) == (28 if tie else 29), what
        assert_same_values(written, expected, msg=what)
    for source in ("plain", "flat"):
        for flat in (False, True):
            target = gpt2(seed=3, tie=tie)
            if flat:
                register_flat_storage(target)
            accelerator._models.clear()
            accelerator.prepare(target)
            accelerator.load_state(tmp_path / source / "state")
            assert_same_values(target, plain, msg=f"{source} flat={flat}")
