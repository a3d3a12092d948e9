"""Per-tensor mode: the leaf parameters of unflattened mode keep their gradients in the group's flat gradient.

In unflattened mode every flattened attribute is a real leaf ``nn.Parameter``
aliasing its slot of the flat buffer, so that per-tensor tools (Adafactor,
Muon, LAMB, per-submodule clipping, comm hooks that compress matrices) see
the plain model. Their gradients live in the group's flat gradient
(``flat_param.grad``), as DDP's ``gradient_as_bucket_view`` keeps each
parameter's gradient in its bucket, so whole-buffer features (grad sync, a
flat clip, ``named_grads()``, ``views_of()``, checkpoints) keep working in this
mode, on the same memory:

* a post-accumulate-grad hook on each leaf moves a gradient that autograd put
  elsewhere (after ``zero_grad()``, whose default sets it to ``None``) into the
  leaf's slot, once per tensor per backward, and makes the leaf's ``.grad``
  that slot's view; later backwards accumulate into it in place;
* when the backward ends, the slots of leaves without a gradient are zeroed
  (the flat gradient is then the plain model's gradients, zeros where it has
  none) and the flat parameter's own post-accumulate-grad hooks run, as they
  would in flat mode (the storage's grad sync reduces the flat gradient there);
* ``flat_param.grad`` (read through :class:`PerTensorGrads`, the group's
  gradient owner in this mode) is ``None`` while every leaf's gradient is
  ``None``; otherwise a gradient assigned to a leaf (``p.grad = t``) is copied
  into its slot first and the slots of leaves whose gradient was set to
  ``None`` read zero. A leaf gradient that is a view of another buffer stays
  where it is and is copied at each read instead: DDP with
  ``gradient_as_bucket_view=True`` keeps each gradient in its own bucket and
  checks that it is still there. Assigning ``flat_param.grad`` makes every leaf's
  gradient a view of the new tensor (``None``: every leaf's gradient ``None``).

A parameter that got no gradient keeps ``.grad is None``, and ``zero_grad()``
with either ``set_to_none`` behaves as on the plain model.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .._core.grad import BASE_GRAD
from .._core.leaves import mode_changed, register_leaves
from .._core.records import Coordinator, Group
from .._core.transaction import Transaction
from .._core.view_cache import same_memory

__all__ = ["PerTensorGrads"]

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_graph_task_id = torch._C._current_graph_task_id


class PerTensorGrads:
    """The gradient owner of a storage's groups in unflattened mode, and the hooks on its leaves.

    Args:
        storage: the coordinator (held weakly).
    """

    def __init__(self, storage: Coordinator) -> None:
        self._storage_ref = weakref.ref(storage)
        #: The hook on each leaf, by leaf ``id`` (the leaf held as the slots hold it: no weak reference,
        #: which would keep ``torch.utils.swap_tensors`` from swapping it).
        self._hooks: dict[int, tuple[Tensor, RemovableHandle]] = {}
        #: Groups whose leaves got a gradient in the backward in flight, and that backward's task.
        self._touched: set[int] = set()
        self._task = -1
        #: The storage's groups, looked up at the first leaf hook of each backward.
        self._groups: tuple[Group, ...] = ()
        #: Per group index: the flat gradient last split into slots, and its slots (one split per buffer).
        self._regions: dict[int, tuple[Tensor, list[Tensor]]] = {}
        #: ``(group index, slot index) -> slot``, made at :meth:`attach` (a hook finds its slot at once).
        self._slot_at: dict[tuple[int, int], Any] = {}

    # ------------------------------------------------------------ mode toggles
    def attach(self, tx: Transaction) -> None:
        """Unflattened mode begins: own each group's flat gradient, hook every leaf (undone with ``tx``)."""
        storage = self._storage()
        register_leaves(storage, [(slot.name, slot.param) for slot in storage.slots()], tx)
        self._slot_at = {(slot.group_index, slot.index): slot for slot in storage.slots()}
        for group in storage.groups():
            if group.grad_buffer.keeper is not self:
                tx.set_attr(group.grad_buffer, "keeper", self)
            if not group.flat.requires_grad:
                continue
            for slot in group.members:
                leaf = slot.param
                hooked = self._hooks.get(id(leaf))
                if hooked is not None and hooked[0] is leaf:
                    continue
                hook = _leaf_hook(weakref.ref(self), group.index, slot.index)
                handle = leaf.register_post_accumulate_grad_hook(hook)
                self._hooks[id(leaf)] = (leaf, handle)
                tx.on_undo(self._unhook_one(id(leaf)))

    def detach(self, tx: Transaction) -> None:
        """Flat mode begins (or the storage is removed): give the flat gradients back, unhook the leaves."""
        storage = self._storage_ref()
        if storage is not None:
            for group in storage.groups():
                if group.grad_buffer.keeper is self:
                    tx.set_attr(group.grad_buffer, "keeper", None)
        for key in list(self._hooks):
            leaf, handle = self._hooks.pop(key)
            handle.remove()
            tx.on_undo(self._rehook(leaf, key))
        self._touched.clear()
        self._task, self._groups = -1, ()
        self._regions.clear()
        mode_changed()

    def _unhook_one(self, key: int) -> Any:
        def undo() -> None:
            hooked = self._hooks.pop(key, None)
            if hooked is not None:
                hooked[1].remove()

        return undo

    def _rehook(self, leaf: Tensor, key: int) -> Any:
        def undo() -> None:
            storage = self._storage_ref()
            if storage is None:
                return
            for slot in storage.slots():
                if slot.param is leaf:
                    handle = leaf.register_post_accumulate_grad_hook(
                        _leaf_hook(weakref.ref(self), slot.group_index, slot.index)
                    )
                    self._hooks[key] = (leaf, handle)
                    return

        return undo

    # ---------------------------------------------------------- the owner API
    def flat_grad(self, flat: Tensor) -> Tensor | None:
        """Return the flat gradient of ``flat``'s group as the leaves have it (``FlatParameter.grad``)."""
        group = self._group_of(flat)
        return BASE_GRAD.__get__(flat) if group is None else self.reconcile(group)

    def set_flat_grad(self, flat: Tensor, value: Tensor | None) -> None:
        """Assign ``flat``'s gradient; every leaf's gradient becomes a view of it (``None``: ``None``)."""
        BASE_GRAD.__set__(flat, value)
        group = self._group_of(flat)
        if group is None:
            return
        regions = None if value is None else group.split(value)
        for slot in group.members:
            slot.param.grad = None if regions is None else regions[slot.index]

    def reconcile(self, group: Group) -> Tensor | None:
        """Make ``group``'s flat gradient hold its leaves' gradients; return it (``None``: none has one)."""
        grads = [slot.param.grad for slot in group.members]
        if all(grad is None for grad in grads):
            return None
        current = _flat_grad_of(group)
        regions = self._slots_of(group.index, group, current)
        with torch.no_grad():
            for slot, grad in zip(group.members, grads):
                if grad is None:
                    regions[slot.index].zero_()
                else:
                    _into_slot(slot.param, grad, regions[slot.index])
        return current

    # -------------------------------------------------------------- backward
    def landed(self, g: int, index: int, leaf: Tensor) -> None:
        """Hook body: ``leaf`` (slot ``index`` of group ``g``) has its gradient for this backward."""
        grad = leaf.grad
        if grad is None:
            return
        task = _graph_task_id()
        if task != self._task:  # the first hook of this backward: look the storage up once
            storage = self._storage_ref()
            if storage is None or storage.is_flattened:
                return
            self._task = task
            self._touched = set()
            self._groups = storage.groups()
            _queue_callback(self._backward_end)
        slot = self._slot_at.get((g, index))
        if slot is None or slot.param is not leaf:
            return
        group = self._groups[g]
        _into_slot(leaf, grad, self._slots_of(g, group, _flat_grad_of(group))[index])
        self._touched.add(g)

    def _backward_end(self) -> None:
        """Engine callback: zero the slots of leaves without a gradient, run the flat parameters' hooks."""
        touched, self._touched, self._task, self._groups = self._touched, set(), -1, ()
        storage = self._storage_ref()
        if storage is None or storage.is_flattened:
            return
        groups = storage.groups()
        for g in sorted(touched):
            group = groups[g]
            self.reconcile(group)
            hooks = getattr(group.flat, "_post_accumulate_grad_hooks", None)
            for hook in tuple(hooks.values()) if hooks else ():
                hook(group.flat)

    # ------------------------------------------------------------- internals
    def _storage(self) -> Coordinator:
        storage = self._storage_ref()
        if storage is None:
            raise RuntimeError("the flat storage of these gradients was garbage collected")
        return storage

    def _slots_of(self, g: int, group: Group, grad: Tensor) -> list[Tensor]:
        """Return the slots of ``grad``, ``group``'s flat gradient, split once per tensor."""
        cached = self._regions.get(g)
        if cached is None or cached[0] is not grad:
            cached = self._regions[g] = (grad, group.split(grad))
        return cached[1]

    def _group_of(self, flat: Tensor) -> Group | None:
        storage = self._storage_ref()
        if storage is None or storage.is_flattened:
            return None
        for group in storage.groups():
            if group.flat is flat:
                return group
        return None


def _flat_grad_of(group: Group) -> Tensor:
    """Return ``group``'s flat gradient, zeros assigned to it first if it has none."""
    current: Tensor | None = BASE_GRAD.__get__(group.flat)
    if current is None:
        current = torch.zeros_like(group.flat, memory_format=torch.contiguous_format)
        BASE_GRAD.__set__(group.flat, current)
    return current


def _into_slot(leaf: Tensor, grad: Tensor, region: Tensor) -> None:
    """Copy ``leaf``'s gradient ``grad`` into its slot ``region`` of the flat gradient, if it is not there.

    The slot becomes the leaf's gradient, except for a view of another buffer (DDP's bucket keeps it
    and checks that it is still there) and a gradient with a graph (``backward(create_graph=True)``:
    the leaf keeps it, for the double backward).
    """
    if grad is region or same_memory(grad, region):
        return
    if grad.requires_grad:
        with torch.no_grad():
            region.copy_(grad)
        return
    region.copy_(grad)
    if grad._base is None:
        leaf.grad = region


def _leaf_hook(ref: weakref.ref[PerTensorGrads], g: int, index: int) -> Any:
    def hook(leaf: Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner.landed(g, index, leaf)

    return hook
