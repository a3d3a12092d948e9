"""Another engine's tensor in a flat parameter's place (FSDP2's ``DTensor``).

``fully_shard`` registers a sharded ``DTensor`` parameter where the flat
parameter was; that tensor, and its conversions (``.to()``, ``.double()``),
are FSDP2's. The library leaves it there (:func:`is_foreign`) and writes into
the part of it that this rank holds (:func:`local_shard`): the padding after
``to_empty()``, the values of a ``load_state_dict``. Under an ``mp_policy``,
FSDP2 gathers that tensor into an unsharded parameter of its ``param_dtype``
(:func:`is_fsdp2_compute_param`): the views are served from it while it is
there, but it is FSDP2's compute copy, not a new flat parameter.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import Tensor, nn

from .flat_parameter import FlatParameter

__all__ = [
    "detached_dtensor",
    "is_distributed",
    "is_foreign",
    "is_fsdp2_compute_param",
    "is_stale_batched",
    "local_shard",
]


def is_foreign(tensor: Any) -> bool:
    """Return whether ``tensor``, found in a flat parameter's place, belongs to another engine.

    A tensor subclass other than ours (FSDP2 registers ``DTensor`` parameters) is
    that engine's to convert and to keep; a plain tensor is ``functional_call``'s
    substitute. Neither is adopted as the group's flat parameter.
    """
    return isinstance(tensor, Tensor) and type(tensor) not in (nn.Parameter, FlatParameter)


@functools.cache
def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def is_distributed(tensor: Any) -> bool:
    """Return whether ``tensor`` is a ``DTensor`` (FSDP2's sharded parameter, say).

    Its local values change (optimizer steps, FSDP2's resharding) without
    anything that a cache of views could compare: views of it are never cached.
    """
    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def is_fsdp2_compute_param(root: nn.Module, flat: Tensor, value: Any) -> bool:
    """Return whether ``value`` in ``flat``'s place is FSDP2's unsharded parameter of another dtype.

    ``fully_shard(root, mp_policy=MixedPrecisionPolicy(param_dtype=...))``
    all-gathers its sharded ``DTensor`` into a plain parameter of
    ``param_dtype`` before each forward and puts it in the flat parameter's
    place: the size and device of the flat parameter, another dtype. It is
    FSDP2's compute copy (FSDP2 keeps the sharded master, reduces its gradient
    and puts the sharded parameter back), so the library serves the views
    from it and adopts nothing.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return (
        fsdp is not None
        and isinstance(root, fsdp.FSDPModule)
        and type(value) is nn.Parameter
        and value.dtype != flat.dtype
        and value.shape == (flat.numel(),)
        and value.device == flat.device
    )


def detached_dtensor(tensor: Any) -> Any:
    """Return a ``DTensor`` without autograd history over ``tensor``'s local values (no copy).

    ``DTensor.detach()`` refuses under ``inference_mode``; a new ``DTensor`` over
    the detached local tensor does not.
    """
    if not torch.is_inference_mode_enabled():
        return tensor.detach()
    return type(tensor).from_local(
        tensor.to_local().detach(),
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=tensor.shape,
        stride=tensor.stride(),
    )


def is_stale_batched(tensor: Any) -> bool:
    """Return whether ``tensor`` is a ``vmap`` batched tensor found outside any ``vmap``.

    Code that swaps stacked weights into a module inside ``vmap`` and fails to
    swap them back (tensordict's ``to_module`` exit can raise there) leaves
    such a tensor in the flat parameter's place; it is unusable once ``vmap``
    returned, so the flat parameter is put back.
    """
    functorch = torch._C._functorch
    return (
        isinstance(tensor, Tensor)
        and functorch.is_batchedtensor(tensor)
        and functorch.maybe_current_level() is None
    )


def local_shard(tensor: Tensor) -> tuple[Tensor, int] | None:
    """Return the part of a one-dimensional ``DTensor`` that this rank holds and its global offset.

    ``None`` for any other tensor: only a DTensor on a one-dimensional mesh,
    sharded along dimension 0 (FSDP2's parameters are) or replicated, is
    located here.
    """
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if not isinstance(tensor, DTensor) or tensor.dim() != 1 or tensor.device_mesh.ndim != 1:
        return None
    placement = tensor.placements[0]
    if not (type(placement) is Replicate or (type(placement) is Shard and placement.dim == 0)):
        return None
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), int(offset[0])
