"""peft's ``merge_and_unload()`` on a flattened model in both modes, with and without a policy.

peft 0.21's merge puts each wrapped layer back where its adapter was (the base layer moves up
one level in the tree) and drops the LoRA matrices; ``get_peft_model`` froze every base weight,
so after the merge only the frozen group is left, and a user who trains the merged model turns
``requires_grad`` back on. The plain twin is built from the same seeds; under the bf16 policy
its reference is ``_helpers.cast_per_forward`` (float32 weights cast for each forward).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import cast_per_forward

X = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.q(x)))


def _merged(policy: str | None, mode: str) -> tuple[nn.Module, nn.Module, Any]:
    """The plain merged model and the flattened one (merged in ``mode``), with its storage."""
    config = LoraConfig(target_modules=["q"], r=2, init_lora_weights=False)
    plain, model = _Small(), _Small()
    torch.manual_seed(1)
    plain_peft = get_peft_model(plain, config)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, copy.deepcopy(config))
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if policy else None
    storage = register_flat_storage(peft_model, mixed_precision=mixed)
    if mode == "per-tensor":
        storage.unflatten()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="a submodule replaced after registration")
        # Under a policy a merge in flat mode writes through the bf16 views (rounded, as the write rules
        # of docs/mixed-precision.md say): the plain merge runs in float32 inside unflattened().
        with storage.unflattened() if policy and mode == "flat" else contextlib.nullcontext():
            merged = peft_model.merge_and_unload()
    return plain_peft.merge_and_unload(), merged, storage


@pytest.mark.parametrize("policy", [None, "bf16"])
def test_training_every_weight_after_merge_and_unload_in_per_tensor_mode_is_the_plain_training(policy):
    """Merged in per-tensor mode, every weight trained: the plain model's steps, norms and gradients.

    Under the policy the forward failed with "element 0 of tensors does not require grad and does not
    have a grad_fn": the group left after the merge was frozen (peft froze the base weights), so the
    compute views were served without a graph although the leaves now required grad. Now a group
    trains while one of its leaves does, and each leaf's own flag decides whether it gets a gradient.
    """
    plain, merged, storage = _merged(policy, "per-tensor")
    assert get_flat_storage(merged) is storage
    for m in (plain, merged):
        m.requires_grad_(True)
    reference = cast_per_forward(plain) if policy else plain
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (merged, plain)]
    for step in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for forward, opt in zip((merged, reference), opts):
            opt.zero_grad()
            forward(x).float().pow(2).mean().backward()
            opt.step()
    assert list(merged.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), plain.state_dict().values()))
    grads = dict(storage.named_grads())
    assert grads.keys() == dict(plain.named_parameters()).keys()
    assert all(torch.equal(grads[name], p.grad) for name, p in plain.named_parameters())
    norm = torch.nn.utils.clip_grad_norm_(storage.flat_params, 1e9)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("policy", [None, "bf16"])
@pytest.mark.parametrize("mode", ["flat", "per-tensor"])
def test_the_flat_state_dict_of_a_merged_model_loads_into_it(mode, policy):
    """``load_state_dict(storage.flat_state_dict())`` after the merge: every value, as the plain round trip.

    In flat mode it failed with "Missing key(s) in state_dict: "q.weight", "q.bias"": the flat entries
    were unpacked under the names the layer had at registration (``q.base_layer.weight``), not where
    the merge moved it. Now they are unpacked under the names the tree reaches each slot by.
    """
    plain, merged, storage = _merged(policy, mode)
    saved = {k: v.clone() for k, v in storage.flat_state_dict().items()}
    with torch.no_grad():
        for p in merged.parameters():
            p.zero_()
    assert merged.load_state_dict(saved).missing_keys == []
    assert list(merged.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), plain.state_dict().values()))
    reference = cast_per_forward(plain) if policy else plain
    assert torch.equal(merged(X), reference(X))
