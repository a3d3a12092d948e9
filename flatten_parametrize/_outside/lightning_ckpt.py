"""Lightning's single-file (``save_distributed_checkpoint=False``) checkpoints of flattened models.

Lightning's ``ModelParallelStrategy`` saves a full checkpoint through DCP (``get_model_state_dict``
and ``get_optimizer_state_dict`` with ``full_state_dict=True``, which ``_outside/dcp.py`` keys by
the plain model's names), then finds the model's parameters by walking the module itself:

* saving (``lightning.pytorch``, rank 0): ``FSDP.rekey_optim_state_dict(osd, PARAM_ID, model)``
  turns the parameter names into ids, the positions in ``model.parameters()``; loading turns ids
  back into names (``_rekey_optimizer_state_if_needed``). On a flattened model
  ``model.parameters()`` yields the flat parameters, so the plain names were unknown
  (``KeyError: 'model.0.weight'`` on rank 0 alone, the other ranks waiting);
* loading (``lightning.fabric.strategies.model_parallel._load_raw_module_state``): each
  ``named_parameters(recurse=False)`` name of each submodule is looked up in the checkpoint and
  broadcast from rank 0 with ``set_model_state_dict``: ``model.flat_param_0`` is not in a checkpoint
  written in the plain names.

:func:`patch_fsdp` and :func:`patch_lightning` wrap them (``flatten_parametrize/_outside/registry.py`` lists
them and runs these when their modules are imported, now or later): the re-keying of a
model with a flattened storage numbers the plain model's parameters in the plain model's
``named_parameters()`` order (so the file is the plain twin's, loadable in either form), and the
loader checks the plain names as Lightning checks them (its ``KeyError`` under ``strict``, on
every rank), lets Lightning load every other entry, and loads each storage's names with one
``set_model_state_dict(..., broadcast_from_rank0=True)``. Models without a flattened storage, and
re-keying with an explicit ``optim`` or ``optim_input``, take the original code.
"""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any, Callable

from torch import nn

from .._core.names import flat_param_name, registered_storage
from .._state.optim import plain_parameter_names
from .on_import import is_ours, wrapper_of

__all__ = ["patch_fsdp", "patch_lightning"]


def _storages(model: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    """Return ``(prefix, registered module, core)`` of every flattened storage in ``model``."""
    out = []
    for prefix, module in model.named_modules():
        core = registered_storage(module)
        if core is not None and core.is_flattened:
            out.append((prefix, module, core))
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _plain_names(model: nn.Module) -> list[str] | None:
    """Return the plain model's ``named_parameters()`` names of ``model`` (``None``: nothing flattened)."""
    storages = _storages(model)
    if not storages:
        return None
    out: list[str] = []
    done: set[int] = set()
    for name, _ in model.named_parameters():
        owner = next(((p, c) for p, _, c in storages if not p or name.startswith(p + ".")), None)
        if owner is None:
            out.append(name)
        elif id(owner[1]) not in done:  # the storage's subtree, in the plain model's order, at its first
            done.add(id(owner[1]))
            out += [_join(owner[0], n) for n in plain_parameter_names(owner[1])]
    return out


# ---------------------------------------------------------------- FSDP.rekey_optim_state_dict
def _rekey(original: Callable[..., Any]) -> Callable[..., Any]:
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: Any,
        model: nn.Module,
        optim_input: Any = None,
        optim: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> dict[str, Any]:
        explicit = optim_input is not None or optim is not None or args or kwargs
        names = None if explicit else _plain_names(model)
        if names is None:
            return original(
                optim_state_dict, optim_state_key_type, model, optim_input, optim, *args, **kwargs
            )
        from torch.distributed.fsdp import OptimStateKeyType

        keys = list(optim_state_dict["state"])
        by_name = all(type(k) is str for k in keys)
        by_id = all(type(k) is int for k in keys)
        if not (by_name or by_id):
            raise ValueError(f"Invalid parameter keys: {optim_state_dict['state'].keys()}")
        to_name = optim_state_key_type == OptimStateKeyType.PARAM_NAME
        if (to_name and by_name) or (not to_name and by_id):
            return optim_state_dict
        mapping: dict[Any, Any] = dict(enumerate(names)) if to_name else {n: i for i, n in enumerate(names)}
        unknown = [k for k in keys if k not in mapping]
        for group in optim_state_dict["param_groups"]:
            unknown += [k for k in group["params"] if k not in mapping and k not in unknown]
        if unknown:
            raise KeyError(
                f"rekey_optim_state_dict maps the plain model's parameters of a flattened model by "
                f"{'position' if to_name else 'name'}; {unknown[0]!r} is none of its {len(names)} "
                f"parameters ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}); re-key a state "
                "dict of this model's optimizer"
            )
        new: dict[str, Any] = {"state": {mapping[k]: v for k, v in optim_state_dict["state"].items()}}
        new["param_groups"] = copy.deepcopy(optim_state_dict["param_groups"])
        for group in new["param_groups"]:
            group["params"] = sorted(mapping[k] for k in group["params"])  # as torch does
        return new

    return wrapper_of(original, rekey_optim_state_dict)


def patch_fsdp(module: ModuleType) -> None:
    """Wrap ``FullyShardedDataParallel.rekey_optim_state_dict`` of FSDP's ``module``, once."""
    fsdp = getattr(module, "FullyShardedDataParallel", None)
    current = getattr(fsdp, "rekey_optim_state_dict", None)
    if fsdp is None or not callable(current) or is_ours(current):
        return
    fsdp.rekey_optim_state_dict = staticmethod(_rekey(current))


# ---------------------------------------------------------------- Lightning's full-checkpoint loader
def _load_raw(original: Callable[..., Any], lightning: ModuleType) -> Callable[..., Any]:
    def _load_raw_module_state(
        state_dict: dict[str, Any], module: nn.Module, world_size: int = 1, strict: bool = True
    ) -> None:
        storages = _storages(module) if isinstance(module, nn.Module) else []
        if not storages or not lightning._has_dtensor_modules(module):
            return original(state_dict, module, world_size=world_size, strict=strict)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        flat_names = {id(m): {flat_param_name(g.name) for g in c.groups()} for _, m, c in storages}
        expected: list[str] = []  # what Lightning looks up for the plain model, in its order
        for prefix, sub in module.named_modules():
            own = [n for n, _ in lightning._named_parameters_and_buffers_to_load(sub)]
            expected += [_join(prefix, n) for n in own if n not in flat_names.get(id(sub), ())]
            core = registered_storage(sub) if id(sub) in flat_names else None
            if core is not None:
                expected += [_join(prefix, n) for i in core.param_infos for n in (i.name, *i.aliases)]
        if strict:
            for name in expected:
                if name not in state_dict:  # every rank holds the file, so every rank raises here
                    raise KeyError(
                        f"The model contains a key '{name}' that does not exist in the loaded checkpoint."
                        " To disable strict loading, set `strict=False`."
                    )
        # everything but the flattened names: Lightning's own loop (a missing flat name is skipped)
        original(state_dict, module, world_size=world_size, strict=False)
        options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True, strict=False)
        for prefix, sub, core in storages:
            start = prefix + "." if prefix else ""
            names = [n for i in core.param_infos for n in (i.name, *i.aliases)]
            found = {n: state_dict[start + n] for n in names if start + n in state_dict}
            set_model_state_dict(sub, found, options=options)

    return wrapper_of(original, _load_raw_module_state)


def patch_lightning(module: ModuleType) -> None:
    """Wrap ``_load_raw_module_state`` of Lightning's ``model_parallel`` ``module``, once."""
    needed = ("_load_raw_module_state", "_has_dtensor_modules", "_named_parameters_and_buffers_to_load")
    if not all(callable(getattr(module, name, None)) for name in needed):
        return  # another Lightning: leave it as it is
    current = module._load_raw_module_state
    if not is_ours(current):
        module._load_raw_module_state = _load_raw(current, module)  # type: ignore[attr-defined]
