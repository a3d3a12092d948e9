"""The one owner of a group's gradient: :class:`GroupGrad`.

Each group has one :class:`GroupGrad` (``Group.grads``), as each bucket of
DDP's Reducer has one owner of its flat gradient. It knows its group's
layout and holds, in one object:

* the flat gradient (:meth:`GroupGrad.read`, :meth:`GroupGrad.assign`,
  :meth:`GroupGrad.release`) and each member's view of it
  (:meth:`GroupGrad.views`), in flat mode (torch's ``.grad`` slot of the
  flat parameter) and in per-tensor mode, where the members are leaf
  parameters whose gradients live in the flat gradient (``leaf_slots.py``);
* the switches between the two (:meth:`GroupGrad.enter_leaves`,
  :meth:`GroupGrad.exit_leaves`) and the gradients the module surgery hands
  to and takes from the original parameters (:meth:`GroupGrad.gather`,
  :meth:`GroupGrad.hand_out`, :meth:`GroupGrad.take_back`);
* the memory that the group's autograd node (``split_node.py``) builds each
  flat gradient in, reused across steps on CPU (:meth:`GroupGrad.take`);
* a gradient lent out (:meth:`GroupGrad.lend`): ZeRO-2 keeps each rank's
  averaged part only and shows placeholders in its place (a :class:`Lent`),
  so that every way torch clears a gradient reaches the one that holds it;
* the group's :class:`FlatGradHook` objects, the seam where a feature sees
  each flat gradient as backward produces it (and may have it divided while
  it is built, or return a converted one), the dtype gradients travel in
  between ranks, and the sync claim: who reduces the gradient across ranks
  (:func:`claim_sync`).

This module and ``leaf_slots.py`` are the only ones that write a tensor's
``.grad`` slot; the rest of the library goes through a group's
:class:`GroupGrad`, or :func:`set_grad` for a tensor no group owns.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..layout import GroupLayout
from ..transaction import Transaction
from .leaf_slots import BASE_GRAD, LeafGrads

__all__ = [
    "BASE_GRAD",
    "FlatGradHook",
    "GroupGrad",
    "Lent",
    "PRESCALE_MIN_SEGMENT_BYTES",
    "check_sync",
    "claim_sync",
    "set_grad",
]


class Member(Protocol):
    """A member of a group as the gradient owner sees it (``records.Slot``)."""

    @property
    def index(self) -> int:
        """Its position in the group's layout order."""

    @property
    def param(self) -> Tensor:
        """Its original parameter (a leaf in unflattened mode)."""

    @property
    def name(self) -> str:
        """Its qualified name, relative to the registered module."""


class FlatGradHook(Protocol):
    """Sees each flat gradient that a group's split node builds in backward ("flat gradient ready").

    Hooks are registered per group with :meth:`GroupGrad.add_hook`. They run
    on the autograd thread, inside backward, before the gradient is
    accumulated into ``flat.grad``; they must not keep the views or the module
    alive (the node that calls them may outlive both).

    Gradient sync divides by the world size here (``_distributed/grad_sync.py``);
    ``ShardedOptimizer`` says that it releases full flat gradients
    (:attr:`releases_gradient`). Views served from a tensor of another dtype
    (``GroupViews.source``) need no hook: the split node builds the flat
    gradient in the flat parameter's dtype.
    """

    #: Whether this hook's owner drops the full flat gradient after backward (ZeRO-2 keeps a slice
    #: only): then the group's :class:`GroupGrad` keeps no memory to reuse, since a kept buffer
    #: would hold a whole gradient alive between steps.
    releases_gradient: bool

    def divisor(self, flat: Tensor) -> int | None:
        """Return a divisor to apply while this backward builds the gradient of ``flat``, or ``None``."""

    def grad_ready(self, grad: Tensor, divided: bool) -> Tensor | None:
        """Take note of a built flat gradient; return ``None`` to keep it, or the gradient to use instead.

        ``grad`` has the flat parameter's dtype (views served from a
        ``GroupViews.source`` of another dtype had their gradients converted
        while backward copied them together); ``divided``: it
        was divided by this hook's divisor. A returned tensor (same shape;
        another dtype is fine, e.g. the master's) replaces it: later hooks see
        it and backward returns it. Autograd casts what backward returns to
        the flat parameter's dtype, so a gradient that no hook converts still
        reaches ``flat.grad`` in the master's dtype (one more pass).
        """


class Lent(Protocol):
    """A group's gradient that lives elsewhere: ZeRO-2 keeps each rank's averaged part of it only.

    While a group's gradient is lent (:meth:`GroupGrad.lend`, after its owner
    released the flat gradient), the flat parameter's ``.grad`` shows
    :meth:`shown` when its own slot is empty, and in per-tensor mode each leaf's
    ``.grad`` shows :meth:`leaf_shown`, so that torch's ways of clearing a
    gradient (``p.grad = None``, ``zero_grad()`` with either ``set_to_none``)
    see one. What clears it is reported back: assigning the flat gradient
    recalls the whole loan (``cleared(None)``); a leaf whose ``.grad`` is not
    its placeholder any more is reported with its member index when the lender
    asks (:meth:`GroupGrad.check_lent`), when per-tensor mode ends, or when the
    group's next gradient arrives (the placeholders leave the leaves then, so
    that autograd accumulates as it does on a leaf without a gradient).
    """

    def shown(self) -> Tensor:
        """Return the placeholder shown as the flat parameter's ``.grad``."""
        ...

    def leaf_shown(self, index: int) -> Tensor:
        """Return the placeholder shown as the ``.grad`` of member ``index``'s leaf (per-tensor mode)."""
        ...

    def cleared(self, index: int | None) -> None:
        """Take note that member ``index``'s gradient (``None``: the whole group's) was cleared."""
        ...


@dataclass(frozen=True)
class _SyncClaim:
    """Who reduces a group's flat gradient across ranks, and what a second claimant is told."""

    owner: weakref.ref[Any]
    refusal: str


#: Dividing while copying costs one small op per segment; below this many bytes per segment on
#: average, one ``cat`` and a separate division pass are cheaper.
PRESCALE_MIN_SEGMENT_BYTES = 16 * 1024


class GroupGrad:
    """The one owner of a group's gradient: the flat gradient, its views, memory, hooks and sync claim.

    In flat mode the flat gradient is torch's ``.grad`` slot of the flat
    parameter; in per-tensor mode (between :meth:`enter_leaves` and
    :meth:`exit_leaves`) the members are leaf parameters whose gradients are
    views of it, and :class:`~.leaf_slots.LeafGrads` keeps the two in step.

    Each backward builds the group's flat gradient as a new tensor; on CPU a
    fresh multi-megabyte allocation is served by new pages that the kernel
    zero-fills on first touch, every step. When memory kept from an earlier
    backward is no longer used (the gradient was dropped by
    ``zero_grad(set_to_none=True)``, or added into the kept ``.grad``),
    backward writes into it again instead (:meth:`take`). It holds no
    reference to the views or the module (it is reachable from autograd nodes).

    ``reduce_dtype`` is the dtype in which the gradient travels between ranks
    (the ``reduce_dtype`` of a mixed-precision policy; ``None``: its own).

    The sync claim says which one object reduces this group's flat gradient
    across ranks (the storage's grad sync, or one ``ShardedOptimizer``): a
    second one would reduce it twice, so :meth:`claim_sync` refuses it with
    the holder's message. The holder is held weakly: its claim ends with it.

    Args:
        layout: the group's layout.
    """

    __slots__ = (
        "_claim",
        "_kept",
        "_lock",
        "_targets",
        "hooks",
        "keep",
        "layout",
        "leaves",
        "lent",
        "reduce_dtype",
    )

    #: Two buffers: with gradients kept across steps (accumulation, ``set_to_none=False``)
    #: one is the flat gradient while backward fills the other.
    KEEP = 2

    def __init__(self, layout: GroupLayout) -> None:
        self.layout = layout
        self._lock = threading.Lock()
        self._kept: list[torch.UntypedStorage] = []
        #: Per kept storage: its dtype, a tensor per layout segment (slots in their shapes) and
        #: the padding segments. Made once, so that backward copies every view's gradient with
        #: one ``_foreach_copy_`` instead of reshaping each in Python and concatenating.
        self._targets: list[tuple[torch.dtype, list[Tensor], list[int]]] = []
        #: How many buffers to keep (``0`` while a hook releases the gradient: every flat gradient
        #: is fresh memory, freed with it).
        self.keep = self.KEEP
        #: The group's flat-gradient hooks, in registration order (a tuple: read without a lock).
        self.hooks: tuple[FlatGradHook, ...] = ()
        self._claim: _SyncClaim | None = None
        #: The dtype in which gradient sync and ``ShardedOptimizer`` reduce this group's gradient
        #: across ranks (``None``: the gradient's own); a mixed-precision policy sets it.
        self.reduce_dtype: torch.dtype | None = None
        #: The members' leaf parameters and their hooks in per-tensor mode; ``None`` in flat mode.
        self.leaves: LeafGrads | None = None
        #: The gradient lent out (:meth:`lend`), shown by placeholders; ``None``: none.
        self.lent: Lent | None = None

    # ------------------------------------------------------------ the flat gradient
    def read(self, flat: Tensor) -> Tensor | None:
        """Return the flat gradient of ``flat`` (this group's flat parameter), or ``None``.

        In per-tensor mode it is the leaves' gradients, landed in it first (``None`` while every
        leaf's gradient is ``None``).
        """
        leaves = self.leaves
        return BASE_GRAD.__get__(flat) if leaves is None else leaves.reconcile(flat)

    def visible(self, flat: Tensor) -> Tensor | None:
        """Return what ``flat.grad`` shows: :meth:`read`, or where that is ``None`` the lent placeholder."""
        grad = self.read(flat)
        lent = self.lent
        return grad if grad is not None or lent is None else lent.shown()

    def assign(self, flat: Tensor, value: Tensor | None) -> None:
        """Make ``value`` the flat gradient of ``flat``; in per-tensor mode every leaf's gradient its view.

        A gradient lent out is recalled: it was cleared (``flat.grad = None``) or replaced.
        """
        self._recall()
        set_grad(flat, value)
        if self.leaves is not None:
            self.leaves.point_at(value)

    def lend(self, lent: Lent) -> None:
        """Show ``lent``'s placeholders as the group's gradient (the flat one, per-tensor mode's leaves).

        Its owner calls it after it released the flat gradient (:meth:`release`): the slots are empty.
        """
        self._recall()
        self.lent = lent
        if self.leaves is not None:
            self.leaves.lend(lent)

    def recall(self, lent: Lent) -> None:
        """End the loan of ``lent`` if it is the group's (its owner leaves): the placeholders go."""
        if self.lent is lent:
            self._recall()

    def check_lent(self) -> None:
        """Report to the lent gradient each leaf whose ``.grad`` is not its placeholder any more."""
        if self.leaves is not None and self.lent is not None:
            self.leaves.check_lent()

    def _recall(self) -> None:
        lent = self.lent
        if lent is None:
            return
        self.lent = None
        if self.leaves is not None:
            self.leaves.withdraw(report=False)
        lent.cleared(None)

    def release(self, flat: Tensor) -> None:
        """Drop the flat gradient of ``flat`` (ZeRO-2 keeps this rank's slice only; ``del flat.grad``)."""
        self.assign(flat, None)

    def forget_memory(self) -> None:
        """Drop the gradient memory kept for reuse (the storage was removed)."""
        with self._lock:
            del self._kept[:], self._targets[:]

    def dense(self, flat: Tensor) -> Tensor:
        """Return the flat gradient as a dense contiguous tensor, assigning zeros first if there is none."""
        grad = self.read(flat)
        if grad is None:
            grad = torch.zeros_like(flat, memory_format=torch.contiguous_format)
            self.assign(flat, grad)
        elif not grad.is_contiguous():
            grad = grad.contiguous()
            self.assign(flat, grad)
        return grad

    def receive_cast(
        self,
        indices: Sequence[int],
        leaves: Sequence[Tensor | None],
        grads: Sequence[Tensor | None],
        dtypes: Sequence[torch.dtype],
    ) -> list[Tensor | None]:
        """Return the gradients of a cast node's leaves in their dtypes, in their slots where they can be.

        The seam of per-tensor mixed precision (``_features/mixed_precision/compute_views.py``): its
        node's backward hands over the compute views' gradients. In per-tensor mode, with every
        leaf alive, each lands in its slot of the flat gradient where it can
        (:meth:`~.leaf_slots.LeafGrads.receive`); otherwise each is converted on its own.

        Args:
            indices: the members' indices in the layout.
            leaves: their leaves (``None``: one that is gone).
            grads: their gradients (``None``: none).
            dtypes: the dtype of each leaf.
        """
        landing = self.leaves
        alive = [leaf for leaf in leaves if leaf is not None]
        if landing is None or len(alive) != len(leaves):
            return [None if g is None else g.to(dtype) for g, dtype in zip(grads, dtypes)]
        return landing.receive(indices, alive, grads)

    def split(self, tensor: Tensor) -> list[Tensor]:
        """Return a view of each member, in layout order, of ``tensor`` (shaped like the flat parameter)."""
        layout = self.layout
        chunks = tensor.split(layout.split_sizes)
        return [chunks[seg].view(shape) for seg, shape in zip(layout.segments, layout.shapes)]

    def views(self, flat: Tensor) -> list[Tensor] | None:
        """Return each member's view of the flat gradient of ``flat``, or ``None`` while there is none."""
        grad = self.read(flat)
        return None if grad is None else self.split(grad)

    # ------------------------------------------------ the original parameters' gradients
    def gather(self, flat: Tensor, members: Iterable[Member], stale: list[str]) -> Tensor | None:
        """Return a new flat gradient for ``flat`` built from the gradients of the members' parameters.

        ``None`` if none of them has a gradient; zeros where one has none. A gradient
        of another shape than its parameter (left from before a shape change) has no
        place in it: it is left out, and ``"<name> (gradient <shape>, parameter <shape>)"``
        appended to ``stale``.
        """
        grads = []
        for member in members:
            grad, param = member.param.grad, member.param
            if grad is not None and grad.shape != param.shape:
                stale.append(f"{member.name} (gradient {tuple(grad.shape)}, parameter {tuple(param.shape)})")
            elif grad is not None:
                grads.append((member.index, grad))
        if not grads:
            return None
        out = torch.zeros_like(flat, memory_format=torch.contiguous_format)
        targets = self.split(out)
        with torch.no_grad():
            for index, grad in grads:
                targets[index].copy_(grad)
        return out

    def take_back(self, flat: Tensor, grad: Tensor | None, leaves: Iterable[Tensor], tx: Transaction) -> None:
        """Make ``grad`` the flat gradient of ``flat`` and drop the gradients of ``leaves``, undoably.

        The module surgery's flatten: the original parameters' gradients now live in the flat gradient.
        """
        set_grad(flat, grad, tx)
        for leaf in leaves:
            set_grad(leaf, None, tx)

    def hand_out(self, flat: Tensor, members: Iterable[Member], tx: Transaction, copy: bool) -> None:
        """Give each member's parameter its view of the flat gradient (a copy if ``copy``), undoably.

        ``None`` to each while the flat gradient is ``None``. The module surgery's unflatten (views)
        and removal (copies: the parameters own their gradients again).
        """
        views = self.views(flat)
        for member in members:
            grad = None if views is None else views[member.index]
            if copy and grad is not None:
                with torch.no_grad():
                    grad = grad.clone()
            set_grad(member.param, grad, tx)

    # ------------------------------------------------------------ per-tensor mode
    def enter_leaves(self, flat: Tensor, members: Sequence[Member], tx: Transaction) -> None:
        """Per-tensor mode begins: the members' leaf parameters keep their gradients in the flat one.

        Undone with ``tx``; a no-op if these very leaves are already in per-tensor mode.
        """
        current = self.leaves
        leaves = [(member.index, member.param) for member in members]
        if current is not None and current.holds(flat, leaves):
            return
        self.exit_leaves(tx)
        fresh = LeafGrads(flat, leaves, self.split)
        tx.on_undo(fresh.close)
        tx.set_attr(self, "leaves", fresh)
        if self.lent is not None:
            fresh.lend(self.lent)

    def flat_hooked(self) -> None:
        """The flat parameter got a post-accumulate-grad hook: in per-tensor mode, hook the leaves for it."""
        if self.leaves is not None:
            self.leaves.watch_flat()

    def exit_leaves(self, tx: Transaction) -> None:
        """Per-tensor mode ends (undone with ``tx``): unhook the leaves; the flat gradient is the slot's.

        A lent gradient's placeholders leave the leaves; a leaf that had lost its own is reported cleared.
        """
        leaves = self.leaves
        if leaves is None:
            return
        leaves.close()
        tx.on_undo(leaves.reopen)
        tx.set_attr(self, "leaves", None)

    # ------------------------------------------------------------------ hooks
    def add_hook(self, hook: FlatGradHook) -> None:
        """Have backward call ``hook`` for each flat gradient of this group (after the hooks added before)."""
        self._set_hooks((*self.hooks, hook))

    def remove_hook(self, hook: FlatGradHook) -> None:
        """Stop calling ``hook`` (nothing happens if it is not registered)."""
        self._set_hooks(tuple(h for h in self.hooks if h is not hook))

    def _set_hooks(self, hooks: tuple[FlatGradHook, ...]) -> None:
        with self._lock:
            self.hooks = hooks
            self.keep = 0 if any(h.releases_gradient for h in hooks) else self.KEEP
            del self._kept[self.keep :], self._targets[self.keep :]

    # ------------------------------------------------------------- sync claim
    def refusal_for(self, owner: object) -> str | None:
        """Return the message of the live holder (not ``owner``) that syncs this gradient, else ``None``."""
        claim = self._claim
        if claim is None:
            return None
        holder = claim.owner()
        return None if holder is None or holder is owner else claim.refusal

    def claim_sync(self, owner: object, refusal: str) -> None:
        """Make ``owner`` (held weakly) the one that reduces this group's flat gradient across ranks.

        Args:
            owner: the claimant; its claim ends when it is garbage collected or
                calls :meth:`release_sync`.
            refusal: what a later claimant is told while ``owner`` holds it:
                who syncs the gradient, and how to stop that.

        Raises:
            RuntimeError: with the holder's message, if another live owner holds it.
        """
        held = self.refusal_for(owner)
        if held is not None:
            raise RuntimeError(held)
        self._claim = _SyncClaim(weakref.ref(owner), refusal)

    def release_sync(self, owner: object) -> None:
        """End ``owner``'s claim (nothing happens if it holds none)."""
        claim = self._claim
        if claim is not None and claim.owner() in (owner, None):
            self._claim = None

    def take(
        self, layout: GroupLayout, dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, list[Tensor] | None, list[int]]:
        """Return a flat tensor for ``layout``: kept memory that nothing uses, else new memory.

        Returns:
            The tensor; for kept memory also one tensor per layout segment
            aliasing it (slots in their shapes) and the padding segments.
        """
        numel = layout.numel
        if device.type != "cpu":  # device allocators cache freed memory themselves
            return torch.empty(numel, dtype=dtype, device=device), None, []
        nbytes = numel * dtype.itemsize
        with self._lock:
            kept = [
                (memory, targets)
                for memory, targets in zip(self._kept, self._targets)
                if memory.nbytes() == nbytes and targets[0] == dtype  # forget other layouts
            ][: self.keep]
            self._kept = [memory for memory, _ in kept]
            self._targets = [targets for _, targets in kept]
            for memory, (_, segments, padding) in kept:
                # Free when only this list and the segment tensors hold the memory.
                if torch._C._storage_Use_Count(memory._cdata) == 1 + len(segments):
                    out = torch.empty(0, dtype=dtype, device=device).set_(memory, 0, (numel,), (1,))
                    return out, segments, padding
            out = torch.empty(numel, dtype=dtype, device=device)
            if len(self._kept) < self.keep:
                memory = out.untyped_storage()
                self._kept.append(memory)
                self._targets.append((dtype, *_segments(memory, layout, dtype)))
            return out, None, []

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupGrad:
        return GroupGrad(self.layout)  # a copy's gradients are its own: no memory, hooks, claim or loan


def check_sync(buffers: Sequence[GroupGrad], owner: object, what: str) -> None:
    """Refuse ``owner`` if another live owner syncs the gradient of one of ``buffers``.

    Args:
        buffers: the groups' gradient owners.
        owner: the claimant.
        what: what the claimant does, the start of the message (``"ShardedOptimizer syncs ..."``).

    Raises:
        RuntimeError: ``"<what>, but <the holder's message>"``.
    """
    for buffer in buffers:
        held = buffer.refusal_for(owner)
        if held is not None:
            raise RuntimeError(f"{what}, but {held}")


def claim_sync(buffers: Sequence[GroupGrad], owner: object, what: str, refusals: Sequence[str]) -> None:
    """Claim the sync of every buffer for ``owner`` (see :meth:`GroupGrad.claim_sync`), or of none.

    Args:
        buffers: the groups' gradient owners.
        owner: the claimant (held weakly).
        what: what the claimant does, the start of the message if it is refused.
        refusals: per buffer, what a later claimant is told.

    Raises:
        RuntimeError: as :func:`check_sync` (nothing is claimed then).
    """
    check_sync(buffers, owner, what)
    for buffer, refusal in zip(buffers, refusals):
        buffer.claim_sync(owner, refusal)


def _segments(
    memory: torch.UntypedStorage, layout: GroupLayout, dtype: torch.dtype
) -> tuple[list[Tensor], list[int]]:
    """Return a tensor per segment of ``layout`` on ``memory``, and the padding segments.

    They are not views of another tensor (no base keeps a reference), so each
    holds exactly one reference to the storage (see :meth:`GroupGrad.take`).
    """
    shapes = dict(zip(layout.segments, layout.shapes))
    segments, offset = [], 0
    for seg, size in enumerate(layout.split_sizes):
        shape = tuple(shapes.get(seg, (size,)))
        stride = torch.empty(shape, device="meta").stride()
        segments.append(torch.empty(0, dtype=dtype).set_(memory, offset, shape, stride))
        offset += size
    return segments, [seg for seg in range(len(layout.split_sizes)) if seg not in shapes]


def set_grad(tensor: Tensor, value: Tensor | None, tx: Transaction | None = None) -> None:
    """Write torch's ``.grad`` slot of ``tensor`` (undoably with ``tx``).

    For a tensor no group owns (a ``ShardedOptimizer``'s slice, an original
    parameter the module surgery hands a gradient to or takes it from, a flat
    parameter before or without a group), and for a group's flat gradient in
    flat mode; the rest of the library writes a group's flat gradient through
    its :class:`GroupGrad`.
    """
    if tx is not None:
        old = BASE_GRAD.__get__(tensor)
        tx.on_undo(lambda: BASE_GRAD.__set__(tensor, old))
    BASE_GRAD.__set__(tensor, value)
