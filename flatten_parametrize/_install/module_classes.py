"""The per-module classes the library injects, and the state each changed module carries.

Every module that gets a flattened attribute is given a subclass of its
original class with the same ``__name__``, holding one property per flattened
attribute and the few ``nn.Module`` methods that must know about the flat
storage (state-dict save/load, ``_apply``, ``__deepcopy__``). All of them read
the module's own :class:`ModuleState`, so modules of one class with the same
flattened attributes share one such class (:func:`make_class`): code that runs
one ``forward`` over many modules (the layers of a model) then sees one type
where the plain model does, and keeps the speed of Python's per-type caches. A
module that torch's ``parametrize`` gave a class of its own keeps a class of
its own, as one that torch parametrizes later gets one (:func:`own_class`).

The methods defined here are those of the state-dict and conversion paths; the
whole set, these and those of the modules that own the other lifecycles
(pickling, deep copy, model operations, the dead-space warning), is listed in
one table, :data:`.injected.METHODS`, which ``injected.assemble`` hands to
:func:`use_methods` before any class is made.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor, nn
from torch.nn.utils.parametrize import is_parametrized

from .._core.attribute import make_property
from .._core.features import in_flat_mode
from .._core.flat_parameter import FlatParameter
from .._core.foreign import is_fsdp2_compute_param
from .._core.names import CLASS_MARKER, MODULE_STATE_ATTR, base_of, registered_storage
from .._core.records import ModuleState
from .._core.writes import check_flat_replacement, land_parameter
from .._state.state_dict import alias_unflattened, load_atomically, load_module, save_module

__all__ = [
    "Methods",
    "apply_in_flat_mode",
    "base_of",
    "clone_class",
    "delete_attribute",
    "is_shared",
    "library_names",
    "load_from_state_dict",
    "load_state_dict",
    "make_class",
    "own_class",
    "prepare_scriptable",
    "register_parameter",
    "save_to_state_dict",
    "state_dict",
    "unscripted",
    "use_methods",
]

_MARKER = CLASS_MARKER
#: Marks a class that :func:`make_class` shares between the modules of one class.
_SHARED_MARKER = "_flat_parametrize_shared"
#: The shared classes of each original class, by the flattened attributes they serve (see :func:`make_class`).
_SHARED: weakref.WeakKeyDictionary[type, dict[frozenset[str], type]] = weakref.WeakKeyDictionary()


def _super(module: nn.Module) -> Any:
    for klass in type(module).__mro__:
        if klass.__dict__.get(_MARKER, False):
            return super(klass, module)
    raise RuntimeError(f"{type(module).__name__} has no flat_parametrize class")


def _state(module: nn.Module) -> ModuleState | None:
    return module.__dict__.get(MODULE_STATE_ATTR)


def save_to_state_dict(self: nn.Module, destination: Any, prefix: str, keep_vars: bool) -> None:
    """Save this module's entries under the plain model's names (``_state/state_dict.save_module``)."""
    save_module(self, _state(self), _super(self)._save_to_state_dict, destination, prefix, keep_vars)


def load_from_state_dict(
    self: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load this module's entries by the plain model's names (``_state/state_dict.load_module``)."""
    load_module(
        self,
        _state(self),
        _super(self)._load_from_state_dict,
        state_dict,
        prefix,
        local_metadata,
        strict,
        missing_keys,
        unexpected_keys,
        error_msgs,
    )


def state_dict(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Return torch's state dict; in unflattened mode each flattened entry gets a storage of its own."""
    result = _super(self).state_dict(*args, **kwargs)
    storage = registered_storage(self)
    keep_vars = kwargs.get("keep_vars", args[2] if len(args) > 2 else False)
    if storage is not None and not storage.is_flattened and not keep_vars:
        # In unflattened mode the other modules are plain: their values are the leaf
        # parameters, which share the flat buffer's storage.
        alias_unflattened(storage, result, kwargs.get("prefix", args[1] if len(args) > 1 else ""))
    return result


def load_state_dict(self: nn.Module, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
    """Load a state dict all or nothing (``_state/state_dict.load_atomically``) on a registered module."""
    core = registered_storage(self)
    base = _super(self).load_state_dict
    if core is None:
        return base(state_dict, strict=strict, assign=assign)
    return load_atomically(core, base, state_dict, strict=strict, assign=assign)


def register_parameter(self: nn.Module, name: str, param: Any) -> None:
    """Run ``register_parameter`` on a module a storage changed.

    A flat parameter's name adopts ``param`` as the group's flat parameter;
    a flattened attribute's name (flat mode) copies the values into its slot;
    anything else is torch's.

    Raises:
        RuntimeError: if ``param`` cannot take that place (nothing changed).
    """
    state = _state(self)
    base = _super(self).register_parameter
    if state is None:
        return base(name, param)
    core = state.storage
    group = next((g for g in core.groups() if g.flat_name == name), None)
    if group is not None and registered_storage(self) is core:
        if not core.is_flattened or core.using_depth:
            raise RuntimeError(
                f"cannot replace {name} in unflattened mode or inside using(): the flat "
                "parameter is not served there; call storage.flatten() (or leave using()) first"
            )
        if is_fsdp2_compute_param(self, group.flat, param):
            return base(name, param)  # FSDP2's unsharded parameter in its param_dtype: served, not adopted
        check_flat_replacement(group, param)
        base(name, param)
        core.adopt_replacements([(group, param)])
        return None
    if core.is_flattened and core.pending is None and name in state.slots and name not in self._parameters:
        land_parameter(self, state, name, param)
        return None
    return base(name, param)


def delete_attribute(self: nn.Module, name: str) -> None:
    """Delete attribute ``name``; deleting a flat parameter in flat mode is refused."""
    storage = registered_storage(self)
    if storage is not None and storage.is_flattened and any(g.flat_name == name for g in storage.groups()):
        raise RuntimeError(
            f"cannot delete {name} of {type(self).__name__}: it is a flat parameter that every "
            "flattened attribute is a view of; call remove_flat_storage(module) to go back to "
            "ordinary parameters"
        )
    _super(self).__delattr__(name)


def apply_in_flat_mode(self: nn.Module, fn: Callable[..., Any], recurse: bool = True) -> nn.Module:
    """Run ``_apply`` (``.to()``, ``.half()``, ...) in flat mode, then re-adopt the flat parameters."""
    core = registered_storage(self)
    base = _super(self)._apply
    if core is None:
        return base(fn, recurse)
    if core.using_depth:
        raise RuntimeError("cannot convert or move the module inside storage.using(...); leave it first")

    def convert(tensor: Tensor) -> Any:
        # A no-op conversion returns the FlatParameter itself, which torch cannot
        # re-wrap in a Parameter when it replaces parameters; hand it a plain view.
        out = fn(tensor)
        return out.detach() if type(out) is FlatParameter else out

    core.sync_writes()
    with in_flat_mode(core):
        try:
            return base(convert, recurse)
        finally:
            core.adopt_flat_params()


#: Marks a forward hook of the library's that ``torch.jit.script`` leaves out (see :func:`unscripted`).
_UNSCRIPTED = "_flat_parametrize_unscripted"


def unscripted(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``hook``, a forward hook the library puts on a module, as one a script module goes without.

    ``torch.jit.script`` compiles a module's hooks with it and refuses Python ones. Such a hook
    does for eager backward passes what a script module does not need (per-tensor mode's
    :func:`~._install.per_tensor._arm_backward`): :func:`prepare_scriptable` hands the scripter
    the module without it.
    """
    setattr(hook, _UNSCRIPTED, True)
    return hook


def prepare_scriptable(self: nn.Module) -> nn.Module:
    """Let ``torch.jit.script`` compile the module in unflattened mode only, less :func:`unscripted` hooks."""
    state = _state(self)
    if state is None or not state.storage.is_flattened:
        # unflattened mode: the attributes are the module's own parameters
        return _without_unscripted_hooks(self)
    raise RuntimeError(
        f"torch.jit.script cannot compile {type(self).__name__}: it is part of a flattened module, "
        "whose attributes are served by the flat storage. Script it inside storage.unflattened(), "
        "or a plain copy "
        "(copy = copy.deepcopy(model); remove_flat_storage(copy); torch.jit.script(copy)), "
        "or use torch.jit.trace on the registered module, which reads the flat parameters"
    )


def _without_unscripted_hooks(module: nn.Module) -> nn.Module:
    """Return ``module``, or a shallow copy of it (same parameters, submodules, buffers) without them."""
    if not any(getattr(hook, _UNSCRIPTED, False) for hook in module._forward_hooks.values()):
        return module
    copy = type(module).__new__(type(module))
    copy.__dict__.update(module.__dict__)
    kept = {key: hook for key, hook in module._forward_hooks.items() if not getattr(hook, _UNSCRIPTED, False)}
    copy.__dict__["_forward_hooks"] = type(module._forward_hooks)(kept)
    for name in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        flags = module.__dict__.get(name)
        if flags is not None:
            copy.__dict__[name] = type(flags)((key, flag) for key, flag in flags.items() if key in kept)
    return copy


_SKIP = ("__dict__", "__weakref__")


@dataclass(frozen=True)
class Methods:
    """The methods every injected class gets, by attribute name (listed in ``injected.py``).

    Attributes:
        always: added to every class.
        where_defined: added only where the original class has an attribute
            of that name (a framework's model operation, e.g. transformers'
            ``resize_token_embeddings``), so that ``hasattr`` answers as for
            the plain module.
    """

    always: Mapping[str, Callable[..., Any]]
    where_defined: Mapping[str, Callable[..., Any]]


#: The methods :func:`make_class` gives, set by :func:`use_methods` (``injected.assemble``).
_methods: Methods | None = None


def use_methods(methods: Methods) -> None:
    """Make every class from now on with ``methods`` (``injected.assemble`` calls it once)."""
    global _methods
    _methods = methods


def _assembled() -> Methods:
    assert _methods is not None, "no injected class is made before _install/injected.assemble() has run"
    return _methods


def library_names() -> frozenset[str]:
    """Return the names of the attributes every injected class may get besides its properties."""
    methods = _assembled()
    return frozenset((_MARKER, *methods.always, *methods.where_defined))


def make_class(module: nn.Module, attrs: Iterable[str] = ()) -> type:
    """Return a class for ``module``: its class plus the library's methods and a property per ``attrs``.

    Modules of one class that flatten the same attributes get the same class:
    the properties and methods read each module's own state, so nothing in it
    differs between them. Per-instance classes would cost every ``forward``
    that runs over several of them (the layers of a model): Python's
    attribute caches are per type, and 12 encoder layers of 12 types ran 3-5%
    slower than the plain model, one type each as fast. Code that stacks
    models of one architecture (``torch.func.stack_module_state``) also
    requires ``type(a) is type(b)``.

    A module that ``torch.nn.utils.parametrize`` already gave a class gets a
    class of its own, a copy of that class's properties (``copy.deepcopy``
    shares such classes between copies, and torch changes them);
    ``__bases__[0]`` stays the original class, so
    ``type_before_parametrizations`` keeps working.
    """
    shared = not is_parametrized(module)
    key = frozenset(attrs)
    if shared:
        known = _SHARED.get(type(module), {}).get(key)
        if known is not None:
            return known
    made = _new_class(module)
    for name in attrs:
        setattr(made, name, make_property(name))
    if shared:  # kept only once complete: a failure above leaves no half-made class behind
        setattr(made, _SHARED_MARKER, True)
        _SHARED.setdefault(type(module), {})[key] = made
    return made


def is_shared(cls: type) -> bool:
    """Return whether ``cls`` is a class that :func:`make_class` shares (copies keep it)."""
    return bool(cls.__dict__.get(_SHARED_MARKER, False))


def own_class(module: nn.Module) -> None:
    """Give ``module`` a class of its own if it shares one, before outside code changes its class.

    torch's ``register_parametrization`` adds a property to ``module.__class__``
    (``parametrize._inject_property``): on a shared class it would reach every
    module of that class.
    """
    cls = type(module)
    if is_shared(cls):
        own = clone_class(cls)
        delattr(own, _SHARED_MARKER)
        module.__class__ = own


def _new_class(module: nn.Module) -> type:
    cls = type(module)
    if is_parametrized(module):
        namespace = {k: v for k, v in cls.__dict__.items() if k not in _SKIP}
        bases = cls.__bases__
    else:
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        bases = (cls,)
    methods = _assembled()
    namespace[_MARKER] = True
    namespace.update(methods.always)
    namespace.update({k: v for k, v in methods.where_defined.items() if hasattr(cls, k)})
    return type(cls.__name__, bases, namespace)


def clone_class(cls: type) -> type:
    """Return a copy of an injected class (same bases, same attributes)."""
    namespace = {k: v for k, v in cls.__dict__.items() if k not in _SKIP}
    return type(cls.__name__, cls.__bases__, namespace)
