"""The hot path: serving ``module.weight`` as a view of the group's flat tensor.

One :class:`GroupViews` per group makes every view of a group *at once* per
pass (per thread, per grad mode) and hands them out from a cache, so that
backward costs O(total numel) per group instead of one full-size gradient per
parameter. In grad mode the views are the outputs of one autograd node
(``_GroupSplit`` in ``_grad.py``) whose backward concatenates their gradients
into the flat gradient; without grad they come from one ``split`` of a
detached alias, which records nothing. Either way every view aliases the
buffer and shares its version counter, so views stay valid across in-place
updates (optimizer steps) while autograd still refuses a backward whose saved
weights were changed in place. The cache is rebuilt whenever the flat tensor is
replaced or re-backed (``.data`` swap, ``module.to()``), and in grad mode when
it is frozen or unfrozen. Each grad and inference mode and each thread has
views of its own. Under ``torch.compile`` the cache is skipped (compiled code
sees plain tensor ops) and the registered module's forward splits each group
once (:func:`trace_split`).
"""

from __future__ import annotations

import copy
import threading
import weakref
from enum import IntEnum
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.jit import _trace as _jit_trace

from .grad import GradBuffer, _GroupSplit
from .layout import GroupLayout
from .names import registered_storage

__all__ = [
    "CacheEntry",
    "GradMode",
    "GroupViews",
    "end_trace_split",
    "same_memory",
    "trace_split",
]

_is_compiling = torch.compiler.is_compiling
# A quarter of the cost of ``is_compiling()`` on the hot path. Other tracers (make_fx, a
# non-strict ``torch.export``) run the eager path with fake tensors, which have no
# ``data_ptr()``: those are never cached either (see ``GroupViews._uncached``).
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_is_grad_enabled = torch.is_grad_enabled
_is_inference = torch.is_inference_mode_enabled
_is_tracing = torch._C._is_tracing
_data_ptr = Tensor.data_ptr


class GradMode(IntEnum):
    """The autograd mode a view was made under: views of one mode never serve another."""

    NO_GRAD = 0
    GRAD = 1
    INFERENCE = 2


# Plain ints for the hot path (an enum member costs an attribute lookup per access).
_NO_GRAD, _GRAD, _INFERENCE = int(GradMode.NO_GRAD), int(GradMode.GRAD), int(GradMode.INFERENCE)


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


class CacheEntry:
    """The views of one group made for one thread and one :class:`GradMode`.

    Valid while the flat tensor is the same object with the same
    ``data_ptr()`` and, in grad mode, the same ``requires_grad`` and while the
    view served still has the node's history (an in-place change of a view
    under grad mode adds to it). In-place updates of the buffer do not
    invalidate it: every view aliases the buffer and shares its version
    counter (see ``_GroupSplit``). Each view's ``data_ptr()`` is kept too: a
    view whose ``.data`` was assigned points elsewhere, and the group lands the
    assigned values in the flat tensor (:meth:`GroupViews.sync`, run by the
    registered module's forward, state dicts, optimizer steps, toggles, and
    before the entry is rebuilt), which retires the entry. The hot path does not
    check it: until then, that view itself serves the assigned tensor.

    Attributes:
        flat: the flat tensor the views were made of (``None`` once retired).
        ptr: its ``data_ptr()`` then.
        chunks: the segments of one ``split`` (``None`` in grad mode: the views
            are the outputs of one autograd node).
        views: one view per slot; without grad made on first use (``None``
            until then).
        ptrs: the ``data_ptr()`` of each view when it was made.
        requires_grad: its ``requires_grad`` then.
        node: the ``grad_fn`` of the views (``None`` without grad or for a
            frozen buffer).
    """

    __slots__ = ("__weakref__", "chunks", "flat", "node", "ptr", "ptrs", "requires_grad", "views")

    def __init__(
        self,
        flat: Tensor,
        ptr: int,
        chunks: tuple[Tensor, ...] | None,
        views: list[Tensor | None],
        ptrs: list[int],
    ) -> None:
        self.flat: Tensor | None = flat
        self.ptr = ptr
        self.chunks = chunks
        self.views = views
        self.ptrs = ptrs
        self.requires_grad = flat.requires_grad
        first = views[0] if views else None
        self.node = None if first is None else first.grad_fn


class GroupViews:
    """Views of one group's tensors, read from ``params[flat_name]`` at each access.

    Args:
        params: the ``_parameters`` dict of the registered module (so that
            ``functional_call`` and ``using()`` substitutions are seen).
        flat_name: the key of the group's flat parameter in ``params``.
        layout: the group's layout.
        names: the qualified name of each slot, for error messages.

    Attributes:
        source: ``None`` (the views are views of the flat tensor), or a
            feature's function ``source(flat) -> tensor`` that gives the tensor
            to serve the views from instead: one-dimensional, of the flat
            tensor's size, e.g. a copy in another dtype. It is called only when
            the cache is rebuilt (never on a cached read; the feature calls
            :meth:`invalidate` when it changes its tensor's identity, and may
            update the tensor in place in between). In grad mode the views are
            still the outputs of the split node whose input is the flat tensor:
            backward builds the flat gradient in the source's dtype, a
            ``FlatGradHook`` may convert it, and it reaches the flat tensor's
            ``.grad`` (autograd casts it to that dtype otherwise). Only the
            eager cached path uses it: torch.compile, jit tracing and tensors
            without storage (vmap) split the flat tensor itself.
    """

    __slots__ = (
        "_entries",
        "_grad_buffer",
        "_segments",
        "_shapes",
        "_split",
        "_tls",
        "_traced",
        "flat_name",
        "layout",
        "names",
        "params",
        "source",
    )

    def __init__(
        self, params: dict[str, Any], flat_name: str, layout: GroupLayout, names: tuple[str, ...] = ()
    ) -> None:
        self.params = params
        self.flat_name = flat_name
        self.layout = layout
        self.names = names
        self._split = list(layout.split_sizes)
        self._segments = layout.segments
        self._shapes = layout.shapes
        self._tls = threading.local()
        #: Every thread's live cache entries, for :meth:`sync`.
        self._entries: weakref.WeakSet[CacheEntry] = weakref.WeakSet()
        self._traced: tuple[Tensor, tuple[Tensor, ...]] | None = None
        self._grad_buffer = GradBuffer()
        self.source: Callable[[Tensor], Tensor] | None = None

    @property
    def grad_buffer(self) -> GradBuffer:
        """Return the group's flat-gradient memory and hooks (shared by all its split nodes)."""
        return self._grad_buffer

    def invalidate(self) -> None:
        """Drop every thread's cached views (they hold the old flat tensor), landing `.data` writes first.

        Raises:
            RuntimeError: as :meth:`sync` (the views are dropped all the same).
        """
        try:
            self.sync()
        finally:
            self._tls = threading.local()
            self._entries = weakref.WeakSet()

    def current(self) -> Tensor:
        """Return the tensor currently registered as the flat parameter."""
        return self.params[self.flat_name]

    def view(self, index: int) -> Tensor:
        """Return slot ``index`` as a view of the current flat tensor."""
        flat: Tensor = self.params[self.flat_name]
        if _is_dynamo_compiling():
            return self._uncached(flat, index)
        if _jit_trace._trace_module_map is not None and _tracing_a_module():
            # torch.jit.trace: the graph reads the flat parameter, split once by the
            # registered module's forward; a traced submodule does not own it.
            traced = self._traced
            if traced is None or traced[0] is not flat:
                raise _submodule_trace_error(self, index)
            return traced[1][self._segments[index]].view(self._shapes[index])
        cache: dict[int, CacheEntry] = self._tls.__dict__  # type: ignore[assignment]
        if _is_grad_enabled():
            mode = _GRAD
            entry = cache.get(_GRAD)
            if (
                entry is None
                or entry.flat is not flat
                or entry.requires_grad is not flat.requires_grad
                # A view changed in place under grad mode carries that change in its
                # history: serving it again would differentiate through it every pass.
                or entry.views[index].grad_fn is not entry.node  # type: ignore[union-attr]
            ):
                return self._rebuild(flat, mode, cache, index)
        else:
            mode = _INFERENCE if _is_inference() else _NO_GRAD
            entry = cache.get(mode)
            if entry is None or entry.flat is not flat:
                return self._rebuild(flat, mode, cache, index)
        try:
            moved = entry.ptr != flat.data_ptr()
        except RuntimeError:  # no storage (vmap): never cached
            moved = True
        if moved:
            return self._rebuild(flat, mode, cache, index)
        views = entry.views
        view = views[index]
        if view is None:
            view = views[index] = entry.chunks[self._segments[index]].view(self._shapes[index])  # type: ignore[index]
            entry.ptrs[index] = view.data_ptr()
        return view

    def _rebuild(self, flat: Tensor, mode: int, cache: dict[int, CacheEntry], index: int) -> Tensor:
        try:
            ptr = flat.data_ptr()
        except RuntimeError:  # fake (tracing) and vmap's batched tensors have no storage
            return self._uncached(flat, index)
        old = cache.get(mode)
        if old is not None and old.flat is not None:
            cache.pop(mode)
            self._entries.discard(old)
            if any(v is not None and v.data_ptr() != p for v, p in zip(old.views, old.ptrs)):
                self._land(old)  # `.data` written before the flat tensor changed: it still lands
        if flat.dim() != 1 or flat.shape[0] != self.layout.numel:
            raise RuntimeError(
                f"{self.flat_name} has shape {tuple(flat.shape)} but its layout needs a "
                f"one-dimensional tensor of {self.layout.numel} elements (was its .data "
                "replaced?); assign a tensor of that size, or load a state dict"
            )
        served = None if self.source is None else _source(self, flat)
        views: list[Tensor | None]
        if mode == _GRAD and flat.requires_grad:
            # One autograd node for the whole group: backward concatenates the
            # gradients of every view into the flat gradient in one go.
            chunks = None
            views = list(_GroupSplit.apply(flat, self.layout, self._grad_buffer, served))
        else:
            # Views of a detached alias record no autograd history, so they stay
            # usable after in-place updates of the buffer (a view of the parameter
            # itself made under no_grad refuses ``grad_fn`` once the buffer changed).
            chunks = (flat if served is None else served).detach().split(self._split)
            if mode == _GRAD:  # frozen: every view now, as above (their grad_fn is None)
                views = [chunks[seg].view(shape) for seg, shape in zip(self._segments, self._shapes)]
            else:
                views = [None] * len(self._shapes)
        ptrs = [0 if v is None else v.data_ptr() for v in views]
        entry = cache[mode] = CacheEntry(flat, ptr, chunks, views, ptrs)
        self._entries.add(entry)
        view = views[index]
        if view is None:
            view = views[index] = chunks[self._segments[index]].view(self._shapes[index])  # type: ignore[index]
            ptrs[index] = view.data_ptr()
        return view

    def _uncached(self, flat: Tensor, index: int) -> Tensor:
        """Return slot ``index`` with plain tensor ops: no cache, no version guard (for tracers).

        Inside the registered module's forward under ``torch.compile`` the group
        was split once (see :func:`trace_split`): every view comes from that split.
        """
        traced = self._traced
        chunks = traced[1] if traced is not None and traced[0] is flat else flat.split(self._split)
        return chunks[self._segments[index]].view(self._shapes[index])

    def sync(self) -> None:
        """Land the values of every cached view (any thread, any mode) whose ``.data`` was assigned.

        Raises:
            RuntimeError: if an assigned tensor has another shape, dtype
                or device than its slot (the flat tensor is then unchanged).
        """
        for entry in list(self._entries):
            try:
                moved = list(map(_data_ptr, entry.views)) != entry.ptrs  # type: ignore[arg-type]
            except TypeError:  # views not made yet (None): check the made ones
                moved = any(v is not None and v.data_ptr() != p for v, p in zip(entry.views, entry.ptrs))
            if moved:
                self._land(entry)

    def _land(self, entry: CacheEntry) -> None:
        """Copy the values assigned through ``.data`` to views of ``entry`` into its flat tensor.

        The entry is retired either way (its views no longer alias the flat tensor).
        """
        flat = entry.flat.detach()  # type: ignore[union-attr]
        entry.flat = None  # retired: the hot path's identity check rebuilds the views
        self._entries.discard(entry)
        storage = flat.untyped_storage()._cdata
        writes = []
        for index, (view, ptr) in enumerate(zip(entry.views, entry.ptrs)):
            if view is None or view.data_ptr() == ptr:
                continue
            if view.untyped_storage()._cdata == storage:
                continue  # the buffer itself moved or was freed (FSDP2 frees unsharded ones)
            value = view.data
            shape = torch.Size(self._shapes[index])
            if value.shape != shape or value.dtype != flat.dtype or value.device != flat.device:
                name = self.names[index] if index < len(self.names) else f"slot {index} of {self.flat_name}"
                raise RuntimeError(
                    f"cannot take `{name}.data = tensor`: the flat storage keeps its values in "
                    f"{self.flat_name} as shape {tuple(shape)}, {flat.dtype} on {flat.device}; "
                    f"got shape {tuple(value.shape)}, {value.dtype} on {value.device}; the value "
                    "was not written. Assign a tensor of the slot's shape, dtype and device (its "
                    "values are copied into the flat buffer), or change shapes inside "
                    "storage.unflattened() or after remove_flat_storage"
                )
            writes.append((index, value))
        if writes:
            targets = self.split(flat)
            with torch.no_grad():
                for index, value in writes:
                    targets[index].copy_(value)

    def split(self, tensor: Tensor) -> list[Tensor]:
        """Return views of every slot of ``tensor``, a tensor shaped like the flat parameter."""
        chunks = tensor.split(self._split)
        return [chunks[seg].view(shape) for seg, shape in zip(self._segments, self._shapes)]

    def trace(self, active: bool) -> None:
        """Split the current flat tensor once for the traced forward (``active``), or forget that split."""
        if active:
            flat = self.params[self.flat_name]
            self._traced = (flat, flat.split(self._split))
        else:
            self._traced = None

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupViews:
        new = GroupViews.__new__(GroupViews)
        memo[id(self)] = new
        new.params = copy.deepcopy(self.params, memo)
        new.flat_name = self.flat_name
        new.layout = self.layout
        new._split = self._split
        new._segments = self._segments
        new._shapes = self._shapes
        new.names = self.names
        new._tls = threading.local()
        new._entries = weakref.WeakSet()
        new._traced = None
        new._grad_buffer = GradBuffer()
        new.source = None  # a feature's copy (``Feature.copy_for``) sets its own
        return new

    def __getstate__(self) -> None:
        raise RuntimeError(
            "the view cache of a flat storage cannot be pickled on its own; pickle the "
            "registered module (torch.save(model)), or save module.state_dict() or "
            "storage.flat_state_dict()"
        )


def _source(group: GroupViews, flat: Tensor) -> Tensor:
    """Return the tensor that ``group.source`` serves ``flat``'s views from (checked: flat-shaped)."""
    served = group.source(flat)  # type: ignore[misc]
    if served.shape != flat.shape or served.device != flat.device:
        raise RuntimeError(
            f"the view source of {group.flat_name} gave a tensor of shape {tuple(served.shape)} on "
            f"{served.device}; the views need one of shape {tuple(flat.shape)} on {flat.device}"
        )
    return served


def _tracing_a_module(module: nn.Module | None = None) -> bool:
    """Return whether ``torch.jit.trace`` is tracing a module's forward (``module``, if given).

    ``trace_module`` records the traced module under ``"__module"``; the legacy
    ONNX exporter traces a function whose inputs are the state dict's tensors
    (the cached views themselves), so it is served from the cache.
    """
    traced = _jit_trace._trace_module_map
    if traced is None or "__module" not in traced or not _is_tracing():
        return False
    return module is None or traced["__module"] is module


def _submodule_trace_error(group: GroupViews, index: int) -> RuntimeError:
    name = group.names[index] if index < len(group.names) else group.flat_name
    return RuntimeError(
        f"torch.jit.trace reached {name} outside the forward of the registered module: the traced "
        f"module does not own {group.flat_name}, so its weights would be baked in as constants. "
        "Trace the module given to register_flat_storage, or trace a copy after "
        "remove_flat_storage(copy)"
    )


def trace_split(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of the registered module: under torch.compile or jit tracing, split each group once.

    Every view that the traced forward reads then comes from that one split of
    the flat parameter (read from the module, so the graph reads it rather than
    baking constants), and the compiled backward builds each flat gradient with
    one ``cat``. In eager mode it lands pending writes (``weight.data = t``,
    a replaced flat parameter) instead; the per-thread cache serves the views.
    """
    storage = registered_storage(module)
    if _is_compiling() or _tracing_a_module(module):
        for group in storage.groups():
            group.views.trace(True)
    else:
        storage.sync_writes()


def end_trace_split(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of the registered module: forget the traced split (see ``trace_split``)."""
    if _is_compiling() or _tracing_a_module(module):
        for group in registered_storage(module).groups():
            group.views.trace(False)
