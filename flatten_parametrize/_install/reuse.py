"""Resolve groups against a module that already has a flat storage (``exist_ok=True``).

Reads the storage and the module but changes nothing.
"""

from __future__ import annotations

from torch import nn

from .._core.flat_parameter import FlatParameter
from .._core.layout import plan_group
from .._core.records import Coordinator
from .grouping import GroupsArg, SlotSpec, bucket_groups, resolve_groups
from .wrappers import strip_prefix

__all__ = ["check_same_layout", "plain_parameters"]


def plain_parameters(storage: Coordinator, prefix: str = "") -> list[SlotSpec]:
    """Return the plain model's parameters of a flattened module, each with every name it has.

    They come in module order, as ``named_parameters()`` of the plain module
    yields them (read from ``state_dict()``, which keeps the plain order).
    ``prefix`` (the path of ``storage.module`` in a wrapper) starts every name.
    """
    specs = [SlotSpec(slot.param, list(slot.all_names)) for slot in storage.slots()]
    seen = {id(spec.param): spec for spec in specs}
    for name, param in storage.module.named_parameters(remove_duplicate=False):
        if isinstance(param, FlatParameter):
            continue
        spec = seen.get(id(param))
        if spec is None:
            seen[id(param)] = spec = SlotSpec(param, [name])
            specs.append(spec)
        elif name not in spec.names:
            spec.names.append(name)
    order = {key: index for index, key in enumerate(storage.module.state_dict(keep_vars=True))}
    specs.sort(key=lambda spec: order.get(spec.name, len(order)))
    return [SlotSpec(spec.param, [prefix + name for name in spec.names]) for spec in specs]


def check_same_layout(
    storage: Coordinator,
    module: nn.Module,
    prefix: str,
    groups: GroupsArg,
    align: int,
    bucket_cap_mb: float | None,
) -> None:
    """Raise unless ``groups`` (with ``align`` and ``bucket_cap_mb``) resolve to the layout of ``storage``.

    ``module`` is the module passed to ``register_flat_storage``: ``storage.module``
    itself or a wrapper of it whose path to it is ``prefix``.

    Raises:
        TypeError, ValueError: as ``register_flat_storage`` does for bad ``groups``.
        RuntimeError: naming the first difference between the two layouts.
    """
    plain = plain_parameters(storage, prefix)
    specs = strip_prefix(resolve_groups(module, groups, plain=plain, prefix=prefix), prefix)
    if bucket_cap_mb is not None:
        specs = bucket_groups(storage.module, specs, bucket_cap_mb, check_names=False)
    wanted = [spec.name for spec in specs]
    fix = (
        "pass the groups (and align, bucket_cap_mb) of the first registration, or call "
        "remove_flat_storage first to register other groups"
    )
    if wanted != storage.group_names:
        raise RuntimeError(
            f"register_flat_storage(exist_ok=True): the module already has a flat storage with groups "
            f"{storage.group_names}, and these arguments make groups {wanted}; {fix}"
        )
    infos = storage.param_infos
    for spec in specs:
        have = [info for info in infos if info.group == spec.name]
        names = [slot.name for slot in spec.slots]
        if names != [info.name for info in have]:
            raise RuntimeError(
                f"register_flat_storage(exist_ok=True): group '{spec.name}' of the existing flat storage "
                f"holds {_show([info.name for info in have])}, and these arguments put "
                f"{_show(names)} in it; {fix}"
            )
        offsets = plan_group([tuple(slot.param.shape) for slot in spec.slots], align).offsets
        if list(offsets) != [info.offset for info in have]:
            raise RuntimeError(
                f"register_flat_storage(exist_ok=True): group '{spec.name}' of the existing flat storage "
                f"has its parameters at offsets {[info.offset for info in have]}, and align={align} puts "
                f"them at {list(offsets)}; {fix}"
            )


def _show(names: list[str]) -> str:
    return "[" + ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "") + "]"
