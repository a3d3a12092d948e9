"""The gradient owner as one room: each group's gradient in flat and per-tensor mode.

* ``owner.py``: :class:`~.owner.GroupGrad`, the one owner of a group's gradient (the
  flat gradient, its views, its memory, a gradient lent out, the feature hooks that
  see it and the sync claim), and ``set_grad`` for a tensor no group owns;
* ``leaf_slots.py``: per-tensor mode's leaves, whose gradients live in their slots of
  the flat gradient (``LeafGrads``, reached through its owner only);
* ``split_node.py``: the group's autograd node, which serves the views and builds the
  flat gradient in the owner's memory;
* ``engine.py``: the private entry points of torch's autograd engine, named once, and
  whether a process group (whose DDP hooks the leaves) exists.
"""
