"""Benchmarks of ``flatten_parametrize`` against the plain model and the alternatives.

Run ``python -m benchmarks`` (or ``python benchmarks/run.py``); ``--quick`` is a
smoke run, ``--only <workload>`` picks workloads, ``--help`` lists them.
The current figures of each workload are in ``benchmarks/RESULTS.md``; earlier runs in
``benchmarks/HISTORY.md``.
"""
