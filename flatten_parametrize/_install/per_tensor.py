"""Per-tensor mode's switch: leaves keep their gradients in the flat ones, features told, writes watched.

In unflattened mode every flattened attribute is a real leaf ``nn.Parameter``
aliasing its slot of the flat buffer (see ``surgery.unflatten_module``). On
the switch, :class:`PerTensorMode` records the leaves as the storage's
(``_core/leaves.py``), puts each group's gradient owner (``_core/grad.py``'s
``GroupGrad``) in per-tensor mode, in which the leaves' gradients live in the
flat gradient (``_core/leaf_grads.py`` says how), starts watching the modules
for outside writes (``leaf_writes.LeafWatch``) and tells the features that have
a per-tensor part (mixed precision's compute copies). On the way back it
undoes all of it.

While a feature works on the flat buffers during training (``forward_sync()``:
gradient sync, a ``ShardedOptimizer``, compute copies), the registered module
gets a forward pre-hook and an always-called forward hook: the pre-hook lands
outside writes first (``leaf_writes.settle``), then each feature's
``before_forward()`` runs; the hook runs their ``after_forward()``. Without
such a feature the forward is the plain module's, hooks and all, so that
``torch.jit.script`` compiles it.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from .._core.compiling import compiling_or_tracing, never_compiled
from .._core.leaves import mode_changed, register_leaves
from .._core.names import registered_storage
from .._core.records import Coordinator
from .._core.transaction import Transaction
from .leaf_writes import LeafWatch, settle

__all__ = ["PerTensorMode"]


class PerTensorMode:
    """Switches a storage's groups into and out of per-tensor mode.

    Args:
        storage: the coordinator (held weakly).
    """

    def __init__(self, storage: Coordinator) -> None:
        self._storage_ref = weakref.ref(storage)
        #: What the modules held when per-tensor mode began (``None`` in flat mode).
        self.watch: LeafWatch | None = None
        #: Set while :func:`leaf_writes.settle` lays the groups out again.
        self.settling = False

    def attach(self, tx: Transaction) -> None:
        """Unflattened mode begins: each group's leaves keep their gradients in its flat one (undoably)."""
        storage = self._storage_ref()
        if storage is None:
            raise RuntimeError("the flat storage of these gradients was garbage collected")
        register_leaves(storage, [(slot.name, slot.param) for slot in storage.slots()], tx)
        for group in storage.groups():
            group.grads.enter_leaves(group.flat, group.members, tx)
        tx.set_attr(self, "watch", LeafWatch(storage))
        for feature in list(storage.features):
            feature.per_tensor_began(tx)
        self.update_hooks(tx)

    def detach(self, tx: Transaction) -> None:
        """Flat mode begins (or the storage is removed): the flat gradients are the flat parameters' again."""
        storage = self._storage_ref()
        if storage is not None:
            for feature in list(storage.features):
                feature.per_tensor_ended(tx)
            for group in storage.groups():
                group.grads.exit_leaves(tx)
            _unhook(storage.module_unchecked, tx)
        tx.set_attr(self, "watch", None)
        mode_changed()

    def rebacked(self) -> None:
        """The flat buffers were re-backed and the leaves pointed at them again: watch their new memory."""
        storage = self._storage_ref()
        if storage is not None and self.watch is not None:
            self.watch = LeafWatch(storage)

    def update_hooks(self, tx: Transaction | None = None) -> None:
        """Hook the registered module's forward while a feature needs it in per-tensor mode (see above)."""
        storage = self._storage_ref()
        if storage is None or self.watch is None:
            return
        root = storage.module_or_none()
        if root is None:  # the model is gone (an optimizer outliving it leaves): nothing to hook
            return
        tx = tx if tx is not None else Transaction()
        needed = any(feature.forward_sync() for feature in storage.features)
        hooked = any(hook is _before_forward for hook in root._forward_pre_hooks.values())
        if needed and not hooked:
            for hooks in (root._forward_pre_hooks, root._forward_hooks, root._forward_hooks_always_called):
                tx.keep_dict(hooks)
            root.register_forward_pre_hook(_before_forward, prepend=True)
            root.register_forward_hook(_after_forward, always_call=True)
        elif hooked and not needed:
            _unhook(root, tx)


def _unhook(root: nn.Module, tx: Transaction) -> None:
    for hooks in (root._forward_pre_hooks, root._forward_hooks, root._forward_hooks_always_called):
        tx.keep_dict(hooks)
    for hooks in (root._forward_pre_hooks, root._forward_hooks):
        for key, hook in list(hooks.items()):
            if hook is _before_forward or hook is _after_forward:
                del hooks[key]
                root._forward_hooks_always_called.pop(key, None)


@never_compiled
def _before_forward(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of the registered module in per-tensor mode: outside writes land, then features."""
    core = registered_storage(module)
    if core is None or core.is_flattened:
        return
    if not compiling_or_tracing():  # a compiled forward: the eager call of the registered module settled
        core = settle(core)
    for feature in list(core.features):
        feature.before_forward()


@never_compiled
def _after_forward(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of the registered module in per-tensor mode (called also when the forward raised)."""
    core = registered_storage(module)
    if core is None:
        return
    for feature in list(core.features):
        feature.after_forward()
