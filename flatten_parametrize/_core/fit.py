"""Which tensors can live in a flat buffer: a plain tensor of the group's dtype.

A weight replaced by a tensor subclass (a quantized tensor of torchao, say,
whose data is packed integers and scales behind a float32 ``dtype``) or by a
tensor of another dtype has no place in a group's one-dimensional buffer: in
flat mode such a write is refused (``writes.py``); in unflattened mode its
slot is released when the storage flattens again (``_install/rehost.py``).
Another engine's ``DTensor`` (FSDP2's) is that engine's to keep and is left
alone.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .foreign import is_distributed
from .names import dtype_name

__all__ = ["MADE_OF", "misfit"]

#: Classes a feature made of ``Tensor`` or ``nn.Parameter`` whose tensors still live in a flat buffer, and
#: the class each was made of (per-tensor mode's masters under a policy register theirs:
#: ``_features/mixed_precision/master_leaf.py``).
MADE_OF: dict[type, type] = {}


def misfit(value: Any, flat: Tensor) -> str | None:
    """Return why ``value`` cannot live in ``flat``'s buffer (``'a tensor of int8, not float32'``), else None.

    Example:
        >>> import torch
        >>> flat = torch.zeros(4)
        >>> misfit(torch.ones(2), flat) is None, misfit(torch.ones(2, dtype=torch.int8), flat)
        (True, 'a tensor of int8, not float32')
    """
    if not isinstance(value, Tensor) or is_distributed(value):
        return None
    if MADE_OF.get(type(value), type(value)) not in (Tensor, nn.Parameter):
        name = type(value).__name__
        article = "an" if name[:1].lower() in "aeiou" else "a"
        return f"{article} {name} (a tensor subclass)"
    if value.dtype != flat.dtype:
        return f"a tensor of {dtype_name(value.dtype)}, not {dtype_name(flat.dtype)}"
    return None
