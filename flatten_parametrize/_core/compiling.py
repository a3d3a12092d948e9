"""How ``torch.compile`` (dynamo) treats the library's own functions, set without importing ``torch._dynamo``.

Importing dynamo costs seconds; the library only marks its functions the way
``torch._dynamo.skip`` / ``torch.compiler.disable`` would, through torch's C
module that is loaded with torch anyway.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

__all__ = ["compiling_or_tracing", "in_compiled_module_call", "never_compiled", "never_traced"]

_frames: Any = torch._C._dynamo.eval_frame
_compiling = torch.compiler.is_compiling
_tracing = torch._C._is_tracing
_SKIP = _frames._FrameAction.SKIP


def never_compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keep dynamo from compiling ``fn``'s frame, and the frames it calls, on their own; return ``fn``.

    ``fn`` stays traceable: a compiled caller inlines it as before. Only where
    ``fn`` runs eagerly under an active ``torch.compile`` (the forward hooks of
    a compiled user module, which torch's ``_call_impl`` calls outside the
    compiled forward) it runs without adding a compiled frame.
    """
    _frames.set_code_exec_strategy(fn.__code__, _frames._FrameExecStrategy(_SKIP, _SKIP))
    return fn


def never_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``fn`` run eagerly under ``torch.compile`` (as ``torch.compiler.disable``); return ``fn``.

    A compiled caller that reaches ``fn`` breaks the graph there and calls it
    eagerly; its own frame is never compiled (:func:`never_compiled`).
    """
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    return never_compiled(fn)


def in_compiled_module_call() -> bool:
    """Return whether this eager frame runs inside a call of ``torch.compile(module)``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    return eval_frame is not None and bool(eval_frame._is_in_optimized_module())


def compiling_or_tracing() -> bool:
    """Return whether this code runs inside ``torch.compile``'s tracing or ``torch.jit.trace``."""
    return bool(_compiling() or _tracing())
