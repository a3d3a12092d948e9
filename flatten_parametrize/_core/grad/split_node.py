"""The autograd node of a group: all its views as the outputs of one node.

:class:`_GroupSplit` makes every view of a group (``view_cache.GroupViews``)
the output of one autograd node; its backward builds the group's flat
gradient in one go, in memory that the group's gradient owner
(:class:`~.owner.GroupGrad`) lends it, and hands it to the owner's
:class:`~.grad.FlatGradHook` objects as it is built.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from ..layout import GroupLayout
from .owner import PRESCALE_MIN_SEGMENT_BYTES, FlatGradHook, GroupGrad

__all__: list[str] = []


class _GroupSplit(torch.autograd.Function):  # the name shows in graphs: _GroupSplitBackward
    """All views of a group as the outputs of one autograd node.

    The node keeps only the (immutable) layout and the group's gradient
    owner: a reference to anything that holds the cached views would make a
    cycle through the C++ autograd graph that Python's garbage collector
    cannot see, and leak the flat buffer.
    """

    @staticmethod
    def forward(
        flat: Tensor, layout: GroupLayout, grads: GroupGrad, source: Tensor | None = None
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
        flat, layout, grads = inputs[:3]
        served = inputs[3] if len(inputs) > 3 and inputs[3] is not None else flat
        ctx.layout = layout
        ctx.grads = grads
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
        owner: GroupGrad = ctx.grads
        hooks = owner.hooks
        if torch.is_grad_enabled():  # create_graph=True: the gradient itself is differentiated
            out = torch.cat(_flat_pieces(_by_segment(layout, grads), sizes, dtype, device))
            for hook in hooks:
                out = _ready(hook, out, False)
            return out, None, None, None
        out, segments, padding = owner.take(layout, dtype, device)
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
