"""ZeRO-1/2 over the flat buffers: :class:`ShardedOptimizer`.

Every rank owns element ranges of each trainable flat parameter, chosen by the
optimizer's ownership rule, one strategy object per rule
(``sharded_strategies.py``): ZeRO's equal slices (each of ``W`` ranks the
``r``-th of ``c = ceil(n / W)`` elements), or whole tensors
(``whole_tensors=True``). This rank's inner optimizers step its pieces, views
of the flat buffer, so it keeps optimizer state for its part of the model only.

Per training step:

* backward: a post-accumulate-grad hook on each flat parameter starts its
  reduction as soon as its gradient is final; with ``shard_gradients=True``
  (ZeRO-2) only this rank's averaged ranges are kept and the full flat
  gradient is freed, with ``False`` (ZeRO-1) the whole flat gradient is
  averaged and the pieces' gradients view it. Collectives start in group
  order on every rank (``bucket_cap_mb`` buckets are numbered in the order
  backward finishes them); an autograd-engine callback finishes every
  reduction when backward ends.
* ``step()``: the inner optimizers update this rank's pieces, then every
  owner's ranges are copied into every rank's flat buffer.

This module is the ``torch.optim.Optimizer`` API and the wiring; it asks the
strategy and branches on none; each concern is an object in its own module,
which the others reach only through it:

* ``sharded_strategies.py``: the ownership rules (param groups, who owns which
  ranges, this rank's pieces); ``sharded_partition.py`` this rank's shards
  (``shard.py``: one flat parameter's ranges and pieces);
* ``sharded_rules.py``: what a class can be sharded by (cuts, settings read when
  constructed, steps that read several tensors);
* ``sharded_collectives.py``: every collective over the process group;
* ``sharded_reducer.py``: the gradient path during backward (hooks, buckets,
  the engine callback); ``sharded_grads.py`` the gradients as the model shows
  them (ZeRO-2's placeholders, ZeRO-1's whole gradients);
* ``sharded_local.py``: the inner optimizers (step, their own methods, state
  creation, gradient clipping);
* ``sharded_state.py``: the state-dict conversions, which read a ``StateView``
  of the parts above;
* ``sharded_feature.py``: the optimizer's feature on the core (lifecycle,
  flat-gradient hook, sync claim);
* ``sharded_args.py``: the argument checks.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .._core.grad.owner import check_sync, claim_sync
from .._core.names import core_behind
from . import sharded_state as _sharded_state
from .outside_params import broadcast as broadcast_outside
from .outside_params import outside_params
from .process_group import checked_process_group
from .sharded_args import ALLOWED_OPTIMIZERS, check_same_layout
from .sharded_collectives import Collectives
from .sharded_feature import SYNCS, OptimizerShards, buffers, live_core, refusal, synced
from .sharded_grads import model_grads
from .sharded_local import build, own_method, pieces_of
from .sharded_partition import Partition
from .sharded_reducer import Reducer, ready_hook
from .sharded_strategies import ShardedGroup, Strategy, strategy_for

if TYPE_CHECKING:
    from .._core.records import Coordinator, PublicStorage

__all__ = ["ShardedOptimizer", "ALLOWED_OPTIMIZERS", "init_state"]


class ShardedOptimizer(torch.optim.Optimizer):
    """Shard an element-wise optimizer's state and the gradients over ranks (ZeRO-1/2) on flat buffers.

    Each trainable flat parameter is cut into one contiguous slice per rank
    (``ceil(n / W)`` elements each, the last ones shorter: the one-buffer
    collectives of NCCL pad in flight); rank ``r`` keeps the inner optimizer's state and,
    with ``shard_gradients=True``, the averaged gradient of slice ``r`` only,
    and :meth:`step` copies every updated slice into every rank's flat
    buffers. The optimizer averages gradients over the ranks itself during
    backward (do not call the storage's ``enable_grad_sync()``); the loop is
    ``loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()``,
    and :meth:`no_sync` (or the storage's) accumulates micro-batches locally.

    Construction is collective: every rank of ``process_group`` builds it
    over the same layout and param groups (compared with one collective; a
    mismatch raises a ``ValueError`` on every rank), and it copies rank 0's
    flat parameters (and the module's parameters that no group holds) to
    every rank, as DDP does. So are :meth:`step`,
    :meth:`clip_grad_norm_`, :meth:`state_dict` and :meth:`load_state_dict`:
    call them on every rank. A rank that fails makes the others' collectives
    fail at the process group's timeout. The gradients of the outside
    parameters (a head put in later, say) are averaged when backward ends,
    as under DDP: step them with an optimizer of their own.

    ``param_groups`` holds the flat parameters with the inner optimizer's
    hyperparameters (LR schedulers change them there; :meth:`step` passes them
    on). ``state[flat]`` is this rank's slice of that flat parameter's state
    (empty until the first step, as in any torch optimizer) and
    ``local_optimizer`` the inner optimizers over this rank's pieces (its
    ``optimizers``, one per class; its ``param_groups`` and ``state`` theirs). After
    backward with ``shard_gradients=True`` the storage keeps no full-size
    gradient memory, and a flat parameter's ``.grad`` (a leaf's in
    per-tensor mode) is a placeholder of the gradient sharded over the ranks:
    clearing it (``model.zero_grad()``, ``p.grad = None``), zeroing it,
    ``torch.nn.utils.clip_grad_norm_`` through it (by the global norm, on
    every rank) and scaling it reach this rank's part; reading its values
    raises. With ``False`` it is the whole averaged gradient, from which each
    step takes the slices' gradients. Flat parameters
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
        whole_tensors: give each rank whole tensors instead of slices, for
            optimizers whose math is per tensor (Muon, Adafactor, LAMB):
            who owns which tensor is decided over every bucket at once,
            balanced by what each tensor's step costs (Newton-Schulz flops
            for Muon-like classes, elements for element-wise ones; a class
            may state its own with ``step_cost(shape)`` and
            ``state_numel(shape)`` class attributes), never cutting a tensor
            whose group's optimizer is not element-wise, and the rank
            steps its tensors in their real shapes. ``params`` may then
            hold the model's parameters of per-tensor mode (after
            ``storage.unflatten()``) and a param group may name its own
            class under ``"optimizer_class"`` (e.g. Muon on the matrices,
            the constructor's AdamW on the rest). ``state_dict()`` is then
            the plain model's per-tensor format (any world size).
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
        whole_tensors: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        core: Coordinator = core_behind(storage, "ShardedOptimizer")
        strategy = strategy_for(core, whole_tensors)
        groups = strategy.groups(core, params, optimizer_class, optimizer_kwargs, allow_unlisted)
        used = _flats_of(core, groups)
        check_sync(buffers(synced(core, used)), self, SYNCS)
        pg, world = checked_process_group(process_group, "ShardedOptimizer")
        self._storage_ref = weakref.ref(core)
        self._shard_gradients = bool(shard_gradients)
        #: The ownership rule, and the param groups it checked (each one's class and entries).
        self._strategy: Strategy = strategy
        self._groups: list[ShardedGroup] = groups
        #: The constructor's class and keyword arguments (a param group added later takes them).
        self._optimizer_class, self._optimizer_kwargs = optimizer_class, dict(optimizer_kwargs)
        #: The process group and every collective over it.
        self._comm = Collectives(pg, world)
        #: This rank's shards, in core order (the order collectives start in), and which move together.
        self._ownership = Partition(strategy, world, self._comm.rank, self._comm.max_padding)
        self._ownership.add(core.flat_params, used)
        #: The gradients as the model shows them (ZeRO-2: placeholders of the shards), settled before
        #: each update.
        self._grads = model_grads(core, self._ownership, self._comm, self._shard_gradients)
        #: The gradient path during backward.
        self._reducer = Reducer(core, self._ownership, self._comm, self._grads)
        #: This optimizer's part on the core: its lifecycle and the flat-gradient hook of its groups.
        self._member = OptimizerShards(
            self,
            core,
            self._shard_gradients,
            _follower(weakref.ref(self)),
            self._reducer.outside,
            self._grads,
        )
        self._building = True
        outer, self._local = build(groups, self._ownership, self._shard_gradients)
        #: The inner optimizers over this rank's pieces (one per class and construction settings).
        self.local_optimizer = self._local.optimizer
        # the constructor's class's defaults that every group has (a group of another class has its own)
        probe = optimizer_class([torch.zeros(2, 2)], **optimizer_kwargs).defaults
        super().__init__(outer, {k: v for k, v in probe.items() if all(k in group for group in outer)})
        self._building = False
        check_same_layout(core, groups, optimizer_class, self._shard_gradients, self._comm)
        self._broadcast(core.flat_params)
        broadcast_outside(outside_params(core.module), self._comm.owners[0], pg)
        self._join(core)
        weakref.finalize(self, self._member.leave)

    def __getattr__(self, name: str) -> Any:
        """Reach a method of the inner optimizers' classes (schedule-free's ``train()`` / ``eval()``).

        The call runs on every inner optimizer of this rank that has it, with the param groups' entries
        given and taken back as in :meth:`step`, then every rank's tensors are gathered (the method may
        change them): a collective call, made on every rank like :meth:`step`.
        """
        groups = self.__dict__.get("_groups", [])
        classes = [self.__dict__.get("_optimizer_class"), *(group.optimizer_class for group in groups)]
        if own_method([cls for cls in classes if cls is not None], name) is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return functools.partial(self._call_inner, name)

    def _call_inner(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._follow(strict=True)  # the slices hold the flat buffers' values (a load wrote them)
        result = self._local.call(name, self.param_groups, *args, **kwargs)
        self._comm.gather_slices(self._ownership.units)
        self._link_state()
        return result

    # ------------------------------------------------------------------- wiring
    def _storage(self) -> Coordinator:
        return live_core(self._storage_ref)

    def _shards(self) -> dict[int, Any]:
        return {shard.g: shard for shard in self._ownership.shards}

    def _broadcast(self, flats: Sequence[Tensor]) -> None:
        """Copy rank 0's values of ``flats`` to every rank, then refresh the slices."""
        self._comm.broadcast_from_first(flats)
        self._ownership.bind()

    def _join(self, storage: Coordinator) -> None:
        """Claim the sync of each sliced group not claimed yet, hook it, and join the core's lifecycle."""
        groups = storage.groups()
        new = [groups[s.g] for s in self._ownership.shards if s.g not in self._member.buffers]
        claim_sync(buffers(new), self, SYNCS, [refusal(group.name) for group in new])
        for group in new:
            self._member.watch(group)
        self._hook()
        self._member.join(storage)

    def _hook(self) -> None:
        """Put the gradient-ready hook on every sliced flat parameter that lacks it; relink ``state``."""
        for shard in self._ownership.shards:
            if shard.hooked is not shard.flat:
                self._member.hook_flat(shard.g, shard.flat, ready_hook(self._reducer))
                shard.hooked = shard.flat
        self._link_state()

    def _link_state(self) -> None:
        """Make ``state[param]`` the state of this rank's piece of it (the inner optimizer's own dict).

        A flat parameter's slice (ZeRO), a tensor this rank steps whole. Like a
        torch optimizer's, ``state`` is empty until the first step (or load):
        ``torch.distributed.checkpoint`` takes a non-empty ``state`` for an
        initialized one.
        """
        self.state.clear()
        self.state.update(self._local.state_by_param(self.param_groups))

    def _follow(self, strict: bool) -> None:
        """Follow flat parameters that ``module.to()`` & co. replaced or moved to other memory.

        A flat parameter converted to another dtype or moved to another device
        cannot be followed (the slices and the state are the old one's):
        ``step()`` raises (``strict``); the lifecycle (``on_rebacked``, inside
        that ``module.to()``) leaves it to ``step()``.
        """
        storage = self._storage()
        flats = storage.flat_params if strict else [group.flat for group in storage.groups()]
        replaced = self._ownership.follow(flats, storage.group_names, strict)
        for old, new in replaced:
            for group in self.param_groups:
                group["params"] = [new if p is old else p for p in group["params"]]
        if replaced:
            self._hook()

    def _state_view(self) -> _sharded_state.StateView:
        """Return what the state conversion reads of this optimizer."""
        return _sharded_state.StateView(
            self.param_groups, self._groups, self._local, self._ownership, self._comm
        )

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
        self._strategy.check_add_group()
        storage = self._storage()
        taken = [p for g in self.param_groups for p in g["params"]]
        cls, kwargs = self._optimizer_class, self._optimizer_kwargs
        (group,) = self._strategy.groups(storage, [param_group], cls, kwargs, True, taken=taken)
        flats = _flats_of(storage, [group])
        check_sync(buffers(synced(storage, flats)), self, SYNCS)
        self._ownership.add(storage.flat_params, flats)
        pieces = [piece for entry in group.entries for piece in pieces_of(entry, self._shards())]
        entries = self._local.add(group, pieces, len(self.param_groups))
        super().add_param_group({**entries, "params": group.group["params"]})
        self._groups.append(group)
        self._broadcast(flats)
        self._join(storage)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the flat parameters and of this rank's slices.

        Args:
            set_to_none: drop the gradients instead of filling them with zeros.

        Example:
            >>> opt.zero_grad()
        """
        super().zero_grad(set_to_none)
        self._local.zero_grad(set_to_none)
        self._grads.before_update()

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
        self._grads.before_update()  # what was cleared or scaled through the model's parameters
        self._local.step(self.param_groups)
        self._comm.gather_slices(self._ownership.units)
        self._link_state()
        return loss

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
        self._grads.before_update()
        return self._local.clip_grad_norm_(
            self._comm,
            lambda: self._comm.device(self._storage().flat_params),
            max_norm,
            norm_type,
            error_if_nonfinite,
        )

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
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        result = _sharded_state.gathered_state_dict(self._state_view())
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            hooked = post_hook(self, result)
            if hooked is not None:
                result = hooked
        return result

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
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hooked = pre_hook(self, state_dict)  # type: ignore[arg-type]  # torch types it a dict
            if hooked is not None:
                state_dict = hooked
        _sharded_state.load_gathered(self._state_view(), state_dict)
        self._link_state()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Return this rank's slices of the state, without any collective.

        The slices are views of the live state (as ``torch.optim`` state dicts
        are); the world size, this rank and the layout are recorded. Save one
        file per rank; :meth:`load_sharded_state_dict` takes this rank's dict
        back, or the list of every rank's dicts at another world size.

        Returns:
            ``{"format", "world_size", "rank", "entries", "state", "param_groups", "stepped_groups"}``:
            ``state`` holds, per tensor of the gathered state dict, this rank's pieces of it.

        Example:
            >>> torch.save(opt.sharded_state_dict(), f"optim.{dist.get_rank()}.pt")
        """
        return _sharded_state.local_state_dict(self._state_view())

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
        _sharded_state.load_local_parts(self._state_view(), state_dict)
        self._link_state()


def init_state(opt: ShardedOptimizer) -> None:
    """Create ``opt``'s state on this rank as a step with zero gradients and ``lr=0`` would (no collective).

    What ``torch.distributed.checkpoint`` does to a fresh optimizer before it
    loads one (``_init_optim_state``; ``dcp.py`` calls this instead); a no-op
    once there is state or a slice has a gradient. What the step puts in the
    inner optimizers' param groups (a step count) goes to the outer ones too,
    so that DCP's load finds its entry there.

    Args:
        opt: the optimizer whose state to create.
    """
    if opt._local.init_state():
        opt._local.pull(opt.param_groups)
        opt._link_state()


def entries_of(opt: ShardedOptimizer) -> tuple[Coordinator, list[list[Any]]]:
    """Return the storage's core and each param group's entries (``sharded_strategies.Entry``).

    The tensors of the gathered state dict, in its order: a flat parameter each (ZeRO's slices), or
    the model's tensors (whole tensors).
    """
    return opt._storage(), [list(group.entries) for group in opt._groups]


def _flats_of(core: Coordinator, groups: Sequence[ShardedGroup]) -> list[Tensor]:
    """Return the flat parameters that hold the entries of ``groups``, in group order."""
    used = sorted({entry.g for group in groups for entry in group.entries})
    return [core.flat_params[g] for g in used]


def _follower(ref: weakref.ref[ShardedOptimizer]) -> Callable[[], None]:
    """Return what the core calls on the optimizer (held weakly) when it replaced flat parameters."""

    def follow() -> None:
        opt = ref()
        if opt is not None:
            opt._follow(strict=False)

    return follow
