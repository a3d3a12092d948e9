"""Meta-device initialization: flatten a model built on ``meta``, materialize into the flat buffers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flatten_parametrize import FlatParameter, get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import assert_same_values, train_steps, values


class _Net(nn.Module):
    """Layers whose reset_parameters() draw from the RNG (Linear, Embedding) or set constants (LayerNorm)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width)
        self.fc2 = nn.Linear(2 * width, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(self.embed(tokens))))).mean(1)


def _reset(model: nn.Module) -> None:
    """Initialize every submodule in construction order, as the constructor on a real device would."""
    for module in model.modules():
        if module is not model and hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _materialize(model: nn.Module, seed: int = 0) -> None:
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    _reset(model)


def _on_meta(**kwargs: Any) -> _Net:
    with torch.device("meta"):
        return _Net(**kwargs)


def _on_cpu(seed: int = 0, **kwargs: Any) -> _Net:
    torch.manual_seed(seed)
    return _Net(**kwargs)


class _Allocations(TorchDispatchMode):
    """Counts the bytes of every new CPU storage that an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type == "cpu"
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs:  # not a view or an in-place result
                    self.bytes += storage.nbytes()
        return out


def test_meta_model_flattens_without_memory():
    """A model built on meta flattens into meta flat parameters: nothing is allocated."""
    model = _on_meta()
    storage = register_flat_storage(model)
    assert [f.device.type for f in storage.flat_params] == ["meta"]
    assert model.fc1.weight.is_meta and model.fc1.weight.shape == (16, 8)


def test_to_empty_and_reset_parameters_initialize_the_flat_buffer():
    """to_empty() then reset_parameters() gives the values of the model built on CPU with the same seed."""
    model = _on_meta()
    storage = register_flat_storage(model)
    _materialize(model, seed=0)
    reference = _on_cpu(seed=0)
    flat = storage["0"]
    assert type(flat) is FlatParameter and flat.device.type == "cpu" and get_flat_storage(model) is storage
    assert torch.isfinite(flat).all()
    assert_same_values(model, reference)
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    assert all(start <= view.data_ptr() < end for _, view in storage.named_views())


def test_materializing_allocates_one_copy_of_the_weights():
    """to_empty() + reset_parameters() on the flattened meta model allocate the flat buffers, nothing more.

    Registering after materializing a plain model costs a second copy; this path does not.
    """
    weights = sum(p.numel() * p.element_size() for p in _on_cpu(width=64).parameters())
    model = _on_meta(width=64)
    register_flat_storage(model)
    with _Allocations() as counter:
        _materialize(model)
    assert weights <= counter.bytes <= weights + 4096

    plain = _on_meta(width=64)
    with _Allocations() as counter:
        _materialize(plain)
        register_flat_storage(plain)
    assert counter.bytes >= 2 * weights


def test_materialized_model_trains_like_the_plain_model():
    """After materializing, a few optimizer steps match the plain model built on CPU."""
    model = _on_meta()
    register_flat_storage(model)
    _materialize(model, seed=3)
    plain = _on_cpu(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    batches = [torch.randint(0, 13, (4, 5)) for _ in range(3)]
    assert train_steps(model, opt, batches) == train_steps(plain, ref, batches)
    assert_same_values(model, plain, close=True)


def test_padding_is_zero_after_to_empty():
    """to_empty() leaves no uninitialized memory in the padding: padding is always zero."""
    model = _on_meta()
    storage = register_flat_storage(model, align=16)
    torch.full((4096,), float("nan")).sum()  # leave NaNs in freed memory for to_empty to pick up
    _materialize(model)
    padding = torch.ones(storage["0"].numel(), dtype=torch.bool)
    for info in storage.param_infos:
        padding[info.offset : info.offset + info.numel] = False
    assert padding.any()
    assert torch.equal(storage["0"].detach()[padding], torch.zeros(int(padding.sum())))


def test_materialized_model_unflattens_and_removes_on_cpu():
    """Unflattened mode and remove_flat_storage give CPU parameters holding the initialized values."""
    model = _on_meta()
    storage = register_flat_storage(model)
    _materialize(model)
    expected = values(model)
    with storage.unflattened():
        assert all(p.device.type == "cpu" and p.is_leaf for p in model.parameters())
        assert model.fc1.weight.data_ptr() == storage["0"].data_ptr() + 8 * 13 * 4  # after embed.weight
    remove_flat_storage(model)
    assert type(model.fc1) is nn.Linear and isinstance(model.fc1.weight, nn.Parameter)
    assert all(value.device.type == "cpu" for value in model.state_dict().values())
    assert_same_values(model, expected)
