"""A picture of the flat buffers (matplotlib, optional)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._storage import FlatStorage

__all__ = ["plot_layout"]


def plot_layout(storage: FlatStorage, **kwargs: Any) -> Any:
    """Return a matplotlib figure of ``storage``'s flat buffers."""
    raise NotImplementedError("plot_layout is not implemented yet")
