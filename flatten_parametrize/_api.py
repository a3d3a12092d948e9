"""The public entry points: register, get and remove a module's flat storage."""

from __future__ import annotations

import math

from torch import nn

from ._core.names import registered_storage
from ._features.mixed_precision.feature import MixedPrecision, MixedPrecisionArg, resolve_policies
from ._guards.left_out import registered
from ._install.coordinator import StorageCore
from ._install.grouping import GroupsArg, bucket_groups, resolve_groups
from ._install.lifecycle import build_storage, remove_storage
from ._install.reuse import check_same_layout
from ._install.wrappers import registration_target, strip_prefix
from ._storage import FlatStorage, facade_of

__all__ = ["register_flat_storage", "get_flat_storage", "remove_flat_storage"]


def register_flat_storage(
    module: nn.Module,
    groups: GroupsArg = None,
    *,
    align: int = 1,
    bucket_cap_mb: float | None = None,
    exist_ok: bool = False,
    mixed_precision: MixedPrecisionArg = None,
) -> FlatStorage:
    """Register one contiguous flat storage per group for the parameters of ``module``.

    Each flattened parameter (``layer.weight``, ...) becomes a
    ``torch.nn.utils.parametrize`` parametrization that returns a view of its
    group's :class:`FlatParameter`, registered on ``module`` as
    ``flat_param_<group>``. The module tree, class names and attribute names
    are unchanged; ``module.parameters()`` yields the flat parameters (and any
    parameter left out of every group), so an optimizer built from it trains
    the flattened model. ``state_dict()`` keeps the plain module's keys.

    Args:
        module: the module whose parameters to flatten.
        groups: which parameters go into which flat buffer.
            ``None`` (default): all of them, one group per (device, dtype,
            requires_grad), named ``"0"``, ``"1"``, ... in first-seen order.
            A sequence of items: one group ``"0"``. A sequence of sequences:
            groups ``"0"``, ``"1"``, .... A mapping ``name -> items``: named
            groups. An item is an ``nn.Parameter`` of ``module``, a submodule
            (all its parameters) or a ``str`` glob matched against qualified
            parameter names (``fnmatch`` rules, e.g. ``"*.bias"``). A group
            whose items name no parameter (``[]``, ``{"no_decay": []}``, a
            submodule without parameters) gets no flat parameter, and an
            empty ``groups`` (``[]``, ``[[]]``, ``{}``) flattens nothing;
            groups of the list forms are numbered over the non-empty ones
            (``[[], [p]]`` gives group ``"0"``, as fairscale's ``param_list``).
        align: every view starts at an element offset that is a multiple of
            ``align`` (padding is zero and never visible). Default: ``1``.
        bucket_cap_mb: split each automatic group into flat parameters
            (buckets) of at most this many MiB, filled walking the parameters
            backwards, i.e. in the order in which backward finishes them:
            group ``"0"`` holds the last parameters. Then
            :meth:`~FlatStorage.enable_grad_sync` syncs early-finished buckets
            while the rest of backward runs, as DDP's 25 MiB buckets do (and,
            as with DDP's default, the first bucket closes once it holds 1 MiB,
            so that sync starts early). A parameter larger than the cap gets a
            bucket of its own. Only for
            ``groups=None``: explicit groups are refused (split them yourself).
            Default: ``None`` (no split).
        exist_ok: if ``module`` already has a flat storage, return it when
            these arguments resolve to its layout (same groups, members, order
            and offsets), instead of raising; for code that runs more than once,
            such as Lightning's ``configure_model``. ``groups`` may then name
            parameters as before registration (objects, globs, submodules,
            :func:`weight_decay_groups` of the flattened module). Default:
            ``False``.
        mixed_precision: a ``torch.distributed.fsdp.MixedPrecisionPolicy``
            (FSDP2's class, with FSDP2's meanings of ``param_dtype``,
            ``reduce_dtype``, ``output_dtype`` and ``cast_forward_inputs``) for
            every group, or a mapping ``group name -> policy or None`` (a group
            that is not named, or maps to ``None``, computes in its own dtype,
            e.g. norms kept in float32). A group with a ``param_dtype`` keeps
            its :class:`FlatParameter` as the master copy (what the optimizer
            steps and the state dicts hold) and serves its views from a compute
            copy in ``param_dtype``, cast once per group after the master
            changed; see :attr:`FlatStorage.mixed_precision`. Default: ``None``
            (every group computes in its own dtype).

    Returns:
        The :class:`FlatStorage` coordinator.

    Raises:
        TypeError: if ``module``, ``groups``, an item, ``align``,
            ``bucket_cap_mb`` or ``mixed_precision`` (a string, a bare dtype,
            a policy field) has a wrong type.
        ValueError: for a parameter or module that is not part
            of ``module``, a pattern that matches nothing, a parameter in two
            groups, a group mixing dtypes, devices or requires_grad, a bad
            group name, ``align < 1``, ``bucket_cap_mb <= 0`` (or not finite),
            or ``bucket_cap_mb`` with explicit ``groups``; a
            ``mixed_precision`` naming an unknown group or a non-floating dtype.
        RuntimeError: if ``module`` (or part of it) already has a flat storage;
            with ``exist_ok=True``, if ``module``'s flat storage has another
            layout than these arguments make. In every case ``module`` is
            left exactly as it was.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> storage = register_flat_storage(model, {"weights": ["*.weight"], "biases": ["*.bias"]})
        >>> [(name, p.numel()) for name, p in model.named_parameters()]
        [('flat_param_weights', 48), ('flat_param_biases', 10)]
        >>> model[0].weight.shape, len(model)
        (torch.Size([8, 4]), 3)
        >>> groups = {"weights": ["*.weight"], "biases": ["*.bias"]}
        >>> register_flat_storage(model, groups, exist_ok=True) is storage
        True
        >>> from torch.distributed.fsdp import MixedPrecisionPolicy
        >>> head = nn.Linear(4, 2)
        >>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        >>> head_storage = register_flat_storage(head, mixed_precision=policy)
        >>> head.weight.dtype, head_storage["0"].dtype  # compute copy, master
        (torch.bfloat16, torch.float32)
    """
    if isinstance(align, bool) or not isinstance(align, int):
        raise TypeError(f"align must be an int; got {type(align).__name__} {align!r}")
    if align < 1:
        raise ValueError(f"align must be >= 1; got {align}")
    if bucket_cap_mb is not None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
            raise TypeError(
                f"bucket_cap_mb must be a number of MiB or None; got {type(bucket_cap_mb).__name__} "
                f"{bucket_cap_mb!r}; pass e.g. bucket_cap_mb=25"
            )
        if not (math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0):
            raise ValueError(
                f"bucket_cap_mb must be a positive finite number of MiB; got {bucket_cap_mb!r}; "
                "pass e.g. bucket_cap_mb=25, or None for one group per dtype and device"
            )
        if groups is not None:
            raise ValueError(
                "bucket_cap_mb splits the automatic groups (groups=None) only; got explicit "
                f"groups of type {type(groups).__name__}; drop bucket_cap_mb and pass smaller "
                "groups yourself, or pass groups=None"
            )
    if not isinstance(exist_ok, bool):
        raise TypeError(f"exist_ok must be a bool; got {type(exist_ok).__name__} {exist_ok!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_flat_storage needs an nn.Module; got {type(module).__name__}")
    target, prefix = registration_target(module)
    existing = registered_storage(target) if exist_ok else None
    if existing is not None:
        check_same_layout(existing, module, prefix, groups, align, bucket_cap_mb)
        _check_same_policies(existing, mixed_precision)
        return facade_of(existing)
    specs = strip_prefix(resolve_groups(module, groups, target=target, prefix=prefix), prefix)
    if bucket_cap_mb is not None:
        specs = bucket_groups(target, specs, bucket_cap_mb)
    policies = None if mixed_precision is None else resolve_policies(mixed_precision, [s.name for s in specs])
    core = build_storage(target, specs, align)
    if policies is not None:
        try:
            core.add_feature(MixedPrecision(core, policies))
        except BaseException:
            remove_storage(core)
            raise
    registered(target)
    return facade_of(core)


def _check_same_policies(core: StorageCore, mixed_precision: MixedPrecisionArg) -> None:
    """Refuse ``exist_ok=True`` with another mixed-precision policy than the storage's."""
    feature = core.feature(MixedPrecision)
    have = feature.policies if feature is not None else dict.fromkeys(core.group_names)
    want = (
        dict.fromkeys(core.group_names)
        if mixed_precision is None
        else resolve_policies(mixed_precision, core.group_names)
    )
    if have != want:
        raise RuntimeError(
            "register_flat_storage(..., exist_ok=True): the module's flat storage has another "
            f"mixed_precision: {have}; got {want}; pass the policy it was registered with, or "
            "call remove_flat_storage(module) first"
        )


def registered_core(module: nn.Module) -> StorageCore | None:
    """Return the core of the storage registered on ``module`` (or on the model it wraps), or ``None``."""
    core: StorageCore | None = registered_storage(module)
    if core is None:
        core = registered_storage(registration_target(module)[0])
    return core


def get_flat_storage(module: nn.Module) -> FlatStorage | None:
    """Return the flat storage registered on ``module``, or ``None``.

    Args:
        module: the module registered with :func:`register_flat_storage`,
            or a wrapper that registration passes on to it (peft's
            ``PeftModel``, ``DistributedDataParallel``, a compiled module).

    Returns:
        The :class:`FlatStorage` of ``module``, or ``None`` if it has none.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.

    Example:
        >>> from torch import nn
        >>> layer = nn.Linear(2, 2)
        >>> get_flat_storage(layer) is None
        True
        >>> storage = register_flat_storage(layer)
        >>> get_flat_storage(layer) is storage
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"get_flat_storage needs an nn.Module; got {type(module).__name__}")
    core = registered_core(module)
    return None if core is None else facade_of(core)


def remove_flat_storage(module: nn.Module) -> None:
    """Undo :func:`register_flat_storage`: ordinary parameters holding the current values.

    Each original name is an ``nn.Parameter`` again (the same object as before
    registration, ties kept, gradients kept), every parametrization, hook and
    class the library added is gone, and ``state_dict()`` keys are those of
    the original module. Pending changes of unflattened mode are kept.

    Args:
        module: the module passed to :func:`register_flat_storage`.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
        ValueError: if ``module`` has no flat storage.
        RuntimeError: if unflattened-mode changes cannot be written back (a
            reassigned parameter of another shape); nothing is changed then.

    Example:
        >>> from torch import nn
        >>> layer = nn.Linear(2, 2)
        >>> weight = layer.weight
        >>> _ = register_flat_storage(layer)
        >>> remove_flat_storage(layer)
        >>> type(layer) is nn.Linear, layer.weight is weight
        (True, True)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"remove_flat_storage needs an nn.Module; got {type(module).__name__}")
    core = registered_core(module)
    if core is None:
        raise ValueError(
            f"{type(module).__name__} has no flat storage to remove; pass the module "
            "given to register_flat_storage"
        )
    remove_storage(core)
