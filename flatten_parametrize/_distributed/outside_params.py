"""Parameters of a synced module that no flat storage holds: averaged, broadcast, as DDP does.

Gradient sync works on whole flat gradients. A parameter of the registered
module outside every group would train on each rank's gradient alone, and the
ranks would drift apart with no word: one left out at registration
(``register_flat_storage(model, ["*.weight"])``), a new classifier head put in
after it (timm's ``reset_classifier``, ``model.head = nn.Linear(...)``: the new
module's parameters are ordinary, SPEC "Structure changes"), a parameter added
to a plain submodule. DDP averages every parameter that requires grad; so do
``enable_grad_sync``, ``all_reduce_grads`` and ``ShardedOptimizer`` (which
syncs gradients itself), and ``broadcast_params`` and the optimizer's
construction copy them as DDP's constructor does.

:class:`OutsideParams` finds them: the module's parameters that are neither a
``FlatParameter`` nor a leaf of a live storage (per-tensor mode; ``_core/unheld.py``).
The walk over the module runs again only after torch registered a parameter or a
submodule anywhere (its global registration hooks move :data:`GENERATION`) or a
storage changed mode or layout (``_core/leaves.py``'s ``EPOCH``): a clean forward costs
two integer comparisons. Each one that requires grad gets a post-accumulate-grad
hook, so that a backward that reaches only them (a frozen body, a new head) is
synced too. At the end of a synced backward :func:`reduce_once` averages their
gradients (once per backward, however many optimizers end it) in one
collective per dtype and device, after a count of the ranks that produced each
one: a gradient no rank produced stays ``None``, as under DDP; one that only
some ranks produced is averaged with zeros.

Every rank must hold the same such parameters (the same model), as DDP needs.
Buffers are left alone, as ``broadcast_params`` says.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .._core.grad.owner import set_grad
from .._core.leaves import EPOCH
from .._core.unheld import GENERATION, watch_registrations
from .._core.unheld import unheld as outside_params

__all__ = ["GENERATION", "OutsideParams", "broadcast", "outside_params", "reduce", "reduce_once"]


class OutsideParams:
    """The outside parameters of one synced module, and a gradient hook on each that trains.

    Args:
        syncer: what syncs them (grad sync, a ``ShardedOptimizer``'s reducer), held weakly: each
            hook calls its ``grad_ready(None)`` once a gradient was accumulated.
        core: the storage whose registered module is watched (held weakly).
    """

    __slots__ = ("_core_ref", "_handles", "_key", "_on_grad", "params")

    def __init__(self, syncer: Any, core: Any) -> None:
        watch_registrations()
        self._on_grad = _hook(weakref.ref(syncer))
        self._core_ref = weakref.ref(core)
        self._key: tuple[int, int] | None = None
        #: The last walk's result.
        self.params: list[nn.Parameter] = []
        self._handles: dict[int, tuple[nn.Parameter, RemovableHandle]] = {}

    def watch(self) -> nn.Module | None:
        """Walk the registered module again if anything was registered since; hook each one that trains.

        Returns the module (``None`` once it or its storage is gone: nothing is watched).
        """
        core = self._core_ref()
        module = None if core is None else core.module_or_none()
        if module is None:
            return None
        key = (GENERATION[0], EPOCH[0])
        if key != self._key:
            self._key = key
            self.params = outside_params(module)
            kept = {id(p) for p in self.params}
            for pid in [pid for pid in self._handles if pid not in kept]:
                self._handles.pop(pid)[1].remove()
        for param in self.params:
            found = self._handles.get(id(param))
            if param.requires_grad and (found is None or found[0] is not param):
                handle = param.register_post_accumulate_grad_hook(self._on_grad)
                self._handles[id(param)] = (param, handle)
        return module

    def training(self) -> list[nn.Parameter]:
        """Return the parameters of the last walk that require grad."""
        return [p for p in self.params if p.requires_grad]

    def close(self) -> None:
        """Remove every hook."""
        for _, handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self.params, self._key = [], None


def _hook(ref: weakref.ref[Any]) -> Callable[[Tensor], None]:
    def hook(param: Tensor) -> None:
        syncer = ref()
        if syncer is not None:
            syncer.grad_ready(None)

    return hook


def _buckets(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Split ``params`` by (device, dtype), in first-seen order."""
    by: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for param in params:
        by.setdefault((param.device, param.dtype), []).append(param)
    return list(by.values())


class _Averaged:
    """The collectives over the outside gradients: ``wait()`` writes the averages back."""

    def __init__(
        self, works: list[Any], counts: Tensor, buckets: list[tuple[list[nn.Parameter], Tensor]]
    ) -> None:
        self.works, self.counts, self.buckets = works, counts, buckets

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        produced = self.counts.tolist()
        i = 0
        with torch.no_grad():
            for params, data in self.buckets:
                for param, chunk in zip(params, data.split([p.numel() for p in params])):
                    if produced[i]:
                        if param.grad is not None and param.grad.layout == torch.strided:
                            param.grad.copy_(chunk.view_as(param))
                        else:
                            set_grad(param, chunk.view_as(param))
                    i += 1
        return True


def reduce_once(
    root: nn.Module,
    task: int | None,
    params: Sequence[nn.Parameter],
    process_group: dist.ProcessGroup | None,
    world: int,
) -> _Averaged | None:
    """Start averaging the gradients of ``params``, ``root``'s outside ones, unless done in backward ``task``.

    Two ``ShardedOptimizer`` over other groups of one storage each end the
    same backward; the first one averages, the other finds it done.
    """
    if task is not None:
        if _DONE.get(root) == task:
            return None
        _DONE[root] = task
    return reduce(params, process_group, world, "mean")


#: The registered module -> the backward (graph task) whose outside gradients were averaged last.
_DONE: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def reduce(
    params: Sequence[nn.Parameter], process_group: dist.ProcessGroup | None, world: int, op: str
) -> _Averaged | None:
    """Start reducing the gradients of ``params`` (``op``: ``"mean"`` or ``"sum"``).

    Returns what to ``wait()`` on (``None`` for no parameters). A rank without
    a gradient for one contributes zeros; one no rank produced stays ``None``.
    A mean divides before the sum, as DDP's default hook does.
    """
    if not params:
        return None
    split = _buckets(params)
    produced = [p.grad is not None for bucket in split for p in bucket]
    counts = torch.tensor(produced, dtype=torch.float32, device=params[0].device)
    works = [dist.all_reduce(counts, dist.ReduceOp.SUM, group=process_group, async_op=True)]
    buckets = []
    for bucket in split:
        data = torch.cat(
            [
                torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                if p.grad is None
                else p.grad.detach().to_dense().reshape(-1)
                for p in bucket
            ]
        )
        if op == "mean":
            data.div_(world)
        works.append(dist.all_reduce(data, dist.ReduceOp.SUM, group=process_group, async_op=True))
        buckets.append((bucket, data))
    return _Averaged(works, counts, buckets)


def broadcast(params: Sequence[nn.Parameter], src: int, process_group: dist.ProcessGroup | None) -> None:
    """Copy the values of ``params`` on rank ``src`` to every rank, one collective per dtype and device."""
    with torch.no_grad():
        for bucket in _buckets(params):
            data = torch.cat([p.detach().reshape(-1) for p in bucket])
            dist.broadcast(data, src, group=process_group)
            for param, chunk in zip(bucket, data.split([p.numel() for p in bucket])):
                param.copy_(chunk.view_as(param))
