"""Registration and module surgery: the private coordinator core and everything that changes the module tree.

The coordinator core (``coordinator.py``), the injected classes
(``module_classes.py``), flatten/unflatten and the other tree changes
(``surgery.py``), registration and removal (``lifecycle.py``), whole-model
pickling (``pickling.py``), deep copy (``copying.py``), grouping and reuse,
module swaps and released weights laid out again on ``flatten()``
(``rehost.py``) and the dead-space warning (``dead_space.py``).
Uses ``_core`` and ``_state``.

``pickling`` and ``copying`` contribute the injected classes' ``__reduce_ex__``
and ``__deepcopy__`` when imported (see ``module_classes.contribute``), and
``relayout`` their ``get_parameter``, ``__setattr__`` and framework model
operations, so they are imported here, before any class is made.
"""

from . import copying, dead_space, pickling, rehost, relayout

# Dead space left by a submodule replaced after registration is said at the assignment (dead_space.py).
dead_space.install()

__all__ = ["copying", "dead_space", "pickling", "rehost", "relayout"]
