"""The gradient path of :class:`~flatten_parametrize.ShardedOptimizer` during backward.

A post-accumulate-grad hook on each sliced flat parameter (:func:`ready_hook`)
tells the :class:`Reducer` that its gradient is final for this backward; the
reducer starts the reductions in the storage's group order on every rank
(``bucket_cap_mb`` buckets are numbered in the order backward finishes them),
and an autograd-engine callback finishes every reduction when backward ends.
With ``shard_gradients=True`` (ZeRO-2) only this rank's averaged slice is
kept and the full flat gradient is freed (one full gradient in flight at a
time; a unit that moves in one buffer, ``Partition.units``, waits for its last
bucket, each finished gradient copied into the unit's padded buffer and freed
at once, ``sharded_staging.py``); with ``False`` (ZeRO-1)
the whole flat gradient is averaged and the slice's gradient is a view of it.
The module's parameters that no group holds (a new head, say) are averaged
too when backward ends, as DDP averages every parameter (``outside_params.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
from torch import Tensor

from .._core.grad.engine import current_node, graph_task_id, queue_callback
from .outside_params import OutsideParams, reduce_once
from .shard import Shard
from .sharded_feature import live_core
from .sharded_grads import ShownGrads
from .sharded_staging import UnitBuffer

if TYPE_CHECKING:
    from .._core.grad.owner import GroupGrad
    from .._core.records import Coordinator
    from .sharded_collectives import Collectives
    from .sharded_grads import TakenGrads
    from .sharded_partition import Partition

__all__ = ["Pending", "Reducer", "ready_hook"]


class Pending(NamedTuple):
    """A reduction in flight."""

    #: The shards it reduces (several: a unit in one buffer; ZeRO-1: one).
    shards: Sequence[Shard]
    #: The collectives' handles.
    works: list[Any]
    #: What gives each shard's result once they finished (ZeRO-2: this rank's packed sum).
    result: Callable[[], list[Tensor]]
    #: ZeRO-1: the flat gradient that the result is, or (in another dtype) is copied into.
    full: Tensor | None
    #: What is being reduced (alive until then).
    sent: list[Tensor]


class Reducer:
    """Reduce each sliced flat gradient to its owners as soon as backward finishes it.

    Args:
        core: the storage's core (held weakly).
        ownership: who owns which slice.
        collectives: the process group's collectives.
        grads: the gradients as the model shows them: ZeRO-2's placeholders, settled before and lent
            after each reduction (``ShownGrads``), or ZeRO-1's whole ones (``TakenGrads``).
    """

    def __init__(
        self,
        core: Coordinator,
        ownership: Partition,
        collectives: Collectives,
        grads: ShownGrads | TakenGrads,
    ) -> None:
        self._core_ref = weakref.ref(core)
        self._ownership = ownership
        self._comm = collectives
        #: ZeRO-2's placeholders (``None``: ZeRO-1).
        self._shown = grads if isinstance(grads, ShownGrads) else None
        self._shard_gradients = self._shown is not None
        #: ZeRO-2: each shard's unit and place in it, for the units of the time (see :meth:`_stage`).
        self._unit_of: tuple[Sequence[Sequence[Shard]] | None, dict[int, tuple[int, int]]] = (None, {})
        #: The module's parameters outside every group, averaged when backward ends.
        self.outside = OutsideParams(self, core)
        self._begin(None)

    def _begin(self, task: int | None) -> None:
        """Forget the previous backward (an aborted one included) and start ``task``."""
        self._task = task
        #: The flat parameters (group indices) whose gradient is final in this backward.
        self._ready: set[int] = set()
        self._next = 0
        #: The reductions started and not finished yet, in start order.
        self.pending: list[Pending] = []
        #: ZeRO-2: the padded buffers of the units not started yet, by unit (``None``: no one buffer).
        self._staged: dict[int, UnitBuffer | None] = {}

    def grad_ready(self, flat: Tensor | None) -> None:
        """Hook body: ``flat``'s gradient is final for this backward (``None``: an outside parameter's)."""
        core = self._core_ref()
        if core is None or core.no_sync_depth:
            return
        index = None if flat is None else self._ownership.index_of(flat)
        if index is None and flat is not None:  # a flat parameter object this optimizer no longer slices
            return
        task = graph_task_id()
        if self._task != task:
            self._begin(task)
            queue_callback(self._backward_end)
        if index is not None:
            shard = self._ownership.shards[index]
            self._ready.add(shard.g)
            if self._shown is not None:
                self._stage(shard)
            self._launch(final=False)

    def _stage(self, shard: Shard) -> None:
        """ZeRO-2: copy ``shard``'s finished gradient into its unit's padded buffer and free it."""
        units = self._ownership.units
        if self._unit_of[0] is not units:
            self._unit_of = (units, {s.g: (k, i) for k, unit in enumerate(units) for i, s in enumerate(unit)})
        k, position = self._unit_of[1][shard.g]
        if len(units[k]) < 2 or k < self._next:
            return
        if k not in self._staged:
            self._staged[k] = self._unit_buffer(units[k])
        staged = self._staged[k]
        if staged is not None and position not in staged.filled:
            staged.put(position, self._taken(shard))

    def _unit_buffer(self, unit: Sequence[Shard]) -> UnitBuffer | None:
        """Return an empty padded buffer for ``unit`` (``None``: it moves shard by shard)."""
        groups = live_core(self._core_ref).groups()
        dtypes = {groups[s.g].grads.reduce_dtype or s.dtype for s in unit}
        return self._comm.unit_buffer(unit, dtypes.pop()) if len(dtypes) == 1 else None

    def _taken(self, shard: Shard) -> Tensor:
        """ZeRO-2: return ``shard``'s flat gradient to reduce; free the group's (this rank keeps its part).

        What was cleared of the gradient this rank keeps is dropped first (the new gradient adds to what
        is left: micro-batches accumulate).
        """
        grads = live_core(self._core_ref).groups()[shard.g].grads
        grad = self._flat_grad(grads, shard.flat)[0]
        assert self._shown is not None
        self._shown.settle(shard, closing=True)
        grads.release(shard.flat)
        return grad

    def _launch(self, final: bool) -> None:
        """Start the reductions next in storage order that are ready (every one if ``final``).

        ZeRO-2 reduces unit by unit; ZeRO-1 (an all-reduce each) one flat gradient at a time.
        """
        shards = self._ownership.shards
        units = self._ownership.units if self._shard_gradients else None
        count = len(shards) if units is None else len(units)
        while self._next < count:
            unit = [shards[self._next]] if units is None else units[self._next]
            if not (final or all(shard.g in self._ready for shard in unit)):
                return
            if self._shard_gradients:
                self.finish()  # one full gradient (one unit's) in flight at a time
            self.pending.append(self.start(unit, self._staged.pop(self._next, None)))
            self._next += 1

    def start(self, unit: Sequence[Shard], staged: UnitBuffer | None = None) -> Pending:
        """Start reducing the flat gradients of ``unit``'s shards (zeros where this rank has none).

        ``staged``: ZeRO-2's padded buffer of the unit, filled so far (the rest is put now).
        """
        if self._shown is None:  # ZeRO-1: one flat gradient, averaged whole
            (shard,) = unit
            grads = live_core(self._core_ref).groups()[shard.g].grads
            grad, full = self._flat_grad(grads, shard.flat)
            grads.assign(shard.flat, full)
            works, result = self._comm.all_reduce_mean(grad)
            return Pending(unit, works, lambda: [result()], full, [grad])
        if staged is not None:
            for position, shard in enumerate(unit):
                if position not in staged.filled:
                    staged.put(position, self._taken(shard))
            handles, parts, kept = self._comm.reduce_staged(unit, staged)
        else:
            handles, parts, kept = self._comm.reduce_unit(unit, [self._taken(shard) for shard in unit])
        return Pending(unit, handles, parts, None, kept)

    def _flat_grad(self, grads: GroupGrad, flat: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``flat``'s gradient in its group's reduce dtype, contiguous (zeros: none), and as it is."""
        grad = grads.read(flat)
        if grad is None:
            grad = torch.zeros_like(flat, memory_format=torch.contiguous_format)
        elif not grad.is_contiguous():
            grad = grad.contiguous()
        return self._in_reduce_dtype(grads, grad), grad

    def _in_reduce_dtype(self, grads: GroupGrad, grad: Tensor) -> Tensor:
        """Return ``grad`` converted to its group's reduce dtype (a mixed-precision policy's), if any."""
        dtype = grads.reduce_dtype
        return grad if dtype is None or dtype == grad.dtype else grad.to(dtype)

    def finish(self) -> None:
        """Wait for the reductions in flight and hand each shard its averaged gradient."""
        pending, self.pending = self.pending, []
        world = self._comm.world
        for shards, works, result, full, _ in pending:
            for work in works:
                work.wait()
            for shard, grad in zip(shards, result()):
                if full is not None:  # ZeRO-1: the pieces view the whole averaged flat gradient
                    if grad is not full:  # reduced in the group's reduce dtype
                        full.copy_(grad)
                    shard.take(full)
                    continue
                shard.receive(grad.to(shard.dtype) / world, accumulate=True)
                if self._shown is not None:
                    self._shown.lend(shard)

    def _backward_end(self) -> None:
        """Engine callback: start what is left, wait for every reduction."""
        enclosing = current_node()
        if enclosing is not None:
            self._begin(None)
            raise RuntimeError(
                "ShardedOptimizer needs each flat gradient to be produced by the outermost backward; one "
                f"came from a nested (reentrant) backward run by {type(enclosing).__name__}, e.g. "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=True); pass use_reentrant=False"
            )
        try:
            self._launch(final=True)
            self.finish()
            root = self.outside.watch()  # a parameter added since the forward (or used without it)
            if root is not None:
                comm = self._comm
                outside = reduce_once(root, self._task, self.outside.training(), comm.group, comm.world)
                if outside is not None:
                    outside.wait()
        finally:
            self._begin(None)


def ready_hook(reducer: Reducer) -> Callable[[Tensor], None]:
    """Return a post-accumulate-grad hook that tells ``reducer`` (held weakly) a flat gradient is final."""
    ref = weakref.ref(reducer)

    def hook(flat: Tensor) -> None:
        live = ref()
        if live is not None:
            live.grad_ready(flat)

    return hook
