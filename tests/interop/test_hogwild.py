"""Hogwild training: processes that step one model in shared memory (``model.share_memory()``).

torch's multiprocessing recipe: the model's tensors move to shared memory, worker processes train it,
and the parent sees their steps. With ``share_memory()`` called before ``register_flat_storage``, the
flat buffer was allocated in private memory: the workers' steps never reached the parent (it kept its
initial weights, 0.10 away from the plain twin after three SGD steps), with no word. Each case here
trains the flattened model and its plain twin from the same seed in a forked worker (one worker at a
time, so that the result is deterministic) and compares what the parent holds afterwards.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import assert_same_values, train_steps

FORK = mp.get_context("fork")


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _train(model: nn.Module, seed: int) -> None:
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + i)) for i in range(3)]
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), batches)


def _trained_in_a_worker(model: nn.Module) -> None:
    worker = FORK.Process(target=_train, args=(model, 1))
    worker.start()
    worker.join(timeout=120)
    assert worker.exitcode == 0


@pytest.mark.parametrize("mode", ["flat", "per-tensor"])
@pytest.mark.parametrize("order", ["share_memory first", "register first"])
def test_a_worker_processs_steps_reach_the_parent_as_on_the_plain_model(order: str, mode: str) -> None:
    plain, model = _net(), _net()
    plain.share_memory()
    if order == "share_memory first":
        model.share_memory()
    storage = register_flat_storage(model)
    if order == "register first":
        model.share_memory()
    if mode == "per-tensor":
        storage.unflatten()
    assert all(flat.is_shared() for flat in storage.flat_params)
    for m in (plain, model):
        _trained_in_a_worker(m)
    assert not torch.equal(plain[0].weight, _net()[0].weight)  # the plain twin's worker did train it
    assert_same_values(model, plain)


def test_a_group_mixing_shared_and_private_tensors_is_shared_with_a_warning() -> None:
    model = _net()
    model[0].share_memory()
    mixed = r"group '0' mixes tensors in shared memory .*\(2\.weight, 2\.bias\)"
    with pytest.warns(UserWarning, match=mixed):
        storage = register_flat_storage(model)
    assert storage.flat_params[0].is_shared()


def test_a_model_in_private_memory_keeps_a_private_flat_buffer() -> None:
    storage = register_flat_storage(_net())
    assert not storage.flat_params[0].is_shared()
