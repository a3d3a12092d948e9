"""Registration and module surgery: the private coordinator core and everything that changes the module tree.

The coordinator core (``coordinator.py``), the injected classes
(``module_classes.py``), flatten/unflatten and the other tree changes
(``surgery.py``), registration and removal (``lifecycle.py``), whole-model
pickling (``pickling.py``), deep copy (``copying.py``), grouping and reuse,
module swaps and released weights laid out again on ``flatten()``
(``rehost.py``), the dead-space warning (``dead_space.py``) and the warning for a
submodule asked for parameters that are slices (``submodule_walks.py``).
Uses ``_core`` and ``_state``.

The methods of the injected classes and the steps of ``flatten()`` are listed
in one place, ``injected.py``, which imports the modules that define them;
:func:`.injected.assemble`, called here and nowhere else, hands them to
``module_classes`` and the coordinator and registers the dead-space hook. No
module of this sub-package registers anything when it is imported.
"""

from . import injected

injected.assemble()

__all__ = ["injected"]
