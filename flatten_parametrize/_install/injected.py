"""The injected classes assembled in one place: every method they get, and the steps of ``flatten()``.

Like ``torch.nn.utils.parametrize``, which builds its injected class in one
function (``_inject_new_class``), every module the library changes gets a class
of its own (``module_classes.make_class``). Its methods come from the modules
that own each part of a changed module's life, and they are all listed here, in
:data:`METHODS`; so are the steps that the user's ``flatten()`` runs first
(:data:`FLATTEN_STEPS`). Those modules need the registration machinery
themselves, so ``module_classes`` and ``coordinator`` cannot import them:
:func:`assemble` hands both tables down. ``_install/__init__.py`` calls it once,
after every module is imported, so no import order decides what a class gets.
"""

from __future__ import annotations

from .._guards import submodule_walks
from . import copying, dead_space, leaf_writes, module_classes, pickling, rehost, relayout
from .coordinator import FlattenStep, use_flatten_steps
from .module_classes import Methods, use_methods

__all__ = ["FLATTEN_STEPS", "METHODS", "assemble"]

#: The methods of every injected class, by attribute name, and the module that owns each.
METHODS = Methods(
    always={
        # state dicts (module_classes.py over _state/state_dict.py)
        "_save_to_state_dict": module_classes.save_to_state_dict,
        "state_dict": module_classes.state_dict,
        "_load_from_state_dict": module_classes.load_from_state_dict,
        "load_state_dict": module_classes.load_state_dict,
        # parameters replaced, converted or scripted (module_classes.py)
        "register_parameter": module_classes.register_parameter,
        "_apply": module_classes.apply_in_flat_mode,
        "__prepare_scriptable__": module_classes.prepare_scriptable,
        # a deleted submodule's dead space said, a flat parameter's deletion refused (dead_space.py)
        "__delattr__": dead_space.delete_saying_dead_space,
        # pickling and deep copy (pickling.py, copying.py)
        "__reduce_ex__": pickling.reduce_ex,
        "__deepcopy__": copying.deepcopy_module,
        # model operations that change ties, run on the plain model (relayout.py)
        "get_parameter": relayout.get_parameter,
        "__setattr__": relayout.set_attribute,
        # a submodule asked by user code for parameters that are slices, said once (submodule_walks.py)
        "parameters": submodule_walks.parameters,
        "named_parameters": submodule_walks.named_parameters,
        "requires_grad_": submodule_walks.requires_grad_,
    },
    where_defined={
        # transformers' resize_token_embeddings, only where the model has it (relayout.py)
        "resize_token_embeddings": relayout.resize_token_embeddings,
    },
)

#: What the user's ``flatten()`` runs before it flattens as usual: parameters of another shape put in
#: unflattened mode (leaf_writes.py), module swaps, released weights and dead space (rehost.py) lay
#: the groups out again.
FLATTEN_STEPS: tuple[FlattenStep, ...] = (leaf_writes.flatten_relaid, rehost.flatten_changed)


def assemble() -> None:
    """Give the injected classes their methods and ``flatten()`` its steps; say dead space when it happens.

    ``_install/__init__.py`` calls it once; calling it again changes nothing.
    """
    use_methods(METHODS)
    use_flatten_steps(FLATTEN_STEPS)
    leaf_writes.use_relayout(relayout.relayout_flat)
    dead_space.install()
