"""Pure layout arithmetic: where each tensor lives inside its group's flat buffer.

Nothing here knows about ``nn.Module``; it turns a list of shapes and an
alignment into offsets, padding and the segment sizes of the one ``split`` that
serves every view of a group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GroupLayout", "plan_group", "shape_numel"]


def shape_numel(shape: Sequence[int]) -> int:
    """Return the number of elements of a tensor of ``shape``."""
    return math.prod(int(s) for s in shape)


@dataclass(frozen=True)
class GroupLayout:
    """Offsets of one group's tensors inside its flat buffer.

    Attributes:
        shapes: shape of each slot, in slot order.
        numels: element count of each slot.
        offsets: element offset of each slot in the flat buffer.
        numel: size of the flat buffer, padding included.
        align: every offset is a multiple of this.
        split_sizes: sizes of consecutive segments that cover ``[0, numel)``
            exactly: slots and the padding between them, in buffer order.
        segments: index into ``split_sizes`` of each slot's segment.
    """

    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    align: int
    split_sizes: tuple[int, ...]
    segments: tuple[int, ...]

    @property
    def padding(self) -> int:
        """Return the number of padding elements in the buffer."""
        return self.numel - sum(self.numels)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_group(shapes: Sequence[Sequence[int]], align: int = 1) -> GroupLayout:
    """Lay out tensors of ``shapes`` back to back, each starting at a multiple of ``align``.

    The buffer's total size is rounded up to a multiple of ``align`` too, so
    that buffers can be concatenated or bucketed without breaking alignment.

    Args:
        shapes: the shape of each tensor, in the order they are stored.
        align: element alignment of every offset (``>= 1``).

    Returns:
        The group's :class:`GroupLayout`.

    Raises:
        ValueError: if ``align`` is smaller than 1 or a dimension is negative.

    Example:
        >>> layout = plan_group([(2, 3), (5,)], align=4)
        >>> layout.offsets, layout.numel, layout.split_sizes
        ((0, 8), 16, (6, 2, 5, 3))
    """
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align must be an integer >= 1; got {align!r}")
    norm_shapes = tuple(tuple(int(s) for s in shape) for shape in shapes)
    for shape in norm_shapes:
        if any(s < 0 for s in shape):
            raise ValueError(f"a shape has a negative dimension: {shape}")
    numels = tuple(shape_numel(shape) for shape in norm_shapes)
    offsets: list[int] = []
    split_sizes: list[int] = []
    segments: list[int] = []
    cursor = 0
    for numel in numels:
        start = _round_up(cursor, align)
        if start > cursor:
            split_sizes.append(start - cursor)
        offsets.append(start)
        segments.append(len(split_sizes))
        split_sizes.append(numel)
        cursor = start + numel
    total = _round_up(cursor, align)
    if total > cursor:
        split_sizes.append(total - cursor)
    return GroupLayout(
        shapes=norm_shapes,
        numels=numels,
        offsets=tuple(offsets),
        numel=total,
        align=align,
        split_sizes=tuple(split_sizes),
        segments=tuple(segments),
    )
