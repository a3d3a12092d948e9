"""File-backed (memory-mapped) flat buffers: weights on disk."""

from __future__ import annotations

__all__ = ["OffloadMixin"]


class OffloadMixin:
    """``FlatStorage`` methods that re-back the flat buffers by files."""
