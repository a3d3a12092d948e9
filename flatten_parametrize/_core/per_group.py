"""Arguments that give one tensor per group: a list in group order, a dict by group name, or one tensor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

__all__ = ["per_group"]


def per_group(tensors: Any, groups: Sequence[str], what: str, noun: str, hint: str) -> list[Tensor]:
    """Return one tensor per group, in group order, after checking the container and the types.

    Args:
        tensors: a tensor (one group only), a sequence in group order or a mapping by group name.
        groups: the group names.
        what: the call, for messages (e.g. ``"using()"``).
        noun: what one entry is called (e.g. ``"tensor"``, ``"stack"``).
        hint: the shape expected of an entry, for the type error.

    Raises:
        TypeError: for a wrong container, a single tensor for several groups, or a non-tensor entry.
        ValueError: for a wrong count or wrong group names.
    """
    if isinstance(tensors, Tensor):
        if len(groups) != 1:
            raise TypeError(
                f"{what} got a single {noun} but this storage has {len(groups)} groups "
                f"{list(groups)}; pass a list in group order or a dict by group name"
            )
        items = [tensors]
    elif isinstance(tensors, Mapping):
        missing = [g for g in groups if g not in tensors]
        unknown = [k for k in tensors if k not in groups]
        if missing or unknown:
            raise ValueError(
                f"{what} needs one {noun} per group {list(groups)}; got keys {list(tensors)} "
                f"(missing {missing}, unknown {unknown})"
            )
        items = [tensors[g] for g in groups]
    elif isinstance(tensors, Sequence) and not isinstance(tensors, (str, bytes)):
        items = list(tensors)
        if len(items) != len(groups):
            raise ValueError(
                f"{what} needs one {noun} per group ({len(groups)}: {list(groups)}); got {len(items)}"
            )
    else:
        raise TypeError(
            f"{what} takes a list of {noun}s in group order or a dict by group name (one {hint} "
            f"per group); got {type(tensors).__name__}"
        )
    for group, item in zip(groups, items):
        if not isinstance(item, Tensor):
            raise TypeError(
                f"{what}: the entry for group '{group}' must be a Tensor; got {type(item).__name__}"
            )
    return items
