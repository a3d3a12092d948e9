"""Per-tensor mode's gradients: a group's leaf parameters keep their gradients in its flat gradient.

In unflattened mode every flattened attribute is a real leaf ``nn.Parameter``
aliasing its slot of the flat buffer, so that per-tensor tools (Adafactor,
Muon, LAMB, per-submodule clipping, comm hooks that compress matrices) see
the plain model. Their gradients live in the group's flat gradient
(``flat_param.grad``), as DDP's ``gradient_as_bucket_view`` keeps each
parameter's gradient in its bucket, so whole-buffer features (grad sync, a
flat clip, ``named_grads()``, ``views_of()``, checkpoints) keep working in this
mode, on the same memory. :class:`LeafGrads` does it for one group, for its
gradient owner (``grad.GroupGrad``):

* once a leaf's ``.grad`` is its slot's view of the flat gradient (after the
  first backward, and after ``zero_grad(set_to_none=False)``), autograd
  accumulates into it in place;
* each leaf has a post-accumulate-grad hook that does one thing: at the first
  gradient of a backward it has the end of that backward call
  :meth:`LeafGrads.end`. There, in one pass over the leaves, a gradient that
  autograd put elsewhere (after ``zero_grad()``, whose default sets it to
  ``None``) is copied into its slot, which becomes the leaf's ``.grad``; the
  slots of leaves without a gradient are zeroed (the flat gradient is then
  the plain model's gradients, zeros where it has none); and the flat
  parameter's own post-accumulate-grad hooks run, as they would in flat mode
  (the storage's grad sync reduces the flat gradient there);
* reading the flat gradient does the same pass (:meth:`LeafGrads.reconcile`):
  it is ``None`` while every leaf's gradient is ``None``; otherwise a gradient
  assigned to a leaf (``p.grad = t``) is copied into its slot first and the
  slots of leaves whose gradient was set to ``None`` read zero. A leaf
  gradient that is a view of another buffer stays where it is and is copied
  at each pass instead: DDP with ``gradient_as_bucket_view=True`` keeps each
  gradient in its own bucket and checks that it is still there; so does a
  gradient with a graph (``backward(create_graph=True)``), for the double
  backward. Assigning the flat gradient makes every leaf's gradient a view of
  it (:meth:`LeafGrads.point_at`; ``None``: every leaf's gradient ``None``).

A parameter that got no gradient keeps ``.grad is None``, and ``zero_grad()``
with either ``set_to_none`` behaves as on the plain model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .engine import graph_task_id, queue_callback, run_post_accumulate_grad_hooks

__all__ = ["BASE_GRAD", "LeafGrads"]

#: torch's own ``Tensor.grad`` descriptor (``FlatParameter.grad`` extends it).
BASE_GRAD: Any = vars(torch._C.TensorBase)["grad"]


class LeafGrads:
    """One group's leaf parameters in per-tensor mode, their hooks, and their slots of the flat gradient.

    Args:
        flat: the group's flat parameter (held weakly).
        leaves: ``(member index, leaf parameter)`` pairs (the leaves held as the slots hold them: a
            weak reference would keep ``torch.utils.swap_tensors`` from swapping them).
        split: the group's split of a flat-shaped tensor into its members' views.
    """

    __slots__ = ("__weakref__", "_flat", "_handles", "_regions", "_split", "indices", "leaves", "task")

    def __init__(
        self, flat: Tensor, leaves: Sequence[tuple[int, Tensor]], split: Callable[[Tensor], list[Tensor]]
    ) -> None:
        self._flat = weakref.ref(flat)
        self.indices = tuple(index for index, _ in leaves)
        self.leaves = tuple(leaf for _, leaf in leaves)
        self._split = split
        #: The flat gradient last split into slots, and its slots in ``leaves`` order (one split per tensor).
        self._regions: tuple[Tensor, list[Tensor]] | None = None
        #: The backward whose end :meth:`end` is queued for (``-1``: none).
        self.task = -1
        self._handles: list[RemovableHandle] = []
        self.reopen()

    def holds(self, flat: Tensor, leaves: Sequence[tuple[int, Tensor]]) -> bool:
        """Return whether this is ``flat``'s per-tensor mode over these very ``leaves``, hooked."""
        return (
            bool(self._handles) == flat.requires_grad
            and self._flat() is flat
            and self.indices == tuple(index for index, _ in leaves)
            and all(mine is leaf for mine, (_, leaf) in zip(self.leaves, leaves))
        )

    def reopen(self) -> None:
        """Hook every leaf (none if the flat parameter does not require grad)."""
        flat = self._flat()
        if self._handles or flat is None or not flat.requires_grad:
            return
        hook = _landing(weakref.ref(self))
        self._handles = [leaf.register_post_accumulate_grad_hook(hook) for leaf in self.leaves]

    def close(self) -> None:
        """Unhook the leaves and forget the backward in flight (per-tensor mode ends)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._regions = None
        self.task = -1

    # -------------------------------------------------------------- backward
    def landed(self) -> None:
        """The first leaf gradient of a backward landed: have its end run :meth:`end` once."""
        self.task = graph_task_id()
        queue_callback(self.end)

    def end(self) -> None:
        """Engine callback: land the leaves' gradients in the flat gradient, then run the flat's hooks."""
        self.task = -1
        flat = self._flat()
        if flat is None or not self._handles:
            return
        self.reconcile(flat)
        run_post_accumulate_grad_hooks(flat)

    # ---------------------------------------------------------- the flat gradient
    def reconcile(self, flat: Tensor) -> Tensor | None:
        """Make ``flat``'s gradient hold its leaves' gradients; return it (``None``: no leaf has one)."""
        grads = [leaf.grad for leaf in self.leaves]
        if all(grad is None for grad in grads):
            return None
        current: Tensor | None = BASE_GRAD.__get__(flat)
        if current is None:
            current = torch.zeros_like(flat, memory_format=torch.contiguous_format)
            BASE_GRAD.__set__(flat, current)
        regions = self._regions_of(current)
        zeros: list[Tensor] = []
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        moved: list[tuple[Tensor, Tensor]] = []
        for leaf, grad, region in zip(self.leaves, grads, regions):
            if grad is region:  # autograd accumulated in place: the common path
                continue
            if grad is None:
                zeros.append(region)
                continue
            if _same_elements(grad, region):  # a view of the slot made elsewhere (the mode switch's)
                moved.append((leaf, region))
                continue
            targets.append(region)
            sources.append(grad)
            if grad._base is None and not grad.requires_grad:
                moved.append((leaf, region))
        with torch.no_grad():
            if zeros:
                torch._foreach_zero_(zeros)
            if targets:
                torch._foreach_copy_(targets, sources)
        for leaf, region in moved:  # later backwards accumulate in the slot
            leaf.grad = region
        return current

    def point_at(self, value: Tensor | None) -> None:
        """Make every leaf's gradient its view of ``value``, the new flat gradient (``None``: ``None``)."""
        self._regions = None
        regions = None if value is None else self._regions_of(value)
        for position, leaf in enumerate(self.leaves):
            leaf.grad = None if regions is None else regions[position]

    def _regions_of(self, grad: Tensor) -> list[Tensor]:
        """Return the leaves' slots of ``grad``, the flat gradient, split once per tensor."""
        cached = self._regions
        if cached is None or cached[0] is not grad:
            views = self._split(grad)
            cached = self._regions = (grad, [views[index] for index in self.indices])
        return cached[1]


def _same_elements(grad: Tensor, region: Tensor) -> bool:
    """Return whether ``grad``, a leaf's gradient, is its slot ``region`` under another tensor object."""
    try:
        return (
            grad.data_ptr() == region.data_ptr()
            and grad.stride() == region.stride()
            and grad.dtype == region.dtype
            and not grad.requires_grad
        )
    except RuntimeError:  # tensors without storage (vmap, functorch wrappers)
        return False


def _landing(ref: weakref.ref[LeafGrads]) -> Callable[[Tensor], None]:
    """Return the hook of a group's leaves: the first gradient of a backward queues :meth:`LeafGrads.end`."""

    def hook(leaf: Tensor) -> None:
        owner = ref()
        if owner is not None and owner.task != graph_task_id():
            owner.landed()

    return hook
