"""How a feature plugs into the coordinator: the seams it may use, and nothing else.

:class:`Feature` is the library's **private** protocol: it is not in the
product contract's public surface, users never implement it, and it may
change with the library. (Users hold ``FlatStorage``; a feature sees the
private core through ``records.Coordinator``.) The features are gradient sync
(``_distributed/grad_sync.py``), ``ShardedOptimizer``'s ``OptimizerShards``
(``_distributed/sharded_feature.py``), disk backing (``_features/offload.py``) and
ensembles (``_features/functional.py``) and mixed precision
(``_features/mixed_precision/feature.py``); each owns its state, holds the core
weakly, and reads nothing of another feature (``tests/guarantees/test_structure.py``
checks their imports). The seams, all of them:

* **Composition**: ``core.feature(kind)``, ``core.add_feature(f)``,
  ``core.remove_feature(f)``. The facade composes the built-in features on
  first use; a ``ShardedOptimizer`` adds its own at construction and removes
  it when it is garbage collected.
* **Lifecycle** (:class:`Feature`), driven by the core:

  - ``on_rebacked()``, "buffers replaced": after ``module.to()`` & co.
    re-backed, converted or replaced flat parameters (also a flat parameter
    assigned in a flat parameter's place), after a feature swapped a buffer
    itself (``core.flat_buffers_replaced()``: disk offload and load), and after
    ``flatten()`` (the leaf parameters of unflattened mode have version
    counters of their own, so their in-place updates changed the buffers
    unseen). The views were dropped before it runs.
  - ``refresh()``, "sync point": at the end of ``core.sync_writes()`` in flat
    mode, i.e. before each eager forward of the registered module (its
    forward pre-hook), ``named_views``/``named_grads``/``flat_params``, state
    dicts, mode toggles, deep copy, pickling and removal. The place for
    cheap checks of what nothing notifies.
  - ``holds_layout()`` (by default a feature holds the layout while
    composed): whether the feature's state would not fit the
    groups laid out again (``_install/relayout.py``, torchao's swaps): the
    way to release it (a sentence), or ``None``. Only while it holds
    something: disk offload while a buffer is a file's mapping, a
    ``ShardedOptimizer`` while it lives, ensembles while a stack of
    ``stack()`` lives. :func:`refuse_held_layout` asks them all before
    anything changes. A feature that holds nothing is dropped with the old
    core (composed again on use), except one whose
    ``relayout_record()`` gives ``(function, args)``: after the change the
    old one is removed and ``function(new_core, *args)`` composes it on the
    new core (mixed precision: compute copies cast from the new masters;
    gradient sync while enabled: enabled again, same process group).
  - ``on_removed()``: ``remove_flat_storage`` (the values are ordinary
    parameters in RAM by then).
  - ``copy_for(core, memo)``: ``copy.deepcopy`` of the module (``None``: the
    copy goes without the feature). A pickled model is registered again on
    load and starts with fresh features (no grad sync, buffers in RAM),
    except those whose ``pickle_record()`` returns
    ``(function, args)``: the loaded core gets ``function(core, *args)``
    (mixed precision keeps its policies so).

* **"Values changed"**: a feature that derives something from the masters'
  values (a low-precision compute copy) compares, per group, the flat
  parameter's identity, ``data_ptr()``, dtype and ``_version`` with what it
  saw, in ``refresh()``: no tensor op, and nothing on the view-read path. Every
  in-place update bumps ``_version``: optimizer steps (``ShardedOptimizer``'s
  gather too), ``load_state_dict`` in flat mode, landed ``.data`` writes,
  ``broadcast_params``, a ``copy_`` into the flat parameter or into a view of
  it; so does reading ``.data`` of a flat parameter whose views come from a
  source, or handing out views of it (``view_cache.GroupViews.aliased``). What
  ``_version`` does not show comes with ``on_rebacked()`` (above).
* **Views from another tensor**: ``group.views.source`` (see
  ``view_cache.GroupViews``), a ``view_cache.ViewSource``: called as
  ``flat -> tensor`` only when a group's cache is rebuilt (also after the flat
  tensor's ``_version`` moved), the feature updates its tensor in place, or
  sets a new one and calls ``group.views.invalidate()``; ``exposed(index,
  view)`` is told of each view served outside the registered module's
  forward and ``land()`` runs at every sync point of the view cache, to land
  what was written into the views (through ``.data`` too). ``group.views.cast``:
  the dtype the uncached paths (torch.compile, tracing, vmap) convert the flat
  tensor to.
* **Reduce dtype**: ``group.grads.reduce_dtype``, the dtype in
  which gradient sync and ``ShardedOptimizer`` reduce the group's gradient.
* **The autograd path**, per group, on ``group.grads``
  (``grad/owner.GroupGrad``): ``add_hook(h)`` / ``remove_hook(h)`` with a
  ``grad.FlatGradHook`` that sees each flat gradient while backward builds it
  (may have it divided, may return a converted one; ``releases_gradient``
  stops the buffer's memory reuse); and the sync claim (``claim_sync`` /
  ``release_sync``): one owner at a time reduces a group's gradient across
  ranks, a second is refused with the holder's message.
* **``no_sync``**: ``core.no_sync()`` / ``core.no_sync_depth``, shared by
  every gradient-syncing feature.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from .records import Coordinator, Feature, Record

__all__ = [
    "Coordinator",
    "Feature",
    "Record",
    "in_flat_mode",
    "layout_holders",
    "refuse_held_layout",
    "storage_of",
]


def layout_holders(storage: Coordinator) -> dict[str, str]:
    """Return the features of ``storage`` that hold its layout now: the way to release each, by name.

    (:meth:`Feature.holds_layout`.)
    """
    return {
        type(feature).__name__.lstrip("_"): fix
        for feature in storage.features
        if (fix := feature.holds_layout()) is not None
    }


def refuse_held_layout(storage: Coordinator, what: str) -> None:
    """Raise if a feature of ``storage`` holds its layout now, before ``what`` changes anything.

    Raises:
        RuntimeError: naming each feature that holds the layout, with the way
            to release it, and the plain model's route.
    """
    holders = layout_holders(storage)
    if holders:
        raise RuntimeError(
            f"cannot run {what} on a flattened module while {', '.join(sorted(holders))} hold(s) its "
            "layout: their state would not fit the new layout; nothing was changed. Release it first "
            f"({'; '.join(fix for _, fix in sorted(holders.items()))}) and run it again, or run it on "
            "the plain model (remove_flat_storage(model), change it, register_flat_storage(model) again)"
        )


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
