"""Every function of outside code that importing the package wraps, and the one call that wraps them.

:data:`OUTSIDE` is the whole list (``docs/outside-code.md`` shows it, one section per entry, and
``tests/interop/test_outside_code.py`` keeps the two equal): for each feature, the functions it wraps,
why, what changes for a model that holds a flattened storage, what stays the original's, and
the explicit way to get the feature when the wrappers are left out. Without a flattened storage
every wrapper calls the original with the same arguments and returns its result.

:func:`wrap_outside_code` is called once, from the package's ``__init__.py``. It wraps each
module now if it is imported, else right after its first import (``_outside/on_import.py``: a
``sys.meta_path`` finder that leaves once nothing is awaited), so importing the package imports
none of them. With the environment variable ``FLATTEN_PARAMETRIZE_NO_PATCHES`` set to anything
but ``""`` or ``"0"`` when the package is imported, it wraps nothing and installs no finder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from . import dcp, lightning_ckpt, module_swaps, timm_decay, torch_renames, torchao_swaps
from .on_import import when_imported
from .plain_calls import Methods

__all__ = ["OUTSIDE", "SWITCH", "OutsideWrapper", "switched_off", "wrap_outside_code"]

#: The environment variable that leaves every wrapper of :data:`OUTSIDE` out (read at import).
SWITCH = "FLATTEN_PARAMETRIZE_NO_PATCHES"


@dataclass(frozen=True)
class OutsideWrapper:
    """The functions of outside code that one feature of the library wraps."""

    #: What the wrappers give (the heading of its section in ``docs/outside-code.md``).
    feature: str
    #: ``(module, function)`` of each function wrapped (a method as ``Class.method``).
    functions: tuple[tuple[str, str], ...]
    #: Wraps what this feature wraps in one of those modules, once (calling it again changes nothing).
    patch: Callable[[ModuleType], None]
    #: Why the original does not serve a flattened model.
    why: str
    #: What changes for a model (or optimizer) that holds a flattened storage.
    changes: str
    #: What stays the original's besides models without a flattened storage.
    unchanged: str
    #: With :data:`SWITCH` set: the explicit way to the feature, or the limitation.
    left_out: str
    #: Wrapped only where ``torch.distributed`` is available.
    distributed: bool = False

    @property
    def modules(self) -> tuple[str, ...]:
        """The outside modules, each once, in order."""
        return tuple(dict.fromkeys(module for module, _ in self.functions))


_DCP = "torch.distributed.checkpoint.state_dict"
_LIGHTNING = "strategies.model_parallel"
_TORCHAO_QAT = "torchao.quantization.qat.linear"
_QUANTIZERS = (
    "Int8DynActInt4WeightQATQuantizer",
    "Int4WeightOnlyQATQuantizer",
    "Float8ActInt4WeightQATQuantizer",
)

#: What stays the original's, and the explicit way, for the wrappers that run a call on the plain model.
_PLAIN_MODEL_UNCHANGED = "a model in per-tensor mode; a call nested in a wrapped one"
_PLAIN_MODEL_LEFT_OUT = "call them inside `with storage.unflattened():` yourself"


def _listed(methods: Methods) -> tuple[tuple[str, str], ...]:
    """Return ``(module, function)`` of each entry of a table of functions run on the plain model."""
    return tuple(
        (module, f"{cls}.{method}" if cls else method)
        for module, entries in methods.items()
        for cls, method, _ in entries
    )


#: Every function of outside code that the package wraps.
OUTSIDE: tuple[OutsideWrapper, ...] = (
    OutsideWrapper(
        feature="DCP state dicts in the plain model's names",
        functions=tuple((_DCP, name) for name in dcp.WRAPPED),
        patch=dcp.patch,
        why=(
            "`get_state_dict` / `set_state_dict` (and their model and optimizer halves) walk "
            "`named_parameters()`, which yields the flat parameters"
        ),
        changes=(
            "the model state is listed under the plain names; optimizer state of a flat parameter is split "
            "into its members' (`state.<plain name>.exp_avg`, plain shapes) and joined back on load; a "
            "`ShardedOptimizer` initializes its own state; a flattened name maps without reading its view"
        ),
        unchanged="every option (`strict`, `full_state_dict`, resharding, `flatten_optimizer_state_dict`)",
        left_out=(
            "DCP sees the flat parameters (`flat_param_0`): save `model.state_dict()` (the plain names) and "
            "`plain_optim_state_dict(storage, optimizer.state_dict())` with `dcp.save` (an attached "
            "optimizer's `state_dict()` has that form already; a `ShardedOptimizer`'s gathers its state, on "
            "every rank); that path was not tested under FSDP2"
        ),
        distributed=True,
    ),
    OutsideWrapper(
        feature="FSDP's optimizer re-keying (Lightning's single-file checkpoint)",
        functions=(
            (
                "torch.distributed.fsdp.fully_sharded_data_parallel",
                "FullyShardedDataParallel.rekey_optim_state_dict",
            ),
        ),
        patch=lightning_ckpt.patch_fsdp,
        why="it numbers optimizer state by the positions of `model.parameters()`, the flat parameters",
        changes=(
            "the plain model's parameters are numbered and named in the plain model's order, by the "
            "wrapper alone (the function it wraps is not called)"
        ),
        unchanged="a call with `optim` or `optim_input`",
        left_out="no explicit call: re-keying a flattened model numbers its flat parameters",
        distributed=True,
    ),
    OutsideWrapper(
        feature="Lightning's single-file checkpoint loader",
        functions=(
            (f"lightning.fabric.{_LIGHTNING}", "_load_raw_module_state"),
            (f"lightning_fabric.{_LIGHTNING}", "_load_raw_module_state"),
        ),
        patch=lightning_ckpt.patch_lightning,
        why="it looks up each `named_parameters()` name (`flat_param_0`) in a file of the plain names",
        changes=(
            "the plain names are checked as Lightning checks them (its `KeyError` under `strict`) and each "
            "storage loads them with one `set_model_state_dict(..., broadcast_from_rank0=True)`"
        ),
        unchanged="every other entry of the file, loaded by Lightning's own loop; models without DTensors",
        left_out=(
            "no explicit call: `ModelParallelStrategy(save_distributed_checkpoint=False)` cannot resume a "
            "flattened model"
        ),
        distributed=True,
    ),
    OutsideWrapper(
        feature="A warning for timm's weight-decay rule by `ndim`",
        functions=(("timm.optim._param_groups", "param_groups_weight_decay"),),
        patch=timm_decay.patch,
        why=(
            "on a flattened model every flat parameter is one-dimensional, so the rule decays none of the "
            "matrices, and the optimizer it builds keeps no trace of the decay asked for"
        ),
        changes=(
            "a `UserWarning` with the fix when `weight_decay > 0` leaves matrices of a flat parameter "
            "undecayed; the groups returned are the original's"
        ),
        unchanged="the groups, in every case",
        left_out="no warning: build the groups with `weight_decay_groups` (the fix the warning gives)",
    ),
    OutsideWrapper(
        feature="torchao's module swaps on the plain model",
        functions=(
            ("torchao.quantization.quant_api", "_replace_with_custom_fn_if_matches_filter"),
            ("torchao.float8.float8_linear_utils", "swap_linear_layers"),
            *((_TORCHAO_QAT, f"{cls}.{method}") for cls in _QUANTIZERS for method in ("prepare", "convert")),
        ),
        patch=torchao_swaps.patch,
        why=(
            "`quantize_`, the legacy QAT quantizers and `convert_to_float8_training` assign "
            "`new.weight = old.weight`, which torch refuses for a view of a flat buffer"
        ),
        changes=(
            "on a model in flat mode the call runs inside `storage.unflattened()`: a re-hosted parameter "
            "keeps its slot, a quantized weight leaves the storage with a warning"
        ),
        unchanged=_PLAIN_MODEL_UNCHANGED,
        left_out=_PLAIN_MODEL_LEFT_OUT,
    ),
    OutsideWrapper(
        feature="torch's weight_norm, spectral_norm, pruning and parametrizations on the plain model",
        functions=_listed(torch_renames.METHODS),
        patch=torch_renames.patch,
        why=(
            "`torch.nn.utils.weight_norm`, `spectral_norm`, the pruning functions of `torch.nn.utils.prune`, "
            "`parametrize.register_parametrization` (behind `torch.nn.utils.parametrizations`) and their "
            "`remove` counterparts take the weight out of `module._parameters` (or register it under another "
            "name), which in flat mode holds no flattened weight: torch fails with `KeyError: 'weight'` or "
            "`cannot assign 'torch.FloatTensor' object to parameter 'weight_orig'`, and "
            "`remove_parametrizations` of a parametrization registered before the storage put the weight "
            "back as a buffer (it silently stopped training)"
        ),
        changes=(
            "on a model in flat mode the call runs inside `storage.unflattened()`: a parameter under a new "
            "name (`weight_orig`, `parametrizations.weight.original`) keeps its slot, a weight taken off "
            "leaves its slot, and new parameters (`weight_g`, `weight_v`, `original0`, the weight `remove` "
            "puts back) are ordinary parameters of their module"
        ),
        unchanged=_PLAIN_MODEL_UNCHANGED,
        left_out=_PLAIN_MODEL_LEFT_OUT,
    ),
    OutsideWrapper(
        feature="SyncBatchNorm conversion, module fusion and eager quantization on the plain model",
        functions=_listed(module_swaps.METHODS),
        patch=module_swaps.patch,
        why=(
            "`torch.nn.SyncBatchNorm.convert_sync_batchnorm` (Lightning's `sync_batchnorm=True`) and "
            "Lightning's `TorchSyncBatchNorm.revert` assign `new.weight = old.weight`, which torch refuses "
            "for a view of a flat buffer (`cannot assign 'torch.FloatTensor' as parameter 'weight'`); "
            "`torch.ao.quantization.fuse_modules` looks its fuser up by exact module class and fails with "
            "`NotImplementedError: Cannot fuse eval modules` on the parametrized classes of flat mode, and "
            "`torch.ao.quantization`'s `convert` (behind `quantize_dynamic`, `prepare_qat`, `quantize`) "
            "with an `AssertionError` naming the parametrized class"
        ),
        changes=(
            "on a model in flat mode the call runs inside `storage.unflattened()`: a parameter that a new "
            "module re-hosts (a `SyncBatchNorm`, a QAT module) keeps its slot, the weights a fusion folds "
            "away or a quantized module packs leave their slots, and new parameters are ordinary "
            "parameters of their module"
        ),
        unchanged=_PLAIN_MODEL_UNCHANGED,
        left_out=_PLAIN_MODEL_LEFT_OUT,
    ),
)


def switched_off() -> bool:
    """Return whether :data:`SWITCH` is set (to anything but ``""`` or ``"0"``)."""
    return os.environ.get(SWITCH, "") not in ("", "0")


def wrap_outside_code() -> None:
    """Wrap every function of :data:`OUTSIDE`, each module now or at its import; nothing if switched off."""
    if switched_off():
        return
    for wrapper in OUTSIDE:
        if wrapper.distributed and not torch.distributed.is_available():
            continue
        for module in wrapper.modules:
            when_imported(module, wrapper.patch)
