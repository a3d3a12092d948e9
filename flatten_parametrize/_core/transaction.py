"""An undo log, so that every operation that changes a module is all or nothing.

Each change is recorded *before* it is made; if anything raises before the
transaction ends, every recorded change is undone in reverse order.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch import Tensor

__all__ = ["Transaction", "atomically"]

_UNSET = object()
_T = TypeVar("_T")


def atomically(step: Callable[[Transaction], _T]) -> _T:
    """Run ``step(tx)`` with a fresh transaction; undo everything it recorded if it raises.

    Example:
        >>> d = {"a": 1}
        >>> def change(tx):
        ...     tx.keep_dict(d)
        ...     d["b"] = 2
        ...     raise KeyError("boom")
        >>> try:
        ...     atomically(change)
        ... except KeyError:
        ...     pass
        >>> d
        {'a': 1}
    """
    tx = Transaction()
    try:
        return step(tx)
    except BaseException:
        tx.rollback()
        raise


class Transaction:
    """Record changes to modules, tensors and dicts, to undo them all with :meth:`rollback`.

    Use it through :func:`atomically`, which rolls back when the step raises.
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._kept: set[int] = set()

    def rollback(self) -> None:
        """Undo every recorded change, newest first."""
        undo, self._undo = self._undo, []
        self._kept.clear()
        for step in reversed(undo):
            step()

    def on_undo(self, step: Callable[[], None]) -> None:
        """Record ``step`` as the way to undo the change about to be made."""
        self._undo.append(step)

    def keep_dict(self, mapping: dict[Any, Any]) -> None:
        """Record ``mapping``'s items and order once, to restore them on rollback."""
        if id(mapping) in self._kept:
            return
        saved = list(mapping.items())

        def restore() -> None:
            mapping.clear()
            mapping.update(saved)

        self.on_undo(restore)
        self._kept.add(id(mapping))

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.<name>`` (``.data``, ``.grad``, ``__class__``, ...) and record the old value."""
        old = getattr(obj, name, _UNSET)

        def restore() -> None:
            if old is _UNSET:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

        self.on_undo(restore)
        setattr(obj, name, value)

    def swap_tensors(self, a: Tensor, b: Tensor) -> None:
        """Swap two tensors' contents and types (``torch.utils.swap_tensors``), undoably."""
        self.on_undo(lambda: torch.utils.swap_tensors(a, b))
        torch.utils.swap_tensors(a, b)

    def write(self, target: Tensor, source: Tensor | None) -> None:
        """Copy ``source`` into ``target`` (zeros if ``None``), keeping the old values for rollback."""
        with torch.no_grad():
            backup = target.detach().clone()

            def restore() -> None:
                with torch.no_grad():
                    target.copy_(backup)

            self.on_undo(restore)
            if source is None:
                target.zero_()
            else:
                target.copy_(source)
