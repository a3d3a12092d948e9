"""Registration and removal of a storage: the two ends of its life, each all or nothing.

:func:`install_storage` makes a new :class:`~.coordinator.StorageCore` take over
its module (classes, parametrizations, flat parameters, hooks; see
``surgery.install``); :func:`remove_storage` gives the module back ordinary
parameters holding the current values and tells every feature. Whole-model
pickling registers again through :func:`install_storage` (``pickling.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from .._core.caller import caller_level
from .._core.flat_parameter import FlatParameter, as_flat_parameter
from .._core.grad.owner import set_grad
from .._core.layout import plan_group
from .._core.leaves import mode_changed, register_leaves
from .._core.records import Slot
from .._core.transaction import Transaction, atomically
from .._guards.decay_check import watch_optimizers
from . import surgery
from .coordinator import StorageCore
from .grouping import GroupSpec

__all__ = ["build_storage", "install_storage", "remove_in", "remove_storage"]


def build_storage(
    target: nn.Module,
    specs: Sequence[GroupSpec],
    align: int,
    reuse: Mapping[str, FlatParameter] | None = None,
    tx: Transaction | None = None,
) -> StorageCore:
    """Lay out ``specs`` (checked groups of ``target``), copy the values in and install a new core.

    ``reuse``: by group name, a flat parameter object to hold that group's new
    buffer and layout instead of a new one (a storage laid out again keeps its
    flat parameters, so that the optimizers that hold them keep them;
    ``relayout.py``). All or nothing: as part of ``tx`` if given, else on its
    own (if it raises, ``target`` and every reused flat parameter are as before).
    """
    if tx is None:
        return atomically(lambda own: build_storage(target, specs, align, reuse, own))
    reuse = reuse or {}
    flats: list[FlatParameter] = []
    layouts = []
    slots: list[Slot] = []
    for g, spec in enumerate(specs):
        layout = plan_group([tuple(s.param.shape) for s in spec.slots], align)
        first = spec.slots[0].param
        data = torch.empty(layout.numel, dtype=first.dtype, device=first.device)
        _share_if_shared(data, spec)
        surgery.zero_padding(data, layout)
        with torch.no_grad():
            for offset, numel, shape, slot in zip(layout.offsets, layout.numels, layout.shapes, spec.slots):
                piece = data.narrow(0, offset, numel)
                piece.copy_(slot.param.detach().reshape(-1))
                _point_at(slot.param, piece.view(shape), tx)
        names = [s.name for s in spec.slots]
        kept = reuse.get(spec.name)
        if kept is None:
            flat = FlatParameter(
                data,
                requires_grad=first.requires_grad,
                names=names,
                shapes=layout.shapes,
                numels=layout.numels,
                offsets=layout.offsets,
            )
        else:
            # Recorded: as_flat_parameter sets its class and layout, the new group serves it.
            tx.keep_dict(kept.__dict__)
            tx.set_attr(kept, "__class__", type(kept))
            set_grad(kept, None, tx)  # the gradients are the members' (install gathers them)
            tx.set_attr(kept, "data", data)
            tx.set_attr(kept, "requires_grad", first.requires_grad)
            flat = as_flat_parameter(kept, names, layout.shapes, layout.numels, layout.offsets)
        flats.append(flat)
        layouts.append(layout)
        slots += [Slot(s.name, tuple(s.names[1:]), g, i, s.param) for i, s in enumerate(spec.slots)]
    core = StorageCore(target, [s.name for s in specs], flats, layouts, slots)
    install_storage(core, tx)
    return core


def _share_if_shared(data: torch.Tensor, spec: GroupSpec) -> None:
    """Put ``data``, a new flat buffer on the CPU, in shared memory where its group's tensors were.

    ``model.share_memory()`` before registering (Hogwild training: processes that step one model in
    shared memory) must keep working: a flat buffer in private memory would leave every other
    process's steps unseen, silently. A group that mixes shared and private tensors shares them all,
    with a warning naming the private ones.
    """
    if data.device.type != "cpu":
        return
    shared = [slot.param.is_shared() for slot in spec.slots]
    if not any(shared):
        return
    data.share_memory_()
    private = [slot.name for slot, is_shared in zip(spec.slots, shared) if not is_shared]
    if private:
        warnings.warn(
            f"group '{spec.name}' mixes tensors in shared memory (model.share_memory()) and in private "
            f"memory ({', '.join(private)}); its flat buffer is one block, so all of them are in shared "
            "memory now and other processes see their updates too. Call share_memory() on the whole "
            "model, or put the private ones in a group of their own",
            UserWarning,
            stacklevel=caller_level(),
        )


def _point_at(param: nn.Parameter, slot: torch.Tensor, tx: Transaction) -> None:
    """Point ``param`` at ``slot``, its values' new home, so that its old memory goes at once.

    The flat buffer is filled while the originals are released one by one: the
    peak is the weights plus the largest tensor, not twice the weights. Undone
    with ``tx`` by giving ``param`` a copy of the slot (the same values, memory
    of its own again), so the undo does not keep the old memory alive either.
    """
    if param.is_meta or not torch._has_compatible_shallow_copy_type(param, slot):
        return  # meta-initialized models and tensor types that cannot share memory: install re-points them
    param.data = slot
    tx.on_undo(_own_copy(param))


def _own_copy(param: nn.Parameter) -> Callable[[], None]:
    def undo() -> None:
        with torch.no_grad():
            param.data = param.detach().clone()

    return undo


def install_storage(core: StorageCore, tx: Transaction | None = None) -> None:
    """Make ``core`` take over its module (classes, parametrizations, flat parameters), all or nothing.

    As part of ``tx`` if given, else on its own.
    """

    watch_optimizers(FlatParameter)  # the user's optimizers checked before their steps (_guards/)

    def change(tx: Transaction) -> None:
        surgery.install(core, tx)
        register_leaves(core, [(slot.name, slot.param) for slot in core.slots()], tx)

    if tx is None:
        atomically(change)
    else:
        change(tx)
    core.members()  # recorded now: unflattened mode takes the state out of the modules


def remove_in(core: StorageCore, tx: Transaction) -> None:
    """Undo the registration of ``core`` as part of ``tx``: plain parameters with the current values.

    In per-tensor mode each parameter keeps its own ``requires_grad`` (a frozen submodule stays
    frozen, as on the plain model); from flat mode each gets its group's.
    """
    flags = [] if core.is_flattened else [(slot.param, slot.param.requires_grad) for slot in core.slots()]
    aside = surgery.set_aside_replacements(core, tx)  # what outside code put there stays
    core.flatten_in(tx)
    surgery.uninstall(core, tx)
    for param, flag in flags:
        if param.requires_grad != flag:
            tx.set_attr(param, "requires_grad", flag)
    surgery.put_back(aside, tx)
    core.mark_removed(tx)
    mode_changed()  # an optimizer over its leaves is checked again (they are ordinary now)


def remove_storage(core: StorageCore) -> None:
    """Undo the registration of ``core``: plain parameters with the current values (atomically)."""
    core.sync_writes()
    atomically(lambda tx: remove_in(core, tx))
    core.invalidate()
    for feature in list(core.features):
        feature.on_removed()  # delete the offload files (values are in RAM now), remove grad-sync hooks
    core.release_buffers()  # the FlatStorage a user still holds keeps no copy of the weights
