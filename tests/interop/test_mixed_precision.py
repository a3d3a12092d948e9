"""Mixed precision: torch.autocast (CPU, bfloat16) and bfloat16 models."""

from __future__ import annotations

import torch
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import TiedLM, assert_same_values, grads, train_steps, twin


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def _autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _float_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The mean square of the output in float32."""
    return model(batch).float().pow(2).mean()


def _autocast_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The forward under bfloat16 autocast, the loss (:func:`_float_loss`) in float32."""
    with _autocast():
        return _float_loss(model, batch)


def test_autocast_forward_and_backward_match_the_plain_model():
    """Under CPU bfloat16 autocast, outputs (bfloat16) and float32 gradients equal the plain model's."""
    plain = _net()
    model = twin(plain)
    storage = register_flat_storage(model)
    x = torch.randn(5, 8)
    with _autocast():
        out, expected = model(x), plain(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().pow(2).sum().backward()
    expected.float().pow(2).sum().backward()
    flat = storage["0"]
    assert flat.dtype == torch.float32 and flat.grad is not None and flat.grad.dtype == torch.float32
    assert_same_values(grads(model), grads(plain), close=True)


def test_autocast_training_matches_the_plain_model():
    """A few AdamW steps under autocast end at the plain model's float32 weights."""
    plain = TiedLM()
    model = twin(plain)
    register_flat_storage(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    batches = [torch.randint(0, 11, (3, 4)) for _ in range(3)]
    train_steps(model, opt, batches, _autocast_loss)
    train_steps(plain, ref, batches, _autocast_loss)
    assert all(value.dtype == torch.float32 for value in model.state_dict().values())
    assert_same_values(model, plain, close=True)


def test_bfloat16_model_flattens_into_a_bfloat16_buffer():
    """A bfloat16 model gets one bfloat16 flat parameter; forward, backward and SGD match the plain model."""
    plain = _net().to(torch.bfloat16)
    model = twin(plain)
    storage = register_flat_storage(model)
    assert [f.dtype for f in storage.flat_params] == [torch.bfloat16]
    assert model[0].weight.dtype == torch.bfloat16
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    batches = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(3)]
    train_steps(model, opt, batches, _float_loss)
    train_steps(plain, ref, batches, _float_loss)
    assert storage["0"].grad.dtype == torch.bfloat16
    assert all(value.dtype == torch.bfloat16 for value in model.state_dict().values())
    assert_same_values(model, plain, close=True)


def test_converting_the_flattened_model_to_bfloat16_converts_the_buffer():
    """model.to(torch.bfloat16) after registering turns the flat buffer into bfloat16, values rounded."""
    model = _net()
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    storage = register_flat_storage(model)
    model.to(torch.bfloat16)
    assert [f.dtype for f in storage.flat_params] == [torch.bfloat16]
    assert_same_values(model, expected)
    assert model(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_mixed_dtypes_get_one_flat_buffer_each():
    """A model mixing bfloat16 layers and a float32 LayerNorm gets a bfloat16 and a float32 group."""
    model = _net()
    model[0].to(torch.bfloat16)
    model[3].to(torch.bfloat16)
    storage = register_flat_storage(model)
    assert [f.dtype for f in storage.flat_params] == [torch.bfloat16, torch.float32]
    assert [i.name for i in storage.param_infos if i.group == "1"] == ["1.weight", "1.bias"]
    with _autocast():
        out = model(torch.randn(3, 8))
    out.float().sum().backward()
    assert storage["0"].grad.dtype == torch.bfloat16 and storage["1"].grad.dtype == torch.float32
