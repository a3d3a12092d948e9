"""Module swaps and replaced weights of unflattened mode: ``flatten()`` lays the groups out again.

In unflattened mode the model is a plain one, and outside code changes it as
one. When the storage flattens again:

* a module swap that keeps the parameter objects (torchao's QAT prepare and
  float8 training, wrappers that re-host a weight: ``new.weight = old.weight``)
  changed the owner of a slot, not the slot: the slot follows its parameter to
  the new module, and the flat parameters keep their objects and, when the
  layout is unchanged, their layout (so optimizer state keeps working);
* a weight replaced by a tensor that cannot live in a flat buffer
  (``_core/fit.py``: a quantized tensor subclass, another dtype) leaves the
  storage: it stays an ordinary parameter of its module, its slot is released,
  the rest of its group is laid out again, and one warning names what left
  (the storage is removed when nothing is left).

Both lay the groups out again through ``relayout.relayout``, which also drops
the dead space of modules replaced meanwhile. Anything else flattens as usual
(``surgery.flatten_module``).
"""

from __future__ import annotations

from .._core.fit import misfit
from . import surgery
from .coordinator import StorageCore
from .relayout import held_names, relayout

__all__ = ["flatten_changed", "needs_relayout"]


def needs_relayout(core: StorageCore) -> bool:
    """Return whether a slot of ``core`` (unflattened) was re-hosted by a module swap or holds a misfit."""
    root = core.module
    modules = dict(root.named_modules(remove_duplicate=False))
    held = held_names(modules)
    groups = core.groups()
    for slot in core.slots():
        flat = groups[slot.group_index].flat
        live = surgery.live_names(core, slot, modules)
        if any(name not in live for name in held.get(id(slot.param), ())):
            return True  # re-hosted
        for name in live:
            owner, attr = surgery.locate(modules, name)
            if misfit(owner._parameters.get(attr), flat) is not None:
                return True
    return False


def flatten_changed(core: StorageCore) -> bool:
    """Flatten ``core`` by laying its groups out again if unflattened mode changed owners or weights.

    Returns:
        Whether it did; ``False``: nothing of the kind changed (flatten as usual).

    Raises:
        RuntimeError: as ``relayout.check_relayout`` (features hold the layout:
            nothing changed, the storage stays unflattened).
    """
    if core.is_flattened or not needs_relayout(core):
        return False
    relayout(core, "flatten()", lambda: None, flat_after=True)
    return True
