"""One contiguous flat storage for the parameters of any ``nn.Module``, via parametrize.

Each flattened parameter becomes a ``torch.nn.utils.parametrize``
parametrization that returns a view of a shared flat ``nn.Parameter``; the
module tree, its classes (as ``isinstance`` sees them) and its attribute
names are unchanged.
"""

from ._api import get_flat_storage, register_flat_storage, remove_flat_storage
from ._attach_optim import OptimizerAttachment
from ._decay import weight_decay_groups
from ._flat_parameter import FlatParameter
from ._optim import flat_optim_state_dict, plain_optim_state_dict
from ._sharded import ShardedOptimizer
from ._storage import FlatStorage, ParamInfo

__version__ = "0.1.0.dev0"

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
