"""The autograd path of a group: one node for all its views, and the memory and hooks of its flat gradient.

:class:`_GroupSplit` makes every view of a group as the outputs of one
autograd node; its backward builds the group's flat gradient in one go, in
memory that :class:`GradBuffer` reuses across steps. The buffer also carries
the group's :class:`FlatGradHook` objects, the seam where a feature sees each
flat gradient as backward produces it (and may have it divided while it is
built, or return a converted one), and the group's sync claim: who reduces
its gradient across ranks (:func:`claim_sync`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from .layout import GroupLayout

__all__ = [
    "BASE_GRAD",
    "FlatGradHook",
    "GradBuffer",
    "GradKeeper",
    "PRESCALE_MIN_SEGMENT_BYTES",
    "check_sync",
    "claim_sync",
]


class FlatGradHook(Protocol):
    """Sees each flat gradient that a group's split node builds in backward ("flat gradient ready").

    Hooks are registered per group with :meth:`GradBuffer.add_hook`. They run
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
    #: only): then the group's :class:`GradBuffer` keeps no memory to reuse, since a kept buffer
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


@dataclass(frozen=True)
class _SyncClaim:
    """Who reduces a group's flat gradient across ranks, and what a second claimant is told."""

    owner: weakref.ref[Any]
    refusal: str


#: Dividing while copying costs one small op per segment; below this many bytes per segment on
#: average, one ``cat`` and a separate division pass are cheaper.
PRESCALE_MIN_SEGMENT_BYTES = 16 * 1024


#: torch's own ``Tensor.grad`` descriptor (``FlatParameter.grad`` extends it).
BASE_GRAD: Any = vars(torch._C.TensorBase)["grad"]


class GradKeeper(Protocol):
    """Who holds a group's flat gradient while its members are leaves (``_install/per_tensor.py``)."""

    def flat_grad(self, flat: Tensor) -> Tensor | None:
        """Return the flat gradient as the leaves have it."""

    def set_flat_grad(self, flat: Tensor, value: Tensor | None) -> None:
        """Assign the flat gradient (the leaves' gradients become views of it)."""


class GradBuffer:
    """One reusable CPU buffer for a group's flat gradient, the group's gradient hooks and its sync claim.

    Each backward builds the group's flat gradient as a new tensor; on CPU a
    fresh multi-megabyte allocation is served by new pages that the kernel
    zero-fills on first touch, every step. When memory kept from an earlier
    backward is no longer used (the gradient was dropped by
    ``zero_grad(set_to_none=True)``, or added into the kept ``.grad``),
    backward writes into it again instead. It holds no reference to the views
    or the module (it is reachable from autograd nodes).

    It is the one owner of the group's flat gradient that the rest of the
    library asks (``Group.grad_buffer``): :meth:`read` / :meth:`write` give and
    take the flat gradient in either mode (in unflattened mode a *keeper*, the
    per-tensor mode's ``_install/per_tensor.py``, holds it as the leaves'
    gradients), and gradient sync, ``ShardedOptimizer`` and ZeRO-2's release
    hook on :meth:`add_hook`.

    ``reduce_dtype`` is the dtype in which the gradient travels between ranks
    (the ``reduce_dtype`` of a mixed-precision policy; ``None``: its own).

    The sync claim says which one object reduces this group's flat gradient
    across ranks (the storage's grad sync, or one ``ShardedOptimizer``): a
    second one would reduce it twice, so :meth:`claim_sync` refuses it with
    the holder's message. The holder is held weakly: its claim ends with it.
    """

    __slots__ = ("_claim", "_kept", "_lock", "_targets", "hooks", "keep", "keeper", "reduce_dtype")

    #: Two buffers: with gradients kept across steps (accumulation, ``set_to_none=False``)
    #: one is the flat gradient while backward fills the other.
    KEEP = 2

    def __init__(self) -> None:
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
        #: Who holds the flat gradient while the members are leaf parameters (unflattened mode);
        #: ``None``: the flat parameter's own ``.grad``.
        self.keeper: GradKeeper | None = None

    # ------------------------------------------------------------ the flat gradient
    def read(self, flat: Tensor) -> Tensor | None:
        """Return the flat gradient of ``flat`` (this group's flat parameter), or ``None``."""
        keeper = self.keeper
        return BASE_GRAD.__get__(flat) if keeper is None else keeper.flat_grad(flat)

    def write(self, flat: Tensor, value: Tensor | None) -> None:
        """Make ``value`` the flat gradient of ``flat``; in unflattened mode the leaves' views of it."""
        keeper = self.keeper
        if keeper is None:
            BASE_GRAD.__set__(flat, value)
        else:
            keeper.set_flat_grad(flat, value)

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

    def __deepcopy__(self, memo: dict[int, Any]) -> GradBuffer:
        return GradBuffer()  # a copy's gradients are its own: no memory, hooks or claim of the original


def check_sync(buffers: Sequence[GradBuffer], owner: object, what: str) -> None:
    """Refuse ``owner`` if another live owner syncs the gradient of one of ``buffers``.

    Args:
        buffers: the groups' buffers.
        owner: the claimant.
        what: what the claimant does, the start of the message (``"ShardedOptimizer syncs ..."``).

    Raises:
        RuntimeError: ``"<what>, but <the holder's message>"``.
    """
    for buffer in buffers:
        held = buffer.refusal_for(owner)
        if held is not None:
            raise RuntimeError(f"{what}, but {held}")


def claim_sync(buffers: Sequence[GradBuffer], owner: object, what: str, refusals: Sequence[str]) -> None:
    """Claim the sync of every buffer for ``owner`` (see :meth:`GradBuffer.claim_sync`), or of none.

    Args:
        buffers: the groups' buffers.
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
    holds exactly one reference to the storage (see :meth:`GradBuffer.take`).
    """
    shapes = dict(zip(layout.segments, layout.shapes))
    segments, offset = [], 0
    for seg, size in enumerate(layout.split_sizes):
        shape = tuple(shapes.get(seg, (size,)))
        stride = torch.empty(shape, device="meta").stride()
        segments.append(torch.empty(0, dtype=dtype).set_(memory, offset, shape, stride))
        offset += size
    return segments, [seg for seg in range(len(layout.split_sizes)) if seg not in shapes]


class _GroupSplit(torch.autograd.Function):  # the name shows in graphs: _GroupSplitBackward
    """All views of a group as the outputs of one autograd node.

    The node keeps only the (immutable) layout and the group's gradient
    buffer: a reference to anything that holds the cached views would make a
    cycle through the C++ autograd graph that Python's garbage collector
    cannot see, and leak the flat buffer.
    """

    @staticmethod
    def forward(
        flat: Tensor, layout: GroupLayout, buffer: GradBuffer, source: Tensor | None = None
    ) -> tuple[Tensor, ...]:
        # Detached views of the buffer: they alias it and share its version counter, but
        # autograd sees plain outputs, not views of a function that returns several views.
        # So the outputs stay usable after in-place updates of the buffer (an optimizer
        # step): the cache serves them until the buffer is replaced, and autograd's own
        # check still refuses a backward whose saved weights were changed in place, with
        # the plain model's message. Wrapping a plain output is also cheap for autograd.
        # With a ``source`` (``GroupViews.source``), the views are its slots; the gradient is still
        # the flat tensor's (a cast's derivative is the identity).
        chunks = (flat if source is None else source).detach().split(layout.split_sizes)
        # One-dimensional slots already have their shape: skip a view (a few us each).
        return tuple(
            (chunks[seg] if len(shape) == 1 else chunks[seg].view(shape)).detach()
            for seg, shape in zip(layout.segments, layout.shapes)
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        flat, layout, buffer = inputs[:3]
        served = inputs[3] if len(inputs) > 3 and inputs[3] is not None else flat
        ctx.layout = layout
        ctx.buffer = buffer
        ctx.flat = weakref.ref(flat)
        # The flat gradient is built in the flat tensor's dtype: views served from a source of
        # another dtype (a low-precision compute copy) have their gradients converted while they
        # are copied together, in the same pass.
        ctx.like = (flat.dtype, served.device)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor, None, None, None]:
        layout: GroupLayout = ctx.layout
        dtype, device = ctx.like
        sizes = layout.split_sizes
        buffer: GradBuffer = ctx.buffer
        hooks = buffer.hooks
        if torch.is_grad_enabled():  # create_graph=True: the gradient itself is differentiated
            out = torch.cat(_flat_pieces(_by_segment(layout, grads), sizes, dtype, device))
            for hook in hooks:
                out = _ready(hook, out, False)
            return out, None, None, None
        out, segments, padding = buffer.take(layout, dtype, device)
        divisor, by = None, None
        if hooks and layout.numel * dtype.itemsize >= PRESCALE_MIN_SEGMENT_BYTES * len(sizes):
            flat = ctx.flat()
            if flat is not None:
                for hook in hooks:
                    divisor = hook.divisor(flat)
                    if divisor is not None:
                        by = hook
                        break
        if divisor is None and segments is not None:
            targets, sources = [], []
            for seg, grad in zip(layout.segments, grads):
                if grad is None:
                    segments[seg].zero_()
                else:
                    targets.append(segments[seg])
                    sources.append(grad)
            for seg in padding:
                segments[seg].zero_()
            if targets:
                torch._foreach_copy_(targets, sources)
        elif divisor is None:
            torch.cat(_flat_pieces(_by_segment(layout, grads), sizes, dtype, device), out=out)
        else:  # divide while copying, instead of one more pass over the whole gradient later
            for chunk, piece in zip(out.split(sizes), _by_segment(layout, grads)):
                if piece is None:
                    chunk.zero_()
                else:
                    torch.div(piece, divisor, out=chunk.view(piece.shape))
        for hook in hooks:
            out = _ready(hook, out, hook is by)
        return out, None, None, None


def _ready(hook: FlatGradHook, grad: Tensor, divided: bool) -> Tensor:
    """Hand ``grad`` to ``hook``; return the gradient from then on (the hook's replacement, if any)."""
    replaced = hook.grad_ready(grad, divided)
    return grad if replaced is None else replaced


def _by_segment(layout: GroupLayout, grads: tuple[Tensor | None, ...]) -> list[Tensor | None]:
    """Return the slots' gradients placed at their segments (``None`` for padding and unused slots)."""
    pieces: list[Tensor | None] = [None] * len(layout.split_sizes)
    for seg, grad in zip(layout.segments, grads):
        pieces[seg] = grad
    return pieces


def _flat_pieces(
    pieces: list[Tensor | None], sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[Tensor]:
    """Return the segments of a flat gradient as 1-D tensors, zeros where none was computed."""
    return [
        piece.reshape(-1) if piece is not None else torch.zeros(size, dtype=dtype, device=device)
        for piece, size in zip(pieces, sizes)
    ]
