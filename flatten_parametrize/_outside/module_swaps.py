"""torch's and Lightning's module conversions and torch.ao's eager quantization run as on the plain model.

``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` (which Lightning's
``Trainer(sync_batchnorm=True)`` calls when fitting starts) builds a
``SyncBatchNorm`` for each batch norm and moves the parameter over with
``new.weight = old.weight``; Lightning's ``TorchSyncBatchNorm.revert`` (called
at teardown) moves it back into a plain batch norm the same way. In flat mode
``old.weight`` is a view of the flat buffer, and torch refuses it with
``cannot assign 'torch.FloatTensor' as parameter 'weight'``.
``torch.ao.quantization.fuse_modules`` and ``convert`` (behind
``quantize_dynamic``, ``prepare_qat`` and ``quantize``) look their fuser or
quantized class up by exact module class, which the parametrized modules of
flat mode are not: torch fails with ``NotImplementedError: Cannot fuse eval
modules`` or an ``AssertionError`` naming the class. So each of them, called
on a module that holds a flattened storage in flat mode, runs on the plain
model (``plain_calls.py``); when the block ends the groups are laid out as the
model now is: a parameter re-hosted by a new module (a ``SyncBatchNorm``, a QAT
module) keeps its slot (a change of owner, no dead space), the weights a
fusion folds away or a quantized module packs leave their slots, and new
parameters are ordinary parameters of their module, as a new module's are. In
per-tensor mode the modules are plain already: the calls run as is.

What is wrapped is the function each of those entry points calls on the model:
the classmethod and ``convert``'s worker (both recurse into the children: a
nested call runs as is), Lightning's method, and ``fuse_modules``' helper,
which fuses one list of modules. The helper and ``convert``'s worker run on
the model after the entry point copied it for ``inplace=False``: the copy is
made in flat mode, as the plain model would be copied, and changed on its own
plain model.
"""

from __future__ import annotations

from types import ModuleType

from .plain_calls import Methods, wrap_methods

__all__ = ["METHODS", "patch"]

_LAYER_SYNC = ("TorchSyncBatchNorm", "revert", "Lightning's TorchSyncBatchNorm.revert (sync_batchnorm=True)")

#: module -> (class or ``""`` for the module, function, how the user reaches it) of each function wrapped.
METHODS: Methods = {
    "torch.nn.modules.batchnorm": (
        ("SyncBatchNorm", "convert_sync_batchnorm", "torch.nn.SyncBatchNorm.convert_sync_batchnorm"),
    ),
    "torch.ao.quantization.fuse_modules": (
        ("", "_fuse_modules_helper", "torch.ao.quantization.fuse_modules"),
    ),
    "torch.ao.quantization.quantize": (
        ("", "_convert", "torch.ao.quantization's convert (quantize_dynamic, prepare_qat, quantize)"),
    ),
    "lightning.pytorch.plugins.layer_sync": (_LAYER_SYNC,),
    "pytorch_lightning.plugins.layer_sync": (_LAYER_SYNC,),
}


def patch(module: ModuleType) -> None:
    """Wrap the functions of :data:`METHODS` in ``module``, once."""
    wrap_methods(module, METHODS)
