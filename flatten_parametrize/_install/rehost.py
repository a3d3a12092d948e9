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

Both lay the groups out again, all or nothing (``relayout.relayout_flat``), which drops
the dead space of modules replaced or deleted (in either mode), as it does when
only dead space is found and no feature holds the layout. Anything else
flattens as usual (``surgery.flatten_module``).
"""

from __future__ import annotations

from .._core.features import layout_holders
from .._core.fit import misfit
from .._core.outside_call import current_call
from . import surgery
from .coordinator import StorageCore
from .relayout import held_names, relayout_flat

__all__ = ["changes", "flatten_changed"]


def changes(core: StorageCore) -> tuple[bool, bool]:
    """Return whether a slot of unflattened ``core`` was re-hosted or holds a misfit; whether one is dead.

    A slot whose module moved in the tree (fused into a container) counts as dead here: its names
    are renamed by the same relayout that reclaims dead space, when nothing holds the layout.
    """
    root = core.module
    modules = dict(root.named_modules(remove_duplicate=False))
    held = held_names(modules)
    groups = core.groups()
    changed = dead = False
    for slot in core.slots():
        flat = groups[slot.group_index].flat
        live = surgery.live_names(core, slot, modules)
        names = held.get(id(slot.param), ())
        if any(name not in live for name in names):
            changed = True  # re-hosted
        elif not live or not set(live) & set(slot.all_names):
            dead = True  # replaced or deleted, or moved (then renamed)
        for name in live:
            owner, attr = surgery.locate(modules, name)
            if misfit(owner._parameters.get(attr), flat) is not None:
                changed = True
    return changed, dead


def flatten_changed(core: StorageCore) -> bool:
    """Flatten ``core`` by laying its groups out again if unflattened mode changed owners or weights.

    Dead space (slots of modules replaced or deleted) is reclaimed the same way,
    unless features hold the layout (then it stays, as ``summary()`` shows).

    Returns:
        Whether it did; ``False``: nothing of the kind changed (flatten as usual).

    Raises:
        RuntimeError: as ``relayout.check_relayout`` for a re-hosted or released
            slot while features hold the layout (nothing changed, the storage
            stays unflattened).
    """
    if core.is_flattened:
        return False
    changed, dead = changes(core)
    free = not layout_holders(core) and not core.using_depth and core.pending is None
    if not changed and not (dead and free):
        return False
    relayout_flat(core, current_call() or "flatten()")
    return True
