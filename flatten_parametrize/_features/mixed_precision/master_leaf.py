"""The class of per-tensor mode's leaves while a compute copy is cast from them: ``.data`` reads are seen.

Under a mixed-precision policy, per-tensor mode's leaves are the float32
masters and each forward computes with a low-precision compute copy cast from
them (``compute_views.py``). In-place updates move a leaf's
``_version``, so the copy is cast again after them; a write through ``.data``
(EMA libraries, hand-written steps, init helpers: ``p.data.mul_(0.5)``) moves
no version counter. While per-tensor mode lasts, such a leaf's class is a
subclass of its own (:func:`master_class`, named as it) whose ``data``
property records the read in :data:`DIRTY` before doing what torch's does; the
next forward casts the leaf's group again. A fused optimizer step moves no
version counter either: the mixed-precision step hook records the stepped
leaves in :data:`DIRTY` too (``WATCHED`` says which ids are leaves). Nothing
holds the leaves: a tensor with a weak reference cannot be swapped
(``torch.utils.swap_tensors``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..._core.fit import MADE_OF

__all__ = ["DIRTY", "WATCHED", "base_class", "master_class"]

_DATA: Any = vars(torch._C.TensorBase)["data"]

#: ``id`` of each leaf whose ``.data`` was read, or that a fused step updated, since its group's last cast.
DIRTY: set[int] = set()
#: ``id`` of each leaf whose compute copy is watched -> how many watchers (a deep copy shares none).
WATCHED: dict[int, int] = {}

_MASTER: dict[type, type] = {}
_BASE: dict[type, type] = {}


def _get_data(self: torch.Tensor) -> torch.Tensor:
    DIRTY.add(id(self))
    return _DATA.__get__(self)


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    DIRTY.add(id(self))
    _DATA.__set__(self, value)


def master_class(base: type) -> type:
    """Return the subclass of parameter class ``base`` recording ``.data`` reads (``base`` if it is one)."""
    if base in _BASE:
        return base
    cls = _MASTER.get(base)
    if cls is None:
        cls = type(
            base.__name__,
            (base,),
            {
                "__module__": __name__,
                "__qualname__": base.__qualname__,
                "__doc__": base.__doc__,
                "data": property(_get_data, _set_data, doc=_DATA.__doc__),
            },
        )
        _MASTER[base], _BASE[cls] = cls, base
        MADE_OF[cls] = base  # it lives in a flat buffer as its base does (``_core/fit.py``)
    return cls


def base_class(cls: type) -> type:
    """Return the class :func:`master_class` made ``cls`` from (``cls`` itself if it was not made so)."""
    return _BASE.get(cls, cls)
