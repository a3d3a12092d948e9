"""Data-parallel gradient sync and ZeRO-1/2 (``ShardedOptimizer``), with its checkpoints.

Uses ``_core``'s seams (the feature lifecycle, the flat-gradient hook) and
``_state``'s optimizer-state conversion; never ``_install``.
"""
