"""A :class:`~flatten_parametrize.ShardedOptimizer`'s part on its storage's core, and its sync claim.

The optimizer reaches its storage only through the core's seams (see
``_core/features.py``): an :class:`OptimizerShards` feature follows replaced flat
parameters (``on_rebacked``) and leaves with the optimizer or the storage; it
is the flat-gradient hook of each group the optimizer slices (ZeRO-2 releases
full gradients, so the buffers keep no memory for them); each group's sync
claim (:data:`SYNCS`) keeps a second optimizer and the storage's grad sync
off its gradients.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, Protocol

from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .._core.features import Feature

if TYPE_CHECKING:
    from .._core.grad.owner import GroupGrad
    from .._core.records import Coordinator, Group
    from .outside_params import OutsideParams

__all__ = ["SYNCS", "OptimizerShards", "buffers", "live_core", "refusal", "synced"]

#: What a ShardedOptimizer does that nothing else may do to its flat parameters (the start of a refusal).
SYNCS = "ShardedOptimizer syncs the gradients of the flat parameters it optimizes"


def refusal(name: str) -> str:
    """What is told to one that wants to sync group ``name``'s gradient while an optimizer does."""
    return (
        f"the flat parameter of group {name!r} is already optimized by a ShardedOptimizer that still "
        "exists, which reduces its gradient (it would be reduced twice); delete that optimizer first "
        "(del opt), or give each optimizer other flat parameters"
    )


def synced(storage: Coordinator, flats: Iterable[Tensor]) -> list[Group]:
    """Return the groups of ``flats`` that an optimizer over them slices and syncs (the trainable ones)."""
    flats = list(flats)
    return [g for g in storage.groups() if g.flat.requires_grad and any(g.flat is f for f in flats)]


def buffers(groups: Iterable[Group]) -> list[GroupGrad]:
    """Return the gradient buffers of ``groups`` (what a sync claim is made on)."""
    return [group.grads for group in groups]


def live_core(ref: weakref.ref[Coordinator]) -> Coordinator:
    """Return the core ``ref`` refers to.

    Raises:
        RuntimeError: if the storage no longer exists.
    """
    core = ref()
    if core is None:
        raise RuntimeError(
            "ShardedOptimizer: its FlatStorage no longer exists (remove_flat_storage was called, or "
            "the model was deleted); build a new optimizer for the new storage"
        )
    return core


class _Closes(Protocol):
    """What goes with the optimizer when it leaves (``sharded_grads.ShownGrads``)."""

    def close(self) -> None: ...


class OptimizerShards(Feature):
    """A ShardedOptimizer's part on its storage's core: a feature, and the flat-gradient hook of its groups.

    The core drives its lifecycle (``_core/features.py``): ``on_rebacked``
    follows flat parameters that ``module.to()`` & co. replaced or moved;
    ``on_removed`` (``remove_flat_storage``) and the optimizer's garbage
    collection make it leave: every hook removed, the feature dropped. A deep
    copy of the model goes without it. As the hook of each group the
    optimizer slices, it tells the group's gradient buffer that ZeRO-2 keeps
    no full flat gradient (:attr:`releases_gradient`). It holds the optimizer
    (the claimant of the groups' sync) and the core weakly.

    Args:
        claimant: the optimizer, holder of the groups' sync claim.
        core: its storage's core.
        releases_gradient: ZeRO-2: the full flat gradients are dropped after backward.
        rebacked: called when the core replaced or moved flat parameters.
        outside: the module's parameters outside every group that the optimizer's
            reducer averages; watched at each forward (``outside_params.py``).
        shown: ZeRO-2's placeholders of the gradients (``None``: ZeRO-1); they go when it leaves.
    """

    def __init__(
        self,
        claimant: object,
        core: Coordinator,
        releases_gradient: bool,
        rebacked: Callable[[], None],
        outside: OutsideParams,
        shown: _Closes | None,
    ) -> None:
        self._claimant = weakref.ref(claimant)
        self._shown = shown
        self._core_ref = weakref.ref(core)
        self._rebacked = rebacked
        self._outside = outside
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
        self._outside.close()
        if self._shown is not None:
            self._shown.close()
        buffers, self.buffers = self.buffers, {}
        claimant = self._claimant()
        for buffer in buffers.values():
            buffer.remove_hook(self)
            buffer.release_sync(claimant)
        core = self._core_ref()
        if core is not None and self._joined:
            core.remove_feature(self)
        self._joined = False

    # ------------------------------------------------------------------ Feature
    def on_rebacked(self) -> None:
        self._rebacked()

    def refresh(self) -> None:
        """Watch the parameters outside the groups (flat parameters replaced come with on_rebacked)."""
        self._outside.watch()

    def before_forward(self) -> None:
        """Per-tensor mode's forward (``_install/per_tensor.py``): as :meth:`refresh`."""
        self.refresh()

    def on_removed(self) -> None:
        self.leave()

    def copy_for(self, storage: Coordinator, memo: dict[int, Any]) -> None:
        return None  # the optimizer optimizes the original's flat parameters, not the copy's

    def forward_sync(self) -> bool:
        return True  # per-tensor mode's forward checks outside writes: they would miss the shards

    def holds_layout(self) -> str | None:
        if self._claimant() is None:  # collected: it leaves at once (a finalizer), this only in between
            return None
        return "delete the ShardedOptimizer (del optimizer), and build a new one after the change"

    # ------------------------------------------------------------- FlatGradHook
    def divisor(self, flat: Tensor) -> int | None:
        return None

    def grad_ready(self, grad: Tensor, divided: bool) -> None:
        return None
