"""Per-tensor mode's switch: leaves keep their gradients in the flat ones, features told, writes watched.

In unflattened mode every flattened attribute is a real leaf ``nn.Parameter``
aliasing its slot of the flat buffer (see ``surgery.unflatten_module``). On
the switch, :class:`PerTensorMode` records the leaves as the storage's
(``_core/leaves.py``), puts each group's gradient owner (``_core/grad/``'s
``GroupGrad``) in per-tensor mode, in which the leaves' gradients live in the
flat gradient (``_core/grad/leaf_slots.py`` says how), starts watching the modules
for outside writes (``leaf_writes.LeafWatch``) and tells the features that have
a per-tensor part (mixed precision's compute copies). On the way back it
undoes all of it.

The registered module gets a forward hook (:func:`_arm_backward`): it hooks the
forward's output, so that a backward through it lands the leaves' gradients in
the flat gradients at its end, with one Python call per backward instead of a
hook per leaf (``LeafGrads.arm``). ``torch.jit.script`` leaves it out.

While a feature works on the flat buffers during training (``forward_sync()``:
gradient sync, a ``ShardedOptimizer``, compute copies), the registered module
also gets a forward pre-hook and an always-called forward hook: the pre-hook
lands outside writes first (``leaf_writes.settle``), then each feature's
``before_forward()`` runs; the hook runs their ``after_forward()``. Without
such a feature the forward is the plain module's, so that
``torch.jit.script`` compiles it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .._core.compiling import compiling_or_tracing, never_compiled
from .._core.grad.engine import graph_task_id, hook_gradient
from .._core.leaves import mode_changed, register_leaves
from .._core.names import registered_storage
from .._core.records import Coordinator
from .._core.transaction import Transaction
from .leaf_writes import LeafWatch, settle
from .module_classes import unscripted

__all__ = ["PerTensorMode"]

_functorch_level = torch._C._functorch.maybe_current_level


class PerTensorMode:
    """Switches a storage's groups into and out of per-tensor mode.

    Args:
        storage: the coordinator (held weakly).
    """

    def __init__(self, storage: Coordinator) -> None:
        self._storage_ref = weakref.ref(storage)
        #: The hook that :func:`_arm_backward` puts on each forward's output.
        self.arm = _Arm(self._storage_ref)
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
            _unhook(storage.module_unchecked, tx, (_before_forward, _after_forward, _arm_backward))
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
        if not any(hook is _arm_backward for hook in root._forward_hooks.values()):
            tx.keep_dict(root._forward_hooks)
            root.register_forward_hook(_arm_backward)
        needed = any(feature.forward_sync() for feature in storage.features)
        hooked = any(hook is _before_forward for hook in root._forward_pre_hooks.values())
        if needed and not hooked:
            for hooks in (root._forward_pre_hooks, root._forward_hooks, root._forward_hooks_always_called):
                tx.keep_dict(hooks)
            root.register_forward_pre_hook(_before_forward, prepend=True)
            root.register_forward_hook(_after_forward, always_call=True)
        elif hooked and not needed:
            _unhook(root, tx, (_before_forward, _after_forward))


def _unhook(root: nn.Module, tx: Transaction, ours: tuple[Any, ...]) -> None:
    for hooks in (root._forward_pre_hooks, root._forward_hooks, root._forward_hooks_always_called):
        tx.keep_dict(hooks)
    for hooks in (root._forward_pre_hooks, root._forward_hooks):
        for key, hook in list(hooks.items()):
            if any(hook is mine for mine in ours):
                del hooks[key]
                root._forward_hooks_always_called.pop(key, None)


class _Arm:
    """The hook on a forward's output: the backward that reaches it lands the leaves' gradients at its end."""

    __slots__ = ("_storage_ref",)

    def __init__(self, storage_ref: weakref.ref[Coordinator]) -> None:
        self._storage_ref = storage_ref  # weak: the graph may outlive the model

    def __call__(self, grad: Tensor) -> None:
        storage = self._storage_ref()
        if storage is None:
            return
        task = graph_task_id()
        for group in storage.groups():
            leaves = group.grads.leaves
            if leaves is not None:
                # Where a compute copy stands in for the leaves, its node lands their gradients itself.
                leaves.arm(task, point=group.views.source is None)


def _tensors(output: Any, depth: int = 3) -> Iterator[Tensor]:
    """Yield the tensors of a forward's output: itself, or in (nested) tuples, lists and dicts."""
    if isinstance(output, Tensor):
        yield output
    elif depth and isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item, depth - 1)
    elif depth and isinstance(output, dict):  # transformers' ModelOutput is one
        for item in output.values():
            yield from _tensors(item, depth - 1)


@unscripted
@never_compiled
def _arm_backward(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of the registered module in per-tensor mode: hook each output backward may start from.

    A backward that reaches one of them lands the leaves' gradients in the flat gradients at its
    end (``LeafGrads.arm``). Under ``torch.compile``, tracing and ``torch.func``'s transforms (whose
    gradients are returned, not accumulated) nothing is hooked; ``torch.compile(model)`` runs this
    hook eagerly, on the compiled forward's output.
    """
    core = registered_storage(module)
    if (
        core is None
        or core.is_flattened
        or not torch.is_grad_enabled()
        or compiling_or_tracing()
        or _functorch_level() is not None
    ):
        return
    arm = core.per_tensor.arm
    for tensor in (output,) if type(output) is Tensor else _tensors(output):
        node = tensor.grad_fn
        if node is not None:
            hook_gradient(tensor, node, arm, arm)


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
