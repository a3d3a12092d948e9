"""The frameworks that walk submodules of a flattened model say nothing new (``_guards/submodule_walks.py``).

transformers, Lightning, DDP, FSDP2 and accelerate call ``parameters()`` and co. on the
submodules of the models they get, for their own bookkeeping (Lightning's model summary, FSDP2's
managed parameters, ...). Those calls are theirs, not the user's: the warning for a submodule asked
for parameters that are slices is turned into an error here and must not come. The same user call
afterwards still warns, so the warning was not said (and swallowed) inside the framework.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import mlp
from _hf import gpt2, lm_dataset, tokens, training_args
from _lightning import LitLM, loader, trainer

SAID = r"a submodule's \w+\(\) in flat mode"


@pytest.fixture
def said_is_an_error() -> Iterator[None]:
    """Only the library's warning for a submodule walk becomes an error (others stay warnings)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=SAID)
        yield


def _assert_user_call_still_warns(submodule: nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.warns(UserWarning, match=SAID):
            list(submodule.parameters())


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()
    optimizer.step()


def test_transformers_model_helpers_and_trainer_say_nothing(said_is_an_error: None, tmp_path: Path) -> None:
    """``num_parameters``, the embedding getters, generation and one ``Trainer`` step of a flattened GPT-2."""
    from transformers import Trainer

    model = gpt2()
    register_flat_storage(model)
    total = sum(p.numel() for p in gpt2().parameters())
    assert model.num_parameters() == total
    assert model.num_parameters(only_trainable=True) == total
    assert model.num_parameters(exclude_embeddings=True) <= total
    assert model.get_input_embeddings().weight.shape == (64, 16)
    assert model.get_output_embeddings() is model.lm_head
    model.generate(tokens(1, 4), max_new_tokens=2, do_sample=False)
    Trainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=lm_dataset()).train()
    _assert_user_call_still_warns(model.transformer.wte)


def test_lightning_fit_with_its_model_summary_says_nothing(said_is_an_error: None) -> None:
    """``Trainer(fast_dev_run=1)`` with the model summary on (it counts each layer's parameters)."""
    module = LitLM(flat=True)
    trainer(fast_dev_run=1, enable_model_summary=True).fit(module, loader())
    assert len(module.losses) == 1
    _assert_user_call_still_warns(module.model.transformer.wte)


def test_ddp_says_nothing(said_is_an_error: None, world1: None) -> None:
    """DistributedDataParallel (with and without ``gradient_as_bucket_view``) on one gloo rank, two steps."""
    for as_view in (False, True):
        model = mlp()
        register_flat_storage(model)
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=as_view)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        for _ in range(2):
            _step(ddp, optimizer, torch.randn(4, 5))
        _assert_user_call_still_warns(model[0])


def test_fsdp2_says_nothing(said_is_an_error: None, world1: None) -> None:
    """``fully_shard`` of each layer and the root on one gloo rank, two steps."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    storage = register_flat_storage(model)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        _step(model, optimizer, torch.randn(4, 5))
    assert get_flat_storage(model) is storage
    _assert_user_call_still_warns(model[0])


def test_accelerate_prepare_and_backward_say_nothing(said_is_an_error: None) -> None:
    """``Accelerator().prepare(model, optimizer)``, ``accelerator.backward``, a step and ``unwrap_model``."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = mlp()
    register_flat_storage(model)
    prepared, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(2):
        optimizer.zero_grad()
        accelerator.backward(prepared(torch.randn(4, 5)).pow(2).mean())
        optimizer.step()
    assert accelerator.unwrap_model(prepared) is model
    _assert_user_call_still_warns(model[0])
