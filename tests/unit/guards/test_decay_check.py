"""_guards/decay_check: which param groups get the weight-decay warning, and what it keeps per optimizer."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from flatten_parametrize import FlatParameter
from flatten_parametrize._guards import decay_check


def flat(*shapes: tuple[int, ...], requires_grad: bool = True) -> FlatParameter:
    numels = [torch.Size(s).numel() for s in shapes]
    names = [f"t{i}" for i in range(len(shapes))]
    return FlatParameter(torch.zeros(sum(numels)), requires_grad, names=names, shapes=shapes, numels=numels)


def check(*groups: tuple[float | torch.Tensor, list[torch.Tensor]]) -> str | None:
    return decay_check._mismatch([{"params": p, "weight_decay": wd} for wd, p in groups], FlatParameter)


def test_matrices_without_decay_while_no_flat_parameter_decays_is_the_dim_rule():
    """Flat parameters holding matrices, all in groups without decay, beside a group with decay."""
    message = check((0.1, []), (0.0, [flat((4, 3), (4,))]))
    assert message is not None and message.startswith("weight decay: a rule by p.dim()")
    assert "'t0' (4, 3)" in message and "param groups [0] decay (weight_decay=0.1)" in message


def test_matrices_and_vectors_with_decay_while_no_flat_parameter_goes_without_is_the_name_rule():
    """Flat parameters mixing matrices and 1-D tensors, all in groups with decay, beside a group without."""
    message = check((torch.tensor(0.1), [flat((4, 3)), flat((4,))]), (0.0, [nn.Parameter(torch.zeros(2))]))
    assert message is not None and message.startswith("weight decay: a rule by parameter name")
    assert "('t0' (4, 3))" in message and "('t0' (4,))" in message


@pytest.mark.parametrize(
    "groups",
    [
        [(0.1, [flat((4, 3))]), (0.0, [flat((4,))])],  # the recipe: one flat parameter on each side
        [(0.1, []), (0.0, [flat((4,), (3,))])],  # no matrix to decay
        [(0.1, [flat((4, 3))]), (0.0, [])],  # only matrices decay
        [(0.1, []), (0.0, [flat((4, 3), requires_grad=False)])],  # frozen: never stepped
        [(0.1, [flat((4, 3), (4,))])],  # uniform
        [(0.0, [flat((4, 3), (4,))])],  # no decay at all
    ],
    ids=["recipe", "no-matrix", "only-matrices", "frozen", "uniform", "none"],
)
def test_groups_that_decay_like_the_plain_model_pass(groups: list[tuple[float, list[torch.Tensor]]]):
    """Nothing to warn about where a rule cannot have split a flat parameter's tensors wrongly."""
    assert check(*groups) is None


def test_an_optimizer_leaves_the_check_with_its_collection():
    """The per-optimizer entry goes with the optimizer, so a later one with the same id is checked afresh."""
    param = flat((2, 2))
    param.grad = torch.zeros(4)
    optimizer = torch.optim.SGD([param], lr=0.1)
    optimizer.step()
    key = id(optimizer)
    assert decay_check._checked[key][0] == 1
    del optimizer
    gc.collect()
    assert key not in decay_check._checked


def test_decay_asked_of_the_optimizer_and_given_to_no_group_is_the_dim_rule():
    """timm 1.0.31 drops the empty decay group: one group without decay while `defaults` asks for some."""
    groups = [{"params": [flat((4, 3), (4,))], "weight_decay": 0.0}]
    message = decay_check._mismatch(groups, FlatParameter, {"weight_decay": 0.05})
    assert message is not None and message.startswith("weight decay: a rule by p.dim()")
    assert "asked for weight_decay=0.05 but no param group decays" in message
    assert decay_check._mismatch(groups, FlatParameter, {}) is None


def test_only_a_weight_decay_other_than_the_class_default_counts_as_asked():
    """AdamW's own default (0.01) says nothing about a split; a value passed to it does."""
    param = flat((4, 3))
    assert decay_check._asked(torch.optim.AdamW([param], weight_decay=0.01)) == {}
    assert decay_check._asked(torch.optim.AdamW([param], weight_decay=0.05)) == {"weight_decay": 0.05}
    assert decay_check._asked(torch.optim.SGD([param])) == {}
