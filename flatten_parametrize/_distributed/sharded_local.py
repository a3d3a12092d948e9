"""The local step of :class:`~flatten_parametrize.ShardedOptimizer`: the inner optimizers over its pieces.

:func:`build` makes one inner optimizer per class and the settings it is constructed with, over the
pieces this rank owns of the groups of that kind (none where it owns none: torch's optimizers refuse
an empty parameter list), and the outer param groups (the class's defaults, the group's settings and
the user's tensors). :class:`LocalStep` steps them with the outer groups' entries (an LR scheduler's
changes) and takes back what they keep in their groups (a step count), reaches their own methods,
creates their state the way ``torch.distributed.checkpoint`` does for a fresh optimizer, and clips
this rank's gradients by the global norm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from .._core.grad.owner import set_grad
from .sharded_args import hyperparameters
from .sharded_collectives import Collectives

if TYPE_CHECKING:
    from .shard import Shard
    from .sharded_partition import Partition
    from .sharded_strategies import Entry, ShardedGroup

__all__ = ["InnerOptimizers", "LocalStep", "build", "own_method"]


class InnerOptimizers(torch.optim.Optimizer):
    """The inner optimizers of a ``ShardedOptimizer``, stepped as one (its ``local_optimizer``).

    ``param_groups`` lists every inner optimizer's groups (the same dicts) and
    ``state`` their state; :meth:`step` and :meth:`zero_grad` run each.

    Args:
        optimizers: the inner optimizers.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        super().__init__([{"params": []}], {})
        self.optimizers = list(optimizers)
        self.relink()

    def relink(self) -> None:
        """List the inner optimizers' groups and state again (a load replaces their group dicts)."""
        self.param_groups = [group for opt in self.optimizers for group in opt.param_groups]
        self.state.clear()
        for opt in self.optimizers:
            self.state.update(opt.state)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every inner optimizer (a closure is not supported: the outer optimizer runs it)."""
        for opt in self.optimizers:
            opt.step()
        self.relink()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every inner optimizer's tensors."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)


def pieces_of(entry: Entry, shards: Mapping[int, Shard]) -> list[Tensor]:
    """Return this rank's pieces inside ``entry`` (none where it owns none of it)."""
    shard = shards.get(entry.g)
    if shard is None:
        return []
    stop = entry.offset + entry.numel
    return [shard.pieces[s.key] for s in shard.specs if s.numel and entry.offset <= s.offset < stop]


def build(
    groups: Sequence[ShardedGroup], ownership: Partition, shard_gradients: bool
) -> tuple[list[dict[str, Any]], LocalStep]:
    """Return the outer param groups and the local step over this rank's pieces of ``groups``."""
    local = LocalStep(InnerOptimizers([]), ownership, shard_gradients)
    shards = {shard.g: shard for shard in ownership.shards}
    outer = []
    for i, group in enumerate(groups):
        pieces = [piece for entry in group.entries for piece in pieces_of(entry, shards)]
        outer.append({**local.add(group, pieces, i), "params": group.group["params"]})
    return outer, local


def _kind(group: ShardedGroup) -> tuple[type[torch.optim.Optimizer], str]:
    """Return what makes one inner optimizer: the class and the settings it is constructed with."""
    return group.optimizer_class, repr(sorted(group.init.items()))


class LocalStep:
    """The inner optimizers over this rank's pieces, linked to the outer param groups.

    Args:
        inner: the inner optimizers (none yet: :meth:`add` makes them).
        ownership: this rank's shards.
        shard_gradients: ZeRO-2 (the shards' gradients are their own memory).
    """

    def __init__(self, inner: InnerOptimizers, ownership: Partition, shard_gradients: bool) -> None:
        self.optimizer = inner
        #: ``(inner optimizer index, its group index, outer group index)`` of every inner group.
        self._links: list[tuple[int, int, int]] = []
        #: What makes each inner optimizer (its class and construction settings), in order.
        self._kinds: list[tuple[type[torch.optim.Optimizer], str]] = []
        self._ownership = ownership
        self._shard_gradients = shard_gradients

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Return the inner optimizers, one per kind of which this rank owns pieces."""
        return list(self.optimizer.optimizers)

    def add(self, group: ShardedGroup, pieces: list[Tensor], index: int) -> dict[str, Any]:
        """Step ``pieces`` (this rank's of ``group``, outer group ``index``) with an optimizer of its kind.

        One inner optimizer per class and construction settings, made at its first pieces (none where
        this rank has none: torch's optimizers refuse an empty parameter list).

        Returns:
            The outer group's entries: its class's defaults, then the group's own settings.
        """
        probe = group.optimizer_class([torch.zeros(2, 2)], **group.init)  # its defaults
        entries = {**hyperparameters(probe.param_groups[0]), **hyperparameters(group.group)}
        if pieces:
            kind, inner = _kind(group), {**entries, "params": pieces}
            if kind in self._kinds:
                o = self._kinds.index(kind)
                self.optimizer.optimizers[o].add_param_group(inner)
            else:
                o = len(self._kinds)
                self._kinds.append(kind)
                self.optimizer.optimizers.append(group.optimizer_class([inner], **group.init))
            self._links.append((o, len(self.optimizer.optimizers[o].param_groups) - 1, index))
            self.optimizer.relink()
        return entries

    def pairs(self, outer_groups: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Return ``(outer group, inner group)`` per inner group (by position: a load makes new dicts)."""
        optimizers = self.optimizers()
        return [(outer_groups[index], optimizers[o].param_groups[j]) for o, j, index in self._links]

    def owned_groups(self) -> list[int]:
        """Return the outer groups of which this rank steps pieces."""
        return sorted({index for _, _, index in self._links})

    def push(self, outer_groups: Sequence[dict[str, Any]]) -> None:
        """Give every inner group its outer group's entries (an LR scheduler's changes, a load's)."""
        for outer, inner in self.pairs(outer_groups):
            inner.update(hyperparameters(outer))

    def pull(self, outer_groups: Sequence[dict[str, Any]]) -> None:
        """Give every outer group what its inner optimizer keeps in its group (a step count, a mode)."""
        for outer, inner in self.pairs(outer_groups):
            outer.update(hyperparameters(inner))

    def step(self, outer_groups: Sequence[dict[str, Any]]) -> None:
        """Step the inner optimizers with the entries of ``outer_groups``; keep what they keep in groups."""
        self.push(outer_groups)
        self.optimizer.step()
        self.pull(outer_groups)

    def call(self, name: str, outer_groups: Sequence[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        """Call the inner optimizers' method ``name`` (each that has one), between a push and a pull.

        Returns:
            The first call's result (``None`` where this rank's optimizers have no such method).
        """
        self.push(outer_groups)
        results = [getattr(opt, name)(*args, **kwargs) for opt in self.optimizers() if hasattr(opt, name)]
        self.pull(outer_groups)
        return results[0] if results else None

    def zero_grad(self, set_to_none: bool) -> None:
        """Reset the gradients of this rank's shards and pieces."""
        for shard in self._ownership.shards:
            shard.zero_grad(set_to_none)
        self.optimizer.zero_grad(set_to_none)

    def state_by_param(self, outer_groups: Sequence[dict[str, Any]]) -> dict[Tensor, dict[str, Any]]:
        """Return ``{outer parameter: the state of its one piece here}`` where it has one with state.

        A flat parameter's slice (ZeRO), a model tensor this rank steps whole (whole tensors).
        """
        state = self.optimizer.state
        out = {}
        for group in outer_groups:
            for param in group["params"]:
                pieces = [piece for shard in self._ownership.shards for piece in _pieces_in(shard, param)]
                if len(pieces) == 1 and state.get(pieces[0]):
                    out[param] = state[pieces[0]]
        return out

    def init_state(self) -> bool:
        """Create this rank's state as a step with zero gradients and ``lr=0`` would, changing no weight.

        What ``torch.distributed.checkpoint`` does to a fresh optimizer before
        it loads one (``_init_optim_state``); a no-op once there is state (an
        empty entry is none) or a piece has a gradient. No collective.

        Returns:
            Whether it created the state.
        """
        inner = self.optimizer
        pieces = [p for group in inner.param_groups for p in group["params"]]
        # an entry made empty by a read (schedule-free's ``train()`` looks each tensor's state up) is no state
        if any(inner.state.values()) or any(p.grad is not None for p in pieces):
            return False
        for piece in pieces:
            set_grad(piece, torch.zeros_like(piece))
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
            self.zero_grad(set_to_none=True)
        return True

    def clip_grad_norm_(
        self,
        comm: Collectives,
        device: Callable[[], torch.device],
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
    ) -> Tensor:
        """Clip the gradients by their norm over every rank (``ShardedOptimizer.clip_grad_norm_``).

        The norm is over the elements each rank owns; ZeRO-2 scales each rank's
        packed gradients, ZeRO-1 the whole flat gradients (the pieces view them).

        Raises:
            ValueError: if ``norm_type`` is not positive.
            RuntimeError: if ``error_if_nonfinite`` and the norm is not finite.
        """
        p = float(norm_type)
        if not p > 0:
            raise ValueError(
                f"clip_grad_norm_(): norm_type must be a positive number or inf; got {norm_type!r}; "
                "pass e.g. norm_type=2.0"
            )
        owned = [self._owned_grad(shard) for shard in self._ownership.shards]
        grads = [g for g in owned if g is not None]
        if math.isinf(p):
            local = max(
                (g.detach().abs().max().double() for g in grads if g.numel()),
                default=torch.zeros((), dtype=torch.float64),
            )
        else:
            local = sum(
                (torch.linalg.vector_norm(g.detach(), p, dtype=torch.float64) ** p for g in grads),
                torch.zeros((), dtype=torch.float64),
            )
        total = comm.total_norm(local, p, device())
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from the ShardedOptimizer is "
                "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                "by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        held = [shard.grad if self._shard_gradients else shard.flat.grad for shard in self._ownership.shards]
        for grad in held:
            if grad is not None:
                grad.detach().mul_(coef.to(grad.device, grad.dtype))
        dtype = grads[0].dtype if grads else torch.float32
        return total.to(dtype)

    def _owned_grad(self, shard: Shard) -> Tensor | None:
        """Return the gradient of the elements this rank owns of ``shard`` (packed), or ``None``."""
        if self._shard_gradients:
            return shard.grad
        grad = shard.flat.grad
        return None if grad is None else shard.pack(grad)


def _pieces_in(shard: Shard, param: Tensor) -> list[Tensor]:
    """Return the pieces of ``shard`` inside ``param`` (its flat parameter, or a member's leaf)."""
    if param is shard.flat:
        return [piece for piece in shard.pieces.values() if piece.numel()]
    return [
        piece
        for piece in shard.pieces.values()
        if piece.numel() and piece.shape == param.shape and piece.data_ptr() == param.data_ptr()
    ]


def own_method(classes: Sequence[type[torch.optim.Optimizer]], name: str) -> Any:
    """Return the public method ``name`` of ``classes`` that ``torch.optim.Optimizer`` lacks, or ``None``.

    What ``ShardedOptimizer`` reaches on its inner optimizers (schedule-free's ``train()`` /
    ``eval()``), decided by the classes, alike on every rank (a rank that owns no tensor of a class
    has no optimizer of it).
    """
    if name.startswith("_") or hasattr(torch.optim.Optimizer, name):
        return None
    found = next((getattr(cls, name) for cls in classes if hasattr(cls, name)), None)
    return found if callable(found) else None
