"""The local step of :class:`~flatten_parametrize.ShardedOptimizer`: the inner optimizer over the shards.

:class:`LocalStep` steps the inner optimizer (any element-wise ``torch.optim``
class) with the outer param groups' hyperparameters, creates its state the way
``torch.distributed.checkpoint`` does for a fresh optimizer, maps its state to
the flat parameters, and clips the shards' gradients by the global norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import Tensor

from .sharded_args import hyperparameters
from .sharded_collectives import Collectives
from .sharded_partition import Partition

__all__ = ["LocalOptimizers", "LocalStep", "WholeTensorStep", "no_checkpoints", "own_method"]


class LocalStep:
    """The inner optimizer over this rank's shards.

    Args:
        optimizer: the inner optimizer, over the shards' parameters.
        ownership: who owns which slice (this rank's shards).
        shard_gradients: ZeRO-2 (the shards' gradients are their own memory).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, ownership: Partition, shard_gradients: bool) -> None:
        self.optimizer = optimizer
        self._ownership = ownership
        self._shard_gradients = shard_gradients

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Return the inner optimizers (one; by class for whole tensors, none where this rank owns none)."""
        return [self.optimizer]

    def owned_groups(self) -> list[int]:
        """Return the outer groups of which this rank steps a part (every one: each has a slice here)."""
        return list(range(len(self.optimizer.param_groups)))

    def pairs(self, outer_groups: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Return ``(outer group, inner group)`` for every inner group."""
        return list(zip(outer_groups, self.optimizer.param_groups))

    def push(self, outer_groups: Sequence[dict[str, Any]]) -> None:
        """Give every inner group its outer group's entries (an LR scheduler's changes, a load's)."""
        for outer, inner in self.pairs(outer_groups):
            inner.update(hyperparameters(outer))

    def pull(self, outer_groups: Sequence[dict[str, Any]]) -> None:
        """Give every outer group what its inner optimizer keeps in its group (a step count, a mode)."""
        for outer, inner in self.pairs(outer_groups):
            outer.update(hyperparameters(inner))

    def step(self, outer_groups: Sequence[dict[str, Any]]) -> None:
        """Step the inner optimizer with the entries of ``outer_groups``; keep what it keeps in its groups."""
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
        """Reset the gradients of this rank's slices."""
        self.optimizer.zero_grad(set_to_none)

    def state_by_flat(self) -> dict[Tensor, dict[str, Any]]:
        """Return ``{flat parameter: the inner optimizer's state of its shard}`` for the shards with state."""
        inner = self.optimizer.state
        return {shard.flat: inner[shard.param] for shard in self._ownership.shards if inner.get(shard.param)}

    def init_state(self) -> bool:
        """Create this rank's state as a step with zero gradients and ``lr=0`` would, changing no weight.

        What ``torch.distributed.checkpoint`` does to a fresh optimizer before
        it loads one (``_init_optim_state``), for the inner optimizer over the
        slices (or the inner optimizers over the whole tensors); a no-op once
        there is state (an empty entry is none) or a slice has a gradient. No
        collective.

        Returns:
            Whether it created the state.
        """
        inner = self.optimizer
        shards = self._ownership.shards
        # an entry made empty by a read (schedule-free's ``train()`` looks each tensor's state up) is no state
        if any(inner.state.values()) or any(s.param.grad is not None for s in shards):
            return False
        for shard in shards:
            shard.set_grad(torch.zeros_like(shard.param), accumulate=False)
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
        for shard in shards:
            if shard.shadow:
                shard.bind()  # the padded copy holds the flat buffer's values again
        return True

    def clip_grad_norm_(
        self,
        comm: Collectives,
        device: Callable[[], torch.device],
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
    ) -> Tensor:
        """Clip the shards' gradients by their norm over every rank (``ShardedOptimizer.clip_grad_norm_``).

        ``device`` gives the device of the norm's all-reduce.

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
        shards = self._ownership.shards
        grads = [s.param.grad for s in shards if s.param.grad is not None]
        if math.isinf(p):
            local = max(
                (g.detach().abs().max().double() for g in grads), default=torch.zeros((), dtype=torch.float64)
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
        scaled = [
            s.param.grad for s in shards if s.param.grad is not None and (self._shard_gradients or s.shadow)
        ]
        if not self._shard_gradients:
            scaled += [s.flat.grad for s in shards if s.flat.grad is not None]
        for grad in scaled:
            grad.detach().mul_(coef.to(grad.device, grad.dtype))
        dtype = grads[0].dtype if grads else torch.float32
        return total.to(dtype)


class LocalOptimizers(torch.optim.Optimizer):
    """The inner optimizers of a ``ShardedOptimizer(whole_tensors=True)``, one per class, stepped as one.

    ``param_groups`` lists every inner optimizer's groups (the same dicts) and
    ``state`` their state; :meth:`step` and :meth:`zero_grad` run each. A
    rank that owns no tensor of a class has no optimizer of it (torch's
    optimizers refuse an empty parameter list).

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


class WholeTensorStep(LocalStep):
    """The inner optimizers over the whole tensors this rank owns (``ShardedOptimizer(whole_tensors=True)``).

    Args:
        optimizer: the inner optimizers.
        links: ``(inner optimizer index, its group index, outer group index)`` of every inner group.
        ownership: who owns which tensors (this rank's ranges).
        shard_gradients: ZeRO-2.
    """

    def __init__(
        self,
        optimizer: LocalOptimizers,
        links: Sequence[tuple[int, int, int]],
        ownership: Partition,
        shard_gradients: bool,
    ) -> None:
        super().__init__(optimizer, ownership, shard_gradients)
        self._links = list(links)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Return the inner optimizers, one per class of which this rank owns tensors."""
        return list(self.optimizer.optimizers)  # type: ignore[attr-defined]  # LocalOptimizers

    def pairs(self, outer_groups: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Return ``(outer group, inner group)`` per inner group (by position: a load makes new dicts)."""
        optimizers = self.optimizers()
        return [(outer_groups[index], optimizers[o].param_groups[j]) for o, j, index in self._links]

    def owned_groups(self) -> list[int]:
        """Return the outer groups of which this rank steps tensors."""
        return sorted({index for _, _, index in self._links})

    def zero_grad(self, set_to_none: bool) -> None:
        """Reset the gradients of this rank's ranges and tensors."""
        for shard in self._ownership.shards:
            shard.zero_grad(set_to_none)
        self.optimizer.zero_grad(set_to_none)

    def state_by_flat(self) -> dict[Tensor, dict[str, Any]]:
        """Return ``{this rank's tensor: its state}`` for the tensors with state."""
        return dict(self.optimizer.state)


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


def no_checkpoints(what: str) -> RuntimeError:
    """Return the error of checkpoint call ``what`` on ``ShardedOptimizer(whole_tensors=True)``."""
    return RuntimeError(
        f"ShardedOptimizer(whole_tensors=True) has no per-rank checkpoint format yet, so {what} cannot save "
        "or load its state; use opt.state_dict() and opt.load_state_dict() (the plain model's per-tensor "
        "format, gathered on every rank, loadable at any world size), or torch.distributed.checkpoint's "
        "get_state_dict / set_state_dict"
    )
