"""The pure layout: offsets, alignment, padding, split segments."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatten_parametrize._core.layout import plan_group, shape_numel

shapes = st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple), max_size=12)


@given(shapes, st.integers(1, 16))
def test_offsets_are_aligned_disjoint_and_in_bounds(shape_list, align):
    """Every slot starts at a multiple of align, slots do not overlap, all fit in the buffer."""
    layout = plan_group(shape_list, align)
    assert layout.numel % align == 0
    end = 0
    for offset, numel in zip(layout.offsets, layout.numels):
        assert offset % align == 0
        assert offset >= end
        end = offset + numel
    assert end <= layout.numel
    assert layout.numel - end < align
    assert layout.padding == layout.numel - sum(layout.numels)


@given(shapes, st.integers(1, 16))
def test_split_segments_cover_the_buffer_and_locate_every_slot(shape_list, align):
    """The segments tile [0, numel) exactly and each slot's segment starts at its offset."""
    layout = plan_group(shape_list, align)
    assert sum(layout.split_sizes) == layout.numel
    starts = [sum(layout.split_sizes[:i]) for i in range(len(layout.split_sizes))]
    for segment, offset, numel in zip(layout.segments, layout.offsets, layout.numels):
        assert starts[segment] == offset
        assert layout.split_sizes[segment] == numel


@given(shapes)
def test_align_one_packs_back_to_back(shape_list):
    """With align=1 there is no padding: the buffer is exactly the sum of numels."""
    layout = plan_group(shape_list, 1)
    assert layout.numel == sum(shape_numel(s) for s in shape_list)
    assert layout.padding == 0


@pytest.mark.parametrize("align", [0, -1, 1.5, True])
def test_plan_group_rejects_bad_align(align):
    """align must be an integer >= 1."""
    with pytest.raises(ValueError, match="align must be an integer >= 1"):
        plan_group([(2,)], align)


def test_plan_group_rejects_negative_dimension():
    """A negative dimension is refused."""
    with pytest.raises(ValueError, match="negative dimension"):
        plan_group([(2, -1)])
