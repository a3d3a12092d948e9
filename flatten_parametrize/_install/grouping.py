"""Turn the ``groups`` argument of ``register_flat_storage`` into checked group specs.

Reads the module (parameter names, submodules) but changes nothing.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn

from .._core.flat_parameter import FlatParameter
from .._core.names import dtype_name, flat_param_name, library_state, registered_storage

__all__ = ["GroupItem", "GroupSpec", "GroupsArg", "SlotSpec", "bucket_groups", "resolve_groups"]

GroupItem = Union[nn.Parameter, nn.Module, str]
GroupsArg = Union[None, Iterable[GroupItem], Iterable[Iterable[GroupItem]], Mapping[str, Any]]


@dataclass
class SlotSpec:
    """One parameter object and every name under which ``module`` reaches it."""

    param: nn.Parameter
    names: list[str]

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class GroupSpec:
    """A named group of slots that will share one flat buffer."""

    name: str
    slots: list[SlotSpec] = field(default_factory=list)


def _describe(item: Any) -> str:
    if isinstance(item, torch.Tensor):
        return f"{type(item).__name__} of shape {tuple(item.shape)}"
    if isinstance(item, nn.Module):
        return f"module {type(item).__name__}"
    return f"{type(item).__name__} {item!r}"


def _is_item(obj: Any) -> bool:
    return isinstance(obj, (torch.Tensor, nn.Module, str))


def _check_not_flattened(module: nn.Module) -> None:
    for path, sub in module.named_modules(remove_duplicate=False):
        where = f"'{path}'" if path else "the module itself"
        if registered_storage(sub) is not None:
            raise RuntimeError(
                f"cannot register flat storage: {where} already has one; call "
                "remove_flat_storage on it first, or use get_flat_storage to reuse it"
            )
        state = library_state(sub)
        if state is not None and state.slots:
            names = ", ".join(f"{path + '.' if path else ''}{n}" for n in state.slots)
            raise RuntimeError(
                f"cannot register flat storage: {names} already live in another flat "
                "storage (registered on an enclosing module); call remove_flat_storage "
                "on that module first"
            )


def collect_names(module: nn.Module) -> dict[int, SlotSpec]:
    slots: dict[int, SlotSpec] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        spec = slots.get(id(param))
        if spec is None:
            slots[id(param)] = SlotSpec(param, [name])
        else:
            spec.names.append(name)
    return slots


def _check_flattenable(spec: SlotSpec, automatic: bool) -> None:
    param = spec.param
    hint = "pass explicit groups that leave it out" if automatic else "leave it out of the groups"
    if isinstance(param, FlatParameter):
        raise RuntimeError(
            f"cannot flatten '{spec.name}': it is already the flat parameter of "
            "another flat storage; call remove_flat_storage on the module that owns it"
        )
    if isinstance(param, nn.parameter.UninitializedParameter):
        raise ValueError(
            f"cannot flatten '{spec.name}': it is an uninitialized (lazy) parameter; "
            f"run one forward pass to materialize lazy modules before registering, or {hint}"
        )
    if type(param) is not nn.Parameter:
        raise ValueError(
            f"cannot flatten '{spec.name}': it is a {type(param).__name__}, and only plain "
            "nn.Parameter objects can become views of a flat buffer (a subclass would lose "
            f"its behaviour); {hint}"
        )
    if param.layout != torch.strided:
        raise ValueError(
            f"cannot flatten '{spec.name}': only dense (strided) parameters can share a "
            f"flat buffer, it has layout {param.layout}; {hint}"
        )


def _split_groups(groups: Any) -> tuple[list[tuple[str, list[Any]]], bool]:
    """Normalize the four accepted forms into ``[(name, items)]``.

    Returns:
        The named item lists, and whether the names are positions (the list
        forms), so that they can be renumbered once empty groups are dropped.
    """
    if isinstance(groups, str):
        raise TypeError(
            f"groups must be a sequence of items, a sequence of groups or a mapping; got the "
            f"str {groups!r}; write [{groups!r}] for one group matching that pattern"
        )
    if _is_item(groups):
        raise TypeError(
            f"groups must be a sequence of items, a sequence of groups or a mapping; got a "
            f"single {_describe(groups)}; wrap it in a list: [item]"
        )
    if isinstance(groups, Mapping):
        named: list[tuple[str, list[Any]]] = []
        for key, value in groups.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"group names must be str; got {type(key).__name__} {key!r}; use str keys such as 'decay'"
                )
            named.append((key, [value] if _is_item(value) else _as_list(value, f"group '{key}'")))
        return named, False
    entries = _as_list(groups, "groups")
    nested = [not _is_item(entry) for entry in entries]
    if entries and all(nested):
        return [(str(i), _as_list(entry, f"group '{i}'")) for i, entry in enumerate(entries)], True
    if any(nested):
        bad = entries[nested.index(True)]
        raise TypeError(
            "groups mixes single items and nested groups: got "
            f"{_describe(bad)} beside parameters, modules or patterns; pass either one "
            "group (a list of items) or a list of groups (a list of lists)"
        )
    return [("0", entries)], True


def _as_list(value: Any, what: str) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{what} must be an iterable of parameters, modules or name patterns; got {_describe(value)}"
        )
    return list(value)


def _resolve_items(
    group: str,
    items: list[Any],
    by_id: dict[int, SlotSpec],
    submodules: dict[int, list[str]],
    prefix: str,
) -> list[SlotSpec]:
    found: dict[int, SlotSpec] = {}
    for index, item in enumerate(items):
        where = f"item {index} of group '{group}'"
        if isinstance(item, nn.Parameter):
            spec = by_id.get(id(item))
            if spec is None:
                raise ValueError(
                    f"{where} is not a parameter of the module: a {_describe(item)} that "
                    "module.named_parameters() does not yield; pass parameters of the "
                    "module you register (or of its submodules)"
                )
            found.setdefault(id(item), spec)
        elif isinstance(item, torch.Tensor):
            raise TypeError(
                f"{where} is a {_describe(item)}, not an nn.Parameter; pass the module's "
                "parameters, submodules or name patterns"
            )
        elif isinstance(item, nn.Module):
            paths = submodules.get(id(item))
            if paths is None:
                raise ValueError(
                    f"{where} is a {_describe(item)} that is not a submodule of the module; "
                    "pass submodules of the module you register"
                )
            # By name, not item.parameters(): a flattened module's own parameters are the flat ones.
            prefixes = tuple(path + "." for path in paths)
            for spec in by_id.values():
                if "" in paths or any(n.startswith(prefixes) for n in spec.names):
                    found.setdefault(id(spec.param), spec)
        elif isinstance(item, str):
            matched = [
                spec
                for spec in by_id.values()
                if any(fnmatch.fnmatchcase(n, item) for n in spec.names)
                or (prefix and any(fnmatch.fnmatchcase(n[len(prefix) :], item) for n in spec.names))
            ]
            if not matched:
                raise ValueError(
                    f"{where}: pattern {item!r} matches no parameter name; "
                    f"names look like {_some_names(by_id)}"
                )
            for spec in matched:
                found.setdefault(id(spec.param), spec)
        else:
            raise TypeError(
                f"{where} must be an nn.Parameter, an nn.Module or a str pattern; got {_describe(item)}"
            )
    return list(found.values())


def _some_names(by_id: dict[int, SlotSpec]) -> str:
    names = [spec.name for spec in by_id.values()]
    shown = ", ".join(repr(n) for n in names[:4])
    return shown + (", ..." if len(names) > 4 else "") if names else "(the module has no parameters)"


def _key(param: torch.Tensor) -> tuple[torch.device, torch.dtype, bool]:
    return (param.device, param.dtype, param.requires_grad)


def _check_uniform(group: GroupSpec) -> None:
    first = group.slots[0]
    for slot in group.slots[1:]:
        for what, attr, hint in (
            ("dtypes", "dtype", "dtype"),
            ("devices", "device", "device"),
            ("requires_grad", "requires_grad", "requires_grad"),
        ):
            a, b = getattr(first.param, attr), getattr(slot.param, attr)
            if a != b:
                show = dtype_name if attr == "dtype" else str
                raise ValueError(
                    f"group '{group.name}' mixes {what}: {first.name} is {show(a)}, "
                    f"{slot.name} is {show(b)}; put them in separate groups or leave "
                    f"groups=None to group by {hint} automatically"
                )


def _check_group_name(module: nn.Module, name: str) -> None:
    attr = flat_param_name(name)
    if not name or not attr.isidentifier():
        raise ValueError(
            f"group name {name!r} cannot name a parameter ('{attr}'); use letters, "
            "digits and underscores, e.g. 'decay'"
        )
    if hasattr(module, attr):
        raise ValueError(
            f"group name {name!r} would register '{attr}', which the module already has; "
            "choose another group name"
        )


def resolve_groups(
    module: nn.Module,
    groups: GroupsArg,
    plain: list[SlotSpec] | None = None,
    target: nn.Module | None = None,
    prefix: str = "",
) -> list[GroupSpec]:
    """Check ``groups`` against ``module`` and return one spec per group, in order.

    A group whose items name no parameter (``[]``, or submodules without
    parameters) is left out: it gets no flat parameter. Groups of the list
    forms are then numbered ``"0"``, ``"1"``, ... over the groups that remain
    (as fairscale's ``param_list`` does); mapping keys are kept.

    ``plain``: for a module that already has a flat storage, its plain
    parameters (see ``_reuse.plain_parameters``) to resolve ``groups`` against.
    ``target``: the module that will own the flat parameters (default: ``module``;
    a wrapped model, see ``_wrappers``), whose attribute names must stay free;
    ``prefix``: its path in ``module``: globs also match names without it.

    Raises:
        TypeError: for a wrong type of ``module``, ``groups`` or an item.
        ValueError: for a foreign parameter or module, a pattern that matches
            nothing, a parameter in two groups, a group that mixes dtypes,
            devices or requires_grad, or a bad group name.
        RuntimeError: if part of ``module`` already lives in a flat storage.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_flat_storage needs an nn.Module; got {type(module).__name__}")
    if plain is None:
        _check_not_flattened(module)
        by_id = collect_names(module)
    else:
        by_id = {id(spec.param): spec for spec in plain}
    positional = False
    if groups is None:
        auto: dict[tuple[torch.device, torch.dtype, bool], GroupSpec] = {}
        for spec in by_id.values():
            key = _key(spec.param)
            if key not in auto:
                auto[key] = GroupSpec(str(len(auto)))
            auto[key].slots.append(spec)
        specs = list(auto.values())
    else:
        submodules: dict[int, list[str]] = {}
        for path, sub in module.named_modules(remove_duplicate=False):
            submodules.setdefault(id(sub), []).append(path)
        specs = []
        owner: dict[int, str] = {}
        named, positional = _split_groups(groups)
        for name, items in named:
            if any(g.name == name for g in specs):
                raise ValueError(f"duplicate group name {name!r}; give every group its own name")
            group = GroupSpec(name, _resolve_items(name, items, by_id, submodules, prefix))
            if not group.slots:  # explicitly empty: nothing to flatten, no flat parameter
                continue
            for slot in group.slots:
                other = owner.setdefault(id(slot.param), name)
                if other != name:
                    raise ValueError(
                        f"parameter {slot.name} is in two groups, '{other}' and '{name}'; "
                        "a parameter can live in one flat buffer only"
                    )
            specs.append(group)
    for group in specs:
        for slot in group.slots:
            _check_flattenable(slot, automatic=groups is None)
        if groups is not None:
            _check_uniform(group)
    if positional:  # messages above name the user's positions
        for index, group in enumerate(specs):
            group.name = str(index)
    for group in specs if plain is None else ():
        _check_group_name(module if target is None else target, group.name)
    return specs


#: The first bucket of each group closes once it holds this many MiB (DDP's
#: ``_DEFAULT_FIRST_BUCKET_BYTES``): backward finishes it early, so its sync starts early.
FIRST_BUCKET_MB = 1.0


def bucket_groups(
    module: nn.Module, specs: list[GroupSpec], bucket_cap_mb: float, check_names: bool = True
) -> list[GroupSpec]:
    """Split each group into buckets of at most ``bucket_cap_mb`` MiB, last-used parameters first.

    Backward finishes the gradients of the parameters used last first, so
    each group is filled into buckets walking its parameters backwards (module
    order is taken as the order of use): bucket ``"0"`` holds the last
    parameters of the first group, and the buckets of a group come before
    those of the next. Inside a bucket parameters keep module order. As with
    DDP's default, the first bucket of each group closes as soon as it holds
    1 MiB (or the cap, if smaller), so that its sync starts early in backward.
    Buckets close at parameter boundaries (as DDP's do), so one can end inside
    a layer; a parameter larger than the cap gets a bucket of its own. Sizes count
    parameter bytes (``numel * element_size``), MiB being 2**20 bytes as in
    DDP's ``bucket_cap_mb``. Buckets are renamed ``"0"``, ``"1"``, ... in order.

    Args:
        module: the module being registered (to check the new group names).
        specs: the groups to split, from :func:`resolve_groups`.
        bucket_cap_mb: the largest bucket, in MiB (positive).
        check_names: check that the module has no attribute of a bucket's
            flat parameter name yet (off when comparing with an existing storage).

    Returns:
        The buckets, one spec each.

    Example:
        >>> model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(4)])  # 1 MiB each
        >>> buckets = bucket_groups(model, resolve_groups(model, None), bucket_cap_mb=2)
        >>> [(b.name, [s.name for s in b.slots]) for b in buckets]
        [('0', ['3.weight']), ('1', ['1.weight', '2.weight']), ('2', ['0.weight'])]
    """
    cap = bucket_cap_mb * 2**20
    first = min(FIRST_BUCKET_MB, bucket_cap_mb) * 2**20
    buckets: list[list[SlotSpec]] = []
    for spec in specs:
        current: list[SlotSpec] = []
        size, in_first = 0, True
        for slot in reversed(spec.slots):
            nbytes = slot.param.numel() * slot.param.element_size()
            if current and (size + nbytes > cap or (in_first and size >= first)):
                buckets.append(current[::-1])
                current, size, in_first = [], 0, False
            current.append(slot)
            size += nbytes
        if current:
            buckets.append(current[::-1])
    out = [GroupSpec(str(i), slots) for i, slots in enumerate(buckets)]
    for group in out if check_names else ():
        _check_group_name(module, group.name)
    return out
