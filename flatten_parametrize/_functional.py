"""Weights as vectors: stacks of flat parameters evaluated with ``torch.func``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import Tensor
from torch.func import functional_call

from ._per_group import per_group

if TYPE_CHECKING:
    from ._flat_parameter import FlatParameter

__all__ = ["FunctionalMixin", "StackedTensors"]

#: One stacked tensor of shape ``(k, numel)`` per group: a list in group order,
#: a dict by group name, or a single tensor when there is one group.
StackedTensors = Union[Tensor, Sequence[Tensor], Mapping[str, Tensor]]


class FunctionalMixin:
    """``FlatStorage`` methods for ensembles: ``stack`` and ``call_stacked``."""

    _flat: list[FlatParameter]
    _group_names: list[str]
    _flat_names: list[str]
    module: Any

    def stack(self, k: int, *, requires_grad: bool = False) -> list[Tensor]:
        """Return ``k`` copies of every flat parameter, stacked: one ``(k, numel)`` tensor per group.

        The copies are independent of the module (perturb them, train them,
        average them) and :meth:`call_stacked` evaluates the module once per row.

        Args:
            k: number of weight sets (``>= 1``).
            requires_grad: make the stacks leaves that require grad. Default: ``False``.

        Returns:
            A list in group order.

        Raises:
            ValueError: if ``k`` is smaller than 1.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(3, 2)
            >>> storage = register_flat_storage(layer)
            >>> [tuple(s.shape) for s in storage.stack(4)]
            [(4, 8)]
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"stack(k) needs an integer k >= 1; got {k!r}")
        return [flat.detach().unsqueeze(0).repeat(k, 1).requires_grad_(requires_grad) for flat in self._flat]

    def _stacked(self, stacked: StackedTensors) -> list[Tensor]:
        groups = self._group_names
        items = per_group(stacked, groups, "call_stacked()", "stack", "(k, numel) tensor")
        ks = set()
        for group, item, flat in zip(groups, items, self._flat):
            if item.dim() != 2 or item.shape[1] != flat.numel():
                raise ValueError(
                    f"call_stacked(): group '{group}' needs a (k, {flat.numel()}) stack; "
                    f"got shape {tuple(item.shape)}"
                )
            ks.add(item.shape[0])
        if len(ks) > 1:
            raise ValueError(f"call_stacked(): every stack needs the same k; got {sorted(ks)}")
        return items

    def call_stacked(self, stacked: StackedTensors, *args: Any, **kwargs: Any) -> Any:
        """Evaluate the module once per row of ``stacked``, in one vectorized call.

        ``torch.vmap`` over ``torch.func.functional_call`` with the flat
        parameters replaced by each row: an ensemble of ``k`` weight sets on
        the same inputs. Gradients flow to ``stacked``.

        Args:
            stacked: one ``(k, numel)`` tensor per group (see :meth:`stack`).
            *args: positional inputs of the module's forward (shared by all rows).
            **kwargs: keyword inputs of the module's forward.

        Returns:
            The module's output with a leading dimension of size ``k``.

        Raises:
            TypeError: if ``stacked`` or an entry has a wrong type.
            ValueError: if counts, group names or shapes do not match.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(3, 2)
            >>> storage = register_flat_storage(layer)
            >>> out = storage.call_stacked(storage.stack(5), torch.randn(7, 3))
            >>> out.shape
            torch.Size([5, 7, 2])
        """
        items = self._stacked(stacked)
        module, names = self.module, self._flat_names

        def one(*weights: Tensor) -> Any:
            return functional_call(module, dict(zip(names, weights)), args, kwargs)

        return torch.vmap(one)(*items)
