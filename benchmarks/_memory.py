"""Process memory as Linux reports it: resident set size and its peak (``/proc/self/status``).

``VmRSS`` is the resident set now and ``VmHWM`` its peak; writing ``5`` to
``/proc/self/clear_refs`` resets the peak to the current size, so the peak of
one operation is measurable in a process that did other things before.
``malloc_trim(0)`` first hands glibc's free heap memory back to the system,
so that what the operation allocates shows up as new resident pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["extra_peak", "held_bytes", "peak_bytes", "reset_peak", "rss_bytes", "trim"]

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def rss_bytes() -> int | None:
    """Return the resident set size in bytes (``None`` where ``/proc`` is missing)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_bytes() -> int | None:
    """Return the peak resident set size in bytes since start or the last :func:`reset_peak`."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak() -> bool:
    """Reset the peak resident set size to the current one; return whether that worked."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def trim() -> None:
    """Collect garbage and return glibc's free heap memory to the system (no-op elsewhere)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(name).malloc_trim(0)


def extra_peak(fn: Callable[[], object]) -> tuple[int | None, object]:
    """Run ``fn`` once; return (its peak resident bytes above the resident size before, its result)."""
    trim()
    before = rss_bytes()
    if before is None or not reset_peak():
        return None, fn()
    result = fn()
    peak = peak_bytes()
    return (None if peak is None else max(0, peak - before)), result


def held_bytes(tensors: Any) -> int:
    """Return the bytes of memory behind ``tensors`` (a DTensor's local shard; views counted once)."""
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
