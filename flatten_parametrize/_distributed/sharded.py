"""ZeRO-1/2 over the flat buffers: :class:`ShardedOptimizer`.

Each trainable flat parameter of ``n`` elements is cut, over a world of ``W``
ranks, into ``W`` contiguous slices of ``c = ceil(n / W)`` elements (the flat
buffer padded once to ``W * c``; the padding lives only where a slice crosses
the end, in a small zero "shadow" of that slice). Rank ``r`` owns slice ``r``:
the inner optimizer (any element-wise ``torch.optim`` class) holds one
parameter of ``c`` elements per flat parameter, which is a view of the flat
buffer itself where the slice lies inside it, so it keeps state for ``1 / W``
of the model.

Per training step:

* backward: a post-accumulate-grad hook on each flat parameter starts its
  reduction as soon as its gradient is final; with ``shard_gradients=True``
  (ZeRO-2) only this rank's averaged slice is kept and the full flat gradient
  is freed, with ``False`` (ZeRO-1) the whole flat gradient is averaged and
  the slice is a view of it. Collectives start in group order on every rank
  (``bucket_cap_mb`` buckets are numbered in the order backward finishes
  them); an autograd-engine callback finishes every reduction when backward
  ends.
* ``step()``: the inner optimizer updates this rank's slices, then every
  slice is copied from its owner into every rank's flat buffer.

The optimizer reaches its storage only through the core's seams (see
``_core/features.py``): a ``_Member`` feature follows replaced flat
parameters (``on_rebacked``) and leaves with the optimizer or the storage; it
is the flat-gradient hook of each group it slices (ZeRO-2 releases full
gradients, so the buffers keep no memory for them); each group's sync claim
keeps a second optimizer and the storage's grad sync off its gradients.

Collectives per backend, measured on gloo (``benchmarks/bench_zero.py
--collectives``, 25 MiB bucket, 2 and 3 ranks): a broadcast from each owner
gathers the updated slices 1.8-5x faster than ``all_gather_into_tensor`` and
2.1-2.8x faster than an all-reduce of a zero-padded buffer; a reduce to each
owner reduces gradients 1.8-3.9x faster than ``reduce_scatter_tensor``. NCCL
has in-place ``all_gather`` / ``reduce_scatter`` over one padded buffer, which
is what it is built for.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .._core.grad import GroupGrad, check_sync, claim_sync, set_grad
from .._core.names import core_behind
from . import sharded_state as _sharded_state
from .engine import checked_process_group, current_node, graph_task_id, queue_callback
from .shard import Shard, all_gather, reduce_scatter
from .sharded_args import ALLOWED_OPTIMIZERS, check_class, hyperparameters, param_groups

if TYPE_CHECKING:
    from .._core.records import Coordinator, Group, PublicStorage

__all__ = ["ShardedOptimizer", "ALLOWED_OPTIMIZERS"]


class ShardedOptimizer(torch.optim.Optimizer):
    """Shard an element-wise optimizer's state and the gradients over ranks (ZeRO-1/2) on flat buffers.

    Each trainable flat parameter is cut into one contiguous slice per rank
    (the buffer padded once to a multiple of the world size; the padding is
    zero and never visible); rank ``r`` keeps the inner optimizer's state and,
    with ``shard_gradients=True``, the averaged gradient of slice ``r`` only,
    and :meth:`step` copies every updated slice into every rank's flat
    buffers. The optimizer averages gradients over the ranks itself during
    backward (do not call the storage's ``enable_grad_sync()``); the loop is
    ``loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()``,
    and :meth:`no_sync` (or the storage's) accumulates micro-batches locally.

    Construction is collective: every rank of ``process_group`` builds it
    over the same layout and param groups (compared with one collective; a
    mismatch raises a ``ValueError`` on every rank), and it copies rank 0's
    flat parameters to every rank, as DDP does. So are :meth:`step`,
    :meth:`clip_grad_norm_`, :meth:`state_dict` and :meth:`load_state_dict`:
    call them on every rank. A rank that fails makes the others' collectives
    fail at the process group's timeout.

    ``param_groups`` holds the flat parameters with the inner optimizer's
    hyperparameters (LR schedulers change them there; :meth:`step` passes them
    on). ``state[flat]`` is this rank's slice of that flat parameter's state
    (empty until the first step, as in any torch optimizer) and
    ``local_optimizer`` the inner optimizer over the slices. After
    backward a flat parameter's ``.grad`` is ``None`` with
    ``shard_gradients=True`` (and the storage keeps no reusable full-size
    gradient memory), the averaged gradient with ``False``. Flat parameters
    that do not require grad at construction get no slice and no state; flat
    parameters outside ``params`` are neither synced nor stepped. Train in
    flat mode (the backward must reach the flat parameters); each flat
    parameter belongs to one ``ShardedOptimizer`` at a time.

    Args:
        storage: the flat storage whose flat parameters to optimize.
        optimizer_class: an element-wise ``torch.optim`` class: one of
            ``ALLOWED_OPTIMIZERS`` (SGD, Adam, AdamW, Adamax, NAdam, RAdam,
            Adagrad, RMSprop), or another with ``allow_unlisted=True``.
        params: ``None`` (every flat parameter of ``storage``), or an iterable
            of the storage's flat parameters or of param-group dicts over them.
        process_group: the ranks to shard over. Default: the default group.
        shard_gradients: keep only this rank's slice of each gradient,
            reduced as soon as it is final (ZeRO-2); ``False`` all-reduces
            whole gradients and keeps them (ZeRO-1).
        allow_unlisted: accept an ``optimizer_class`` outside
            ``ALLOWED_OPTIMIZERS`` that the caller knows to be element-wise.
        **optimizer_kwargs: defaults for the inner optimizer (``lr=...``).

    Raises:
        TypeError: if ``storage`` is not a ``FlatStorage``, ``optimizer_class``
            not an optimizer class, ``params`` not flat parameters or dicts of
            them, or ``process_group`` not a process group.
        ValueError: if ``optimizer_class`` is not element-wise, a parameter is
            not a flat parameter of ``storage`` or is listed twice, the ranks'
            layouts differ, or this rank is not in ``process_group``.
        RuntimeError: if no process group is initialized, the storage's own
            grad sync is enabled, or another ``ShardedOptimizer`` that still
            exists optimizes one of the flat parameters.

    Example:
        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from flatten_parametrize import ShardedOptimizer, register_flat_storage
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> storage = register_flat_storage(model, bucket_cap_mb=25)
        >>> opt = ShardedOptimizer(storage, torch.optim.AdamW, lr=1e-3)
        >>> model(torch.randn(8, 4)).pow(2).mean().backward()  # gradients reduced here
        >>> norm = opt.clip_grad_norm_(1.0)
        >>> opt.step()
        >>> opt.zero_grad()
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        storage: PublicStorage,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        shard_gradients: bool = True,
        allow_unlisted: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        core: Coordinator = core_behind(storage, "ShardedOptimizer")
        check_class(optimizer_class, allow_unlisted)
        groups = param_groups(core, params)
        check_sync(_buffers(_synced(core, [p for g in groups for p in g["params"]])), self, _SYNCS)
        pg, world = checked_process_group(process_group, "ShardedOptimizer")
        self._storage_ref = weakref.ref(core)
        self._pg, self._world = pg, world
        self._rank = dist.get_rank(pg)
        self._owners = [dist.get_global_rank(pg, r) if pg is not None else r for r in range(world)]
        self._shard_gradients = bool(shard_gradients)
        #: This optimizer's part on the core: its lifecycle and the flat-gradient hook of its groups.
        self._member = _Member(self, core, releases_gradient=self._shard_gradients)
        self._nccl = "nccl" in str(dist.get_backend(pg))
        self._by_owner = not self._nccl
        #: This rank's slices, in core order (the order collectives start in, on every rank).
        self._shards: list[Shard] = []
        self._begin(None)
        self._building = True
        inner_groups = [{**g, "params": self._new_shards(core, g["params"])} for g in groups]
        #: The inner optimizer (of ``optimizer_class``) over this rank's slices.
        self.local_optimizer = optimizer_class(inner_groups, **optimizer_kwargs)
        outer = [
            {**hyperparameters(inner), "params": g["params"]}
            for g, inner in zip(groups, self.local_optimizer.param_groups)
        ]
        super().__init__(outer, dict(self.local_optimizer.defaults))
        self._building = False
        self._check_layout(core, optimizer_class)
        self._broadcast(core.flat_params)
        self._join(core)
        weakref.finalize(self, self._member.leave)

    # ----------------------------------------------------------------- building
    def _new_shards(self, storage: Coordinator, flats: list[Tensor]) -> list[Tensor]:
        """Make a slice of each trainable flat parameter in ``flats``; return the inner parameters."""
        new = [
            Shard(g, flat, self._rank, self._world)
            for g, flat in enumerate(storage.flat_params)
            if flat.requires_grad and any(flat is f for f in flats)
        ]
        self._shards = sorted(self._shards + new, key=lambda s: s.g)
        by_flat = {id(s.flat): s for s in new}
        return [by_flat[id(f)].param for f in flats if id(f) in by_flat]

    def _storage(self) -> Coordinator:
        storage = self._storage_ref()
        if storage is None:
            raise RuntimeError(
                "ShardedOptimizer: its FlatStorage no longer exists (remove_flat_storage was called, or "
                "the model was deleted); build a new optimizer for the new storage"
            )
        return storage

    def _shard_of(self, flat: Tensor) -> Shard | None:
        return next((s for s in self._shards if s.flat is flat), None)

    def _check_layout(self, storage: Coordinator, optimizer_class: type) -> None:
        """Compare a fingerprint of this rank's layout with every rank's, in one collective."""
        flats = storage.flat_params
        layout = repr(
            (
                [(n, f.numel(), str(f.dtype), f.requires_grad) for n, f in zip(storage.group_names, flats)],
                [(i.name, i.group, i.offset, i.numel, tuple(i.shape)) for i in storage.param_infos],
                [
                    [next(g for g, f in enumerate(flats) if f is p) for p in pg["params"]]
                    for pg in self.param_groups
                ],
                optimizer_class.__qualname__,
                self._shard_gradients,
            )
        )
        mine = int.from_bytes(hashlib.sha256(layout.encode()).digest()[:7], "little")
        device = self._device(storage)
        everyone = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self._world)]
        dist.all_gather(everyone, torch.tensor([mine], dtype=torch.int64, device=device), group=self._pg)
        prints = [int(t.item()) for t in everyone]
        if len(set(prints)) > 1:
            differ = [r for r, p in enumerate(prints) if p != prints[0]]
            raise ValueError(
                "ShardedOptimizer needs the same flat layout, param groups, optimizer class and "
                f"shard_gradients on every rank; ranks {differ} differ from rank 0 (layout fingerprints "
                f"{prints}); register the same model with the same groups on every rank"
            )

    def _device(self, storage: Coordinator) -> torch.device:
        """Return the device for small collectives (the backend's: CUDA for NCCL)."""
        if self._nccl:
            return torch.device("cuda", torch.cuda.current_device())
        flats = storage.flat_params
        return flats[0].device if flats else torch.device("cpu")

    def _broadcast(self, flats: Sequence[Tensor]) -> None:
        """Copy rank 0's values of ``flats`` to every rank, then refresh the slices."""
        with torch.no_grad():
            works = [
                dist.broadcast(f.detach(), self._owners[0], group=self._pg, async_op=True) for f in flats
            ]
            for work in works:
                work.wait()
            for flat in flats:
                torch.autograd.graph.increment_version(flat)
        for shard in self._shards:
            shard.bind()

    def _join(self, storage: Coordinator) -> None:
        """Claim the sync of each sliced group not claimed yet, hook it, and join the core's lifecycle."""
        groups = storage.groups()
        new = [groups[s.g] for s in self._shards if s.g not in self._member.buffers]
        claim_sync(_buffers(new), self, _SYNCS, [_refusal(group.name) for group in new])
        for group in new:
            self._member.watch(group)
        self._hook()
        self._member.join(storage)

    def _hook(self) -> None:
        """Put the gradient-ready hook on every sliced flat parameter that lacks it; relink ``state``."""
        ref = weakref.ref(self)
        for shard in self._shards:
            if shard.hooked is not shard.flat:
                self._member.hook_flat(shard.g, shard.flat, _ready_hook(ref))
                shard.hooked = shard.flat
        self._link_state()

    def _link_state(self) -> None:
        """Make ``state[flat]`` this rank's slice state (the inner optimizer's own dict), once it has any.

        Like a torch optimizer's, ``state`` is empty until the first step (or
        load): ``torch.distributed.checkpoint`` takes a non-empty ``state`` for
        an initialized one.
        """
        self.state.clear()
        inner = self.local_optimizer.state
        for shard in self._shards:
            if inner.get(shard.param):
                self.state[shard.flat] = inner[shard.param]

    def _init_state(self) -> None:
        """Create this rank's state as a step with zero gradients and ``lr=0`` would, changing no weight.

        What ``torch.distributed.checkpoint`` does to a fresh optimizer before
        it loads one (``_init_optim_state``), for the inner optimizer over the
        slices; a no-op once there is state or a slice has a gradient. No
        collective.
        """
        inner = self.local_optimizer
        if inner.state or any(s.param.grad is not None for s in self._shards):
            return
        for shard in self._shards:
            set_grad(shard.param, torch.zeros_like(shard.param))
        lrs = []
        for group in inner.param_groups:
            lrs.append(group.get("lr"))
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], Tensor) else 0.0
        try:
            inner.step()
        finally:
            for group, lr in zip(inner.param_groups, lrs):
                if lr is not None:
                    group["lr"] = lr
            inner.zero_grad(set_to_none=True)
        for shard in self._shards:
            if shard.shadow:
                shard.bind()  # the padded copy holds the flat buffer's values again
        self._link_state()

    def _follow(self, strict: bool) -> None:
        """Follow flat parameters that ``module.to()`` & co. replaced or moved to other memory.

        A flat parameter converted to another dtype or moved to another device
        cannot be followed (the slices and the state are the old one's):
        ``step()`` raises (``strict``); the lifecycle (``on_rebacked``, inside
        that ``module.to()``) leaves it to ``step()``.
        """
        storage = self._storage()
        flats = storage.flat_params if strict else [group.flat for group in storage.groups()]
        changed = False
        for shard in self._shards:
            flat = flats[shard.g]
            if flat.dtype != shard.param.dtype or flat.device != shard.param.device:
                if not strict:
                    continue
                raise RuntimeError(
                    f"ShardedOptimizer: flat parameter {storage.group_names[shard.g]!r} moved to "
                    f"{flat.dtype} on {flat.device} after the optimizer was built for {shard.param.dtype} on "
                    f"{shard.param.device}; build the optimizer after model.to(...)"
                )
            if flat is not shard.flat:
                for group in self.param_groups:
                    group["params"] = [flat if p is shard.flat else p for p in group["params"]]
                shard.flat, changed = flat, True
            if flat.data_ptr() != shard.ptr or (shard.shadow and flat._version != shard.version):
                shard.bind()  # new memory, or values written into a padded slice's range (a load)
        if changed:
            self._hook()

    # -------------------------------------------------------------- gradient sync
    def _begin(self, task: int | None) -> None:
        """Forget the previous backward (an aborted one included) and start ``task``."""
        self._task = task
        self._ready: set[int] = set()
        self._next = 0
        self._pending: list[tuple[Shard, list[Any], Tensor]] = []

    def _grad_ready(self, flat: Tensor) -> None:
        """Hook body: ``flat``'s gradient is final for this backward."""
        storage = self._storage_ref()
        if storage is None or storage.no_sync_depth:
            return
        index = next((i for i, s in enumerate(self._shards) if s.flat is flat), None)
        if index is None:  # a flat parameter object this optimizer no longer slices (replaced)
            return
        task = graph_task_id()
        if self._task != task:
            self._begin(task)
            queue_callback(self._backward_end)
        self._ready.add(index)
        self._launch(final=False)

    def _launch(self, final: bool) -> None:
        """Start the reductions next in storage order that are ready (every one if ``final``)."""
        while self._next < len(self._shards):
            if not (final or self._next in self._ready):
                return
            if self._shard_gradients:
                self._finish()  # one full gradient in flight at a time
            self._pending.append(self._start(self._shards[self._next]))
            self._next += 1

    def _start(self, shard: Shard) -> tuple[Shard, list[Any], Tensor]:
        """Start reducing ``shard``'s flat gradient (zeros where this rank has none)."""
        flat, pg, world = shard.flat, self._pg, self._world
        grad = flat.grad
        if grad is None:
            grad = torch.zeros_like(flat, memory_format=torch.contiguous_format)
        elif not grad.is_contiguous():
            grad = grad.contiguous()
        grad, full = self._in_reduce_dtype(shard, grad), grad
        if not self._shard_gradients:
            self._storage().groups()[shard.g].grads.assign(flat, full)
            if not self._nccl:
                grad.div_(world)  # gloo has no average: divide, then sum
                return shard, [dist.all_reduce(grad, group=pg, async_op=True)], grad
            return shard, [dist.all_reduce(grad, dist.ReduceOp.AVG, group=pg, async_op=True)], grad
        self._storage().groups()[shard.g].grads.release(flat)  # this rank keeps its slice only
        if self._by_owner:
            works = []
            for owner in range(world):
                lo, hi = shard.bounds(owner)
                if hi > lo:
                    works.append(dist.reduce(grad[lo:hi], self._owners[owner], group=pg, async_op=True))
            return shard, works, grad
        padded = grad
        if grad.numel() != shard.chunk * world:
            padded = torch.cat([grad, grad.new_zeros(shard.chunk * world - grad.numel())])
        out = grad.new_empty(shard.chunk)
        return shard, [reduce_scatter(out, padded, group=pg, async_op=True)], out

    def _in_reduce_dtype(self, shard: Shard, grad: Tensor) -> Tensor:
        """Return ``grad`` converted to its group's reduce dtype (a mixed-precision policy's), if any."""
        dtype = self._storage().groups()[shard.g].grads.reduce_dtype
        return grad if dtype is None or dtype == grad.dtype else grad.to(dtype)

    def _finish(self) -> None:
        """Wait for the reductions in flight and hand each slice its averaged gradient."""
        pending, self._pending = self._pending, []
        for shard, works, grad in pending:
            for work in works:
                work.wait()
            if grad.dtype != shard.flat.dtype:  # reduced in the group's reduce dtype
                grad = grad.to(shard.flat.dtype)
                if not self._shard_gradients and shard.flat.grad is not None:
                    shard.flat.grad.copy_(grad)
            if not self._shard_gradients:
                shard.set_grad(grad[shard.lo : shard.hi], accumulate=False)
            elif self._by_owner:
                shard.set_grad(grad[shard.lo : shard.hi] / self._world, accumulate=True)
            else:
                shard.set_grad(grad.div_(self._world), accumulate=True)

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
            self._finish()
        finally:
            self._begin(None)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next backward outside syncs their sum.

        The same as the storage's ``no_sync()``. Inside, each rank keeps full
        local flat gradients (as DDP's ``no_sync`` does).

        Example:
            >>> with opt.no_sync():
            ...     model(x0).sum().backward()
            >>> model(x1).sum().backward()  # syncs the sum of both
        """
        with self._storage().no_sync():
            yield

    # -------------------------------------------------------------- optimizer API
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group over flat parameters not optimized yet (collective: call it on every rank).

        The new flat parameters get rank 0's values on every rank, as at construction.

        Args:
            param_group: a dict with ``"params"`` (flat parameters of the
                storage) and hyperparameters for them.

        Raises:
            TypeError: if ``param_group`` is not a dict over flat parameters.
            ValueError: if a parameter is not a flat parameter of the storage
                or is already optimized.

        Example:
            >>> opt.add_param_group({"params": [storage["head"]], "lr": 1e-4})
        """
        if self._building:
            super().add_param_group(param_group)
            return
        storage = self._storage()
        taken = [p for g in self.param_groups for p in g["params"]]
        (group,) = param_groups(storage, [param_group], taken=taken)
        check_sync(_buffers(_synced(storage, group["params"])), self, _SYNCS)
        new = self._new_shards(storage, group["params"])
        self.local_optimizer.add_param_group({**group, "params": new})
        super().add_param_group(
            {**hyperparameters(self.local_optimizer.param_groups[-1]), "params": group["params"]}
        )
        self._broadcast(group["params"])
        self._join(storage)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the flat parameters and of this rank's slices.

        Args:
            set_to_none: drop the gradients instead of filling them with zeros.

        Example:
            >>> opt.zero_grad()
        """
        super().zero_grad(set_to_none)
        self.local_optimizer.zero_grad(set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update this rank's slices with the inner optimizer, then gather every slice on every rank.

        Args:
            closure: reevaluates the model and returns the loss (its backward syncs gradients).

        Returns:
            The closure's loss, or ``None``.

        Example:
            >>> opt.step()
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow(strict=True)
        for outer, inner in zip(self.param_groups, self.local_optimizer.param_groups):
            inner.update(hyperparameters(outer))
        self.local_optimizer.step()
        self._gather()
        self._link_state()
        return loss

    def _gather(self) -> None:
        """Copy every owner's updated slice into every rank's flat buffers."""
        world, pg = self._world, self._pg
        works, padded = [], []
        with torch.no_grad():
            for shard in self._shards:
                flat = shard.flat.detach()
                if shard.shadow:
                    flat[shard.lo : shard.hi].copy_(shard.param[: shard.hi - shard.lo])
                if self._by_owner:
                    for owner in range(world):
                        lo, hi = shard.bounds(owner)
                        if hi > lo:
                            works.append(
                                dist.broadcast(flat[lo:hi], self._owners[owner], group=pg, async_op=True)
                            )
                elif shard.numel == shard.chunk * world:  # in place: the input is the output's slice
                    works.append(all_gather(flat, shard.param, group=pg, async_op=True))
                else:
                    out = flat.new_empty(shard.chunk * world)
                    works.append(all_gather(out, shard.param, group=pg, async_op=True))
                    padded.append((flat, out))
            for work in works:
                work.wait()
            for flat, out in padded:
                flat.copy_(out[: flat.numel()])
            for shard in self._shards:
                if shard.shadow:
                    shard.param[shard.hi - shard.lo :].zero_()  # the padding stays zero
                torch.autograd.graph.increment_version(shard.flat)
                shard.version = shard.flat._version

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the gradients by their global norm over every rank's slices (one scalar all-reduce).

        Equals ``torch.nn.utils.clip_grad_norm_`` over the unsharded averaged
        gradients: same norm, same scaling. Call it on every rank, after
        backward and before :meth:`step`.

        Args:
            max_norm: the largest norm allowed.
            norm_type: the p of the p-norm: a positive number or ``inf``.
            error_if_nonfinite: raise if the total norm is ``nan`` or ``inf``.

        Returns:
            The total norm of the gradients before clipping (a scalar tensor).

        Raises:
            ValueError: if ``norm_type`` is not positive.
            RuntimeError: if ``error_if_nonfinite`` and the norm is not finite.

        Example:
            >>> norm = opt.clip_grad_norm_(1.0)
        """
        p = float(norm_type)
        if not p > 0:
            raise ValueError(
                f"clip_grad_norm_(): norm_type must be a positive number or inf; got {norm_type!r}; "
                "pass e.g. norm_type=2.0"
            )
        grads = [s.param.grad for s in self._shards if s.param.grad is not None]
        device = self._device(self._storage())
        if math.isinf(p):
            local = max(
                (g.detach().abs().max().double() for g in grads), default=torch.zeros((), dtype=torch.float64)
            )
            total = local.reshape(1).to(device)
            dist.all_reduce(total, dist.ReduceOp.MAX, group=self._pg)
        else:
            local = sum(
                (torch.linalg.vector_norm(g.detach(), p, dtype=torch.float64) ** p for g in grads),
                torch.zeros((), dtype=torch.float64),
            )
            total = local.reshape(1).to(device)
            dist.all_reduce(total, group=self._pg)
            total = total ** (1.0 / p)
        total = total[0]
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from the ShardedOptimizer is "
                "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                "by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        scaled = [
            s.param.grad
            for s in self._shards
            if s.param.grad is not None and (self._shard_gradients or s.shadow)
        ]
        if not self._shard_gradients:
            scaled += [s.flat.grad for s in self._shards if s.flat.grad is not None]
        for grad in scaled:
            grad.detach().mul_(coef.to(grad.device, grad.dtype))
        dtype = grads[0].dtype if grads else torch.float32
        return total.to(dtype)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the whole optimizer state, gathered, in the format of a single-process optimizer.

        The result equals ``optimizer_class(storage.flat_params).state_dict()``
        after the same steps on the combined batch (so
        :func:`plain_optim_state_dict` turns it into the plain model's format),
        and :meth:`load_state_dict` takes it at any world size. Collective:
        call it on every rank; every rank gets the whole state (save it from
        rank 0). The tensors are new (nothing is shared with the live state).
        State-dict hooks registered on this optimizer run as usual.

        Returns:
            ``{"state": {id: {...}}, "param_groups": [...]}``.

        Example:
            >>> sd = opt.state_dict()
            >>> if dist.get_rank() == 0:
            ...     torch.save(sd, "optim.pt")
        """
        return _sharded_state.gathered_state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (or a single-process optimizer's), at any world size.

        Each rank keeps its slices of the element-wise state; hyperparameters
        come from the state dict, as with any ``torch.optim`` optimizer. Checked
        completely before anything changes; ``state_dict`` is not modified.

        Args:
            state_dict: the optimizer state, over the same flat parameters.

        Raises:
            TypeError: if ``state_dict`` is not an optimizer state dict.
            ValueError: if its param groups or state sizes do not match.

        Example:
            >>> opt.load_state_dict(torch.load("optim.pt"))
        """
        _sharded_state.load_gathered(self, state_dict)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Return this rank's slices of the state, without any collective.

        The slices are views of the live state (as ``torch.optim`` state dicts
        are); the world size, this rank and the layout are recorded. Save one
        file per rank; :meth:`load_sharded_state_dict` takes this rank's dict
        back, or the list of every rank's dicts at another world size.

        Returns:
            ``{"format", "world_size", "rank", "numels", "state", "param_groups"}``.

        Example:
            >>> torch.save(opt.sharded_state_dict(), f"optim.{dist.get_rank()}.pt")
        """
        return _sharded_state.local_state_dict(self)

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Load slices saved by :meth:`sharded_state_dict`, at the same or another world size.

        Pass this rank's dict when the world size is the one it was saved at,
        or the list of every saving rank's dicts (in rank order) at any world
        size: each rank then copies only the ranges it owns now, so with
        ``torch.load(path, mmap=True)`` it reads only those from the files.
        No collective. Checked completely before anything changes.

        Args:
            state_dict: this rank's sharded state dict, or every rank's in a list.

        Raises:
            TypeError: if it is not what :meth:`sharded_state_dict` returns.
            ValueError: if the world size, rank or layout does not match.

        Example:
            >>> saved_world_size = 1  # the number of ranks that saved them
            >>> parts = [torch.load(f"optim.{r}.pt", mmap=True) for r in range(saved_world_size)]
            >>> opt.load_sharded_state_dict(parts)
        """
        _sharded_state.load_local_parts(self, state_dict)


#: What a ShardedOptimizer does that nothing else may do to its flat parameters (the start of a refusal).
_SYNCS = "ShardedOptimizer syncs the gradients of the flat parameters it optimizes"


def _refusal(name: str) -> str:
    """What is told to one that wants to sync group ``name``'s gradient while an optimizer does."""
    return (
        f"the flat parameter of group {name!r} is already optimized by a ShardedOptimizer that still "
        "exists, which reduces its gradient (it would be reduced twice); delete that optimizer first "
        "(del opt), or give each optimizer other flat parameters"
    )


def _synced(storage: Coordinator, flats: Iterable[Tensor]) -> list[Group]:
    """Return the groups of ``flats`` that an optimizer over them slices and syncs (the trainable ones)."""
    flats = list(flats)
    return [g for g in storage.groups() if g.flat.requires_grad and any(g.flat is f for f in flats)]


def _buffers(groups: Iterable[Group]) -> list[GroupGrad]:
    return [group.grads for group in groups]


class _Member:
    """A ShardedOptimizer's part on its storage's core: a feature, and the flat-gradient hook of its groups.

    The core drives its lifecycle (``_core/features.py``): ``on_rebacked``
    follows flat parameters that ``module.to()`` & co. replaced or moved;
    ``on_removed`` (``remove_flat_storage``) and the optimizer's garbage
    collection make it leave: every hook removed, the feature dropped. A deep
    copy of the model goes without it. As the hook of each group the
    optimizer slices, it tells the group's gradient buffer that ZeRO-2 keeps
    no full flat gradient (:attr:`releases_gradient`). It holds the optimizer
    and the core weakly.
    """

    def __init__(self, opt: ShardedOptimizer, core: Coordinator, releases_gradient: bool) -> None:
        self._opt = weakref.ref(opt)
        self._core_ref = weakref.ref(core)
        #: ZeRO-2: the full flat gradients are dropped after backward (``FlatGradHook``).
        self.releases_gradient = releases_gradient
        #: Group index -> its gradient buffer, which calls this hook.
        self.buffers: dict[int, GroupGrad] = {}
        #: Group index -> the optimizer's post-accumulate-grad hook on its flat parameter.
        self._handles: dict[int, RemovableHandle] = {}
        self._joined = False

    def watch(self, group: Group) -> None:
        """Be the flat-gradient hook of ``group``."""
        buffer = self.buffers[group.index] = group.grads
        buffer.add_hook(self)

    def hook_flat(self, g: int, flat: Tensor, hook: Callable[[Tensor], None]) -> None:
        """Put ``hook`` on group ``g``'s (new) flat parameter, off the one it replaced."""
        old = self._handles.pop(g, None)
        if old is not None:
            old.remove()
        self._handles[g] = flat.register_post_accumulate_grad_hook(hook)

    def join(self, core: Coordinator) -> None:
        """Take part in ``core``'s lifecycle (once)."""
        if not self._joined:
            core.add_feature(self)
            self._joined = True

    def leave(self) -> None:
        """Remove every hook and claim and leave the core's lifecycle (again: nothing to do)."""
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.remove()
        buffers, self.buffers = self.buffers, {}
        opt = self._opt()
        for buffer in buffers.values():
            buffer.remove_hook(self)
            buffer.release_sync(opt)
        core = self._core_ref()
        if core is not None and self._joined:
            core.remove_feature(self)
        self._joined = False

    # ------------------------------------------------------------------ Feature
    def on_rebacked(self) -> None:
        opt = self._opt()
        if opt is not None:
            opt._follow(strict=False)

    def refresh(self) -> None:
        return None  # replacements come with on_rebacked; step() checks .data swaps nothing notifies

    def on_removed(self) -> None:
        self.leave()

    def copy_for(self, storage: Coordinator, memo: dict[int, Any]) -> None:
        return None  # the optimizer optimizes the original's flat parameters, not the copy's

    # ------------------------------------------------------------- FlatGradHook
    def divisor(self, flat: Tensor) -> int | None:
        return None

    def grad_ready(self, grad: Tensor, divided: bool) -> None:
        return None


def _ready_hook(ref: weakref.ref[ShardedOptimizer]) -> Callable[[Tensor], None]:
    def hook(flat: Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt._grad_ready(flat)

    return hook
