"""A mixed-precision policy in both modes, in one folder.

``feature.py``: the policy's feature on the core (the compute copies of flat mode, one cast per
group, the casts of the registered module's inputs and outputs); ``compute_views.py``: per-tensor
mode's compute views and their cast node; ``master_leaf.py``: the class of per-tensor mode's leaves
while a compute copy is cast from them.
"""
