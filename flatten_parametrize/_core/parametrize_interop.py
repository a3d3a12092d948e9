"""Interop with ``torch.nn.utils.parametrize``: the objects it sees on a flattened module.

Each flattened attribute gets a real ``ParametrizationList`` holding one
:class:`FlatView`, in a ``parametrizations`` container kept out of
``_modules`` (:class:`HiddenParametrizations`), so that ``is_parametrized``,
``remove_parametrizations``, ``cached`` and ``type_before_parametrizations``
keep working while ``print(model)``, ``model.modules()`` and ``state_dict()``
stay as before. The attribute itself is served by the library's own property
(``_view_cache.make_property``), not through these objects.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, cast

from torch import Tensor, nn
from torch.nn.utils.parametrize import ParametrizationList

from .view_cache import GroupViews

__all__ = ["FlatView", "FlatViewList", "HiddenParametrizations", "register_view"]


class FlatView(nn.Module):
    """The parametrization registered on each flattened attribute.

    Its ``forward`` returns the attribute's view of the flat buffer. Values
    cannot be assigned through ``right_inverse``: the flat buffer owns them.
    """

    def __init__(self, group: GroupViews, index: int, qualified_name: str) -> None:
        super().__init__()
        self.__dict__["_slot"] = (group, index)
        self.__dict__["_qualified_name"] = qualified_name
        self.__dict__["_registering"] = True

    def forward(self) -> Tensor:
        group, index = self.__dict__["_slot"]
        return group.view(index)

    def right_inverse(self, value: Tensor) -> tuple[()]:
        if self.__dict__.pop("_registering", False):
            return ()
        raise RuntimeError(
            f"cannot assign to {self.__dict__['_qualified_name']} through its "
            "parametrization: it is a view of a flat storage. Write values with "
            "`with torch.no_grad(): view.copy_(value)` or swap weights with storage.using(...)"
        )

    def extra_repr(self) -> str:
        group, index = self.__dict__["_slot"]
        layout = group.layout
        return (
            f"{group.flat_name}[{layout.offsets[index]}:"
            f"{layout.offsets[index] + layout.numels[index]}] -> {tuple(layout.shapes[index])}"
        )


class FlatViewList(ParametrizationList):
    """A ``ParametrizationList`` holding one :class:`FlatView` and no original tensor."""

    def _refuse(self, *args: Any) -> None:
        name = self.__dict__.get("_qualified_name", "a flattened attribute")
        raise RuntimeError(
            f"cannot add a parametrization on top of {name}: "
            "it is a view of a flat storage; register other parametrizations before "
            "register_flat_storage (their original tensors are then flattened), in per-tensor mode "
            "on a module that had none at registration (storage.unflatten(), then register it: the "
            "next flatten() lays its tensors out again), or call remove_flat_storage first"
        )

    append = _refuse  # type: ignore[assignment]
    insert = _refuse  # type: ignore[assignment]


class HiddenParametrizations(nn.ModuleDict):
    """The ``parametrizations`` container of a module, kept out of ``_modules``.

    ``torch.nn.utils.parametrize`` finds it by attribute, so ``is_parametrized``
    and friends work, while ``print(model)``, ``model.modules()`` and
    ``state_dict()`` stay exactly as before. If another parametrization is
    registered on the same module later, the container moves into
    ``_modules`` so that its tensors are seen by ``parameters()``.
    """

    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.__dict__["_owner"] = weakref.ref(owner)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        super().add_module(name, module)
        if not isinstance(module, FlatViewList):
            owner = self.__dict__["_owner"]()
            if owner is not None and owner.__dict__.get("parametrizations") is self:
                del owner.__dict__["parametrizations"]
                owner._modules["parametrizations"] = self

    def __deepcopy__(self, memo: dict[int, Any]) -> HiddenParametrizations:
        new = HiddenParametrizations.__new__(HiddenParametrizations)
        memo[id(self)] = new
        state = {k: v for k, v in self.__dict__.items() if k != "_owner"}
        new.__dict__.update(copy.deepcopy(state, memo))
        owner = self.__dict__["_owner"]()
        new.__dict__["_owner"] = (
            weakref.ref(memo.get(id(owner), owner)) if owner is not None else (lambda: None)
        )
        return new


def register_view(
    module: nn.Module,
    name: str,
    group: GroupViews,
    index: int,
    qualified_name: str,
    original: Tensor,
    on_undo: Callable[[Callable[[], None]], None],
) -> None:
    """Install the parametrization of ``module.<name>`` (the class must already be ours)."""
    view = FlatView(group, index, qualified_name)
    plist = FlatViewList([view], original, unsafe=True)
    plist.__dict__["_qualified_name"] = qualified_name
    container: nn.ModuleDict
    if "parametrizations" not in module.__dict__ and "parametrizations" not in module._modules:
        container = HiddenParametrizations(module)

        def drop_container() -> None:
            module.__dict__.pop("parametrizations", None)

        on_undo(drop_container)
        module.__dict__["parametrizations"] = container
    else:
        container = cast(nn.ModuleDict, module.parametrizations)

    def drop_entry() -> None:
        container._modules.pop(name, None)

    on_undo(drop_entry)
    container[name] = plist
