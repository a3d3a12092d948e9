"""How a feature plugs into the coordinator: the lifecycle it follows and the interface it sees.

``FlatStorage`` composes its features (gradient sync in ``_distributed.py``,
disk backing in ``_offload.py``, ensembles in ``_functional.py``): each is an
object that owns its state, holds the coordinator weakly and sees it only
through ``_records.Coordinator``. The coordinator calls each feature's
:class:`Feature` lifecycle:

* ``on_rebacked()``: the "flat buffer replaced" notification, after
  ``module.to()`` & co. re-backed or replaced flat parameters and after a
  feature swapped a buffer itself (``coordinator.flat_buffers_replaced()``);
* ``on_removed()``: ``remove_flat_storage`` (the values are ordinary
  parameters in RAM by then);
* ``copy_for(new, memo)``: ``copy.deepcopy`` of the module (``None``: the copy
  goes without the feature). A pickled model is registered again on load
  and starts with fresh features (no grad sync, buffers in RAM).

The built-in features are created with the coordinator; a feature made later
(a sharded optimizer, say) joins with ``storage.add_feature(feature)`` and
leaves with ``storage.remove_feature(feature)``.

The autograd path has its own seam, per group: a ``_grad.FlatGradHook``
registered with ``group.views.grad_buffer.add_hook`` sees (and may scale while
it is built) each flat gradient in backward. A sharded optimizer would plug
into both seams (reduce-scatter when a flat gradient is ready, re-pad when a
buffer is replaced); a mixed-precision feature would keep its low-precision
copy of each buffer up to date in ``on_rebacked``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from .records import Coordinator

__all__ = ["Coordinator", "Feature", "in_flat_mode", "storage_of"]


class Feature(Protocol):
    """The lifecycle the coordinator drives on each of its features."""

    def on_rebacked(self) -> None:
        """Flat parameters were re-backed or replaced, or written behind their version counters."""

    def refresh(self) -> None:
        """A sync point (the registered module's forward, among others): check what may have changed."""

    def on_removed(self) -> None:
        """The storage was removed from its module: release files, hooks and the like."""

    def copy_for(self, storage: Coordinator, memo: dict[int, Any]) -> Feature | None:
        """Return this feature's state for ``storage``, a copy of its coordinator (``None``: not copied)."""


def storage_of(ref: weakref.ref[Coordinator]) -> Coordinator:
    """Return the coordinator behind a feature's weak reference (features die with it)."""
    storage = ref()
    if storage is None:
        raise RuntimeError("the flat storage of this feature was garbage collected")
    return storage


@contextmanager
def in_flat_mode(storage: Coordinator) -> Iterator[None]:
    """Run a block in flat mode, then restore the previous mode (also on an exception)."""
    was_flat = storage.is_flattened
    storage.flatten()
    try:
        yield
    finally:
        if not was_flat:
            storage.unflatten()
