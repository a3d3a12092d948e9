"""Data-parallel gradient sync and ZeRO-1/2 (``ShardedOptimizer``), with its checkpoints.

Uses ``_core``'s seams (the feature lifecycle, the flat-gradient hook, the
sync claim, ``no_sync``; listed in ``_core/features.py``) and ``_state``'s
optimizer-state conversion; never ``_install``. Grad sync and
``ShardedOptimizer`` share no state and do not import each other: the
autograd-engine helpers both call are in ``engine.py``. ``ShardedOptimizer``
is ``sharded.py`` (the optimizer API and the wiring) over one module per
concern, ``sharded_*.py`` and ``shard.py`` (listed in ``sharded.py``).
"""
