"""Per-tensor mode's gradients: a group's leaf parameters keep their gradients in its flat gradient.

In unflattened mode every flattened attribute is a real leaf ``nn.Parameter``
aliasing its slot of the flat buffer, so that per-tensor tools (Adafactor,
Muon, LAMB, per-submodule clipping, comm hooks that compress matrices) see
the plain model. Their gradients live in the group's flat gradient
(``flat_param.grad``), as DDP's ``gradient_as_bucket_view`` keeps each
parameter's gradient in its bucket, so whole-buffer features (grad sync, a
flat clip, ``named_grads()``, ``views_of()``, checkpoints) keep working in this
mode, on the same memory. :class:`LeafGrads` does it for one group, for its
gradient owner (``owner.GroupGrad``):

* once a leaf's ``.grad`` is its slot's view of the flat gradient (after the
  first backward, and after ``zero_grad(set_to_none=False)``), autograd
  accumulates into it in place;
* the registered module's forward hooks its output (``_install/per_tensor.py``): a
  backward that reaches it calls :meth:`LeafGrads.arm` (one Python call per backward,
  none per leaf), which gives each leaf whose ``.grad`` is ``None`` (after
  ``zero_grad()``, whose default sets it so) its zeroed slot of the flat gradient
  as ``.grad`` (:meth:`LeafGrads._point`): autograd then adds the gradient into the
  slot in place, as for a later micro-batch. At the end of that backward
  (:meth:`LeafGrads.end`) a leaf that got no gradient has ``None`` again, as on the
  plain model (also after a backward that raised); a gradient that was elsewhere
  when the backward began (one that autograd put in memory of its own in an earlier
  backward, a view of another buffer) is copied into its slot, the slots of leaves
  without a gradient are zeroed (the flat gradient is then the plain model's
  gradients, zeros where it has none), and the flat parameter's own
  post-accumulate-grad hooks run, as they would in flat mode. A backward in which
  every gradient already is its slot has nothing to do at its end. A backward that
  does not pass through that output (a submodule called on its own, a loss that
  skips the module's output, a compiled function that calls the module) leaves
  each gradient where autograd put it, with the plain model's values: the next read
  of the flat gradient, or the next backward that does pass, lands it; so does a
  gradient that code moves elsewhere during a backward (a hook's ``p.grad = None``,
  DDP's bucket views);
* while the flat parameter has post-accumulate-grad hooks (grad sync and
  ``ShardedOptimizer`` reduce the flat gradient there), each leaf has one too
  (:meth:`LeafGrads.watch_flat`): every backward then runs that end, and the first
  gradient counts the leaves this backward will accumulate, so that the last of them
  runs it at once, during backward, and the group's reduction overlaps the rest of
  backward as a flat parameter's does (a leaf whose gradient never comes, e.g. a node
  that returned none, leaves it to the backward's end); no leaf is pointed at its slot
  then, so that its ``.grad`` is ``None`` until its gradient came, for those hooks. A
  flat gradient made at the end, as after ZeRO-2 released the last one, starts empty
  and each of its elements is written once: copied, or zeroed with the padding
  between slots. Under a mixed-precision policy the backward lands each gradient in
  its slot itself (:meth:`LeafGrads.receive`); when nothing waits for the flat
  gradient during it, that backward skips the end (reading the flat gradient does
  the pass below);
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

import operator
import weakref
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .engine import (
    graph_task_id,
    has_post_accumulate_grad_hooks,
    process_group_exists,
    queue_callback,
    run_post_accumulate_grad_hooks,
    will_execute,
)

__all__ = ["BASE_GRAD", "LeafGrads"]

#: torch's own ``Tensor.grad`` descriptor (``FlatParameter.grad`` extends it).
BASE_GRAD: Any = vars(torch._C.TensorBase)["grad"]
_grad_of = operator.attrgetter("grad")
_version_of = operator.attrgetter("_version")


class LeafGrads:
    """One group's leaf parameters in per-tensor mode, their hooks, and their slots of the flat gradient.

    Args:
        flat: the group's flat parameter (held weakly).
        leaves: ``(member index, leaf parameter)`` pairs (the leaves held as the slots hold them: a
            weak reference would keep ``torch.utils.swap_tensors`` from swapping them).
        split: the group's split of a flat-shaped tensor into its members' views.
    """

    __slots__ = (
        "__weakref__",
        "_accumulators",
        "_claims",
        "_ended",
        "_flat",
        "_gap_ranges",
        "_handles",
        "_left",
        "_lent",
        "_lent_hooks",
        "_open",
        "_pointed",
        "_positions",
        "_quiet_task",
        "_regions",
        "_split",
        "indices",
        "leaves",
        "task",
    )

    def __init__(
        self, flat: Tensor, leaves: Sequence[tuple[int, Tensor]], split: Callable[[Tensor], list[Tensor]]
    ) -> None:
        self._flat = weakref.ref(flat)
        self.indices = tuple(index for index, _ in leaves)
        self.leaves = tuple(leaf for _, leaf in leaves)
        self._split = split
        #: The flat gradient last split into slots, and its slots in ``leaves`` order (one split per tensor).
        self._regions: tuple[Tensor, list[Tensor]] | None = None
        #: ``(start, length)`` of each part of the flat gradient outside the leaves' slots (computed once).
        self._gap_ranges: list[tuple[int, int]] | None = None
        #: The backward whose end :meth:`end` is queued for (``-1``: none).
        self.task = -1
        #: The leaves of that backward still to accumulate before :meth:`end` may run early (0: do not
        #: count), and whether it already ran for that backward.
        self._left = 0
        self._ended = False
        #: Whether backwards land the leaves' gradients (per-tensor mode, the flat parameter requires grad).
        self._open = False
        #: The leaves' hooks, while the flat parameter has hooks of its own (:meth:`watch_flat`).
        self._handles: list[RemovableHandle] = []
        #: The leaves :meth:`arm` pointed at their zeroed slots, those slots, and the slots' versions then.
        #: Also whether a leaf's gradient was elsewhere than its slot then (the end lands it).
        self._pointed: tuple[Sequence[Tensor], Sequence[Tensor], list[int], bool] | None = None
        #: The backward whose :meth:`receive` found nothing waiting for the flat gradient (``-1``: none).
        self._quiet_task = -1
        #: Member index -> position in ``leaves``.
        self._positions = {index: position for position, index in enumerate(self.indices)}
        #: Each leaf's gradient accumulator (made at its first :meth:`receive`).
        self._accumulators: dict[int, Any] = {}
        #: Backward (graph task) -> the positions whose slot holds a gradient that backward has not
        #: accumulated yet (:meth:`receive`), held by that backward only: gone when it ends or raises.
        self._claims: dict[int, weakref.ref[_Claims]] = {}
        #: A lent gradient (``grad.Lent``) and the placeholder shown as each leaf's ``.grad``; ``None``
        #: while none is lent.
        self._lent: tuple[Any, list[Tensor]] | None = None
        #: The hooks that take the placeholders out when the group's next gradient arrives (removed
        #: outside backward: a hook may not remove the hooks being called).
        self._lent_hooks: list[RemovableHandle] = []
        self.reopen()

    def holds(self, flat: Tensor, leaves: Sequence[tuple[int, Tensor]]) -> bool:
        """Return whether this is ``flat``'s per-tensor mode over these very ``leaves``, open."""
        return (
            self._open == flat.requires_grad
            and self._flat() is flat
            and self.indices == tuple(index for index, _ in leaves)
            and all(mine is leaf for mine, (_, leaf) in zip(self.leaves, leaves))
        )

    def reopen(self) -> None:
        """Land the leaves' gradients from now on (not if the flat parameter does not require grad)."""
        flat = self._flat()
        if self._open or flat is None or not flat.requires_grad:
            return
        self._open = True
        self.watch_flat()

    def watch_flat(self) -> None:
        """Hook every leaf if the flat parameter has post-accumulate-grad hooks (and the leaves are not yet).

        Its hooks then run as soon as the group's last leaf of a backward landed (see the module's
        docstring). ``FlatParameter.register_post_accumulate_grad_hook`` calls it.
        """
        flat = self._flat()
        if not self._open or self._handles or flat is None or not has_post_accumulate_grad_hooks(flat):
            return
        hook = _landing(weakref.ref(self))
        self._handles = [leaf.register_post_accumulate_grad_hook(hook) for leaf in self.leaves]

    def close(self) -> None:
        """Unhook the leaves and forget the backward in flight (per-tensor mode ends)."""
        self.withdraw(report=True)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._open = False
        self._pointed = None
        self._quiet_task = -1
        self._regions = None
        self._claims.clear()
        self.task = -1
        self._left = 0
        self._ended = False

    # -------------------------------------------------------------- backward
    def arm(self, task: int, point: bool) -> None:
        """Backward ``task`` reached the output of a forward of the registered module: :meth:`end` at its end.

        With ``point`` (the leaves are the forward's weights: no compute copy stands in for them),
        each leaf without a gradient gets its zeroed slot as ``.grad`` first, so that autograd adds
        its gradient into the slot in place: no memory of its own to copy from and free at the end
        (see :meth:`_point`); and where every leaf's gradient then is its slot the end has nothing to
        land. Not while the leaves are hooked (:meth:`watch_flat`): there a leaf's ``.grad`` is
        ``None`` until its gradient came, as on the plain model, for the flat parameter's hooks that
        run during backward; nor under ``create_graph``, where each gradient has a graph of its own.
        """
        if self.task == task or not self._open:
            return
        self.watch_flat()  # hooks added to the flat parameter behind its method's back
        if point and not self._handles and not torch.is_grad_enabled():
            self.task = task
            if self._point():
                self._ended, self._left = False, 0
                queue_callback(_End(self))
        else:
            self._begin(task)

    def landed(self, task: int) -> None:
        """A leaf gradient of backward ``task`` landed: run :meth:`end` after the last, or when it ends."""
        if self.task != task:
            self._begin(task)
        if self._left:
            self._left -= 1
            if not self._left:
                self._ended = True
                self.end()

    def _begin(self, task: int) -> None:
        """Backward ``task`` lands the leaves' gradients: count the hooked leaves, queue the end."""
        self.task = task
        self._ended = False
        self._left = self._expected()
        queue_callback(_End(self))

    def _expected(self) -> int:
        """Return how many leaves this backward accumulates (0 if nothing waits for the flat gradient)."""
        flat = self._flat()
        if not self._handles or flat is None or not has_post_accumulate_grad_hooks(flat):
            return 0
        try:
            return sum(map(self._accumulates, range(len(self.leaves))))
        except RuntimeError:  # not a backward that accumulates: leave it to the end
            return 0

    def _point(self) -> bool:
        """Give each leaf without a gradient its zeroed slot as ``.grad``; return whether the end has work.

        Autograd then adds the leaf's gradient into its slot (``grad += new``, as for a gradient kept
        from an earlier micro-batch) instead of handing the leaf memory of its own, which the end of
        backward would copy into the slot and free: after ``zero_grad()`` that copy, and glibc
        returning the freed memory to the system and faulting it in again at the next backward,
        were most of per-tensor mode's cost over the plain model. A leaf that gets no gradient (not
        in this backward, or a node returned none for it) is given ``None`` back at the end
        (:meth:`_unpoint`), as on the plain model: the slots carry version counters of their own
        (:meth:`_regions_of`), which only an accumulation moves during backward. Where every leaf's
        gradient was ``None`` or its slot, the end does only that (and nothing where none was
        ``None``: the gradients accumulate in their slots); a gradient that code puts elsewhere during
        backward (a hook's ``p.grad = None``, DDP's bucket views) lands at the next read of the flat
        gradient, as after a backward that skips the module's output. Every step is one loop of
        torch's or Python's in C over the leaves: no Python per leaf.
        """
        flat = self._flat()
        if flat is None:
            return True
        leaves = self.leaves
        current, fresh = _flat_grad(flat, contiguous=True, empty=False)  # fresh: zeros
        regions = self._regions_of(current)
        if not fresh and all(map(operator.is_, map(_grad_of, leaves), regions)):
            return False  # micro-batches: every gradient accumulates in its slot
        grads = list(map(_grad_of, leaves))
        positions = list(compress(range(len(leaves)), map(operator.is_, grads, repeat(None))))
        elsewhere = len(positions) + sum(map(operator.is_, grads, regions)) != len(leaves)
        if not positions:
            return elsewhere
        every = len(positions) == len(leaves)
        pointed = leaves if every else [leaves[position] for position in positions]
        targets = regions if every else [regions[position] for position in positions]
        if not fresh:  # grad mode is off (see arm)
            if every:
                current.zero_()
            else:
                torch._foreach_zero_(targets)
        try:
            any(map(setattr, pointed, repeat("grad"), targets))
        except RuntimeError:  # a leaf of another shape (`.data = t`): autograd gives it memory of its own,
            kept = [(leaf, target) for leaf, target in zip(pointed, targets) if leaf.shape == target.shape]
            pointed, targets = [leaf for leaf, _ in kept], [target for _, target in kept]
            any(map(setattr, pointed, repeat("grad"), targets))
            elsewhere = True  # and the storage's next sync point lays the groups out again
        self._pointed = (pointed, targets, list(map(_version_of, targets)), elsewhere)
        return True

    def _unpoint(self) -> bool:
        """Give ``None`` back to each leaf :meth:`_point` pointed at its slot that got no gradient since.

        Returns:
            Whether the leaves' gradients need landing still (:meth:`reconcile`): a leaf's gradient
            was elsewhere than its slot when the backward began, or nothing was pointed.
        """
        pointed, self._pointed = self._pointed, None
        if pointed is None:
            return True
        leaves, targets, versions, elsewhere = pointed
        if any(map(operator.eq, map(_version_of, targets), versions)):  # some got no gradient
            for leaf, target, version in zip(leaves, targets, versions):
                if target._version == version and _grad_of(leaf) is target:
                    leaf.grad = None
        return elsewhere

    def _backward_end(self) -> None:
        """Engine callback: run :meth:`end` unless the last leaf already did, or the backward was quiet."""
        ended, quiet = self._ended, self._quiet_task == self.task
        self._ended, self._left, self.task = False, 0, -1
        if not ended and not quiet:
            self.end()

    def end(self) -> None:
        """Land the leaves' gradients in the flat gradient, then run the flat's hooks."""
        flat = self._flat()
        if flat is None or not self._open:
            return
        if self._unpoint() or has_post_accumulate_grad_hooks(flat):
            self.reconcile(flat)
            run_post_accumulate_grad_hooks(flat)

    # ---------------------------------------------------------- the flat gradient
    def reconcile(self, flat: Tensor) -> Tensor | None:
        """Make ``flat``'s gradient hold its leaves' gradients; return it (``None``: no leaf has one)."""
        leaves = self.leaves
        grads = list(map(_grad_of, leaves))
        if self._lent is not None:  # a placeholder is no gradient of this process
            grads = [None if grad is shown else grad for grad, shown in zip(grads, self._lent[1])]
        if all(grad is None for grad in grads):
            return None
        current, fresh = _flat_grad(flat, contiguous=False, empty=True)  # fresh: each element written below
        regions = self._regions_of(current)
        if not fresh and all(map(operator.is_, grads, regions)):
            return current  # autograd accumulated into every slot in place
        pending = self._pending()
        zeros: list[Tensor] = self._gaps(current) if fresh else []
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        moved: list[int] = []
        for position, grad in enumerate(grads):
            region = regions[position]
            if grad is region:
                continue
            if grad is None:
                if fresh or position not in pending:  # a slot that backward filled keeps its gradient
                    zeros.append(region)
            elif grad.shape != region.shape:  # the leaf got another shape (`.data = t`): the storage's next
                pass  # sync point lays the groups out again, with this gradient in the leaf's new slot
            elif grad._base is None and not grad.requires_grad:  # memory of its own (autograd gave it)
                targets.append(region)
                sources.append(grad)
                moved.append(position)
            elif not fresh and _same_elements(grad, region):  # the slot's view made elsewhere (mode switch)
                moved.append(position)
            else:  # a view of another buffer (DDP's bucket), or with a graph: copied at each pass
                targets.append(region)
                sources.append(grad)
        with torch.no_grad():
            if zeros:
                torch._foreach_zero_(zeros)
            if targets:
                torch._foreach_copy_(targets, sources)
        for position in moved:  # later backwards accumulate in the slot
            leaves[position].grad = regions[position]
        return current

    def receive(
        self, indices: Sequence[int], leaves: Sequence[Tensor], grads: Sequence[Tensor | None]
    ) -> list[Tensor | None]:
        """Return the members' gradients in the master dtype; each in its slot where the slot is free.

        The backward of per-tensor mixed precision (``_features/mixed_precision/compute_views.py``): the
        compute views' gradients (``param_dtype``) become the leaves' (the flat gradient's dtype).
        A leaf whose ``.grad`` is ``None``, whose accumulation this backward will run and whose slot
        no backward has filled yet gets its gradient converted straight into its slot of the flat
        gradient, and the slot is returned: autograd makes it the leaf's ``.grad`` without a copy
        (and copies it if something else holds it). A later micro-batch's gradient is added into the
        slot that is the leaf's ``.grad`` here, when nothing watches the leaf's accumulation (no
        hook of the user's or of a feature, no process group whose DDP may hook it): the leaf then
        gets ``None`` from this backward. The others (a gradient to add to elsewhere, a
        ``torch.autograd.grad`` call, ``create_graph``) are converted into one new buffer.

        Args:
            indices: the members' indices in the layout.
            leaves: their leaves (one that is not this mode's leaf any more is converted apart).
            grads: their gradients (``None``: none).
        """
        flat = self._flat()
        dtype = None if flat is None else flat.dtype
        out: list[Tensor | None] = [None] * len(grads)
        direct: list[tuple[int, int, Tensor]] = []  # (where in out, position, gradient)
        added: list[tuple[Tensor, Tensor]] = []  # (slot, gradient)
        rest: list[tuple[int, Tensor]] = []
        task = graph_task_id()
        quiet = self._quiet(task, flat)
        pending = self._pending()
        positions, own = self._positions, self.leaves
        # create_graph: each gradient has a graph of its own; none lands in a slot
        slots = flat is not None and not torch.is_grad_enabled()
        regions: list[Tensor] | None = None
        for where, (index, leaf, grad) in enumerate(zip(indices, leaves, grads)):
            if grad is None:
                continue
            position = positions.get(index, -1)
            if not (
                slots
                and position >= 0
                and own[position] is leaf
                and type(grad) is Tensor
                and position not in pending
                and self._accumulates_here(position)
            ):
                rest.append((where, grad))
                continue
            current = leaf.grad
            if current is None:
                direct.append((where, position, grad))
                continue
            if regions is None:  # asked at the first gradient to add to, not at every backward
                watched = not quiet or flat is None or process_group_exists()
                base = None if watched else BASE_GRAD.__get__(flat)
                regions = [] if base is None or not base.is_contiguous() else self._regions_of(base)
            if regions and _same_elements(current, regions[position]) and not _hooked(leaf):
                # A micro-batch after the first: added into the slot that is the leaf's ``.grad``, as its
                # accumulation would add it (nothing watches that accumulation: it gets no gradient).
                added.append((current, grad))
            else:
                rest.append((where, grad))
        with torch.no_grad():
            if added:
                torch._foreach_add_([slot for slot, _ in added], [grad for _, grad in added])
            if direct and flat is not None:
                regions = self._regions_of(_flat_grad(flat, contiguous=True, empty=False)[0])
                targets = [regions[position] for _, position, _ in direct]
                torch._foreach_copy_(targets, [grad for _, _, grad in direct])
                ref = self._claims.get(task)
                claims = None if ref is None else ref()
                if claims is None:
                    claims = _Claims()
                    queue_callback(claims.clear)  # the backward holds them: they go with it
                    self._claims[task] = weakref.ref(claims)
                for (where, position, _), target in zip(direct, targets):
                    claims.add(position)
                    out[where] = target.view_as(target)  # a tensor of its own: autograd may keep it
        if rest:  # create_graph: the conversion is part of each gradient's graph (grad mode is on)
            converted = _converted([grad for _, grad in rest], dtype)
            for (where, _), grad in zip(rest, converted):
                out[where] = grad
        return out

    def _quiet(self, task: int, flat: Tensor | None) -> bool:
        """Return whether nothing waits for the flat gradient during backward ``task`` (it skips :meth:`end`).

        Such a backward lands every gradient in its slot here (:meth:`receive`), so the pass at its
        end (:meth:`end`) would find nothing to land, and reading the flat gradient does it anyway
        (:meth:`reconcile`): it was about 0.5% of a small GPT-2's forward+backward. Grad sync and
        ``ShardedOptimizer`` hook the flat parameter: then the end runs, to reduce during backward.
        """
        if self._quiet_task == task:
            return True
        if not self._open or flat is None or has_post_accumulate_grad_hooks(flat):
            return False
        self._quiet_task = task
        return True

    def _pending(self) -> set[int]:
        """Return the positions whose slot holds a gradient a backward in progress has not accumulated."""
        if not self._claims:
            return _NONE
        live = {task: claims for task, ref in self._claims.items() if (claims := ref())}
        if len(live) != len(self._claims):
            self._claims = {task: self._claims[task] for task in live}
        return set().union(*live.values()) if live else _NONE

    def _accumulates(self, position: int) -> bool:
        """Return whether the backward in progress accumulates into leaf ``position``'s ``.grad``.

        Raises:
            RuntimeError: in ``torch.autograd.grad()``, where gradients are returned, not accumulated.
        """
        if not self.leaves[position].requires_grad:
            return False
        node = self._accumulator(position)
        return node is not None and bool(will_execute(node))

    def _accumulates_here(self, position: int) -> bool:
        """:meth:`_accumulates`, ``False`` in ``torch.autograd.grad()``."""
        try:
            return self._accumulates(position)
        except RuntimeError:
            return False

    def _accumulator(self, position: int) -> Any:
        """Return leaf ``position``'s gradient accumulator (the autograd node that sets its ``.grad``).

        ``None`` where autograd records nothing for the leaf here (inside a ``torch.func`` transform).
        """
        node = self._accumulators.get(position)
        if node is None:
            leaf = self.leaves[position]
            with torch.enable_grad():
                view_node = leaf.view_as(leaf).grad_fn
            if view_node is None:
                return None
            node = view_node.next_functions[0][0]
            self._accumulators[position] = node
        return node

    # ------------------------------------------------------------ a lent gradient
    def lend(self, lent: Any) -> None:
        """Show ``lent``'s placeholder (a ``grad.Lent``) as the ``.grad`` of each leaf that has none.

        A hook on each leaf takes every placeholder out when the first of the group's next gradients
        arrives, before autograd accumulates it (into nothing, as on a leaf without a gradient).
        """
        self.withdraw(report=False)
        if not self._handles:  # the flat parameter does not require grad
            return
        shown = [lent.leaf_shown(index) for index in self.indices]
        for leaf, placeholder in zip(self.leaves, shown):
            if leaf.grad is None:
                leaf.grad = placeholder
        take_out = _taking_out(weakref.ref(self))
        self._lent = (lent, shown)
        self._lent_hooks = [leaf.register_hook(take_out) for leaf in self.leaves]

    def check_lent(self) -> None:
        """Report to the lent gradient each leaf whose ``.grad`` is not its placeholder any more."""
        if self._lent is not None:
            lent, shown = self._lent
            for index, leaf, placeholder in zip(self.indices, self.leaves, shown):
                if leaf.grad is not placeholder:
                    lent.cleared(index)

    def withdraw(self, report: bool, unhook: bool = True) -> None:
        """Take the lent gradient's placeholders out of the leaves (``report``: the cleared ones first).

        Args:
            report: tell the lent gradient which leaves lost their placeholder first.
            unhook: remove the hooks that would have done it (not from inside one of them).
        """
        held = self._lent
        if unhook:
            hooks, self._lent_hooks = self._lent_hooks, []
            for handle in hooks:
                handle.remove()
        if held is None:
            return
        if report:
            self.check_lent()
        self._lent = None
        for leaf, placeholder in zip(self.leaves, held[1]):
            if leaf.grad is placeholder:
                leaf.grad = None

    def point_at(self, value: Tensor | None) -> None:
        """Make every leaf's gradient its view of ``value``, the new flat gradient (``None``: ``None``)."""
        self.withdraw(report=False)
        self._regions = None
        regions = None if value is None else self._regions_of(value)
        for position, leaf in enumerate(self.leaves):
            leaf.grad = None if regions is None else regions[position]

    def _gaps(self, grad: Tensor) -> list[Tensor]:
        """Return the parts of ``grad``, the flat gradient, outside the leaves' slots (padding, others)."""
        ranges = self._gap_ranges
        if ranges is None:
            base, end = int(grad.storage_offset()), int(grad.numel())
            ranges, start = [], 0
            slots = sorted((int(r.storage_offset()) - base, int(r.numel())) for r in self._regions_of(grad))
            for offset, numel in slots:
                if offset > start:
                    ranges.append((start, offset - start))
                start = max(start, offset + numel)
            if start < end:
                ranges.append((start, end - start))
            self._gap_ranges = ranges
        flat = grad.view(-1)
        return [flat[start : start + numel] for start, numel in ranges]

    def _regions_of(self, grad: Tensor) -> list[Tensor]:
        """Return the leaves' slots of ``grad``, the flat gradient, split once per tensor.

        Each slot is an alias of its elements with a version counter of its own (``.data`` of its
        view), so that an in-place accumulation into one slot moves no other's (:meth:`_unpoint`).
        """
        cached = self._regions
        if cached is None or cached[0] is not grad:
            views = self._split(grad)
            cached = self._regions = (grad, [views[index].data for index in self.indices])
        return cached[1]


_NONE: set[int] = set()


def _flat_grad(flat: Tensor, contiguous: bool, empty: bool) -> tuple[Tensor, bool]:
    """Return ``flat``'s own gradient and whether it was made now (it had none, or a strided one).

    A strided gradient is replaced only with ``contiguous``. A gradient made now is zeros, or with
    ``empty`` not filled (the caller writes every element).
    """
    current: Tensor | None = BASE_GRAD.__get__(flat)
    if current is not None and (not contiguous or current.is_contiguous()):
        return current, False
    make = torch.empty_like if empty else torch.zeros_like
    current = make(flat, memory_format=torch.contiguous_format)
    BASE_GRAD.__set__(flat, current)
    return current, True


class _End:
    """The end of one backward, queued on it: :meth:`LeafGrads.end` if it completes.

    The backward holds it and nothing else does: one that raises drops it unrun, and then the
    leaves that :meth:`LeafGrads._point` gave their slots and that got no gradient get ``None``
    back, as on the plain model.
    """

    __slots__ = ("_owner", "_ran")

    def __init__(self, owner: LeafGrads) -> None:
        self._owner = weakref.ref(owner)
        self._ran = False

    def __call__(self) -> None:
        self._ran = True
        owner = self._owner()
        if owner is not None:
            owner._backward_end()

    def __del__(self) -> None:
        owner = self._owner()
        if not self._ran and owner is not None:
            owner._unpoint()


class _Claims(set):  # type: ignore[type-arg]  # a set that a weak reference can point at
    """The positions whose slots one backward filled and has not accumulated yet."""


def _hooked(leaf: Tensor) -> bool:
    """Return whether user code hooks ``leaf``'s gradient (``register_hook``, a post-accumulate hook)."""
    return bool(leaf._backward_hooks) or has_post_accumulate_grad_hooks(leaf)


def _converted(grads: list[Tensor], dtype: torch.dtype | None) -> list[Tensor]:
    """Return ``grads`` converted to ``dtype``: views of one new buffer (one allocation, one copy)."""
    if (
        dtype is None
        or any(grad.dtype == dtype or type(grad) is not Tensor for grad in grads)
        or torch.is_grad_enabled()
    ):
        return [grad if dtype is None else grad.to(dtype) for grad in grads]
    buffer = torch.empty(sum(grad.numel() for grad in grads), dtype=dtype, device=grads[0].device)
    targets = [part.view(grad.shape) for part, grad in zip(buffer.split([g.numel() for g in grads]), grads)]
    torch._foreach_copy_(targets, grads)
    return targets


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


def _taking_out(ref: weakref.ref[LeafGrads]) -> Callable[[Tensor], None]:
    """Return the hook of the leaves while a gradient is lent: a first gradient takes the placeholders out."""

    def hook(grad: Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner.withdraw(report=True, unhook=False)

    return hook


def _landing(ref: weakref.ref[LeafGrads]) -> Callable[[Tensor], None]:
    """Return the hook of a group's leaves: each gradient that lands counts towards :meth:`LeafGrads.end`."""

    def hook(leaf: Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner.landed(graph_task_id())

    return hook
