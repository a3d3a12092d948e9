"""The hot path: serving ``module.weight`` as a view of the group's flat tensor.

One :class:`GroupViews` per group makes every view of a group *at once* per
pass (per thread, per grad mode) and hands them out from a cache, so that
backward costs O(total numel) per group instead of one full-size gradient per
parameter. In grad mode the views are the outputs of one autograd node
(``_GroupSplit``) whose backward concatenates their gradients into the flat
gradient; without grad they come from one ``split``. The cache is rebuilt
whenever the flat tensor is replaced, changed in place (``_version``),
re-backed (``.data`` swap, ``module.to()``), frozen or unfrozen, or read under
another grad or inference mode.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any, Callable, Protocol, cast

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrize import ParametrizationList

from ._layout import GroupLayout
from ._names import MODULE_STATE_ATTR, STORAGE_ATTR

__all__ = [
    "GroupViews",
    "FlatView",
    "FlatViewList",
    "HiddenParametrizations",
    "make_property",
    "same_memory",
]

_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_is_inference = torch.is_inference_mode_enabled
_MISSING = object()


def same_memory(a: Tensor, b: Tensor) -> bool:
    """Return whether ``a`` and ``b`` are the same elements of the same memory."""
    try:
        return (
            a.data_ptr() == b.data_ptr()
            and a.dtype == b.dtype
            and a.device == b.device
            and a.shape == b.shape
            and a.stride() == b.stride()
        )
    except RuntimeError:  # tensors without storage (vmap, functorch wrappers)
        return a is b


class GroupViews:
    """Views of one group's tensors, read from ``params[flat_name]`` at each access.

    Args:
        params: the ``_parameters`` dict of the registered module (so that
            ``functional_call`` and ``using()`` substitutions are seen).
        flat_name: the key of the group's flat parameter in ``params``.
        layout: the group's layout.
    """

    __slots__ = (
        "_grad_buffer",
        "_segments",
        "_shapes",
        "_split",
        "_tls",
        "_traced",
        "flat_name",
        "layout",
        "params",
    )

    def __init__(self, params: dict[str, Any], flat_name: str, layout: GroupLayout) -> None:
        self.params = params
        self.flat_name = flat_name
        self.layout = layout
        self._split = list(layout.split_sizes)
        self._segments = layout.segments
        self._shapes = layout.shapes
        self._tls = threading.local()
        self._traced: tuple[Tensor, tuple[Tensor, ...]] | None = None
        self._grad_buffer = GradBuffer()

    @property
    def grad_buffer(self) -> GradBuffer:
        """Return the group's reusable flat-gradient memory (shared by all its split nodes)."""
        return self._grad_buffer

    def invalidate(self) -> None:
        """Drop every thread's cached views (they hold the old flat tensor alive)."""
        self._tls = threading.local()

    def current(self) -> Tensor:
        """Return the tensor currently registered as the flat parameter."""
        return self.params[self.flat_name]  # type: ignore[no-any-return]

    def view(self, index: int) -> Tensor:
        """Return slot ``index`` as a view of the current flat tensor."""
        flat = self.params[self.flat_name]
        if _is_compiling():
            # Compiled code sees plain tensor ops: no cache, no version guard. Inside the
            # registered module's forward the group was split once (see ``trace_split``).
            traced = self._traced
            if traced is not None and traced[0] is flat:
                chunks = traced[1]
            else:
                chunks = flat.split(self._split)
            return chunks[self._segments[index]].view(self._shapes[index])
        if _is_grad_enabled():
            key = 1
        else:
            key = 2 if _is_inference() else 0
        cache: dict[Any, Any] = self._tls.__dict__
        entry = cache.get(key)
        if (
            entry is None
            or entry[0] is not flat
            or entry[1] != flat._version
            or entry[5] is not flat.requires_grad
        ):
            return self._rebuild(flat, key, cache, index)
        try:
            if entry[2] != flat.data_ptr():
                return self._rebuild(flat, key, cache, index)
        except RuntimeError:
            return self._rebuild(flat, key, cache, index)
        views = entry[4]
        view = views[index]
        if view is None:
            view = views[index] = entry[3][self._segments[index]].view(self._shapes[index])
        return view

    def _rebuild(self, flat: Tensor, key: int, cache: dict[Any, Any], index: int) -> Tensor:
        try:
            ptr = flat.data_ptr()
        except RuntimeError:  # vmap's batched tensors have no storage: never cache them
            return flat.split(self._split)[self._segments[index]].view(self._shapes[index])
        views: list[Tensor | None]
        if key == 1 and flat.requires_grad:
            # One autograd node for the whole group: backward concatenates the
            # gradients of every view into the flat gradient in one go.
            chunks = None
            views = list(_GroupSplit.apply(flat, self.layout, self._grad_buffer))
        else:
            chunks = flat.split(self._split)
            views = [None] * len(self._shapes)
        cache[key] = (flat, flat._version, ptr, chunks, views, flat.requires_grad)
        view = views[index]
        if view is None:
            view = views[index] = chunks[self._segments[index]].view(self._shapes[index])  # type: ignore[index]
        return view

    def split(self, tensor: Tensor) -> list[Tensor]:
        """Return views of every slot of ``tensor``, a tensor shaped like the flat parameter."""
        chunks = tensor.split(self._split)
        return [chunks[seg].view(shape) for seg, shape in zip(self._segments, self._shapes)]

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupViews:
        new = GroupViews.__new__(GroupViews)
        memo[id(self)] = new
        new.params = copy.deepcopy(self.params, memo)
        new.flat_name = self.flat_name
        new.layout = self.layout
        new._split = self._split
        new._segments = self._segments
        new._shapes = self._shapes
        new._tls = threading.local()
        new._traced = None
        new._grad_buffer = GradBuffer()
        return new

    def __getstate__(self) -> None:
        raise RuntimeError(
            "a flattened module cannot be pickled (its classes are generated at "
            "registration); save module.state_dict() or storage.flat_state_dict() "
            "instead, or call remove_flat_storage first"
        )


class Prescale(Protocol):
    """Lets the split node divide a flat gradient while building it (see ``_distributed``)."""

    def divisor(self, flat: Tensor) -> int | None:
        """Return the divisor for this backward's gradient of ``flat``, or ``None`` to leave it."""

    def produced(self, grad: Tensor) -> None:
        """Take note of a gradient that was divided while it was built."""


#: Dividing while copying costs one small op per segment; below this many bytes per segment on
#: average, one ``cat`` and a separate division pass are cheaper.
PRESCALE_MIN_SEGMENT_BYTES = 16 * 1024


class GradBuffer:
    """One reusable CPU buffer for a group's flat gradient.

    Each backward builds the group's flat gradient as a new tensor; on CPU a
    fresh multi-megabyte allocation is served by new pages that the kernel
    zero-fills on first touch, every step. When memory kept from an earlier
    backward is no longer used (the gradient was dropped by
    ``zero_grad(set_to_none=True)``, or added into the kept ``.grad``),
    backward writes into it again instead. It holds no reference to the views
    or the module (it is reachable from autograd nodes). While gradient sync
    is enabled, ``prescale`` may have backward divide the gradient as it is
    copied together.
    """

    __slots__ = ("_kept", "_lock", "keep", "prescale")

    #: Two buffers: with gradients kept across steps (accumulation, ``set_to_none=False``)
    #: one is the flat gradient while backward fills the other.
    KEEP = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[torch.UntypedStorage] = []
        #: How many buffers to keep (``0``: every flat gradient is fresh memory, freed with it).
        self.keep = self.KEEP
        #: Set while gradient sync may have backward divide this group's flat gradient.
        self.prescale: Prescale | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Return a tensor of ``numel`` elements: kept memory that nothing uses, else new memory."""
        if device.type != "cpu":  # device allocators cache freed memory themselves
            return torch.empty(numel, dtype=dtype, device=device)
        nbytes = numel * dtype.itemsize
        with self._lock:
            self._kept = [s for s in self._kept if s.nbytes() == nbytes][: self.keep]  # forget other layouts
            for kept in self._kept:
                if torch._C._storage_Use_Count(kept._cdata) == 1:
                    return torch.empty(0, dtype=dtype, device=device).set_(kept, 0, (numel,), (1,))
            out = torch.empty(numel, dtype=dtype, device=device)
            if len(self._kept) < self.keep:
                self._kept.append(out.untyped_storage())
            return out

    def __deepcopy__(self, memo: dict[int, Any]) -> GradBuffer:
        return GradBuffer()


class _GroupSplit(torch.autograd.Function):
    """All views of a group as the outputs of one autograd node.

    The node keeps only the (immutable) layout and the group's gradient
    buffer: a reference to anything that holds the cached views would make a
    cycle through the C++ autograd graph that Python's garbage collector
    cannot see, and leak the flat buffer.
    """

    @staticmethod
    def forward(flat: Tensor, layout: GroupLayout, buffer: GradBuffer) -> tuple[Tensor, ...]:  # type: ignore[override]
        # Views of a detached alias, not of the input itself: autograd then wraps each
        # output cheaply (about 4 us instead of 20), and in-place changes to an output are
        # still refused, as for the outputs of any function that returns several views.
        chunks = flat.detach().split(layout.split_sizes)
        # One-dimensional slots already have their shape: skip a view (a few us each).
        return tuple(
            chunks[seg] if len(shape) == 1 else chunks[seg].view(shape)
            for seg, shape in zip(layout.segments, layout.shapes)
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        flat, layout, buffer = inputs
        ctx.layout = layout
        ctx.buffer = buffer
        ctx.flat = weakref.ref(flat)
        ctx.like = (flat.dtype, flat.device)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor, None, None]:  # type: ignore[override]
        layout: GroupLayout = ctx.layout
        dtype, device = ctx.like
        sizes = layout.split_sizes
        pieces: list[Tensor | None] = [None] * len(sizes)
        for seg, grad in zip(layout.segments, grads):
            pieces[seg] = grad
        if torch.is_grad_enabled():  # create_graph=True: the gradient itself is differentiated
            return torch.cat(_flat_pieces(pieces, sizes, dtype, device)), None, None
        buffer: GradBuffer = ctx.buffer
        out = buffer.take(layout.numel, dtype, device)
        prescale, divisor = buffer.prescale, None
        if prescale is not None and layout.numel * dtype.itemsize >= PRESCALE_MIN_SEGMENT_BYTES * len(sizes):
            flat = ctx.flat()
            if flat is not None:
                divisor = prescale.divisor(flat)
        if prescale is None or divisor is None:
            return torch.cat(_flat_pieces(pieces, sizes, dtype, device), out=out), None, None
        # Divide while copying, instead of one more pass over the whole gradient later.
        for chunk, piece in zip(out.split(sizes), pieces):
            if piece is None:
                chunk.zero_()
            else:
                torch.div(piece, divisor, out=chunk.view(piece.shape))
        prescale.produced(out)
        return out, None, None


def _flat_pieces(
    pieces: list[Tensor | None], sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[Tensor]:
    """Return the segments of a flat gradient as 1-D tensors, zeros where none was computed."""
    return [
        piece.reshape(-1) if piece is not None else torch.zeros(size, dtype=dtype, device=device)
        for piece, size in zip(pieces, sizes)
    ]


def trace_split(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of the registered module: under torch.compile, split each group once.

    Every view that the traced forward reads then comes from that one split, so
    the compiled backward builds each flat gradient with one ``cat``. In eager
    mode it does nothing (the per-thread cache plays that role).
    """
    if _is_compiling():
        for group in module.__dict__[STORAGE_ATTR]._views:
            flat = group.params[group.flat_name]
            group._traced = (flat, flat.split(group._split))


def end_trace_split(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of the registered module: forget the traced split (see ``trace_split``)."""
    if _is_compiling():
        for group in module.__dict__[STORAGE_ATTR]._views:
            group._traced = None


def _assignment_error(module: nn.Module, name: str) -> RuntimeError:
    return RuntimeError(
        f"cannot assign to {type(module).__name__}.{name}: it is a view of a flat "
        f"storage and assigning a new tensor would be lost. To write values use "
        f"`with torch.no_grad(): module.{name}.copy_(value)`; to run with other weights "
        f"use storage.using(...), storage.unflattened(), or functional_call with the "
        f"flat parameter's name (flat_param_<group>)"
    )


def make_property(name: str) -> property:
    """Return the class property that serves attribute ``name`` of a flattened module.

    In unflattened mode the attribute is a real parameter in ``_parameters``
    and is returned as is; in flat mode it is the slot's view.
    """

    def fget(module: nn.Module) -> Tensor:
        param = module._parameters.get(name, _MISSING)
        if param is not _MISSING:
            return param  # type: ignore[return-value]
        group, index = module.__dict__[MODULE_STATE_ATTR].slots[name]
        return group.view(index)  # type: ignore[no-any-return]

    def fset(module: nn.Module, value: Any) -> None:
        group, index = module.__dict__[MODULE_STATE_ATTR].slots[name]
        if isinstance(value, Tensor) and same_memory(value, group.view(index)):
            return
        raise _assignment_error(module, name)

    return property(fget, fset, doc=f"View of '{name}' in the flat storage.")


class FlatView(nn.Module):
    """The parametrization registered on each flattened attribute.

    Its ``forward`` returns the attribute's view of the flat buffer. Values
    cannot be assigned through ``right_inverse``: the flat buffer owns them.
    """

    def __init__(self, group: GroupViews, index: int, qualified_name: str) -> None:
        super().__init__()
        self.__dict__["_slot"] = (group, index)
        self.__dict__["_qualified_name"] = qualified_name
        self.__dict__["_registering"] = True

    def forward(self) -> Tensor:
        group, index = self.__dict__["_slot"]
        return group.view(index)  # type: ignore[no-any-return]

    def right_inverse(self, value: Tensor) -> tuple[()]:
        if self.__dict__.pop("_registering", False):
            return ()
        raise RuntimeError(
            f"cannot assign to {self.__dict__['_qualified_name']} through its "
            "parametrization: it is a view of a flat storage. Write values with "
            "`with torch.no_grad(): view.copy_(value)` or swap weights with storage.using(...)"
        )

    def extra_repr(self) -> str:
        group, index = self.__dict__["_slot"]
        layout = group.layout
        return (
            f"{group.flat_name}[{layout.offsets[index]}:"
            f"{layout.offsets[index] + layout.numels[index]}] -> {tuple(layout.shapes[index])}"
        )


class FlatViewList(ParametrizationList):
    """A ``ParametrizationList`` holding one :class:`FlatView` and no original tensor."""

    def _refuse(self, *args: Any) -> None:
        name = self.__dict__.get("_qualified_name", "a flattened attribute")
        raise RuntimeError(
            f"cannot add a parametrization on top of {name}: "
            "it is a view of a flat storage; register other parametrizations before "
            "register_flat_storage (their original tensors are then flattened), or call "
            "remove_flat_storage first"
        )

    append = _refuse  # type: ignore[assignment]
    insert = _refuse  # type: ignore[assignment]


class HiddenParametrizations(nn.ModuleDict):
    """The ``parametrizations`` container of a module, kept out of ``_modules``.

    ``torch.nn.utils.parametrize`` finds it by attribute, so ``is_parametrized``
    and friends work, while ``print(model)``, ``model.modules()`` and
    ``state_dict()`` stay exactly as before. If another parametrization is
    registered on the same module later, the container moves into
    ``_modules`` so that its tensors are seen by ``parameters()``.
    """

    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.__dict__["_owner"] = weakref.ref(owner)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        super().add_module(name, module)
        if not isinstance(module, FlatViewList):
            owner = self.__dict__["_owner"]()
            if owner is not None and owner.__dict__.get("parametrizations") is self:
                del owner.__dict__["parametrizations"]
                owner._modules["parametrizations"] = self

    def __deepcopy__(self, memo: dict[int, Any]) -> HiddenParametrizations:
        new = HiddenParametrizations.__new__(HiddenParametrizations)
        memo[id(self)] = new
        state = {k: v for k, v in self.__dict__.items() if k != "_owner"}
        new.__dict__.update(copy.deepcopy(state, memo))
        owner = self.__dict__["_owner"]()
        new.__dict__["_owner"] = (
            weakref.ref(memo.get(id(owner), owner)) if owner is not None else (lambda: None)
        )
        return new


def register_view(
    module: nn.Module,
    name: str,
    group: GroupViews,
    index: int,
    qualified_name: str,
    original: Tensor,
    on_undo: Callable[[Callable[[], None]], None],
) -> None:
    """Install the parametrization of ``module.<name>`` (the class must already be ours)."""
    view = FlatView(group, index, qualified_name)
    plist = FlatViewList([view], original, unsafe=True)
    plist.__dict__["_qualified_name"] = qualified_name
    container: nn.ModuleDict
    if "parametrizations" not in module.__dict__ and "parametrizations" not in module._modules:
        container = HiddenParametrizations(module)

        def drop_container() -> None:
            module.__dict__.pop("parametrizations", None)

        on_undo(drop_container)
        module.__dict__["parametrizations"] = container
    else:
        container = cast(nn.ModuleDict, module.parametrizations)

    def drop_entry() -> None:
        container._modules.pop(name, None)

    on_undo(drop_entry)
    container[name] = plist
