"""The process group that gradient sync and ``ShardedOptimizer`` are given, checked (both call it)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["checked_process_group"]


def checked_process_group(process_group: Any, what: str) -> tuple[dist.ProcessGroup | None, int]:
    """Check ``process_group`` and the distributed state; return ``(group, world size)``.

    Raises:
        RuntimeError: without torch.distributed or an initialized default group.
        ValueError: on a rank outside the group.
        TypeError: if ``process_group`` is not a process group or ``None``.
    """
    if not dist.is_available():
        raise RuntimeError(
            f"{what} needs torch.distributed, which this build of torch lacks; "
            "install a torch build with distributed support"
        )
    if isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{what}: this rank is not a member of the given process group (dist.new_group "
            "returned NON_GROUP_MEMBER here); call it only on the ranks of that group"
        )
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{what}: group must be a torch.distributed ProcessGroup or None (the default group); "
            f"got {type(process_group).__name__} {process_group!r}; pass a group made by dist.new_group(...)"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs an initialized default process group; none is initialized in this "
            "process; call torch.distributed.init_process_group(...) first"
        )
    return process_group, dist.get_world_size(process_group)
