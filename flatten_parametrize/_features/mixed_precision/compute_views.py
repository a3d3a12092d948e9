"""Mixed precision in per-tensor mode: the leaves are the masters, forwards compute with the compute copy.

In per-tensor mode (``unflatten()``, ``unflattened()``) each flattened
attribute is a real leaf ``nn.Parameter`` of the master dtype, on its original
module class, aliasing its slot of the flat buffer: the optimizer steps it. For
a forward to compute in ``param_dtype``, :class:`LeafCompute` puts each leaf's
**compute view** (its slot of the group's compute copy,
``MixedPrecision.compute_copy``) in the leaf's place for the length of the
forward, as FSDP2 puts its unsharded parameters in place of the sharded ones,
and puts the leaf back after it (also when the forward raised):

* The registered module's forward swaps every leaf (its per-tensor hooks,
  ``_install/per_tensor.py``, call :meth:`LeafCompute.before_forward` and
  :meth:`LeafCompute.after_forward`), so that code reading a weight outside
  its module's own forward (a tied head's ``x @ wte.weight.T``) computes in
  ``param_dtype`` too. A module that owns leaves swaps its own when it is
  called outside that forward: a submodule called directly, activation
  checkpointing's recomputation in backward (forward pre-hooks and
  always-called forward hooks on those modules).
* The compute views are the outputs of autograd nodes (:class:`_LeafCast`)
  whose inputs are the leaves: backward converts each gradient to the master
  dtype and autograd accumulates it into the leaf, whose ``.grad`` is its slot
  of the master-dtype flat gradient (``_core/grad/leaf_slots.py``). So DDP's
  reducer, comm hooks and per-parameter hooks see the leaves' gradients as on
  the plain model. Where a process group exists there is a node per owning
  module, so that a module's gradients land (and DDP reduces them) as soon as
  its backward is done; in one process, one node per group, so that backward
  runs one Python call per group instead of one per module (the gradients of a
  group then land together, as a flat parameter's do). The nodes are made once
  per compute copy and serve every forward (they hold nothing); in ``no_grad``
  and ``inference_mode`` forwards the views are served detached.
* Inside the registered module's forward every leaf is swapped, so the owners'
  hooks are taken out of their dicts for its length (:func:`_mute`): their
  calls take ``nn.Module.__call__``'s fast path.
* When the copy is cast: at each forward, each group's leaves' ``_version``
  (and the flat parameter's) are compared with those at its last cast, and
  the leaves whose ``.data`` was read or that a fused step updated (neither
  moves a version counter: ``master_leaf.py``) are looked up. One cast
  per group after a change, none for a forward when nothing changed.
* Under ``torch.compile`` and tracing the swap puts ``leaf.to(param_dtype)`` in
  the leaf's place: the cast is part of the graph, nothing is cached. A tensor
  that ``torch.func.functional_call`` put in a leaf's place for its call is cast
  so too (the forward's sync point leaves it there: ``_install/leaf_writes.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..._core.compiling import compiling_or_tracing
from ..._core.grad.engine import process_group_exists
from ..._core.grad.owner import GroupGrad
from ..._core.records import Coordinator, Group
from ..._core.transaction import Transaction
from .master_leaf import DIRTY, WATCHED, base_class, master_class

__all__ = ["LeafCompute"]

#: ``(module, attribute, leaf, compute view)`` of each swap, to put the leaf back.
_Swap = tuple[nn.Module, str, Tensor, Tensor]

#: ``(forward pre-hooks, key of ours, forward hooks, key of ours)`` of a module that owns leaves.
_Hooks = tuple[dict[int, Any], int, dict[int, Any], int]

#: Each module that owns leaves of a group with a compute copy -> its storage's :class:`LeafCompute`.
_OWNER_OF: weakref.WeakKeyDictionary[nn.Module, weakref.ref[LeafCompute]] = weakref.WeakKeyDictionary()


class _LeafCast(torch.autograd.Function):  # the name shows in graphs: _LeafCastBackward
    """The compute views of one module's leaves as the outputs of one node whose inputs are the leaves."""

    generate_vmap_rule = True  # made inside torch.func.vmap (functional_call's per-sample gradients)

    @staticmethod
    def forward(
        views: tuple[Tensor, ...], grads: GroupGrad, indices: tuple[int, ...], *leaves: Tensor
    ) -> tuple[Tensor, ...]:
        # Detached aliases of the compute copy (as ``split_node._GroupSplit`` serves flat mode's views):
        # a cast after a step updates them in place, and autograd's own check refuses a backward whose
        # saved weights changed since, as on the plain model.
        return tuple(view.detach() for view in views)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.grads, ctx.indices = inputs[1], inputs[2]
        ctx.leaves = [weakref.ref(leaf) for leaf in inputs[3:]]
        ctx.dtypes = tuple(leaf.dtype for leaf in inputs[3:])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        # Each gradient in the master dtype, straight into its slot of the flat gradient where it can.
        owner: GroupGrad = ctx.grads
        converted = owner.receive_cast(ctx.indices, [ref() for ref in ctx.leaves], grads, ctx.dtypes)
        return (None, None, None, *converted)


@dataclass
class _GroupLeaves:
    """One group's leaves, where they live, and the compute views served from its copy."""

    #: ``(owner module, attribute, slot index, leaf)`` of every live name.
    targets: list[tuple[nn.Module, str, int, Tensor]]
    #: Slot index -> its leaf.
    leaves: dict[int, Tensor]
    #: The module of each slot's first name -> the slots whose node it makes.
    by_owner: dict[int, list[int]]
    #: Each module (by ``id``) -> its entries of :attr:`targets`.
    by_module: dict[int, list[tuple[nn.Module, str, int, Tensor]]]
    #: ``(flat._version, *leaf._version)`` at the last cast (empty: cast at the next forward).
    versions: tuple[int, ...] = ()
    #: The compute copy the views were split from.
    copy: Tensor | None = None
    #: Slot index -> its detached view, and its view out of a :class:`_LeafCast` node.
    plain: list[Tensor] = field(default_factory=list)
    graph: dict[int, Tensor] = field(default_factory=dict)
    #: Whether :attr:`graph` has a node per owning module (else one for the group).
    by_owner_graph: bool = False
    #: Each leaf's ``requires_grad`` when :attr:`graph` was made (the leaves that are its nodes' inputs).
    graph_flags: tuple[bool, ...] = ()


class LeafCompute:
    """Per-tensor mode's part of a storage's mixed-precision feature (see above).

    Args:
        recast: ``g -> compute copy``: casts group ``g``'s compute copy from its master now.
        groups: the indices of the groups that have a compute copy.
    """

    def __init__(self, recast: Callable[[int], Tensor], groups: list[int]) -> None:
        self._recast = recast
        self._indices = groups
        self._groups: dict[int, _GroupLeaves] = {}
        #: What each forward being run swapped: the registered module's, then an owner's, innermost last.
        self._stack: list[list[_Swap]] = []
        #: Forwards of the registered module running: every leaf is swapped, an owner's call needs nothing.
        self._root_depth = 0
        #: The hooks of the modules that own leaves, and those out for the registered module's forward.
        self._owners: list[_Hooks] = []
        self._muted: list[_Hooks] = []
        self._storage_ref: weakref.ref[Coordinator] | None = None

    # ------------------------------------------------------------- lifecycle
    def begin(self, storage: Coordinator, tx: Transaction) -> None:
        """Per-tensor mode began: note the leaves, give them the master class, hook their modules."""
        self._storage_ref = weakref.ref(storage)
        modules = dict(storage.module_unchecked.named_modules(remove_duplicate=False))
        # The names the tree reaches each slot by now (a module moved in the tree: its current path).
        current = {id(slot): names for slot, names in zip(storage.slots(), storage.current_names())}
        groups = storage.groups()
        tx.on_undo(self._forget)  # the leaves' classes, counts and hooks are undone one by one
        self._groups = {g: self._note(groups[g], modules, current, tx) for g in self._indices}
        owners = {id(m): m for record in self._groups.values() for m, _, _, _ in record.targets}
        self._owners = [hooks for owner in owners.values() if (hooks := _hooks_of(owner)) is not None]

    def _note(
        self,
        group: Group,
        modules: dict[str, nn.Module],
        current: dict[int, tuple[str, ...]],
        tx: Transaction,
    ) -> _GroupLeaves:
        targets: list[tuple[nn.Module, str, int, Tensor]] = []
        by_owner: dict[int, list[int]] = {}
        leaves: dict[int, Tensor] = {}
        for slot in group.members:
            names = current[id(slot)]
            leaf = slot.param
            leaves[slot.index] = leaf
            tx.set_attr(leaf, "__class__", master_class(type(leaf)))
            WATCHED[id(leaf)] = WATCHED.get(id(leaf), 0) + 1
            tx.on_undo(_unwatching(id(leaf)))
            for position, name in enumerate(names):
                owner = modules[name.rpartition(".")[0]]
                targets.append((owner, name.rpartition(".")[2], slot.index, leaf))
                if position == 0:
                    by_owner.setdefault(id(owner), []).append(slot.index)
                if owner not in _OWNER_OF:
                    _unhook_owner(owner, tx)  # a deep copy's hooks, copied with its dicts
                    owner.register_forward_pre_hook(_owner_before)
                    owner.register_forward_hook(_owner_after, always_call=True)
                    _OWNER_OF[owner] = weakref.ref(self)
                    tx.on_undo(_forgetting(owner))
        by_module: dict[int, list[tuple[nn.Module, str, int, Tensor]]] = {}
        for target in targets:
            by_module.setdefault(id(target[0]), []).append(target)
        return _GroupLeaves(targets, leaves, by_owner, by_module)

    def end(self, tx: Transaction | None) -> None:
        """Per-tensor mode ends: every leaf back in place, its own class again, the modules unhooked."""
        tx = tx if tx is not None else Transaction()
        _unmute(self._muted)
        while self._stack:
            _put_back(self._stack.pop())
        self._root_depth = 0
        groups, owners, self._groups, self._owners = self._groups, self._owners, {}, []
        tx.on_undo(lambda: self.__dict__.update(_groups=groups, _owners=owners))
        for record in groups.values():
            for leaf in record.leaves.values():
                if type(leaf) is not base_class(type(leaf)):
                    tx.set_attr(leaf, "__class__", base_class(type(leaf)))
                _unwatch(id(leaf))
            for owner, _, _, _ in record.targets:
                if _OWNER_OF.get(owner) is not None:
                    _unhook_owner(owner, tx)

    def _forget(self) -> None:
        self._groups = {}
        self._owners = []

    def rebacked(self) -> None:
        """The buffers were replaced or written unseen: cast every group again at its next forward."""
        for record in self._groups.values():
            record.versions = ()

    # --------------------------------------------------------------- forward
    def before_forward(self) -> None:
        """The registered module's forward begins: every leaf's compute view in its place."""
        self._stack.append(self._swap(None))
        if not self._root_depth and not compiling_or_tracing():
            self._muted = _mute(self._owners)
        self._root_depth += 1

    def after_forward(self) -> None:
        """The registered module's forward ended (or raised): every leaf back."""
        self._root_depth = max(self._root_depth - 1, 0)
        if not self._root_depth:
            _unmute(self._muted)
        if self._stack:
            _put_back(self._stack.pop())

    def swap_owner(self, owner: nn.Module) -> None:
        """A module that owns leaves is called: its leaves' compute views in their places (if not yet)."""
        if not self._root_depth:  # inside the registered module's forward every leaf is swapped already
            self._stack.append(self._swap(owner))

    def owner_done(self) -> None:
        """A module that owns leaves returned (or raised): what its call swapped goes back."""
        if not self._root_depth and self._stack:
            _put_back(self._stack.pop())

    def _swap(self, owner: nn.Module | None) -> list[_Swap]:
        done: list[_Swap] = []
        compiling = compiling_or_tracing()
        traced: dict[int, Tensor] = {}  # casts in the graph (compiling, or functional_call's tensors)
        for g, record in self._groups.items():
            targets = record.targets if owner is None else record.by_module.get(id(owner))
            if not targets:
                continue
            views = None  # made at the first leaf found in place: functional_call may have put others there
            for module, attr, index, leaf in targets:
                current = module._parameters.get(attr)
                if current is leaf and not compiling:
                    views = self._views(g, record) if views is None else views
                    view = views[index]
                elif current is leaf or (current is not None and self._substitute(g, current)):
                    if id(current) not in traced:  # one cast per tensor, also for a tied one
                        traced[id(current)] = self._cast(g, current)
                    view = traced[id(current)]
                else:
                    continue  # swapped already (an outer forward's view)
                module._parameters[attr] = view  # type: ignore[assignment]  # a non-leaf, as FSDP2
                done.append((module, attr, current, view))
        return done

    def _dtype(self, g: int) -> torch.dtype | None:
        storage = self._storage_ref() if self._storage_ref is not None else None
        return storage.groups()[g].views.cast if storage is not None else None

    def _substitute(self, g: int, tensor: Tensor) -> bool:
        """Return whether ``tensor``, in a leaf's place, is ``functional_call``'s (a floating tensor to cast).

        The forward's sync point lets such a tensor be (``leaf_writes.settle``): it computes in the
        group's ``param_dtype`` as the leaf would, through a cast its gradient flows back through.
        """
        dtype = self._dtype(g)
        return isinstance(tensor, Tensor) and tensor.is_floating_point() and dtype not in (None, tensor.dtype)

    def _cast(self, g: int, tensor: Tensor) -> Tensor:
        """Return ``tensor`` cast to group ``g``'s ``param_dtype``, the cast part of the graph."""
        dtype = self._dtype(g)
        return tensor if dtype is None else tensor.to(dtype)

    def _views(self, g: int, record: _GroupLeaves) -> list[Tensor] | dict[int, Tensor]:
        """Return group ``g``'s compute views by slot index, cast first if a leaf changed since then."""
        storage = self._storage_ref() if self._storage_ref is not None else None
        if storage is None:
            return {}
        group = storage.groups()[g]
        flat = group.flat
        leaves = record.leaves
        versions = (flat._version, *(leaf._version for leaf in leaves.values()))
        dirty = bool(DIRTY) and any(id(leaf) in DIRTY for leaf in leaves.values())
        if versions != record.versions or dirty or record.copy is None:
            for leaf in leaves.values():
                DIRTY.discard(id(leaf))
            with torch.inference_mode(False):
                tensor = self._recast(g)
            record.versions = (flat._version, *(leaf._version for leaf in leaves.values()))
            if tensor is not record.copy:
                record.copy = tensor
                record.plain = group.views.split(tensor)
                record.graph = {}
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return record.plain
        # Each leaf's own flag, as on the plain model (per-tensor mode: a frozen submodule, say): a leaf
        # that does not require grad is served its detached view and is no input of a node.
        flags = tuple(leaf.requires_grad for leaf in leaves.values())
        if not any(flags):
            return record.plain
        by_owner = process_group_exists()
        if not record.graph or record.by_owner_graph != by_owner or record.graph_flags != flags:
            record.graph = {i: record.plain[i] for i, leaf in leaves.items() if not leaf.requires_grad}
            record.by_owner_graph = by_owner
            record.graph_flags = flags
            nodes = list(record.by_owner.values())
            if not by_owner:
                nodes = [[index for indices in nodes for index in indices]]
            with torch.inference_mode(False):
                for indices in nodes:
                    trained = [i for i in indices if leaves[i].requires_grad]
                    if not trained:
                        continue
                    outputs = _LeafCast.apply(
                        tuple(record.plain[i] for i in trained),
                        group.grads,
                        tuple(trained),
                        *(leaves[i] for i in trained),
                    )
                    record.graph.update(zip(trained, outputs))
        return record.graph


def _put_back(done: list[_Swap]) -> None:
    for module, attr, leaf, view in reversed(done):
        if module._parameters.get(attr) is view:  # outside code put something else there: it stays
            module._parameters[attr] = leaf  # type: ignore[assignment]


def _hooks_of(owner: nn.Module) -> _Hooks | None:
    """Return ``owner``'s hook dicts and the keys of this mode's hooks in them (``None``: not hooked)."""
    pre, post = owner._forward_pre_hooks, owner._forward_hooks
    pre_key = next((key for key, hook in pre.items() if hook is _owner_before), None)
    post_key = next((key for key, hook in post.items() if hook is _owner_after), None)
    return None if pre_key is None or post_key is None else (pre, pre_key, post, post_key)


def _mute(owners: list[_Hooks]) -> list[_Hooks]:
    """Take the owners' hooks out of their dicts for the registered module's forward.

    Inside that forward every leaf is swapped already, so the owners' hooks would do
    nothing, and a module without hooks takes ``nn.Module.__call__``'s fast path. Only
    an owner whose forward hooks are ours alone is muted; :func:`_unmute` puts the
    hooks back first in their dicts, where they were.
    """
    muted: list[_Hooks] = []
    for hooks in owners:
        pre, pre_key, post, post_key = hooks
        if len(pre) == 1 and len(post) == 1 and pre_key in pre and post_key in post:
            pre.clear()
            post.clear()
            muted.append(hooks)
    return muted


def _unmute(muted: list[_Hooks]) -> None:
    """Put back the hooks :func:`_mute` took out (before any registered since); empty ``muted``."""
    while muted:
        pre, pre_key, post, post_key = muted.pop()
        pre[pre_key] = _owner_before
        post[post_key] = _owner_after
        for hooks, key in ((pre, pre_key), (post, post_key)):
            if len(hooks) > 1:
                hooks.move_to_end(key, last=False)  # type: ignore[attr-defined]  # an OrderedDict


def _forgetting(owner: nn.Module) -> Callable[[], None]:
    def forget() -> None:
        _OWNER_OF.pop(owner, None)

    return forget


def _unwatching(key: int) -> Callable[[], None]:
    return lambda: _unwatch(key)


def _unwatch(key: int) -> None:
    count = WATCHED.get(key, 0) - 1
    if count > 0:
        WATCHED[key] = count
    else:
        WATCHED.pop(key, None)
        DIRTY.discard(key)


def _unhook_owner(owner: nn.Module, tx: Transaction) -> None:
    for hooks in (owner._forward_pre_hooks, owner._forward_hooks):
        tx.keep_dict(hooks)
    tx.keep_dict(owner._forward_hooks_always_called)
    for hooks in (owner._forward_pre_hooks, owner._forward_hooks):
        for key, hook in list(hooks.items()):
            if hook is _owner_before or hook is _owner_after:
                del hooks[key]
                owner._forward_hooks_always_called.pop(key, None)
    ref = _OWNER_OF.pop(owner, None)
    if ref is not None:
        tx.on_undo(lambda: _OWNER_OF.__setitem__(owner, ref))


def _owner_before(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a module owning leaves: their compute views in place (see the module docstring)."""
    if compiling_or_tracing():  # a compiled forward: the registered module's hook put traced casts in place
        return
    ref = _OWNER_OF.get(module)
    compute = None if ref is None else ref()
    if compute is not None:
        compute.swap_owner(module)


def _owner_after(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of a module owning leaves (called also when the forward raised): the leaves back."""
    if compiling_or_tracing():
        return
    ref = _OWNER_OF.get(module)
    compute = None if ref is None else ref()
    if compute is not None:
        compute.owner_done()
