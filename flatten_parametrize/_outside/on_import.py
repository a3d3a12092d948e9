"""Run a patch of an outside module now if it is imported, else right after its first import.

The wrappers of outside code that ``flatten_parametrize/_outside/registry.py`` lists (DCP's state-dict
functions, FSDP's optimizer re-keying, Lightning's full-checkpoint loader, timm's decay rule,
torchao's module swaps) must not import what they wrap: importing DCP costs ~0.7 s, and
Lightning may not be installed. :func:`when_imported` patches a loaded module at
once; otherwise one meta-path finder wraps the loader of each awaited module so that the patch
runs as soon as the module's code has run, and leaves ``sys.meta_path`` once nothing is awaited.
:func:`wrapper_of` gives every wrapper the original's name, docstring, signature and
``__wrapped__``, and one mark (:func:`is_ours`), so that a patch run twice wraps nothing twice
while a user's own wrapper of the original is wrapped like the original.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any, Callable

__all__ = ["is_ours", "when_imported", "wrapper_of"]

_lock = threading.RLock()
#: Attribute of every wrapper of outside code the package makes: the function it wraps.
_MARK = "__flatten_parametrize_original__"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wrap the loaders of the awaited modules so that their patches run after they execute."""

    def __init__(self) -> None:
        self.awaited: dict[str, list[Callable[[ModuleType], None]]] = {}
        self._busy: set[str] = set()

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.awaited or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:  # the real finders find it; only its loader's exec_module is wrapped
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        loader = None if spec is None else spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec
        with _lock:
            patches = self.awaited.pop(fullname, [])
            if not self.awaited and self in sys.meta_path:
                sys.meta_path.remove(self)

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            for patch in patches:
                patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign,union-attr]  # this spec's own
        return spec


_finder = _PatchOnImport()


def when_imported(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` for module ``name`` now if it is loaded, else right after its import."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        patch(loaded)
        return
    with _lock:
        patches = _finder.awaited.setdefault(name, [])
        if patch not in patches:
            patches.append(patch)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def wrapper_of(original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``wrapper`` with the name, docstring, signature and ``__wrapped__`` of ``original``, marked."""
    wrapped = functools.wraps(original)(wrapper)
    setattr(wrapped, _MARK, original)
    return wrapped


def is_ours(function: Any) -> bool:
    """Return whether ``function`` is a wrapper made by :func:`wrapper_of` (or a copy of one's attributes)."""
    return getattr(function, _MARK, None) is not None
