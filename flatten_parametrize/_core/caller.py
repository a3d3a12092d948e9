"""Who called into the library: the ``stacklevel`` that points at that code, and whether it is user code."""

from __future__ import annotations

import contextlib
import os
import site
import sys
import sysconfig

from torch.nn.modules import container as _torch_container
from torch.nn.modules import module as _torch_module

__all__ = ["called_from_user_code", "caller_level"]

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


def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    roots.add(site.getusersitepackages())
    return (_PACKAGE, *sorted(os.path.join(os.path.abspath(root), "") for root in roots))


#: The library itself, the standard library and every installed package (torch, transformers, Lightning, ...).
_INSTALLED = _installed_roots()
#: Whether each source file seen so far holds user code (see :func:`called_from_user_code`).
_USER_CODE: dict[str, bool] = {}


def called_from_user_code(depth: int) -> bool:
    """Return whether the frame ``depth`` levels above the caller of this function runs user code.

    User code is code outside the library, the standard library and the installed packages
    (site-packages): a script, a notebook cell, a test, a project's own modules.
    """
    filename = sys._getframe(depth + 1).f_code.co_filename
    known = _USER_CODE.get(filename)
    if known is None:
        known = _USER_CODE[filename] = not os.path.abspath(filename).startswith(_INSTALLED)
    return known
