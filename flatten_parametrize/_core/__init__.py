"""The foundation: layout, records and protocols, the hot path and the write paths.

Nothing here imports another sub-package. ``records.Coordinator`` is the
protocol the rest of the library sees of a storage's private core;
``features.Feature`` and ``grad.FlatGradHook`` are the seams features plug
into; ``grad/`` is the one owner of each group's gradient (``GroupGrad``, with
per-tensor mode's leaves, its autograd node and torch's autograd-engine helpers); ``view_cache`` serves every
flattened attribute; ``writes`` lands values written around the views;
``decay_check`` warns before the first step of an optimizer whose param
groups cannot decay like the plain model's.

``flat_parameter.allow_weights_only_loads`` runs here, on import: ``torch.load``
with ``weights_only=True`` accepts flat parameters wherever the package is loaded.
"""

from .flat_parameter import allow_weights_only_loads

allow_weights_only_loads()
