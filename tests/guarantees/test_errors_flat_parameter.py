"""FlatParameter refuses data, names and layouts that do not describe its buffer.

Each test pins the exception type and the part of the message that names the offending size, shape,
count or name together with the rule it breaks.
"""

from __future__ import annotations

import pytest
import torch

from flatten_parametrize import FlatParameter

# ----------------------------------------------------------------- construction


def test_flat_parameter_refuses_a_layout_that_does_not_fit():
    """FlatParameter's layout must fit its buffer: ValueError giving both sizes."""
    with pytest.raises(ValueError, match=r"FlatParameter layout needs 7 elements but the buffer holds 5"):
        FlatParameter(torch.zeros(5), names=["w", "b"], shapes=[(2, 2), (3,)], numels=[4, 3])
    with pytest.raises(ValueError, match=r"FlatParameter layout needs 9 elements but the buffer holds 8"):
        FlatParameter(torch.zeros(8), names=["w"], shapes=[(3,)], numels=[3], offsets=[6])


def test_flat_parameter_refuses_layout_lists_of_different_lengths():
    """FlatParameter needs one name, shape, numel and offset per tensor: ValueError giving the counts."""
    with pytest.raises(
        ValueError, match=r"one name, shape, numel and offset per tensor; got 2 names, 1 shapes, 1 numels"
    ):
        FlatParameter(torch.zeros(5), names=["w", "b"], shapes=[(2, 2)], numels=[4])


def test_flat_parameter_refuses_data_that_is_not_one_dimensional():
    """FlatParameter data is one-dimensional: ValueError giving the shape."""
    with pytest.raises(ValueError, match=r"FlatParameter data must be one-dimensional; got shape \(2, 2\)"):
        FlatParameter(torch.zeros(2, 2), names=["w"], shapes=[(2, 2)], numels=[4])


def test_flat_parameter_refuses_numels_that_disagree_with_shapes():
    """A layout whose numel is not the product of its shape does not describe its tensors: ValueError."""
    with pytest.raises(ValueError, match=r"(?s)(?=.*\bw\b)(?=.*numel)"):
        FlatParameter(torch.zeros(5), names=["w"], shapes=[(2, 2)], numels=[3])


def test_flat_parameter_refuses_non_tensor_data_and_non_str_names():
    """FlatParameter checks its data and names."""
    with pytest.raises(TypeError, match="data must be a Tensor; got list"):
        FlatParameter([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"names must be str; got \[0\]"):
        FlatParameter(torch.zeros(1), names=[0], shapes=[(1,)], numels=[1])  # type: ignore[list-item]
