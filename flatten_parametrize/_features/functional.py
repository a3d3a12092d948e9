"""Weights as vectors: stacks of flat parameters evaluated with ``torch.func``."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch
from torch import Tensor
from torch.func import functional_call

from .._core.features import Coordinator, Feature, storage_of
from .._core.per_group import per_group

__all__ = ["Functional", "StackedTensors"]

#: One stacked tensor of shape ``(k, numel)`` per group: a list in group order,
#: a dict by group name, or a single tensor when there is one group.
StackedTensors = Union[Tensor, Sequence[Tensor], Mapping[str, Tensor]]


class Functional(Feature):
    """The ensemble feature of a storage: ``FlatStorage.stack`` and ``call_stacked`` delegate here.

    It keeps no state of its own but weak references to the stacks it handed
    out: while one lives it holds the layout (a stack of the old sizes fits no
    new one).

    Args:
        storage: the coordinator (held weakly).
    """

    def __init__(self, storage: Coordinator) -> None:
        self._storage_ref = weakref.ref(storage)
        #: The stacks handed out by :meth:`stack` (they have the layout's sizes), while they live.
        self._stacks: weakref.WeakSet[Tensor] = weakref.WeakSet()

    @property
    def _storage(self) -> Coordinator:
        return storage_of(self._storage_ref)

    def on_rebacked(self) -> None:
        """Nothing to do: the flat parameters are read at each call."""

    def refresh(self) -> None:
        """Nothing to check."""

    def on_removed(self) -> None:
        """Nothing to release."""

    def copy_for(self, storage: Coordinator, memo: dict[int, Any]) -> Functional:
        """A stateless copy for ``storage``."""
        return Functional(storage)

    def holds_layout(self) -> str | None:
        """While a stack of :meth:`stack` lives."""
        if not len(self._stacks):
            return None
        return "drop the stacks of storage.stack() (del them), and stack again after the change"

    def stack(self, k: int, requires_grad: bool) -> list[Tensor]:
        """Return ``k`` stacked copies of every flat parameter (see ``FlatStorage.stack``)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"stack(k) needs an integer k >= 1; got {k!r}")
        stacks = [
            group.flat.detach().unsqueeze(0).repeat(k, 1).requires_grad_(requires_grad)
            for group in self._storage.groups()
        ]
        for stack in stacks:
            self._stacks.add(stack)
        return stacks

    def _stacked(self, stacked: StackedTensors) -> list[Tensor]:
        groups = self._storage.groups()
        items = per_group(stacked, [g.name for g in groups], "call_stacked()", "stack", "(k, numel) tensor")
        ks = set()
        for group, item in zip(groups, items):
            numel = group.flat.numel()
            if item.dim() != 2 or item.shape[1] != numel:
                raise ValueError(
                    f"call_stacked(): group '{group.name}' needs a (k, {numel}) stack; "
                    f"got shape {tuple(item.shape)}"
                )
            ks.add(item.shape[0])
        if len(ks) > 1:
            raise ValueError(f"call_stacked(): every stack needs the same k; got {sorted(ks)}")
        return items

    def call_stacked(self, stacked: StackedTensors, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Evaluate the module once per row, vectorized (see ``FlatStorage.call_stacked``)."""
        items = self._stacked(stacked)
        storage = self._storage
        module, names = storage.module, [group.flat_name for group in storage.groups()]

        def one(*weights: Tensor) -> Any:
            return functional_call(module, dict(zip(names, weights)), args, kwargs)

        return torch.vmap(one)(*items)
