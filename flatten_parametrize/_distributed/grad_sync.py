"""Data-parallel gradient sync over the flat buffers with torch.distributed.

Every collective here works on a whole flat parameter (or its ``.grad``): one
collective per group, no copy into buckets of our own. The module's parameters
that no group holds are averaged and broadcast too, as DDP does with every
parameter (``outside_params.py``). The transport is torch.distributed itself
(gloo on CPU, NCCL on GPU).

Overlap with backward (``enable_grad_sync``):

* a post-accumulate-grad hook on each flat parameter fires once its ``.grad``
  is final for this backward and starts that group's ``all_reduce``
  (``async_op=True``);
* the first hook of a backward queues an autograd-engine callback that runs
  when backward ends: it starts the collective of every group not reduced yet
  (a group this rank's backward did not reach contributes zeros), then waits
  on all of them, so the gradients are averaged when ``loss.backward()``
  returns.

Every rank must issue the same collectives in the same order, whatever order
its hooks fire in. Collectives are therefore started in one launch order
shared by all ranks: a hook whose group is not next in that order only marks
the group ready. The first synced backward launches everything in group order
at the end and records the order in which gradients became ready; rank 0's
record is then broadcast and becomes the launch order from the second
backward on (as DDP rebuilds its buckets after the first iteration).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import RemovableHandle

from .._core.features import Coordinator, Feature, Record, in_flat_mode, storage_of
from .._core.grad.engine import current_node, graph_task_id, queue_callback, will_execute
from .._core.grad.owner import claim_sync
from .outside_params import OutsideParams, outside_params, reduce_once
from .outside_params import broadcast as broadcast_outside
from .outside_params import reduce as reduce_outside
from .process_group import checked_process_group

__all__ = ["GradSync"]

#: The reductions ``all_reduce_grads`` accepts.
REDUCE_OPS = ("mean", "sum")

#: What a ``ShardedOptimizer`` built while grad sync is enabled is told (the sync claim of every group).
_CLAIM = (
    "the storage's grad sync is enabled and reduces every flat gradient (each would be reduced twice); "
    "call storage.disable_grad_sync() first"
)


def _check_op(op: Any) -> str:
    if not isinstance(op, str):
        raise TypeError(
            f"all_reduce_grads(): op must be a str, one of {list(REDUCE_OPS)}; "
            f"got {type(op).__name__} {op!r}; pass e.g. op='mean'"
        )
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce_grads(): op must be one of {list(REDUCE_OPS)}; got {op!r}")
    return op


class _CastBack:
    """A collective over a copy of a gradient in its reduce dtype: ``wait()`` copies the result back."""

    def __init__(self, work: dist.Work, low: Tensor, grad: Tensor) -> None:
        self.work, self.low, self.grad = work, low, grad

    def wait(self) -> bool:
        self.work.wait()
        with torch.no_grad():
            self.grad.copy_(self.low)
        return True


def _all_reduce(
    grad: Tensor,
    process_group: dist.ProcessGroup | None,
    world: int,
    op: str,
    dtype: torch.dtype | None = None,
) -> Any:
    """Start an in-place all-reduce of ``grad`` (``op`` is ``"mean"`` or ``"sum"``), in ``dtype`` if given.

    A ``dtype`` other than the gradient's (a mixed-precision policy's ``reduce_dtype``, on the
    group's ``GroupGrad``) reduces a converted copy; waiting copies the result back into ``grad``.
    """
    if dtype is not None and dtype != grad.dtype:
        low = grad.to(dtype)
        return _CastBack(_all_reduce(low, process_group, world, op), low, grad)
    if op == "sum" or world == 1:
        return dist.all_reduce(grad, dist.ReduceOp.SUM, group=process_group, async_op=True)
    if grad.is_cuda and "nccl" in str(dist.get_backend(process_group)):
        return dist.all_reduce(grad, dist.ReduceOp.AVG, group=process_group, async_op=True)
    grad.div_(world)  # gloo has no AVG: pre-divide, then sum (DDP divides too)
    return dist.all_reduce(grad, dist.ReduceOp.SUM, group=process_group, async_op=True)


class _SyncState:
    """State of ``enable_grad_sync``: hooks, launch order, the backward in flight."""

    def __init__(
        self, process_group: dist.ProcessGroup | None, world: int, groups: int, outside: OutsideParams
    ) -> None:
        self.process_group = process_group
        self.world = world
        self.handles: list[RemovableHandle | None] = [None] * groups
        self.pre_handles: list[RemovableHandle | None] = [None] * groups
        self.hooked: list[Tensor | None] = [None] * groups
        #: The gradient accumulator node of each hooked flat parameter.
        self.accumulators: list[Any] = [None] * groups
        #: The prescale hook of each group, registered on its split node's gradient buffer.
        self.prescales: list[_Prescale | None] = [None] * groups
        #: The backward (graph task) whose gradient of each group was divided as it was built.
        self.prescaled: list[int | None] = [None] * groups
        #: Whether backward may divide gradients as it builds them: only where the collective
        #: cannot average by itself (gloo; NCCL has ``ReduceOp.AVG``).
        self.may_prescale = world > 1 and "nccl" not in str(dist.get_backend(process_group))
        #: Launch order shared by all ranks; ``None`` until the first synced backward ends.
        self.order: list[int] | None = None
        #: The module's parameters outside every storage, averaged at the end of backward.
        self.outside = outside
        self.begin(None)

    def begin(self, task: int | None) -> None:
        """Forget the previous backward (an aborted one included) and start ``task``."""
        self.task = task
        self.ready = [False] * len(self.handles)
        self.seen: list[int] = []
        self.next = 0
        self.works: list[Any] = []


class _Prescale:
    """A flat-gradient hook that has a group's split node divide its gradient by the world size.

    A gloo average is a sum followed by a division: dividing while the flat
    gradient is copied together saves a pass over it, as DDP divides while
    copying into its buckets. Backward divides only when it can tell that the
    gradient ends up in ``flat.grad`` of the hooked flat parameter, which has
    no ``.grad`` yet and no other tensor hook (``torch.autograd.grad``, gradient
    accumulation and ``no_sync`` keep the plain path). If something else adds
    to the same gradient in that backward (the flat parameter used directly,
    say), :meth:`before_accumulation` corrects the sum before it is accumulated.
    """

    __slots__ = ("_index", "_outs", "_ref", "_task")

    #: Sync keeps the whole flat gradient: the buffer may reuse its memory.
    releases_gradient = False

    def __init__(self, ref: weakref.ref[GradSync], group_index: int) -> None:
        self._ref = ref
        self._index = group_index
        self._task: int | None = None
        self._outs: list[Tensor] = []

    def divisor(self, flat: Tensor) -> int | None:
        sync = self._ref()
        if sync is None:
            return None
        state = sync.state
        if state is None or sync.is_paused() or not state.may_prescale:
            return None
        g = self._index
        if state.hooked[g] is not flat or flat.grad is not None or len(flat._backward_hooks or ()) != 1:
            return None
        try:
            if not will_execute(state.accumulators[g]):
                return None
        except RuntimeError:  # torch.autograd.grad(): the gradient is returned, not accumulated
            return None
        task = graph_task_id()
        if self._task != task:
            self._task, self._outs = task, []
        return state.world

    def grad_ready(self, grad: Tensor, divided: bool) -> None:
        if divided:
            self._outs.append(grad)
        return None

    def before_accumulation(self, grad: Tensor) -> Tensor | None:
        """Tensor hook of the flat parameter: mark a gradient divided in backward, correct a mixed one.

        A gradient divided as it was built only needs a sum from the
        collective. If undivided contributions were added to it in the same
        backward, the average needs ``divided + rest / world``.
        """
        sync = self._ref()
        state = None if sync is None else sync.state
        outs = self._outs if self._task == graph_task_id() else []
        self._task, self._outs = None, []  # let accumulation take the gradient without a copy
        if state is None or not outs:
            return None
        state.prescaled[self._index] = graph_task_id()
        if len(outs) == 1 and grad.data_ptr() == outs[0].data_ptr():
            return None  # the divided gradient is the whole gradient
        divided = outs[0] if len(outs) == 1 else torch.stack(outs).sum(0)
        return grad.sub(divided).div_(state.world).add_(divided)


class GradSync(Feature):
    """The data-parallel feature of a storage: collectives over whole flat parameters, sync in backward.

    ``FlatStorage.all_reduce_grads``, ``broadcast_params``,
    ``enable_grad_sync``, ``disable_grad_sync`` and ``no_sync`` delegate here
    (their docstrings state the semantics).

    Args:
        storage: the coordinator (held weakly).
    """

    def __init__(self, storage: Coordinator) -> None:
        self._storage_ref = weakref.ref(storage)
        #: The state of ``enable_grad_sync`` (``None``: not enabled).
        self.state: _SyncState | None = None

    @property
    def _storage(self) -> Coordinator:
        return storage_of(self._storage_ref)

    def is_paused(self) -> bool:
        """Return whether a ``no_sync()`` block of the storage is open (or the storage is gone)."""
        storage = self._storage_ref()
        return storage is None or bool(storage.no_sync_depth)

    # ------------------------------------------------------------- lifecycle
    def on_rebacked(self) -> None:
        """Hook the flat parameters that ``module.to()`` & co. replaced (at once: the next backward syncs)."""
        self.rehook()

    def refresh(self) -> None:
        """Hook a group unfrozen since (``requires_grad_(True)``), and parameters added outside the groups.

        Nothing notifies those changes. The core calls this at its sync points,
        the registered module's forward among them, so the backward of that
        forward is synced.
        """
        self.rehook()
        self.before_forward()

    def before_forward(self) -> None:
        """Per-tensor mode's forward (``_install/per_tensor.py``): watch the parameters outside the groups."""
        if self.state is not None:
            self.state.outside.watch()

    def on_removed(self) -> None:
        """Remove every hook that sync added."""
        self.disable()

    def copy_for(self, storage: Coordinator, memo: dict[int, Any]) -> GradSync:
        """A copy starts without sync (its hooks left in the module's dicts are inert)."""
        return GradSync(storage)

    def forward_sync(self) -> bool:
        """Return whether per-tensor mode's forward must land outside writes first: while enabled.

        A parameter that outside code put on the model in per-tensor mode
        would otherwise train without being averaged (``_install/leaf_writes.py``).
        """
        return self.state is not None

    def holds_layout(self) -> None:
        """Never: enabled, it follows a new layout (:meth:`relayout_record`)."""
        return None

    def relayout_record(self) -> Record | None:
        """While enabled: ``(function, args)`` that enables sync on the core laid out again, same group."""
        if self.state is None:
            return None
        return _enable_again, (self.state.process_group,)

    # ------------------------------------------------------------ collectives
    def all_reduce(self, process_group: dist.ProcessGroup | None, op: str) -> None:
        """All-reduce every flat gradient and the outside ones (see ``FlatStorage.all_reduce_grads``)."""
        op = _check_op(op)
        pg, world = checked_process_group(process_group, "all_reduce_grads()")
        storage = self._storage
        outside = [p for p in outside_params(storage.module) if p.requires_grad]
        with in_flat_mode(storage):
            groups = [g for g in storage.groups() if g.flat.requires_grad]
            works = [_all_reduce(g.grads.dense(g.flat), pg, world, op, g.grads.reduce_dtype) for g in groups]
            works.append(reduce_outside(outside, pg, world, op))
            for work in works:
                if work is not None:
                    work.wait()

    def broadcast(self, src: int, process_group: dist.ProcessGroup | None) -> None:
        """Broadcast the flat and the outside parameters from ``src`` (``FlatStorage.broadcast_params``)."""
        if isinstance(src, bool) or not isinstance(src, int):
            raise TypeError(
                f"broadcast_params(): src must be an int (a global rank); got {type(src).__name__} "
                f"{src!r}; pass e.g. src=0"
            )
        pg, world = checked_process_group(process_group, "broadcast_params()")
        ranks = list(range(world)) if pg is None else dist.get_process_group_ranks(pg)
        if src not in ranks:
            raise ValueError(
                f"broadcast_params(): src must be a global rank of the process group, one of "
                f"{ranks}; got {src}; pass the rank that holds the weights to copy"
            )
        storage = self._storage
        outside = outside_params(storage.module)
        with in_flat_mode(storage), torch.no_grad():
            data = [g.flat.detach() for g in storage.groups()]
            works = [dist.broadcast(t, src, group=pg, async_op=True) for t in data]
            for work in works:
                work.wait()
            for t in data:  # an in-place write: cached views and saved tensors must see it
                torch.autograd.graph.increment_version(t)
        broadcast_outside(outside, src, pg)

    # ------------------------------------------------------- sync in backward
    def enable(self, process_group: dist.ProcessGroup | None) -> None:
        """Start syncing in backward (see ``FlatStorage.enable_grad_sync``)."""
        pg, world = checked_process_group(process_group, "enable_grad_sync()")
        if self.state is not None:
            raise RuntimeError(
                "enable_grad_sync(): grad sync is already enabled on this storage; call "
                "disable_grad_sync() first to change the process group"
            )
        storage = self._storage
        _ = storage.module  # raises for a detached storage
        buffers = [group.grads for group in storage.groups()]
        claim_sync(buffers, self, "enable_grad_sync() averages every flat gradient", [_CLAIM] * len(buffers))
        outside = OutsideParams(self, storage)
        self.state = _SyncState(pg, world, len(storage.groups()), outside)
        self.rehook()
        outside.watch()
        storage.per_tensor.update_hooks()

    def disable(self) -> None:
        """Stop syncing and remove every hook (see ``FlatStorage.disable_grad_sync``)."""
        state, self.state = self.state, None
        storage = self._storage_ref()
        if state is not None:
            state.outside.close()
            for handle in state.handles + state.pre_handles:
                if handle is not None:
                    handle.remove()
            if storage is not None:
                for group, prescale in zip(storage.groups(), state.prescales):
                    if prescale is not None:
                        group.grads.remove_hook(prescale)
        if storage is not None:
            for group in storage.groups():
                group.grads.release_sync(self)
            storage.per_tensor.update_hooks()

    # --------------------------------------------------------------- internals
    def rehook(self) -> None:
        """Register the grad-ready hook on every flat parameter that does not carry it yet."""
        state = self.state
        if state is None:
            return
        ref = weakref.ref(self)
        for group in self._storage.groups():
            g, flat = group.index, group.flat
            if state.hooked[g] is flat or not flat.requires_grad:
                continue
            for handle in (state.handles[g], state.pre_handles[g]):
                if handle is not None:
                    handle.remove()
            buffer = group.grads
            old = state.prescales[g]
            if old is not None:
                buffer.remove_hook(old)
            prescale = state.prescales[g] = _Prescale(ref, g)
            state.handles[g] = flat.register_post_accumulate_grad_hook(_grad_ready_hook(ref, g))
            state.pre_handles[g] = flat.register_hook(prescale.before_accumulation)
            state.accumulators[g] = get_gradient_edge(flat).node
            state.hooked[g] = flat
            buffer.add_hook(prescale)

    def grad_ready(self, g: int | None) -> None:
        """Hook body: group ``g``'s flat gradient is final for this backward (``None``: an outside one's)."""
        state = self.state
        if state is None or self.is_paused():
            return
        task = graph_task_id()
        if state.task != task:
            state.begin(task)
            queue_callback(lambda: self._backward_end(state))
        if g is None or state.ready[g]:
            return
        state.ready[g] = True
        state.seen.append(g)
        if state.order is not None:
            self._launch(state, state.order, final=False)

    def _launch(self, state: _SyncState, order: Sequence[int], final: bool) -> None:
        """Start the collectives of the groups next in ``order`` that are ready (all if ``final``)."""
        groups = self._storage.groups()
        while state.next < len(order):
            g = order[state.next]
            flat = groups[g].flat
            if flat.requires_grad:
                if not (final or state.ready[g]):
                    return
                op = "sum" if state.prescaled[g] == state.task else "mean"  # divided in backward
                grads = groups[g].grads
                state.works.append(
                    _all_reduce(grads.dense(flat), state.process_group, state.world, op, grads.reduce_dtype)
                )
            state.next += 1

    def _backward_end(self, state: _SyncState) -> None:
        """Engine callback: reduce what is left, wait for every collective, learn the order."""
        enclosing = current_node()
        if enclosing is not None:  # the end of a nested backward, not of the user's backward
            state.begin(None)
            raise RuntimeError(
                "grad sync needs each flat gradient to be produced by the outermost backward; "
                f"one came from a nested (reentrant) backward run by {type(enclosing).__name__}, "
                "e.g. torch.utils.checkpoint.checkpoint(..., use_reentrant=True); pass "
                "use_reentrant=False, or call disable_grad_sync() and all_reduce_grads() after backward"
            )
        try:
            order = state.order if state.order is not None else list(range(len(self._storage.groups())))
            self._launch(state, order, final=True)
            root = state.outside.watch()  # a parameter added since the forward (or used without it)
            if root is not None:
                pg = state.process_group
                outside = reduce_once(root, state.task, state.outside.training(), pg, state.world)
                if outside is not None:
                    state.works.append(outside)
            for work in state.works:
                work.wait()
            if state.order is None:
                state.order = self._agree_order(state)
        finally:
            state.begin(None)

    def _agree_order(self, state: _SyncState) -> list[int]:
        """Return rank 0's readiness order (unseen groups last), broadcast to every rank."""
        flats = [group.flat for group in self._storage.groups()]
        n = len(flats)
        local = state.seen + [g for g in range(n) if g not in state.seen]
        synced = [f for f in flats if f.requires_grad]
        device = synced[0].device if synced else torch.device("cpu")
        order = torch.tensor(local, dtype=torch.int64, device=device)
        pg = state.process_group
        src = 0 if pg is None else dist.get_global_rank(pg, 0)
        dist.broadcast(order, src, group=pg)
        return [int(g) for g in order.tolist()]


def _enable_again(storage: Coordinator, process_group: dist.ProcessGroup | None) -> None:
    """Enable gradient sync on ``storage``, a core laid out again (hooks and claims on its new groups)."""
    sync = GradSync(storage)
    storage.add_feature(sync)
    sync.enable(process_group)


def _grad_ready_hook(ref: weakref.ref[GradSync], g: int) -> Callable[[Tensor], None]:
    def hook(flat: Tensor) -> None:
        sync = ref()
        if sync is not None:
            sync.grad_ready(g)

    return hook
