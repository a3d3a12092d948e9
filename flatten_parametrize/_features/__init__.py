"""Features composed on the coordinator: disk backing and ensembles.

Each reaches the coordinator through ``_core``'s seams only (listed in
``_core/features.py``); none imports ``_install`` or another feature.
"""
