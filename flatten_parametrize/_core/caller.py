"""The ``stacklevel`` of a warning that points at the code that called into the library."""

from __future__ import annotations

import contextlib
import os
import sys

from torch.nn.modules import container as _torch_container
from torch.nn.modules import module as _torch_module

__all__ = ["caller_level"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: Frames of these files are passed over too: context managers' exits, nn.Module's and containers' setters.
_PASSED = frozenset({contextlib.__file__, _torch_module.__file__, _torch_container.__file__})


def caller_level() -> int:
    """Return the ``stacklevel`` (for the caller of this function) of the first frame outside the library."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE) or frame.f_code.co_filename in _PASSED
    ):
        frame, level = frame.f_back, level + 1
    return level
