"""Which outside call (a wrapped entry point of someone else's code) runs on the plain model in this thread.

The wrappers of ``_outside/plain_calls.py`` run torch's and other libraries' model changes on the plain
model (inside ``storage.unflattened()``); what lays the groups out again when such a call ends
(``_install/rehost.py``) names it in its warnings. The state lives here, in the core, so that both read
it without the install importing the outside wing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["current_call", "depth", "running"]

#: Depth of wrapped calls running in this thread (a nested one runs as is), and the outermost one.
_running = threading.local()


def current_call() -> str | None:
    """Return the entry point (as users call it) running on the plain model in this thread, if any."""
    return getattr(_running, "what", None) if getattr(_running, "depth", 0) else None


def depth() -> int:
    """Return how many wrapped calls run in this thread (0: none; more: this one is nested)."""
    return int(getattr(_running, "depth", 0))


@contextmanager
def running(what: str) -> Iterator[None]:
    """Record that the wrapped entry point ``what`` runs in this thread (the outermost one is named)."""
    outer = depth()
    _running.depth = outer + 1
    if not outer:
        _running.what = what
    try:
        yield
    finally:
        _running.depth = outer
