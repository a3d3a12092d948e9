"""The contenders every workload compares, besides the plain model and ``register_flat_storage``.

- fairscale's ``FlattenParamsWrapper`` (optional: ``pip install --no-deps fairscale``);
- ``parameters_to_vector`` / ``vector_to_parameters``: a flat copy of the
  parameters kept next to the model, gathered and scattered around each step;
- a naive parametrization that slices the flat parameter separately at each
  access (the quadratic trap of the engineering facts in the spec);
- the identity parametrization: the floor of any parametrize-based design;
- another version of the library (an exported copy of its package), for A/B runs in one process.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector, parametrize, vector_to_parameters

__all__ = [
    "FAIRSCALE",
    "Identity",
    "NaiveSlice",
    "VectorCopy",
    "fairscale_wrap",
    "import_base",
    "register_identity",
    "register_naive_slices",
    "zero_grad",
]


def _import_fairscale() -> tuple[Any, str]:
    try:
        from fairscale.nn.misc import FlattenParamsWrapper
    except ImportError:
        return None, "not installed"
    except Exception as error:  # an old fairscale against a new torch, say
        return None, f"import failed ({type(error).__name__})"
    return FlattenParamsWrapper, ""


_FPW, FAIRSCALE_MISSING = _import_fairscale()
#: Row label of fairscale's wrapper in every table.
FAIRSCALE = "fairscale FPW"


def fairscale_wrap(module: nn.Module) -> nn.Module | None:
    """Return ``FlattenParamsWrapper(module)``, or ``None`` when fairscale is unavailable."""
    return None if _FPW is None else _FPW(module)


def zero_grad(params: Iterable[Tensor]) -> None:
    """Set every ``.grad`` to ``None`` (what ``optimizer.zero_grad()`` does by default)."""
    for p in params:
        p.grad = None


class NaiveSlice(nn.Module):
    """Serve one attribute as ``flat[offset:offset + numel].view(shape)``, sliced at every access.

    Each access makes a new slice of the whole flat parameter, so backward
    accumulates one full-size gradient per attribute: O(parameters x numel).
    """

    def __init__(self, root: nn.Module, offset: int, shape: torch.Size) -> None:
        super().__init__()
        self.__dict__["_root"] = root  # not a submodule: no cycle in the module tree
        self.offset = offset
        self.numel = shape.numel()
        self.shape = shape

    def forward(self) -> Tensor:
        flat: Tensor = self.__dict__["_root"].naive_flat
        return flat[self.offset : self.offset + self.numel].view(self.shape)

    def right_inverse(self, value: Tensor) -> tuple[()]:
        return ()


def register_naive_slices(root: nn.Module) -> nn.Parameter:
    """Flatten ``root``'s parameters the naive way; return the flat parameter (``root.naive_flat``)."""
    named = list(root.named_parameters())
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for _, p in named]))
    offset = 0
    modules = dict(root.named_modules())
    for name, p in named:
        owner_name, _, attr = name.rpartition(".")
        owner = modules[owner_name]
        parametrize.register_parametrization(owner, attr, NaiveSlice(root, offset, p.shape), unsafe=True)
        offset += p.numel()
    root.register_parameter("naive_flat", flat)
    return flat


class Identity(nn.Module):
    """The trivial parametrization: ``weight`` is returned as is."""

    def forward(self, x: Tensor) -> Tensor:
        return x


def register_identity(module: nn.Module, name: str = "weight") -> None:
    """Register :class:`Identity` on ``module.<name>``."""
    parametrize.register_parametrization(module, name, Identity())


class VectorCopy:
    """A flat copy of a plain model's parameters, stepped by an optimizer of its own.

    Around each optimizer step the gradients are gathered with
    ``parameters_to_vector`` and the stepped values scattered back with
    ``vector_to_parameters`` (which makes the parameters views of the vector).
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = list(params)
        self.flat = nn.Parameter(parameters_to_vector(self.params).detach())
        vector_to_parameters(self.flat.detach(), self.params)

    def gather_grads(self) -> None:
        """Copy the parameters' gradients into ``flat.grad``."""
        self.flat.grad = parameters_to_vector([p.grad for p in self.params])  # type: ignore[misc]

    def scatter(self) -> None:
        """Point the parameters at the stepped vector again."""
        vector_to_parameters(self.flat.detach(), self.params)


def import_base(folder: Path) -> ModuleType:
    """Import ``folder/flatten_parametrize`` (another version) as ``flatten_parametrize_base``.

    The package's own imports are relative, so a copy under another name is a second library in the
    same process (e.g. ``git archive <commit> flatten_parametrize | tar -x -C folder``).
    """
    target = Path(tempfile.mkdtemp()) / "flatten_parametrize_base"
    shutil.copytree(folder / "flatten_parametrize", target)
    sys.path.insert(0, str(target.parent))
    return importlib.import_module("flatten_parametrize_base")
