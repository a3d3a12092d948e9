"""Data-parallel gradient sync over the flat buffers with torch.distributed."""

from __future__ import annotations

__all__ = ["DistributedMixin"]


class DistributedMixin:
    """``FlatStorage`` methods for torch.distributed (one collective per flat parameter)."""
