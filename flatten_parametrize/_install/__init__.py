"""Registration and module surgery: the private coordinator core and everything that changes the module tree.

The coordinator core (``coordinator.py``), the injected classes
(``module_classes.py``), flatten/unflatten and the other tree changes
(``surgery.py``), registration and removal (``lifecycle.py``), whole-model
pickling (``pickling.py``), deep copy (``copying.py``), grouping and reuse.
Uses ``_core`` and ``_state``.

``pickling`` and ``copying`` contribute the injected classes' ``__reduce_ex__``
and ``__deepcopy__`` when imported (see ``module_classes.contribute``), and
``relayout`` their ``get_parameter``, ``__setattr__`` and framework model
operations, so they are imported here, before any class is made.
"""

from . import copying, pickling, relayout

__all__ = ["copying", "pickling", "relayout"]
