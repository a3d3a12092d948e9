"""Registration and module surgery: the private coordinator core and everything that changes the module tree.

The coordinator (``coordinator.py``), the injected classes (``module_classes.py``),
flatten/unflatten (``surgery.py``), pickling and deep copy, grouping and reuse.
Uses ``_core`` and ``_state``.
"""
