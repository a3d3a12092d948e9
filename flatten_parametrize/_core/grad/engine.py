"""torch's autograd-engine helpers, named once for the whole library.

The gradient owner (``owner.py``, ``leaf_slots.py``), the view cache, gradient
sync and ``ShardedOptimizer`` need a few private entry points of torch's
autograd engine: the id of the backward in progress, a callback at its end,
the node it runs, whether it will run a node, the post-accumulate-grad
hooks of a tensor, and a gradient hook put on a tensor without a handle. They
are reached here only, so that a change of torch's private API is met in one
module. Here too: whether a default process group exists, whose DDP may hook
the leaves' accumulation (the owner and mixed precision's cast node both ask).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = [
    "current_node",
    "graph_task_id",
    "has_post_accumulate_grad_hooks",
    "hook_gradient",
    "process_group_exists",
    "queue_callback",
    "run_post_accumulate_grad_hooks",
    "will_execute",
]

#: The id of the backward (graph task) this thread is running (``-1`` outside backward).
graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
#: Whether the backward in progress will run an autograd node (raises in ``torch.autograd.grad``).
will_execute: Callable[[Any], bool] = torch._C._will_engine_execute_node
_ENGINE = torch.autograd.Variable._execution_engine
#: Have the autograd engine run a callback when the backward in progress ends.
queue_callback: Callable[[Callable[[], None]], None] = _ENGINE.queue_callback


def current_node() -> Any:
    """Return the autograd node this thread is running (``None`` outside backward)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return None if current is None else current()


def has_post_accumulate_grad_hooks(tensor: Tensor) -> bool:
    """Return whether ``tensor`` has post-accumulate-grad hooks (something waits for its gradient)."""
    return bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


def run_post_accumulate_grad_hooks(tensor: Tensor) -> None:
    """Run the post-accumulate-grad hooks registered on ``tensor``, as backward does after accumulating."""
    hooks = getattr(tensor, "_post_accumulate_grad_hooks", None)
    for hook in tuple(hooks.values()) if hooks else ():
        hook(tensor)


def hook_gradient(tensor: Tensor, node: Any, key: object, hook: Callable[[Tensor], None]) -> None:
    """Have backward call ``hook(grad)`` at the gradient of ``tensor`` (``node``: its ``grad_fn``).

    What ``tensor.register_hook(hook)`` does (a second call with the same ``key`` replaces the
    hook), without the handle it makes and its per-call import: a quarter of its cost, which is
    paid at every forward that hooks its output. A tensor subclass gets ``register_hook`` itself.
    """
    if type(tensor) is not Tensor:
        tensor.register_hook(hook)
        return
    hooks: dict[Any, Any] | None = tensor._backward_hooks
    if hooks is None:
        hooks = OrderedDict()
        tensor._backward_hooks = hooks
        node._register_hook_dict(tensor)
    hooks[key] = hook


def process_group_exists() -> bool:
    """Return whether a default process group exists (DDP may hook and reduce the leaves during backward)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()
