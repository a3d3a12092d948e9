"""One contiguous flat storage for the parameters of any ``nn.Module``, via parametrize.

Each flattened parameter becomes a ``torch.nn.utils.parametrize``
parametrization that returns a view of a shared flat ``nn.Parameter``; the
module tree, its classes (as ``isinstance`` sees them) and its attribute
names are unchanged.

Layout of the package (every sub-package is private; what users import is
re-exported here). Dependencies run one way, downwards in this list, and
``tests/guarantees/test_structure.py`` enforces it:

* the public entry points, beside this file: ``_api.py`` (register, get,
  remove), ``_storage.py`` (the ``FlatStorage`` facade users hold),
  ``_decay.py`` (``weight_decay_groups``), ``_flat_parameter.py`` (the stable
  pickle path), ``_demo.py``;
* ``_distributed/``: gradient sync and ``ShardedOptimizer`` with its
  checkpoints, and what lets ``torch.distributed.checkpoint`` and Lightning's
  checkpoints see a flattened storage as the plain model (wrappers that
  ``_outside/registry.py`` installs); ``_features/``: disk backing, ensembles and
  mixed precision;
  ``_inspect/``: summary, repr and plot. Each uses ``_core`` (and
  ``_distributed`` uses ``_state``), never ``_install`` or each other;
* ``_install/``: registration and the module surgery: the private coordinator
  core, the injected classes, flatten/unflatten, install/remove, pickling and
  deep copy, grouping, laying groups out again (model operations that change
  shapes or ties), the per-tensor mode's gradients (leaves whose ``.grad`` are
  views of the flat gradients), module swaps and weights that left the storage
  (laid out again on ``flatten()``) and the dead-space warning;
* ``_state/``: state dicts (both forms, atomic loads), state-dict aliases,
  optimizer-state conversion, ``attach_optimizer`` and optimizer state that
  follows a group laid out again;
* ``_core/``: what everything else stands on: names, layout, records and
  protocols (the coordinator's read API, the feature lifecycle, the
  flat-gradient hook), the view cache (the hot path), gradients, write landing,
  transactions, the optimizer step checks (weight decay, element-wise math,
  leaves of the other mode), the wrappers of timm's decay rule and torchao's
  module swaps, and what runs a wrapper when its outside module is imported.

``_outside/registry.py``, beside this file, lists every function of outside code that the
package wraps (DCP's, FSDP's and Lightning's wrappers live in ``_distributed/``)
and wraps them, called once below.
"""

from ._api import get_flat_storage, register_flat_storage, remove_flat_storage
from ._core.flat_parameter import FlatParameter
from ._decay import weight_decay_groups
from ._distributed.sharded import ShardedOptimizer
from ._outside.registry import wrap_outside_code as _wrap_outside_code
from ._state.attach_optim import OptimizerAttachment
from ._state.optim import flat_optim_state_dict, plain_optim_state_dict
from ._storage import FlatStorage, ParamInfo

__version__ = "0.1.0.dev0"

# The functions of DCP, FSDP, Lightning, timm and torchao that _outside/registry.py lists, each wrapped
# when its module is imported; FLATTEN_PARAMETRIZE_NO_PATCHES=1 leaves them all out (docs/outside-code.md).
_wrap_outside_code()

__all__ = [
    # entry points
    "register_flat_storage",
    "get_flat_storage",
    "remove_flat_storage",
    # groups for frameworks
    "weight_decay_groups",
    # optimizer state between the plain and the flattened model
    "flat_optim_state_dict",
    "plain_optim_state_dict",
    "OptimizerAttachment",
    # ZeRO-1/2 over the flat buffers
    "ShardedOptimizer",
    # types
    "FlatStorage",
    "FlatParameter",
    "ParamInfo",
]
