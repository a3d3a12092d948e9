"""Data-parallel gradient sync over the flat buffers with torch.distributed.

Every collective here works on a whole flat parameter (or its ``.grad``): one
collective per group, no copy into buckets of our own. The transport is
torch.distributed itself (gloo on CPU, NCCL on GPU).

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from ._flat_parameter import FlatParameter
    from ._views import GroupViews

__all__ = ["DistributedMixin"]

#: The reductions ``all_reduce_grads`` accepts.
REDUCE_OPS = ("mean", "sum")

_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id  # type: ignore[attr-defined]
_will_execute: Callable[[Any], bool] = torch._C._will_engine_execute_node  # type: ignore[attr-defined]


def _current_node() -> Any:
    """Return the autograd node this thread is running (``None`` outside backward)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return None if current is None else current()


def _queue_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def _process_group(group: Any, what: str) -> tuple[dist.ProcessGroup | None, int]:
    """Check ``group`` and the distributed state; return ``(group, world size)``."""
    if not dist.is_available():
        raise RuntimeError(
            f"{what} needs torch.distributed, which this build of torch lacks; "
            "install a torch build with distributed support"
        )
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{what}: this rank is not a member of the given process group (dist.new_group "
            "returned NON_GROUP_MEMBER here); call it only on the ranks of that group"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{what}: group must be a torch.distributed ProcessGroup or None (the default group); "
            f"got {type(group).__name__} {group!r}; pass a group made by dist.new_group(...)"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs an initialized default process group; none is initialized in this "
            "process; call torch.distributed.init_process_group(...) first"
        )
    return group, dist.get_world_size(group)


def _check_op(op: Any) -> str:
    if not isinstance(op, str):
        raise TypeError(
            f"all_reduce_grads(): op must be a str, one of {list(REDUCE_OPS)}; "
            f"got {type(op).__name__} {op!r}; pass e.g. op='mean'"
        )
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce_grads(): op must be one of {list(REDUCE_OPS)}; got {op!r}")
    return op


def _all_reduce(grad: Tensor, group: dist.ProcessGroup | None, world: int, op: str) -> dist.Work:
    """Start an in-place all-reduce of ``grad`` (``op`` is ``"mean"`` or ``"sum"``)."""
    if op == "sum" or world == 1:
        return dist.all_reduce(grad, dist.ReduceOp.SUM, group=group, async_op=True)
    if grad.is_cuda and "nccl" in str(dist.get_backend(group)):
        return dist.all_reduce(grad, dist.ReduceOp.AVG, group=group, async_op=True)
    grad.div_(world)  # gloo has no AVG: pre-divide, then sum (DDP divides too)
    return dist.all_reduce(grad, dist.ReduceOp.SUM, group=group, async_op=True)


def _flat_grad(flat: Tensor) -> Tensor:
    """Return ``flat.grad`` as a dense contiguous tensor, zeros if it is ``None``."""
    grad = flat.grad
    if grad is None:
        grad = flat.grad = torch.zeros_like(flat, memory_format=torch.contiguous_format)
    elif not grad.is_contiguous():
        grad = flat.grad = grad.contiguous()
    return grad


class _GradSync:
    """State of ``enable_grad_sync`` on one storage: hooks, launch order, backward in flight."""

    def __init__(self, group: dist.ProcessGroup | None, world: int, groups: int) -> None:
        self.group = group
        self.world = world
        self.handles: list[RemovableHandle | None] = [None] * groups
        self.pre_handles: list[RemovableHandle | None] = [None] * groups
        self.hooked: list[Tensor | None] = [None] * groups
        #: The gradient accumulator node of each hooked flat parameter.
        self.accumulators: list[Any] = [None] * groups
        #: The backward (graph task) whose gradient of each group was divided as it was built.
        self.prescaled: list[int | None] = [None] * groups
        #: Whether backward may divide gradients as it builds them: only where the collective
        #: cannot average by itself (gloo; NCCL has ``ReduceOp.AVG``).
        self.may_prescale = world > 1 and "nccl" not in str(dist.get_backend(group))
        self.forward_handle: RemovableHandle | None = None
        #: Launch order shared by all ranks; ``None`` until the first synced backward ends.
        self.order: list[int] | None = None
        self.begin(None)

    def begin(self, task: int | None) -> None:
        """Forget the previous backward (an aborted one included) and start ``task``."""
        self.task = task
        self.ready = [False] * len(self.handles)
        self.seen: list[int] = []
        self.next = 0
        self.works: list[dist.Work] = []


class _Prescale:
    """Has a group's split node divide its flat gradient by the world size while building it.

    A gloo average is a sum followed by a division: dividing while the flat
    gradient is copied together saves a pass over it, as DDP divides while
    copying into its buckets. Backward divides only when it can tell that the
    gradient ends up in ``flat.grad`` of the hooked flat parameter, which has
    no ``.grad`` yet and no other tensor hook (``torch.autograd.grad``, gradient
    accumulation and ``no_sync`` keep the plain path). If something else adds
    to the same gradient in that backward (the flat parameter used directly,
    say), :meth:`before_accumulation` corrects the sum before it is accumulated.
    """

    __slots__ = ("_g", "_outs", "_ref", "_task")

    def __init__(self, ref: weakref.ref[DistributedMixin], g: int) -> None:
        self._ref = ref
        self._g = g
        self._task: int | None = None
        self._outs: list[Tensor] = []

    def divisor(self, flat: Tensor) -> int | None:
        storage = self._ref()
        if storage is None:
            return None
        state = storage._grad_sync
        if state is None or storage._no_sync_depth or not state.may_prescale:
            return None
        g = self._g
        if state.hooked[g] is not flat or flat.grad is not None or len(flat._backward_hooks or ()) != 1:
            return None
        try:
            if not _will_execute(state.accumulators[g]):
                return None
        except RuntimeError:  # torch.autograd.grad(): the gradient is returned, not accumulated
            return None
        task = _graph_task_id()
        if self._task != task:
            self._task, self._outs = task, []
        return state.world

    def produced(self, grad: Tensor) -> None:
        self._outs.append(grad)

    def before_accumulation(self, grad: Tensor) -> Tensor | None:
        """Tensor hook of the flat parameter: mark a gradient divided in backward, correct a mixed one.

        A gradient divided as it was built only needs a sum from the
        collective. If undivided contributions were added to it in the same
        backward, the average needs ``divided + rest / world``.
        """
        storage = self._ref()
        state = None if storage is None else storage._grad_sync
        outs = self._outs if self._task == _graph_task_id() else []
        self._task, self._outs = None, []  # let accumulation take the gradient without a copy
        if state is None or not outs:
            return None
        state.prescaled[self._g] = _graph_task_id()
        if len(outs) == 1 and grad.data_ptr() == outs[0].data_ptr():
            return None  # the divided gradient is the whole gradient
        divided = outs[0] if len(outs) == 1 else torch.stack(outs).sum(0)
        return grad.sub(divided).div_(state.world).add_(divided)


class _RehookOnForward:
    """Root forward pre-hook: re-register the grad hooks on flat parameters that changed.

    ``module.to()`` & co. may replace a flat parameter object (see
    ``FlatStorage._adopt_flat_params``); hooks registered on the old object
    would be lost. A copy (``copy.deepcopy`` of the module) is inert and
    removes itself at its first call.
    """

    def __init__(self, storage: DistributedMixin | None) -> None:
        self._ref = None if storage is None else weakref.ref(storage)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        storage = None if self._ref is None else self._ref()
        if storage is None or storage._grad_sync is None:
            _drop_forward_hooks(module, only=self)
            return
        storage._rehook()

    def __deepcopy__(self, memo: dict[int, Any]) -> _RehookOnForward:
        return _RehookOnForward(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_RehookOnForward, (None,))


def _drop_forward_hooks(module: nn.Module, only: _RehookOnForward | None = None) -> None:
    """Remove our forward pre-hooks (all of them, or just ``only``) from ``module``."""
    hooks = module._forward_pre_hooks
    for key, hook in list(hooks.items()):
        if isinstance(hook, _RehookOnForward) and (only is None or hook is only):
            del hooks[key]


class DistributedMixin:
    """``FlatStorage`` methods for torch.distributed (one collective per flat parameter)."""

    if TYPE_CHECKING:
        _flat: list[FlatParameter]
        _views: list[GroupViews]
        _group_names: list[str]
        _flattened: bool
        _root_ref: weakref.ref[nn.Module]

        @property
        def module(self) -> nn.Module: ...

        def flatten(self) -> None: ...

        def unflatten(self) -> None: ...

    _grad_sync: _GradSync | None = None
    _no_sync_depth: int = 0

    @contextmanager
    def _flat_mode(self) -> Iterator[None]:
        """Run a block in flat mode, then restore the previous mode."""
        was_flat = self._flattened
        self.flatten()
        try:
            yield
        finally:
            if not was_flat:
                self.unflatten()

    # ------------------------------------------------------------ collectives
    def all_reduce_grads(self, group: dist.ProcessGroup | None = None, op: str = "mean") -> None:
        """All-reduce the gradient of every flat parameter across ranks, one collective per group.

        Call it on every rank of ``group`` after backward (instead of, or
        without, :meth:`enable_grad_sync`). Groups whose flat parameter does
        not require grad are skipped; one that requires grad but has no
        ``.grad`` on this rank contributes zeros and receives the result, so
        every rank issues the same collectives. In unflattened mode the
        parameters' gradients are written to the flat buffers first and are
        views of the reduced gradients afterwards.

        Args:
            group (ProcessGroup, optional): the ranks to reduce over.
                Default: ``None``, the default process group.
            op (str): ``"mean"`` (average over ranks, as DDP does) or ``"sum"``.
                Default: ``"mean"``.

        Raises:
            TypeError: if ``op`` is not a str or ``group`` not a process group.
            ValueError: if ``op`` is not one of ``"mean"``, ``"sum"``, or this
                rank is not a member of ``group``.
            RuntimeError: if no default process group is initialized.

        Example:
            >>> import torch
            >>> import torch.distributed as dist
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500",
            ...                         rank=0, world_size=1)  # doctest: +SKIP
            >>> layer = nn.Linear(2, 1)
            >>> storage = register_flat_storage(layer)
            >>> layer(torch.ones(1, 2)).sum().backward()
            >>> storage.all_reduce_grads()  # doctest: +SKIP
            >>> storage["0"].grad  # doctest: +SKIP
            tensor([1., 1., 1.])
        """
        op = _check_op(op)
        pg, world = _process_group(group, "all_reduce_grads()")
        with self._flat_mode():
            grads = [_flat_grad(flat) for flat in self._flat if flat.requires_grad]
            works = [_all_reduce(grad, pg, world, op) for grad in grads]
            for work in works:
                work.wait()

    def broadcast_params(self, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
        """Copy the flat parameters of rank ``src`` to every rank, one collective per group.

        Use it once after building the model so that every rank starts from
        the same weights (DDP does this in its constructor). Every group is
        broadcast, frozen ones included; buffers (e.g. BatchNorm running
        statistics) are not part of the flat storage and are left alone.

        Args:
            src (int): global rank whose values every rank receives. Default: ``0``.
            group (ProcessGroup, optional): the ranks to broadcast to.
                Default: ``None``, the default process group.

        Raises:
            TypeError: if ``src`` is not an int or ``group`` not a process group.
            ValueError: if ``src`` is not a rank of ``group``, or this rank is
                not a member of ``group``.
            RuntimeError: if no default process group is initialized.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> storage = register_flat_storage(nn.Linear(2, 1))
            >>> storage.broadcast_params(src=0)  # doctest: +SKIP
        """
        if isinstance(src, bool) or not isinstance(src, int):
            raise TypeError(
                f"broadcast_params(): src must be an int (a global rank); got {type(src).__name__} "
                f"{src!r}; pass e.g. src=0"
            )
        pg, world = _process_group(group, "broadcast_params()")
        ranks = list(range(world)) if pg is None else dist.get_process_group_ranks(pg)
        if src not in ranks:
            raise ValueError(
                f"broadcast_params(): src must be a global rank of the process group, one of "
                f"{ranks}; got {src}; pass the rank that holds the weights to copy"
            )
        with self._flat_mode(), torch.no_grad():
            data = [flat.detach() for flat in self._flat]
            works = [dist.broadcast(t, src, group=pg, async_op=True) for t in data]
            for work in works:
                work.wait()
            for t in data:  # an in-place write: cached views and saved tensors must see it
                torch.autograd.graph.increment_version(t)

    # ------------------------------------------------------- sync in backward
    def enable_grad_sync(self, group: dist.ProcessGroup | None = None) -> None:
        """Average every flat gradient across ranks during each backward, as DDP does.

        Once enabled, every flat gradient is averaged over ``group`` by the
        time ``loss.backward()`` returns. The collective of a group starts as
        soon as its flat gradient is final for this backward (a
        post-accumulate-grad hook), so, with the model split into several
        groups (``register_flat_storage(..., bucket_cap_mb=25)``, or one group
        per block), communication overlaps the rest of backward; an
        autograd-engine callback waits for all of them at the end of backward.

        Semantics:

        * Collectives start in one order shared by all ranks: group order in
          the first synced backward, then the order in which rank 0's first
          synced backward finished the groups.
        * A group that this rank's backward did not reach (an unused branch)
          is still reduced at the end of backward, contributing zeros, so
          ranks never wait on each other (like DDP's
          ``find_unused_parameters=True``). Its ``.grad`` is then set, to zeros
          if no rank produced one. Every rank's backward must reach at least
          one flat parameter.
        * Groups that do not require grad are never reduced.
        * Inside :meth:`no_sync` nothing is reduced; gradients accumulate
          locally and the next synced backward averages the sum.
        * Only backward passes in flat mode that reach the flat parameters
          are synced: not ``using()`` substitutes, not the leaf parameters of
          unflattened mode (call :meth:`all_reduce_grads` there).
        * Call ``backward`` once per step outside ``no_sync`` (a second
          synced backward reduces the already averaged gradient again).
          Reentrant activation checkpointing (``use_reentrant=True``) runs a
          nested backward and is refused with a ``RuntimeError`` from
          ``backward``; use ``use_reentrant=False``.
        * A flat parameter replaced by ``module.to()`` gets its hook again at
          the next forward of the registered module.
        * Where the backend cannot average inside the collective (gloo),
          backward divides a flat gradient by the world size while copying it
          together and the collective only sums, saving a pass over the
          gradient (DDP divides while copying into its buckets). A tensor
          hook on a flat parameter still sees the local, undivided gradient.

        A rank that fails or stops makes the others' collectives fail after
        the process group's timeout (``init_process_group(timeout=...)``),
        raised from ``backward``; they never wait forever.

        Args:
            group (ProcessGroup, optional): the ranks to average over.
                Default: ``None``, the default process group.

        Raises:
            TypeError: if ``group`` is not a process group.
            ValueError: if this rank is not a member of ``group``.
            RuntimeError: if no default process group is initialized, or grad
                sync is already enabled on this storage.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
            >>> storage = register_flat_storage(model, bucket_cap_mb=25)
            >>> storage.broadcast_params()  # doctest: +SKIP
            >>> storage.enable_grad_sync()  # doctest: +SKIP
            >>> model(torch.randn(8, 4)).pow(2).mean().backward()  # grads averaged here
        """
        pg, world = _process_group(group, "enable_grad_sync()")
        if self._grad_sync is not None:
            raise RuntimeError(
                "enable_grad_sync(): grad sync is already enabled on this storage; call "
                "disable_grad_sync() first to change the process group"
            )
        module = self.module
        _drop_forward_hooks(module)  # inert leftovers of a deep-copied module
        state = _GradSync(pg, world, len(self._flat))
        self._grad_sync = state
        state.forward_handle = module.register_forward_pre_hook(_RehookOnForward(self))
        self._rehook()

    def disable_grad_sync(self) -> None:
        """Stop syncing gradients in backward and remove every hook that sync added.

        Does nothing if grad sync is not enabled. A backward already in
        flight still completes its collectives.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> storage = register_flat_storage(nn.Linear(2, 1))
            >>> storage.disable_grad_sync()
        """
        state, self._grad_sync = self._grad_sync, None
        if state is not None:
            for handle in state.handles + state.pre_handles:
                if handle is not None:
                    handle.remove()
            for group in self._views:
                group.grad_buffer.prescale = None
            if state.forward_handle is not None:
                state.forward_handle.remove()
        module = self._root_ref()
        if module is not None:
            _drop_forward_hooks(module)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient sync inside the block, for gradient accumulation (like DDP's ``no_sync``).

        Backward passes inside only accumulate local gradients; the first
        synced backward after the block averages the accumulated sum. Nests;
        without :meth:`enable_grad_sync` it changes nothing.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(2, 1)
            >>> storage = register_flat_storage(model)
            >>> micro_batches = torch.randn(4, 3, 2).unbind()
            >>> with storage.no_sync():
            ...     for x in micro_batches[:-1]:
            ...         model(x).sum().backward()
            >>> model(micro_batches[-1]).sum().backward()  # syncs the sum, if enabled
        """
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    # --------------------------------------------------------------- internals
    def _rehook(self) -> None:
        """Register the grad-ready hook on every flat parameter that does not carry it yet."""
        state = self._grad_sync
        if state is None:
            return
        ref = weakref.ref(self)
        for g, flat in enumerate(self._flat):
            if state.hooked[g] is flat or not flat.requires_grad:
                continue
            for handle in (state.handles[g], state.pre_handles[g]):
                if handle is not None:
                    handle.remove()
            prescale = _Prescale(ref, g)
            state.handles[g] = flat.register_post_accumulate_grad_hook(_grad_ready_hook(ref, g))
            state.pre_handles[g] = flat.register_hook(prescale.before_accumulation)
            state.accumulators[g] = get_gradient_edge(flat).node
            state.hooked[g] = flat
            self._views[g].grad_buffer.prescale = prescale

    def _grad_ready(self, g: int) -> None:
        """Hook body: group ``g``'s flat gradient is final for this backward."""
        state = self._grad_sync
        if state is None or self._no_sync_depth:
            return
        task = _graph_task_id()
        if state.task != task:
            state.begin(task)
            _queue_callback(lambda: self._backward_end(state))
        if state.ready[g]:
            return
        state.ready[g] = True
        state.seen.append(g)
        if state.order is not None:
            self._launch(state, state.order, final=False)

    def _launch(self, state: _GradSync, order: Sequence[int], final: bool) -> None:
        """Start the collectives of the groups next in ``order`` that are ready (all if ``final``)."""
        while state.next < len(order):
            g = order[state.next]
            flat = self._flat[g]
            if flat.requires_grad:
                if not (final or state.ready[g]):
                    return
                op = "sum" if state.prescaled[g] == state.task else "mean"  # divided in backward
                state.works.append(_all_reduce(_flat_grad(flat), state.group, state.world, op))
            state.next += 1

    def _backward_end(self, state: _GradSync) -> None:
        """Engine callback: reduce what is left, wait for every collective, learn the order."""
        enclosing = _current_node()
        if enclosing is not None:  # the end of a nested backward, not of the user's backward
            state.begin(None)
            raise RuntimeError(
                "grad sync needs each flat gradient to be produced by the outermost backward; "
                f"one came from a nested (reentrant) backward run by {type(enclosing).__name__}, "
                "e.g. torch.utils.checkpoint.checkpoint(..., use_reentrant=True); pass "
                "use_reentrant=False, or call disable_grad_sync() and all_reduce_grads() after backward"
            )
        try:
            order = state.order if state.order is not None else list(range(len(self._flat)))
            self._launch(state, order, final=True)
            for work in state.works:
                work.wait()
            if state.order is None:
                state.order = self._agree_order(state)
        finally:
            state.begin(None)

    def _agree_order(self, state: _GradSync) -> list[int]:
        """Return rank 0's readiness order (unseen groups last), broadcast to every rank."""
        n = len(self._flat)
        local = state.seen + [g for g in range(n) if g not in state.seen]
        synced = [f for f in self._flat if f.requires_grad]
        device = synced[0].device if synced else torch.device("cpu")
        order = torch.tensor(local, dtype=torch.int64, device=device)
        src = 0 if state.group is None else dist.get_global_rank(state.group, 0)
        dist.broadcast(order, src, group=state.group)
        return [int(g) for g in order.tolist()]


def _grad_ready_hook(ref: weakref.ref[DistributedMixin], g: int) -> Callable[[Tensor], None]:
    def hook(flat: Tensor) -> None:
        storage = ref()
        if storage is not None:
            storage._grad_ready(g)

    return hook
