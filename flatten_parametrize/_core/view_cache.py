"""The hot path: serving ``module.weight`` as a view of the group's flat tensor.

One :class:`GroupViews` per group makes every view of a group *at once* per
pass (per thread, with grad mode on or off) and hands them out from a cache, so that
backward costs O(total numel) per group instead of one full-size gradient per
parameter. In grad mode the views are the outputs of one autograd node
(``_GroupSplit`` in ``grad/split_node.py``) whose backward concatenates their gradients
into the flat gradient; without grad they come from one ``split`` of a
detached alias, which records nothing. Either way every view aliases the
buffer and shares its version counter, so views stay valid across in-place
updates (optimizer steps) while autograd still refuses a backward whose saved
weights were changed in place. The cache is rebuilt whenever the flat tensor is
replaced or re-backed (``.data`` swap, ``module.to()``), and in grad mode when
it is frozen or unfrozen. Each thread has views of its own, one set with grad
and one without (``no_grad`` and ``inference_mode`` share it). Under
``torch.compile`` the cache is skipped (compiled code sees plain tensor ops) and
the registered module's forward splits each group once (:func:`trace_split`).

A cache hit reads the flat tensor from the module, compares it with the
thread's current entry and the grad mode with the entry's, and hands out the
view: no ``data_ptr()`` (a ``FlatParameter`` drops the cache when its ``.data``
is replaced), no scan. Writes to a view's ``.data`` are looked for only where a
read switches entries, when the flat parameter's ``.grad`` is read, and in the
library's own operations (see ``_writes.py``).
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.jit import _trace as _jit_trace

from .compiling import in_compiled_module_call, never_compiled
from .flat_parameter import FlatParameter
from .foreign import is_distributed
from .grad.engine import graph_task_id
from .grad.owner import GroupGrad
from .grad.split_node import _GroupSplit
from .layout import GroupLayout
from .names import registered_storage

__all__ = [
    "WRITE_SCANS",
    "CacheEntry",
    "GroupViews",
    "ViewSource",
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
_is_tracing = torch._C._is_tracing
_data_ptr = Tensor.data_ptr
_increment_version = torch.autograd.graph.increment_version
#: Key of a thread's current entry in its cache dict (:attr:`_ThreadViews.current`); the entries
#: themselves are keyed by grad mode (``True`` / ``False``).
_CURRENT = "current"

#: The work spent looking for writes made around the views (for tests and benchmarks):
#: ``"parameters"`` counts the ``_parameters`` dicts of changed modules visited,
#: ``"views"`` the cached views whose ``data_ptr()`` was compared, ``"exposed"`` the slots of a
#: source's tensor (a compute copy) compared with what they held when a view of them was read
#: outside the forward. A forward in which nothing was written adds nothing to any of them.
WRITE_SCANS = {"parameters": 0, "views": 0, "exposed": 0}


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


class ViewSource(Protocol):
    """Where a feature serves a group's views from instead of the flat tensor (``GroupViews.source``).

    E.g. a low-precision compute copy (``_features/mixed_precision/feature.py``). Its
    memory is not the flat tensor's, so what is written into the views must be
    landed in the flat tensor by the source, and what is written into the flat
    tensor behind its version counter must reach the source.
    """

    def __call__(self, flat: Tensor) -> Tensor:
        """Return the one-dimensional tensor, of ``flat``'s size and device, to serve the views from.

        Asked only when the group's cache is rebuilt: a first read, the flat
        tensor replaced, or its ``_version`` moved.
        """

    def exposed(self, index: int, view: Tensor) -> None:
        """Take note of slot ``index`` served as ``view`` outside the registered module's forward.

        Code outside the forward may write into ``view`` through ``.data`` (an
        init helper: ``layer.weight.data.normal_()``), which moves no version
        counter: the source keeps what it needs to find such writes.
        """

    def watching(self) -> bool:
        """Return whether views served outside the forward are watched now (:meth:`exposed`).

        While they are, a changed flat tensor makes new views (the old ones
        stop being watched unless outside code holds them); otherwise the
        views are kept and the source's tensor is updated in place.
        """

    def land(self) -> None:
        """Land in the flat tensor what was written into the source's views since the last call.

        Called at every sync point of the view cache (:meth:`GroupViews.sync`):
        the flat parameter's ``.grad`` read by an optimizer step, a ``.data``
        read, a rebuilt cache, the library's own operations.
        """


class _ThreadViews(threading.local):
    """A group's cache in each thread: its entries by grad mode, and the entry its last read used.

    ``current`` reads ``None`` in a thread that made no entry yet (a class default): the cached
    read (``attribute.py``) takes it with one attribute lookup, no dict method call.
    """

    current: CacheEntry | None = None


class CacheEntry:
    """The views of one group made for one thread, with grad mode on (``grad``) or off.

    ``no_grad`` and ``inference_mode`` share one entry: its views come from one
    ``split`` of a detached alias of a normal tensor, which both modes may use
    (and write in place). Under grad mode the views are the outputs of one
    autograd node (made all at once), or plain views for a frozen buffer.

    Valid while the flat tensor is the same object with the same
    ``requires_grad`` (the views require grad where it does, in both modes) and,
    in grad mode, the view served still has the node's history (an in-place
    change of a view under grad mode adds to it). A ``FlatParameter``
    drops the cache itself when its ``.data`` is replaced, and marks it
    ``trusted = False`` when its ``requires_grad`` is set; for any other flat
    tensor (FSDP2's unsharded parameter, whose memory is freed and allocated
    again; substitutes of ``using()``), ``data_ptr()`` is compared at each read
    (``watch_ptr``). In-place updates of the buffer do not invalidate it: every
    view aliases the buffer and shares its version counter (see ``_GroupSplit``).

    Each view made is kept in ``made`` with its ``data_ptr()`` and shape then (``ptrs``,
    ``shapes``): a view whose ``.data`` was assigned points elsewhere (or, given a crop of
    its own memory such as ``w.data[:8]``, has another shape), and a write scan
    (:meth:`GroupViews.sync`) lands the assigned values in the flat tensor and
    retires the entry. Until then that view itself serves the assigned tensor.

    Attributes:
        flat: the flat tensor the views were made of (``None`` once retired).
        ptr: its ``data_ptr()`` then.
        grad: the grad mode the views were made for.
        watch_ptr: whether reads compare ``flat.data_ptr()`` with ``ptr``.
        trusted: whether a cached read may skip ``flat.requires_grad`` (the
            inlined hit of ``attribute.py``): the flat tensor is a
            ``FlatParameter``, which reports a set ``requires_grad``
            (:meth:`GroupViews.on_requires_grad_set`), and none was reported
            since the last read that compared it.
        chunks: the segments of one ``split`` (``None`` in grad mode for a
            buffer that requires grad: the views are the outputs of one node).
        views: one view per slot; without grad made on first use (``None``
            until then).
        made: the slot index of every view made so far, in the order made.
        ptrs: the ``data_ptr()`` of each of those views when it was made.
        shapes: the shape of each of those views when it was made.
        requires_grad: ``flat.requires_grad`` then.
        version: ``flat._version`` then if the views come from a source (a
            copy that does not share the flat tensor's in-place updates), else ``-1``.
        node: the ``grad_fn`` of the views (``None`` without grad or for a
            frozen buffer).
    """

    __slots__ = (
        "__weakref__",
        "chunks",
        "flat",
        "grad",
        "made",
        "made_views",
        "node",
        "ptr",
        "ptrs",
        "requires_grad",
        "served",
        "shapes",
        "trusted",
        "version",
        "views",
        "watch_ptr",
    )

    def __init__(
        self,
        flat: Tensor,
        ptr: int,
        grad: bool,
        chunks: tuple[Tensor, ...] | None,
        views: list[Tensor | None],
        version: int = -1,
    ) -> None:
        self.flat: Tensor | None = flat
        self.ptr = ptr
        self.grad = grad
        self.watch_ptr = type(flat) is not FlatParameter
        self.trusted = not self.watch_ptr
        self.chunks = chunks
        self.views = views
        self.made: list[int] = [i for i, v in enumerate(views) if v is not None]
        self.made_views: list[Tensor] = [v for v in views if v is not None]
        self.ptrs: list[int] = [v.data_ptr() for v in self.made_views]
        self.shapes: list[torch.Size] = [v.shape for v in self.made_views]
        self.requires_grad = flat.requires_grad
        #: ``flat._version`` when the views were served from ``GroupViews.source`` (``-1``: from
        #: the flat tensor itself, whose in-place updates the views share).
        self.version = version
        #: The source's tensor the views alias (``None``: the flat tensor's own views).
        self.served: Tensor | None = None
        first = views[0] if views else None
        self.node = None if first is None else first.grad_fn

    def make(self, index: int, segment: int, shape: tuple[int, ...]) -> Tensor:
        """Make the view of slot ``index`` (no-grad entries make their views on first use).

        Where the flat tensor requires grad it is a detached alias that requires grad, as the
        plain model's parameter is under ``no_grad``: torch's ``matmul`` folds a non-contiguous
        batch into one ``mm`` only when the weight's transpose requires grad, and otherwise
        expands the weight into a batched copy (a linear layer on a transposed input, as
        ``MultiheadAttention(batch_first=True)`` runs it, was 4x slower under ``no_grad`` with
        plain views). It shares the buffer's memory and version counter; no history is
        recorded under ``no_grad``.
        """
        view = self.chunks[segment].view(shape)  # type: ignore[index]
        if self.requires_grad:
            view = view.detach().requires_grad_()
        self.views[index] = view
        self.made.append(index)
        self.made_views.append(view)
        self.ptrs.append(view.data_ptr())
        self.shapes.append(view.shape)
        return view

    def written(self) -> bool:
        """Return whether a view made from this entry was given other memory or shape (``.data = t``)."""
        WRITE_SCANS["views"] += len(self.made_views)
        made = self.made_views
        return list(map(_data_ptr, made)) != self.ptrs or [v.shape for v in made] != self.shapes


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
            feature's :class:`ViewSource`, ``source(flat) -> tensor``, that gives the tensor
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
            without storage (vmap) split the flat tensor itself (converted to
            ``cast``). Views served from a source are rebuilt when the flat
            tensor's ``_version`` moved (one integer compared per read), so
            that the source sees every in-place update of the flat tensor.
            A view read outside the registered module's forward is shown to
            the source (:meth:`ViewSource.exposed`), and every :meth:`sync`
            has it land what was written into its views; reading the flat
            parameter's ``.data`` (an alias that no version counter follows,
            which EMA libraries and hand-written steps write through) lands
            those writes, then moves the flat tensor's ``_version``, so that
            the source is asked again before the next use of the views.
        cast: ``None``, or the dtype that the uncached paths (torch.compile,
            jit tracing, vmap) convert the flat tensor to before splitting it,
            inside the traced graph: the counterpart of a ``source`` in another dtype.
    """

    __slots__ = (
        "__weakref__",
        "_entries",
        "_grads",
        "_masters",
        "_segments",
        "_shapes",
        "_split",
        "_tls",
        "_traced",
        "cast",
        "check_next_forward",
        "flat_name",
        "forward_depth",
        "layout",
        "names",
        "params",
        "source",
    )

    def __init__(
        self,
        params: dict[str, Any],
        flat_name: str,
        layout: GroupLayout,
        grads: GroupGrad,
        names: tuple[str, ...] = (),
    ) -> None:
        self.params = params
        self.flat_name = flat_name
        self.layout = layout
        self.names = names
        self._split = list(layout.split_sizes)
        self._segments = layout.segments
        self._shapes = layout.shapes
        self._tls = _ThreadViews()
        #: Every thread's live cache entries, for :meth:`sync`.
        self._entries: weakref.WeakSet[CacheEntry] = weakref.WeakSet()
        self._traced: tuple[Tensor, tuple[Tensor, ...]] | None = None
        #: The group's gradient owner (``Group.grads``), handed to each split node it makes.
        self._grads = grads
        self.source: ViewSource | None = None
        self.cast: torch.dtype | None = None
        #: How many forwards of the registered module are running (its forward hooks count them):
        #: views served from a source outside of them are shown to it (:meth:`ViewSource.exposed`).
        self.forward_depth = 0
        #: With a source: the flat tensor, its ``data_ptr()`` and one detached split of it, for
        #: :meth:`master_view`.
        self._masters: tuple[Tensor, int, tuple[Tensor, ...]] | None = None
        #: Set when a read switched entries (see :meth:`_switch`): the next forward of the
        #: registered module scans the views once (:meth:`land_flagged`).
        self.check_next_forward = False

    @property
    def grads(self) -> GroupGrad:
        """Return the group's gradient owner (``Group.grads``), given at construction."""
        return self._grads

    def invalidate(self) -> None:
        """Drop every thread's cached views (they hold the old flat tensor), landing `.data` writes first.

        Raises:
            RuntimeError: as :meth:`sync` (the views are dropped all the same).
        """
        try:
            self.sync()
        finally:
            self._tls = _ThreadViews()
            self._entries = weakref.WeakSet()
            self._masters = None

    def current(self) -> Tensor:
        """Return the tensor currently registered as the flat parameter."""
        return self.params[self.flat_name]

    def view(self, index: int) -> Tensor:
        """Return slot ``index`` as a view of the current flat tensor.

        A cache hit checks that the thread's current entry is for this flat
        tensor and grad mode (and, in grad mode, ``requires_grad`` and the
        view's history); nothing else is read, nothing is scanned.
        """
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
        entry = self._tls.current
        if entry is None or entry.flat is not flat or entry.grad is not _is_grad_enabled():
            return self._switch(flat, index)
        view = entry.views[index]
        if entry.requires_grad is not flat.requires_grad:  # frozen or unfrozen since
            return self._switch(flat, index)
        entry.trusted = not entry.watch_ptr  # compared: cached reads may skip it again
        if entry.grad:
            # A view changed in place under grad mode carries that change in its history:
            # serving it again would differentiate through it every pass.
            if view.grad_fn is not entry.node:  # type: ignore[union-attr]
                return self._switch(flat, index)
        elif view is None:
            view = entry.make(index, self._segments[index], self._shapes[index])
        if entry.watch_ptr and entry.ptr != _ptr(flat):
            return self._switch(flat, index)
        if entry.version >= 0:  # served from a source
            if entry.version != flat._version and not self._refreshed(entry, flat):
                return self._switch(flat, index)  # the source gave another tensor: new views
            if not self.forward_depth:
                self._expose(index, view)  # type: ignore[arg-type]
        return view  # type: ignore[return-value]

    def master_view(self, index: int) -> Tensor:
        """Return slot ``index`` of the flat tensor itself, also where a ``source`` serves the views.

        What state dicts save and loads stage: the master's values, detached
        when a source serves the views (one split per flat tensor, kept). Such
        a view goes to outside code, which may write through its ``.data``:
        the flat tensor's ``_version`` moves, so that the source is asked again
        before the next use of the views (see :meth:`aliased`).
        """
        if self.source is None:
            return self.view(index)
        flat: Tensor = self.params[self.flat_name]
        masters = self._masters
        ptr = _ptr(flat)
        if masters is None or masters[0] is not flat or masters[1] != ptr:
            masters = self._masters = (flat, ptr, flat.detach().split(self._split))
        _mark_changed(flat)
        return masters[2][self._segments[index]].view(self._shapes[index])

    def _switch(self, flat: Tensor, index: int) -> Tensor:
        """Serve slot ``index`` from the entry for the current grad mode, made anew if needed.

        Reached when the thread's last read used another entry (another grad
        mode, another flat tensor, a first read) or that entry is stale. Views
        that were assigned through ``.data`` must land before another entry
        serves the slot, so every entry is scanned here; and the registered
        module's next forward scans once more (``check_next_forward``), since
        the views served from here on may be assigned to before it.
        """
        try:
            ptr = flat.data_ptr()
        except RuntimeError:  # fake (tracing) and vmap's batched tensors have no storage
            return self._uncached(flat, index)
        if is_distributed(flat):  # FSDP2's sharded DTensor: its split is a copy that steps leave behind
            return self._uncached(flat, index)
        self.sync()
        self.check_next_forward = True
        cache: dict[Any, CacheEntry] = self._tls.__dict__
        grad = _is_grad_enabled()
        entry = cache.get(grad)
        if entry is None or not self._valid(entry, flat, ptr, index):
            entry = self._rebuild(flat, grad, ptr, cache)
        cache[_CURRENT] = entry
        view = entry.views[index]
        if view is None:
            view = entry.make(index, self._segments[index], self._shapes[index])
        if entry.version >= 0 and not self.forward_depth:
            self._expose(index, view)
        return view

    def _refreshed(self, entry: CacheEntry, flat: Tensor) -> bool:
        """Have the source update its tensor for the changed flat tensor; return whether ``entry`` serves on.

        The source updates its tensor in place (a compute copy cast again
        after an optimizer step): the entry's views alias it and stay valid, so
        a step costs no new views. Views are made anew (``False``) where the
        source gives another tensor, where one of them was assigned through
        ``.data`` (landed and retired by :meth:`sync`), and where the source
        watches views served outside the forward (then only views that outside
        code holds keep being watched).
        """
        source = self.source
        if entry.served is None or source is None or source.watching():
            return False
        self.sync()
        if entry.flat is not flat or _source(self, flat) is not entry.served:
            return False
        entry.version = _version(flat)
        return True

    def _expose(self, index: int, view: Tensor) -> None:
        """Show the source a view served outside the registered module's forward (and outside backward)."""
        if graph_task_id() == -1:  # a backward recomputing a checkpointed forward is not "outside"
            self.source.exposed(index, view)  # type: ignore[union-attr]

    def _valid(self, entry: CacheEntry, flat: Tensor, ptr: int, index: int) -> bool:
        if entry.flat is not flat or (entry.watch_ptr and entry.ptr != ptr):
            return False
        if entry.version >= 0 and entry.version != flat._version:
            return False
        if entry.requires_grad is not flat.requires_grad:
            return False
        if entry.grad:
            return entry.views[index].grad_fn is entry.node  # type: ignore[union-attr]
        return True

    def _rebuild(self, flat: Tensor, grad: bool, ptr: int, cache: dict[Any, CacheEntry]) -> CacheEntry:
        old = cache.pop(grad, None)
        if old is not None:
            self._entries.discard(old)
        other = cache.get(not grad)
        if other is not None and other.version >= 0 and other.version != _version(flat):
            # Views from a source that the flat tensor's change made stale: dropped now, so that
            # views outside code holds are the only ones that keep their exposure alive.
            del cache[not grad]
            self._entries.discard(other)
        if flat.dim() != 1 or flat.shape[0] != self.layout.numel:
            raise RuntimeError(
                f"{self.flat_name} has shape {tuple(flat.shape)} but its layout needs a "
                f"one-dimensional tensor of {self.layout.numel} elements (was its .data "
                "replaced?); assign a tensor of that size, or load a state dict"
            )
        served = None if self.source is None else _source(self, flat)
        views: list[Tensor | None]
        if grad and flat.requires_grad:
            # One autograd node for the whole group: backward concatenates the
            # gradients of every view into the flat gradient in one go.
            chunks = None
            views = list(_GroupSplit.apply(flat, self.layout, self._grads, served))
        else:
            # Views of a detached alias record no autograd history, so they stay
            # usable after in-place updates of the buffer (a view of the parameter
            # itself made under no_grad refuses ``grad_fn`` once the buffer changed).
            chunks = (flat if served is None else served).detach().split(self._split)
            if grad:  # frozen: every view now, as above (their grad_fn is None)
                views = [chunks[seg].view(shape) for seg, shape in zip(self._segments, self._shapes)]
            else:
                views = [None] * len(self._shapes)
        entry = cache[grad] = CacheEntry(
            flat, ptr, grad, chunks, views, -1 if served is None else _version(flat)
        )
        entry.served = served
        self._entries.add(entry)
        return entry

    def _uncached(self, flat: Tensor, index: int) -> Tensor:
        """Return slot ``index`` with plain tensor ops: no cache, no version guard (for tracers).

        Inside the registered module's forward under ``torch.compile`` the group
        was split once (see :func:`trace_split`): every view comes from that split.
        """
        traced = self._traced
        if traced is not None and traced[0] is flat:
            chunks = traced[1]
        else:
            chunks = (flat if self.cast is None else flat.to(self.cast)).split(self._split)
        return chunks[self._segments[index]].view(self._shapes[index])

    def sync(self) -> None:
        """Land the values of every cached view (any thread, any mode) whose ``.data`` was assigned.

        Raises:
            RuntimeError: if an assigned tensor has another shape, dtype
                or device than its slot (the flat tensor is then unchanged).
        """
        for entry in list(self._entries):
            if entry.written():
                self._land(entry)
        if self.source is not None:
            self.source.land()

    def aliased(self, flat: Tensor) -> None:
        """Take note that an alias of ``flat`` that no version counter follows was handed out.

        ``flat.data`` (EMA libraries, hand-written steps, init helpers write
        through it) and views of the master given to outside code. Where the
        views are served from a source, writes into them land first (the
        master's values are about to be written), then the flat tensor's
        ``_version`` moves, so that the next use of the views asks the source
        again: one cast, after the write. Without a source the views alias
        the flat tensor itself and nothing is needed.
        """
        if self.source is not None and self.params.get(self.flat_name) is flat:
            self.sync()
            _mark_changed(flat)

    def land_flagged(self) -> None:
        """Scan the views once if a read switched entries since the last forward (see :meth:`_switch`).

        Raises:
            RuntimeError: as :meth:`sync`.
        """
        if self.check_next_forward:
            self.check_next_forward = False
            self.sync()

    def on_data_read(self, flat: Tensor) -> None:
        """Called by a ``FlatParameter`` this group serves when its ``.data`` is read: see :meth:`aliased`."""
        self.aliased(flat)

    def on_requires_grad_set(self) -> None:
        """Called by a ``FlatParameter`` this group serves when its ``requires_grad`` is set.

        Every entry is checked against the flag at its next read (:meth:`view`),
        which makes the views again where it changed.
        """
        for entry in list(self._entries):
            entry.trusted = False

    def on_data_replaced(self) -> None:
        """Called by a ``FlatParameter`` this group serves before its ``.data`` is replaced: drop the views.

        Pending ``.data`` writes of views land in the old buffer first (a later
        write of the whole buffer wins, as on a plain model).
        """
        self.invalidate()

    def _land(self, entry: CacheEntry) -> None:
        """Copy the values assigned through ``.data`` to views of ``entry`` into its flat tensor.

        The entry is retired either way (its views no longer alias the flat tensor).
        """
        flat = entry.flat.detach()  # type: ignore[union-attr]
        entry.flat = None  # retired: the hot path's identity check rebuilds the views
        self._entries.discard(entry)
        storage = flat.untyped_storage()._cdata
        writes = []
        for index, view, ptr, made_shape in zip(entry.made, entry.made_views, entry.ptrs, entry.shapes):
            moved = view.data_ptr() != ptr
            if not moved and view.shape == made_shape:
                continue
            if moved and view.untyped_storage()._cdata == storage:
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
                    "values are copied into the flat buffer), or change shapes on the plain model "
                    "(remove_flat_storage, change, register_flat_storage again; transformers' "
                    "resize_token_embeddings does this itself)"
                )
            writes.append((index, value))
        if writes:
            targets = self.split(flat)
            with torch.no_grad():
                for index, value in writes:
                    targets[index].copy_(value)

    def split(self, tensor: Tensor) -> list[Tensor]:
        """Return views of every slot of ``tensor``, a tensor shaped like the flat parameter."""
        return self._grads.split(tensor)

    def trace(self, active: bool) -> None:
        """Split the current flat tensor once for the traced forward (``active``), or forget that split."""
        if active:
            flat = self.params[self.flat_name]
            self._traced = (flat, (flat if self.cast is None else flat.to(self.cast)).split(self._split))
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
        new._tls = _ThreadViews()
        new._entries = weakref.WeakSet()
        new._traced = None
        new._masters = None
        new._grads = copy.deepcopy(self._grads, memo)  # the copied group's own (``Group.grads``)
        new.source = None  # a feature's copy (``Feature.copy_for``) sets its own
        new.cast = None
        new.check_next_forward = False
        new.forward_depth = 0
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


def _version(tensor: Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors keep no version counter (nor can they change)
        return -1


def _mark_changed(tensor: Tensor) -> None:
    """Move ``tensor``'s ``_version``: views served from a source are made again at their next use."""
    try:
        _increment_version(tensor)
    except RuntimeError:  # inference tensors keep no version counter (nor can they change)
        pass


def _ptr(tensor: Tensor) -> int:
    try:
        return tensor.data_ptr()
    except RuntimeError:  # no storage
        return -1


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
    one ``cat``. In eager mode it runs the forward's cheap write check instead
    (``sync_writes(forward=True)``: an identity check per group for a replaced
    flat parameter, and a scan of the views only where a read switched cache
    entries since the last forward); the per-thread cache serves the views.

    ``torch.compile(model)`` of a module that is not one of torch's runs the
    hooks eagerly and compiles the forward as a frame of its own: there the
    hook runs the eager check and splits each group once eagerly, and the
    compiled forward takes every view from that split (as graph inputs). The
    hooks' frames are never compiled on their own (``never_compiled``):
    that would add a graph per call and compile the write check's helpers.

    It also counts the forwards running on each group's views
    (``GroupViews.forward_depth``, decremented by :func:`end_trace_split`):
    views served from a source outside of them are shown to the source.
    """
    storage = registered_storage(module)
    groups = storage.groups()
    if _is_compiling() or _tracing_a_module(module):  # views uncached: nothing to count
        for group in groups:
            group.views.trace(True)
        return
    for group in groups:
        group.views.forward_depth += 1
    storage.sync_writes(forward=True)
    if in_compiled_module_call():
        for group in groups:
            group.views.trace(True)


def end_trace_split(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of the registered module (called also when the forward raises): see ``trace_split``."""
    storage = registered_storage(module)
    if storage is None:
        return
    if _is_compiling() or _tracing_a_module(module):
        for group in storage.groups():
            group.views.trace(False)
        return
    traced = in_compiled_module_call()
    for group in storage.groups():
        views = group.views
        views.forward_depth = max(views.forward_depth - 1, 0)
        if traced:
            views.trace(False)


never_compiled(trace_split)
never_compiled(end_trace_split)
