"""Per-tensor mode's switch: each group's leaf parameters keep their gradients in its flat gradient.

In unflattened mode every flattened attribute is a real leaf ``nn.Parameter``
aliasing its slot of the flat buffer (see ``surgery.unflatten_module``). On
the switch, :class:`PerTensorMode` records the leaves as the storage's
(``_core/leaves.py``) and puts each group's gradient owner
(``_core/grad.py``'s ``GroupGrad``) in per-tensor mode, in which the leaves'
gradients live in the flat gradient (``_core/leaf_grads.py`` says how); on
the way back it takes them out of it.
"""

from __future__ import annotations

import weakref

from .._core.leaves import mode_changed, register_leaves
from .._core.records import Coordinator
from .._core.transaction import Transaction

__all__ = ["PerTensorMode"]


class PerTensorMode:
    """Switches a storage's groups into and out of per-tensor mode.

    Args:
        storage: the coordinator (held weakly).
    """

    def __init__(self, storage: Coordinator) -> None:
        self._storage_ref = weakref.ref(storage)

    def attach(self, tx: Transaction) -> None:
        """Unflattened mode begins: each group's leaves keep their gradients in its flat one (undoably)."""
        storage = self._storage_ref()
        if storage is None:
            raise RuntimeError("the flat storage of these gradients was garbage collected")
        register_leaves(storage, [(slot.name, slot.param) for slot in storage.slots()], tx)
        for group in storage.groups():
            group.grads.enter_leaves(group.flat, group.members, tx)

    def detach(self, tx: Transaction) -> None:
        """Flat mode begins (or the storage is removed): the flat gradients are the flat parameters' again."""
        storage = self._storage_ref()
        if storage is not None:
            for group in storage.groups():
                group.grads.exit_leaves(tx)
        mode_changed()
