"""Which storage each original parameter object (a leaf of unflattened mode) belongs to, and mode changes.

An optimizer built over the leaf parameters (inside ``unflattened()``, or over
``model.parameters()`` taken before registering) and stepped while the storage
is in flat mode would step nothing: the leaves get no gradient there. The
optimizer step check (``_guards/step_checks.py``) looks its parameters up here by
``id``; an entry counts only while its storage is alive and still holds that
very object in a slot (an ``id`` is reused once its object is gone). The
registry holds no reference to the leaves, not even a weak one: a tensor with
a weak reference cannot be swapped (``torch.utils.swap_tensors``, which
``module.to_empty()`` of a meta-initialized model uses). :data:`EPOCH` moves at
every registration, removal and mode change, so that a check done once is done
again only after one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .transaction import Transaction

__all__ = ["EPOCH", "mode_changed", "register_leaves", "slot_of_leaf", "storage_of_leaf"]

#: Moves at every registration, removal and mode change of any storage (``EPOCH[0]``).
EPOCH = [0]

#: ``id(leaf) -> (storage, qualified name)``, the storage held weakly.
_OWNERS: dict[int, tuple[weakref.ref[Any], str]] = {}
#: ``id(storage) -> ids of its leaves`` (forgotten with the storage).
_BY_STORAGE: dict[int, set[int]] = {}


def mode_changed() -> None:
    """Record that a storage was registered, removed, flattened or unflattened."""
    EPOCH[0] += 1


def register_leaves(storage: Any, leaves: Iterable[tuple[str, Tensor]], tx: Transaction) -> None:
    """Record ``(qualified name, leaf)`` pairs as leaves of ``storage`` (held weakly), undone with ``tx``."""
    key = id(storage)
    if key not in _BY_STORAGE:
        _BY_STORAGE[key] = set()
        weakref.finalize(storage, _forget, key)
        tx.on_undo(lambda: _forget(key))
    ref = weakref.ref(storage)
    mine = _BY_STORAGE[key]
    for name, leaf in leaves:
        leaf_id = id(leaf)
        before = _OWNERS.get(leaf_id)
        _OWNERS[leaf_id] = (ref, name)
        mine.add(leaf_id)
        tx.on_undo(_restore(leaf_id, before))
    mode_changed()


def _restore(leaf_id: int, before: tuple[weakref.ref[Any], str] | None) -> Any:
    def undo() -> None:
        if before is None:
            _OWNERS.pop(leaf_id, None)
        else:
            _OWNERS[leaf_id] = before

    return undo


def _forget(key: int) -> None:
    for leaf_id in _BY_STORAGE.pop(key, ()):
        found = _OWNERS.get(leaf_id)
        if found is not None and found[0]() is None:
            del _OWNERS[leaf_id]


def storage_of_leaf(param: Any) -> tuple[Any, str] | None:
    """Return ``(storage, qualified name)`` if ``param`` is a leaf of a live storage, else ``None``."""
    owner = slot_of_leaf(param)
    if owner is None:
        return None
    return owner[0], _OWNERS[id(param)][1]


def slot_of_leaf(param: Any) -> tuple[Any, Any] | None:
    """Return ``(storage, its records.Slot)`` if ``param`` is a leaf of a live storage, else ``None``."""
    found = _OWNERS.get(id(param))
    storage = None if found is None else found[0]()
    if storage is None:
        return None
    for slot in storage.slots():
        if slot.param is param:
            return storage, slot
    return None
