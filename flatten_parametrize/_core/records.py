"""The coordinator's read API: one record per group and per slot, and the public ``ParamInfo``.

Every module that needs to know the layout of a flat storage (state dicts,
inspection, plotting, optimizer conversion, module surgery, features) reads
these records, obtained from ``core.groups()`` and ``core.slots()``,
instead of the coordinator's private attributes. Nothing here imports the
coordinator core itself (``_install/coordinator.py``): :class:`Coordinator`
is the protocol it implements, :class:`Feature` the base of what it drives
(``features.py`` says how a feature plugs in).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, TypeVar

import torch
from torch import Tensor, nn

from .flat_parameter import FlatParameter, serve
from .grad.owner import GroupGrad
from .layout import GroupLayout
from .transaction import Transaction
from .view_cache import GroupViews

__all__ = [
    "Coordinator",
    "Feature",
    "Group",
    "ModuleState",
    "ParamInfo",
    "PublicStorage",
    "Record",
    "Slot",
    "StagedValue",
]


@dataclass(frozen=True)
class ParamInfo:
    """Where one flattened parameter lives.

    Attributes:
        name: qualified name, relative to the registered module.
        aliases: the other names of a tied parameter (empty if not tied).
        group: name of the group whose flat buffer holds it.
        offset: element offset in that buffer.
        numel: number of elements.
        shape: shape of the parameter.
        dtype: dtype of the buffer.
    """

    name: str
    aliases: tuple[str, ...]
    group: str
    offset: int
    numel: int
    shape: torch.Size
    dtype: torch.dtype


@dataclass
class Slot:
    """One flattened parameter object and every name the module reaches it by.

    Attributes:
        name: its first qualified name.
        aliases: its other names (a tied parameter).
        group_index: the position of its group in the storage.
        index: its position in its group's layout.
        param: the original parameter object (a leaf in unflattened mode).
    """

    name: str
    aliases: tuple[str, ...]
    group_index: int
    index: int
    param: nn.Parameter

    @property
    def all_names(self) -> tuple[str, ...]:
        """Return the first name and the aliases."""
        return (self.name, *self.aliases)


@dataclass(frozen=True, eq=False)
class Group:
    """One group of a flat storage, as the coordinator holds it now.

    A new record replaces the old one when the flat parameter object is
    replaced (``module.to()`` & co.); the other fields never change.

    Attributes:
        index: position of the group in the storage (group order).
        name: the group name (``storage["name"]``).
        flat_name: the attribute of its flat parameter on the module (``flat_param_<name>``).
        layout: where each member lives in the flat buffer.
        views: the hot-path view cache that serves the members' attributes.
        flat: the group's flat parameter.
        members: its slots, in layout order.
        grads: the one owner of the group's gradient (flat gradient, views, memory, hooks and
            sync claim), made with the group and handed to its view cache, whose split nodes
            build the flat gradient in it.
    """

    index: int
    name: str
    flat_name: str
    layout: GroupLayout
    views: GroupViews
    flat: FlatParameter
    members: tuple[Slot, ...]
    grads: GroupGrad

    def __post_init__(self) -> None:
        serve(self.flat, self.views)  # its `.data` setter and `.grad` getter reach the view cache

    def split(self, tensor: Tensor) -> list[Tensor]:
        """Return a view of each member, in layout order, of a tensor shaped like the flat parameter."""
        return self.views.split(tensor)

    def value_views(self) -> list[Tensor]:
        """Return a view of each member of the flat parameter's values (detached)."""
        return self.views.split(self.flat.detach())

    def grad_views(self) -> list[Tensor] | None:
        """Return a view of each member of the flat gradient, or ``None`` while there is none."""
        grad = self.flat.grad
        return None if grad is None else self.views.grads.split(grad)


F = TypeVar("F", bound="Feature")

#: A value that ``load_state_dict`` will write into one slot: (group views, index in group, source).
StagedValue = tuple[GroupViews, int, Tensor]


class Coordinator(Protocol):
    """What the library's modules may use of a storage's private core (``_install/coordinator.py``).

    The injected classes, the view cache, surgery, state dicts and every
    feature see a storage through this protocol; users hold the public
    ``FlatStorage`` facade instead.
    """

    #: Depth of nested ``using()`` blocks.
    using_depth: int
    #: Depth of nested ``no_sync()`` blocks (gradient sync reduces nothing while it is not 0).
    no_sync_depth: int
    #: Values staged by a ``load_state_dict`` in progress (``None``: none, or unflattened mode).
    pending: list[StagedValue] | None
    #: The public ``FlatStorage`` of this core (``None`` until one was handed out).
    facade: Any
    #: Per-tensor mode's switch (``_install/per_tensor.py``): features call its ``update_hooks()``
    #: when what their ``forward_sync()`` says changed.
    per_tensor: Any

    @property
    def module(self) -> nn.Module:
        """The registered module (raises for a detached storage)."""

    def module_or_none(self) -> nn.Module | None:
        """The registered module, or ``None`` once it was garbage collected."""

    @property
    def is_attached(self) -> bool:
        """Whether the module is alive and this storage is registered on it."""

    @property
    def module_unchecked(self) -> nn.Module:
        """The registered module, also while registration or removal is under way."""

    @property
    def is_flattened(self) -> bool:
        """Whether the module is in flat mode."""

    @property
    def param_infos(self) -> list[ParamInfo]:
        """One public record per slot."""

    @property
    def flat_params(self) -> list[FlatParameter]:
        """The flat parameters, in group order (pending writes landed)."""

    @property
    def group_names(self) -> list[str]:
        """The group names, in group order."""

    def groups(self) -> tuple[Group, ...]:
        """The records of the groups, in group order."""

    def slots(self) -> tuple[Slot, ...]:
        """The records of the slots, in group and layout order."""

    def members(self) -> list[tuple[nn.Module, ModuleState]]:
        """Every module this storage changed (still alive), with its state."""

    def state_of(self, module: nn.Module) -> ModuleState | None:
        """The library's state of ``module`` if this storage changed it (also while unflattened)."""

    def adopt_members(self, owners: list[tuple[nn.Module, ModuleState]]) -> None:
        """Take ``owners`` as the modules this storage changed."""

    def current_names(self) -> list[tuple[str, ...]]:
        """The names by which the tree reaches each slot now, in ``param_infos`` order (none: dead)."""

    def live_names(self) -> set[str]:
        """Every flattened name whose module was not replaced or deleted since registration."""

    def flatten(self) -> None:
        """Switch to flat mode."""

    def unflatten(self) -> None:
        """Switch to unflattened mode."""

    def unflattened(self) -> AbstractContextManager[Any]:
        """Run a block in unflattened mode."""

    def views_of(self, tensors: Any, remove_duplicate: bool = True) -> dict[str, Tensor]:
        """``{name: view}`` over tensors shaped like the flat parameters."""

    def flat_state_dict(self) -> Any:
        """The module's state dict in flat form."""

    def sync_writes(self, *, forward: bool = False) -> None:
        """Land (or refuse) the writes made around the views since the last call."""

    def adopt_replacements(self, replaced: list[tuple[Group, Any]]) -> None:
        """Adopt parameters registered in flat parameters' places, all or nothing."""

    def adopt_flat_params(self) -> None:
        """Re-wrap flat parameters that ``module.to()`` & co. replaced or re-classed."""

    # The feature seams (see ``features.py``).
    #: The features composed on this core, in the order the lifecycle notifies them.
    features: list[Feature]

    def feature(self, kind: type[F]) -> F | None:
        """The feature of type ``kind`` composed on this core, or ``None``."""

    def add_feature(self, feature: Feature) -> None:
        """Drive ``feature``'s lifecycle from now on."""

    def remove_feature(self, feature: Feature) -> None:
        """Stop driving ``feature``'s lifecycle."""

    def flat_buffers_replaced(self) -> None:
        """Tell the core (and every feature) that flat buffers were swapped (``.data``)."""

    def no_sync(self) -> AbstractContextManager[None]:
        """Have gradient sync skip the backward passes inside the block."""


class PublicStorage(Protocol):
    """What the public functions that take a ``FlatStorage`` rely on to find its core (its module)."""

    @property
    def module(self) -> nn.Module:
        """The registered module."""


@dataclass
class ModuleState:
    """What the library keeps on each module it changed (in ``module.__dict__``).

    Attributes:
        storage: the coordinator that owns the flat buffers.
        order: names of the module's parameters before registration, in order.
        prev_class: the module's class before registration.
        slots: flattened attribute name -> (group views, index in group).
        injected: the library's class of the module while unflattened mode
            gives it back its ``prev_class`` (``None`` in flat mode).
        hidden: its ``parametrizations`` container while unflattened mode
            takes it out of the module.
    """

    storage: Coordinator
    order: list[str]
    prev_class: type
    slots: dict[str, tuple[GroupViews, int]] = field(default_factory=dict)
    injected: type | None = None
    hidden: Any = None


#: ``(function, args)``: what composes a feature again on another core, as ``function(core, *args)``.
Record = tuple[Callable[..., None], tuple[Any, ...]]


class Feature(ABC):
    """The hooks the coordinator calls on each of its features (a private base class: ``features.py``).

    The four lifecycle hooks are abstract; every other hook is declared here with
    what a feature that does not override it does (nothing, holds the layout, is
    not carried), so the core calls each one directly.
    """

    # ------------------------------------------------------------- lifecycle
    @abstractmethod
    def on_rebacked(self) -> None:
        """Flat parameters were re-backed or replaced, or written behind their version counters."""

    @abstractmethod
    def refresh(self) -> None:
        """A sync point (the registered module's forward, among others): check what may have changed."""

    @abstractmethod
    def on_removed(self) -> None:
        """The storage was removed from its module: release files, hooks and the like."""

    @abstractmethod
    def copy_for(self, storage: Coordinator, memo: dict[int, Any]) -> Feature | None:
        """Return this feature's state for ``storage``, a copy of its coordinator (``None``: not copied)."""

    # ------------------------------------------------------ layout and loads
    def holds_layout(self) -> str | None:
        """Return how to release the layout this feature holds now (a sentence), or ``None``.

        By default a feature holds it while it is composed.
        """
        return f"remove the {type(self).__name__.lstrip('_')} feature"

    def relayout_record(self) -> Record | None:
        """Return what composes this feature on the core laid out again (``None``: it is dropped)."""
        return None

    def pickle_record(self) -> Record | None:
        """Return what composes this feature on a core loaded from a pickle (``None``: it is dropped)."""
        return None

    # ------------------------------------------------ per-tensor mode's forward
    def forward_sync(self) -> bool:
        """Return whether per-tensor mode's forward must call :meth:`before_forward`/:meth:`after_forward`."""
        return False

    def per_tensor_began(self, tx: Transaction) -> None:  # noqa: B027 (by default: nothing to do)
        """Per-tensor mode began (undoably, in ``tx``)."""

    def per_tensor_ended(self, tx: Transaction) -> None:  # noqa: B027 (by default: nothing to do)
        """Per-tensor mode ends (undoably, in ``tx``)."""

    def before_forward(self) -> None:  # noqa: B027 (by default: nothing to do)
        """The registered module's forward in per-tensor mode begins (outside writes landed)."""

    def after_forward(self) -> None:  # noqa: B027 (by default: nothing to do)
        """The registered module's forward in per-tensor mode ended (also when it raised)."""
