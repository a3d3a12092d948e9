"""Write paths around the views: a value written to a flattened model lands in the flat buffer, or is refused.

Outside code writes to a model in ways that bypass the library's property:
``layer.weight.data = t`` (re-points the served view), ``layer._parameters["weight"] = p``
and ``register_parameter`` / ``setattr`` with an ``nn.Parameter`` (put a tensor next
to the view), ``model.flat_param_0 = p`` or ``model._parameters["flat_param_0"] = p``
(replace a flat parameter). In flat mode each of them either lands (the values
are copied into the slot, or the new flat parameter is adopted by the
coordinator) or raises a ``RuntimeError`` that leaves the model as it was.

Nothing is scanned per forward when nothing was written. Where each write lands:

* ``register_parameter`` / ``setattr`` with a parameter: at once (the injected
  ``register_parameter``).
* ``_parameters[name] = p``: at the next read of that attribute (the property
  looks in ``_parameters`` anyway), or at the next full scan.
* ``_parameters["flat_param_0"] = p``: at the registered module's next forward
  (an identity check per group) or full scan.
* ``view.data = t``: the view itself serves ``t`` at once; the values land in
  the flat buffer at the next read of the flat parameter's ``.grad`` (every
  optimizer step and ``zero_grad`` reads it; ``FlatParameter.grad``), the next
  read that switches cache entries (another grad mode or thread, rebuilt views)
  and the registered module's forward after such a read, or the next full scan.

A full scan (``FlatStorage.sync_writes()``: every changed module's
``_parameters`` and every cached view) runs before the library's own operations:
state dicts, ``storage[...]`` / ``flat_params`` / ``named_views`` /
``named_grads``, toggles, ``.to()`` & co., loading, copying, pickling and removal.
``_view_cache.WRITE_SCANS`` counts the work of all of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .fit import misfit
from .names import dtype_name
from .records import Group, ModuleState
from .view_cache import WRITE_SCANS

__all__ = ["check_flat_replacement", "land_direct_writes", "land_parameter", "served_parameter"]


def _qualified(state: ModuleState, attr: str) -> str:
    views, index = state.slots[attr]
    return views.names[index] if index < len(views.names) else attr


def land_parameter(module: nn.Module, state: ModuleState, attr: str, value: Any) -> None:
    """Copy ``value``, set as parameter ``attr`` of ``module`` in flat mode, into its slot.

    The entry is removed from ``module._parameters`` in every case, so that the
    slot's view serves the attribute again.

    Raises:
        RuntimeError: if ``value`` is ``None``, not a tensor, a tensor subclass
            (a quantized weight), or differs from the slot in shape, dtype,
            device or ``requires_grad`` (nothing written).
    """
    module._parameters.pop(attr, None)
    views, index = state.slots[attr]
    name = _qualified(state, attr)
    flat = views.current()
    shape = torch.Size(views.layout.shapes[index])
    how = (
        f"; write values with `with torch.no_grad(): module.{attr}.copy_(value)`, or change "
        "parameters inside storage.unflattened() or after remove_flat_storage"
    )
    if not isinstance(value, Tensor):
        raise RuntimeError(
            f"cannot set {name} to {type(value).__name__}: it is a slot of the flat storage "
            f"({views.flat_name}) and needs a tensor of shape {tuple(shape)}{how}"
        )
    misfits = misfit(value, flat)
    if misfits is not None and value.dtype == flat.dtype:  # another dtype: the message below
        raise RuntimeError(
            f"cannot set {name} to {misfits}: a slot of the flat storage ({views.flat_name}) holds "
            f"a plain {dtype_name(flat.dtype)} tensor, and a quantized or otherwise subclassed "
            "weight cannot live in a flat buffer; quantize or swap weights inside "
            "`with storage.unflattened():` (a weight that cannot live in the flat buffer then "
            "leaves the storage when the block ends, and the rest is laid out again) or after "
            "remove_flat_storage(model)"
        )
    found = (tuple(value.shape), value.dtype, value.device)
    if found != (tuple(shape), flat.dtype, flat.device):
        raise RuntimeError(
            f"cannot set {name} to a tensor of shape {found[0]}, {found[1]} on {found[2]}: its "
            f"slot in {views.flat_name} holds shape {tuple(shape)}, {flat.dtype} on {flat.device}"
            f"{how}"
        )
    if isinstance(value, nn.Parameter) and value.requires_grad != flat.requires_grad:
        raise RuntimeError(
            f"cannot set {name} to a parameter with requires_grad={value.requires_grad}: it is a "
            f"slot of {views.flat_name}, which has requires_grad={flat.requires_grad} for all its "
            f"slots{how}"
        )
    with torch.no_grad():
        views.split(flat.detach())[index].copy_(value)


def served_parameter(module: nn.Module, state: ModuleState, attr: str, param: Any) -> Any:
    """Return what ``module.<attr>`` serves when its ``_parameters`` holds ``attr`` (the property calls it).

    In unflattened mode (and while a load stages values) that parameter; in
    flat mode it was put there around the view: it lands in the slot (or is
    refused) and the view is served.
    """
    core = state.storage
    if not core.is_flattened or core.pending is not None:
        return param
    land_parameter(module, state, attr, param)
    views, index = state.slots[attr]
    return views.view(index)


def land_direct_writes(owners: Iterable[tuple[nn.Module, ModuleState]]) -> None:
    """Land every parameter put into a flattened module's ``_parameters`` under a flattened name.

    Raises:
        RuntimeError: as :func:`land_parameter`; the refused entry is removed.
    """
    for module, state in owners:
        WRITE_SCANS["parameters"] += 1
        params = module._parameters
        if params.keys().isdisjoint(state.slots):
            continue
        for attr in [a for a in state.slots if a in params]:
            land_parameter(module, state, attr, params[attr])


def check_flat_replacement(group: Group, value: Any) -> None:
    """Check that ``value`` can take the place of ``group``'s flat parameter.

    Raises:
        RuntimeError: if ``value`` is not an ``nn.Parameter`` of the flat
            parameter's size, dtype and device.
    """
    flat = group.flat
    fix = (
        f"; assign an nn.Parameter of {flat.numel()} elements, {flat.dtype} on {flat.device}, "
        f"or write values with `with torch.no_grad(): module.{group.flat_name}.copy_(t)`"
    )
    if not isinstance(value, nn.Parameter):
        raise RuntimeError(
            f"cannot replace {group.flat_name} with {type(value).__name__}: the flat storage "
            f"needs an nn.Parameter in its place{fix}"
        )
    found = (tuple(value.shape), value.dtype, value.device)
    if found != ((flat.numel(),), flat.dtype, flat.device):
        raise RuntimeError(
            f"cannot replace {group.flat_name} with a parameter of shape {found[0]}, {found[1]} "
            f"on {found[2]}: group '{group.name}' is laid out in a one-dimensional buffer of "
            f"{flat.numel()} elements, {flat.dtype} on {flat.device}{fix}"
        )
