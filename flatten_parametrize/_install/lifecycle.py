"""Registration and removal of a storage: the two ends of its life, each all or nothing.

:func:`install_storage` makes a new :class:`~.coordinator.StorageCore` take over
its module (classes, parametrizations, flat parameters, hooks; see
``surgery.install``); :func:`remove_storage` gives the module back ordinary
parameters holding the current values and tells every feature. Whole-model
pickling registers again through :func:`install_storage` (``pickling.py``).
"""

from __future__ import annotations

from .._core.transaction import Transaction, atomically
from . import surgery
from .coordinator import StorageCore

__all__ = ["install_storage", "remove_storage"]


def install_storage(core: StorageCore) -> None:
    """Make ``core`` take over its module (classes, parametrizations, flat parameters), atomically."""
    atomically(lambda tx: surgery.install(core, tx))
    core.members()  # recorded now: unflattened mode takes the state out of the modules


def remove_storage(core: StorageCore) -> None:
    """Undo the registration of ``core``: plain parameters with the current values (atomically)."""
    core.sync_writes()

    def change(tx: Transaction) -> None:
        core.flatten_in(tx)
        surgery.uninstall(core, tx)
        core.mark_removed(tx)

    atomically(change)
    core.invalidate()
    for feature in list(core.features):
        feature.on_removed()  # delete the offload files (values are in RAM now), remove grad-sync hooks
