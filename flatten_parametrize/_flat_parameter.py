"""The stable import path of pickled flat parameters.

A pickled :class:`~flatten_parametrize.FlatParameter` (``torch.save`` of a flat
parameter, an optimizer or a flat state dict) names its rebuild function by this
module, as checkpoints did before the package had sub-packages; the class itself
lives in ``_core/flat_parameter.py``. Keep this module and its two names.
"""

from ._core.flat_parameter import FlatParameter
from ._core.flat_parameter import rebuild_flat_parameter as _rebuild_flat_parameter

__all__ = ["FlatParameter", "_rebuild_flat_parameter"]
