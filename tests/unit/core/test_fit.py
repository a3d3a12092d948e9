"""Which tensors can live in a flat buffer (``_core/fit.py``): plain tensors of the group's dtype."""

from __future__ import annotations

import torch
from torch import nn

from flatten_parametrize._core.fit import misfit


class Packed(torch.Tensor):
    """A tensor subclass, as torchao's quantized weights are."""


def test_plain_tensors_and_parameters_of_the_dtype_fit():
    """A tensor or an nn.Parameter of the flat buffer's dtype fits, whatever its shape."""
    flat = torch.zeros(10)
    assert misfit(torch.ones(2, 3), flat) is None and misfit(nn.Parameter(torch.ones(4)), flat) is None


def test_a_subclass_and_another_dtype_do_not_fit_and_say_why():
    """A tensor subclass (also as a parameter) and another dtype are named; anything not a tensor passes."""
    flat = torch.zeros(10)
    packed = torch.ones(3).as_subclass(Packed)
    assert misfit(packed, flat) == "a Packed (a tensor subclass)"
    assert misfit(nn.Parameter(packed), flat) == "a Packed (a tensor subclass)"
    assert misfit(torch.ones(3, dtype=torch.bfloat16), flat) == "a tensor of bfloat16, not float32"
    assert misfit(None, flat) is None
