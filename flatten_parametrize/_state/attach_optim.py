"""An optimizer of the flattened model that saves and loads the plain model's per-parameter format.

:func:`attach_optimizer` registers two hooks on a ``torch.optim.Optimizer``:
``state_dict()`` converts its state with :func:`plain_optim_state_dict`, and
``load_state_dict()`` accepts the flat format as it is and converts the plain
one with :func:`flat_optim_state_dict`. So a training checkpoint (Trainer,
Lightning, Fabric, accelerate) moves freely between plain and flattened runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .optim import flat_optim_state_dict, plain_optim_state_dict

if TYPE_CHECKING:
    from .._core.records import PublicStorage

__all__ = ["OptimizerAttachment", "attach_optimizer", "attachment_of", "own_format"]

#: Attribute on an attached optimizer: its attachment.
_ATTACHED = "_flat_storage_attachment"


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """Return the torch optimizer inside framework wrappers (accelerate, Lightning, Fabric)."""
    seen = 0
    while not type(optimizer).__module__.startswith("torch.optim") and seen < 8:
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer, seen = inner, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"attach_optimizer needs a torch.optim.Optimizer; got {type(optimizer).__name__}; pass the "
            "optimizer built over the flattened module's parameters"
        )
    return optimizer


class OptimizerAttachment:
    """The link between an optimizer and a flat storage made by :meth:`FlatStorage.attach_optimizer`.

    ``remove()`` detaches it: the optimizer saves and loads its own flat format again.
    """

    def __init__(self, storage: PublicStorage, optimizer: torch.optim.Optimizer) -> None:
        self.storage = storage
        self.optimizer = optimizer
        self._handles = [
            optimizer.register_state_dict_post_hook(self._to_plain),
            optimizer.register_load_state_dict_pre_hook(self._from_either),
        ]
        #: Depth of :func:`own_format` blocks: ``state_dict()`` gives the flat format inside.
        self._own_format_depth = 0
        setattr(optimizer, _ATTACHED, self)

    def remove(self) -> None:
        """Detach: remove both hooks; the optimizer saves and loads its own flat format again.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(2, 2)
            >>> storage = register_flat_storage(model)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> attachment = storage.attach_optimizer(optimizer)
            >>> attachment.remove()
            >>> optimizer.state_dict()["param_groups"][0]["params"]  # one flat parameter
            [0]
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if getattr(self.optimizer, _ATTACHED, None) is self:
            delattr(self.optimizer, _ATTACHED)

    def _plain_names(self, flat_names: list[list[str]]) -> list[list[str]]:
        """The plain model's parameter names of each param group, in the order ``state_dict()`` gives."""
        groups, start = [], 0
        for names in flat_names:
            groups.append({"params": list(range(start, start + len(names))), "param_names": names})
            start += len(names)
        converted = plain_optim_state_dict(self.storage, {"state": {}, "param_groups": groups})
        return [list(group["param_names"]) for group in converted["param_groups"]]

    # ------------------------------------------------------------------ hooks
    def _to_plain(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._own_format_depth:
            return state_dict
        flat_names = _flat_names(self.storage, optimizer)
        plain = plain_optim_state_dict(
            self.storage, state_dict, param_names=[n for names in flat_names for n in names]
        )
        groups = state_dict["param_groups"]
        if groups and all("param_names" in group for group in groups):  # keep the optimizer's own prefix
            prefix = _prefix(groups[0]["param_names"], flat_names[0])
            for group, names in zip(plain["param_groups"], self._plain_names(flat_names)):
                group["param_names"] = [prefix + n for n in names]
        return plain

    def _from_either(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        if (
            not isinstance(state_dict, Mapping)
            or "param_groups" not in state_dict
            or "state" not in state_dict
        ):
            return state_dict  # torch's own checks report it
        if _is_format_of(optimizer, state_dict):
            return state_dict
        flat_names = _flat_names(self.storage, optimizer)
        expected = self._plain_names(flat_names)
        groups = list(state_dict["param_groups"])
        sizes = [len(group["params"]) for group in groups]
        if sizes != [len(names) for names in expected]:
            raise ValueError(
                "load_state_dict of an optimizer attached to a flat storage accepts its own (flat) state "
                "dict or the plain model's; this one has param groups of "
                f"{sizes} parameters, the optimizer {[len(p['params']) for p in optimizer.param_groups]} "
                f"flat and {[len(names) for names in expected]} plain ones; pass a state dict of an "
                "optimizer built the same way over the plain or the flattened model"
            )
        named = []
        for group, names in zip(groups, expected):
            given = group.get("param_names")
            if given is not None:
                prefix = _prefix(given, names)
                names = [n[len(prefix) :] if n.startswith(prefix) else n for n in given]
            named.append({**group, "param_names": names})
        flat = flat_optim_state_dict(self.storage, {"state": state_dict["state"], "param_groups": named})
        return _reorder(flat, optimizer, flat_names)


def _flat_names(storage: PublicStorage, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Name (relative to the flattened module) of each optimizer parameter, per param group."""
    names = {id(p): n for n, p in storage.module.named_parameters()}
    out = []
    for i, group in enumerate(optimizer.param_groups):
        found = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise ValueError(
                    "attach_optimizer: the optimizer must hold parameters of the flattened module only; "
                    f"param group {i} holds a {type(param).__name__} of shape {tuple(param.shape)} that "
                    f"{type(storage.module).__name__}.named_parameters() does not yield; build the "
                    "optimizer from the flattened module's parameters"
                )
            found.append(name)
        out.append(found)
    return out


def _prefix(given: list[str], ours: list[str]) -> str:
    """The path that ``given`` names carry in front of ``ours`` (e.g. ``"model."`` in a LightningModule)."""
    for name in given:
        for own in ours:
            if name.endswith("." + own):
                return name[: -len(own)]
            if name == own:
                return ""
    return ""


def _is_format_of(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` has the optimizer's own layout: group sizes, state of its parameters' shapes."""
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        return False
    params: dict[Any, Tensor] = {}
    for saved, group in zip(groups, optimizer.param_groups):
        if len(saved["params"]) != len(group["params"]):
            return False
        params.update(zip(saved["params"], group["params"]))
    for pid, entry in state_dict["state"].items():
        param = params.get(pid)
        for value in entry.values() if isinstance(entry, Mapping) else ():
            if (
                isinstance(value, Tensor)
                and value.dim() > 0
                and (param is None or value.shape != param.shape)
            ):
                return False
    return True


def _reorder(
    flat: dict[str, Any], optimizer: torch.optim.Optimizer, flat_names: list[list[str]]
) -> dict[str, Any]:
    """Put each converted param group in the optimizer's parameter order, with its names or none."""
    state: dict[int, Any] = {}
    out_groups = []
    pid = 0
    for group, own, names in zip(flat["param_groups"], optimizer.param_groups, flat_names):
        position = {name: i for i, name in enumerate(group["param_names"])}
        new = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        new["params"] = []
        for name in names:
            old = group["params"][position[name]]
            if old in flat["state"]:
                state[pid] = flat["state"][old]
            new["params"].append(pid)
            pid += 1
        if "param_names" in own:
            new["param_names"] = list(own["param_names"])
        out_groups.append(new)
    return {"state": state, "param_groups": out_groups}


def attachment_of(optimizer: Any) -> OptimizerAttachment | None:
    """Return the attachment of ``optimizer`` (a torch optimizer), or ``None`` if it is not attached."""
    found = getattr(optimizer, _ATTACHED, None)
    return found if isinstance(found, OptimizerAttachment) else None


@contextmanager
def own_format(optimizer: Any) -> Iterator[None]:
    """Inside the block, ``optimizer.state_dict()`` gives its own (flat) format even if it is attached.

    For code that converts names itself (``_outside/dcp.py``); a no-op for an
    optimizer that is not attached.
    """
    attachment = attachment_of(optimizer)
    if attachment is None:
        yield
        return
    attachment._own_format_depth += 1
    try:
        yield
    finally:
        attachment._own_format_depth -= 1


def attach_optimizer(storage: PublicStorage, optimizer: Any) -> OptimizerAttachment:
    """Attach ``optimizer`` to ``storage``: see :meth:`FlatStorage.attach_optimizer`."""
    inner = _unwrap(optimizer)
    existing = getattr(inner, _ATTACHED, None)
    if existing is not None:
        if existing.storage is storage:
            return existing
        raise RuntimeError(
            "attach_optimizer: this optimizer is already attached to another flat storage; call remove() "
            "on the attachment that the first attach_optimizer returned"
        )
    _flat_names(storage, inner)  # refuse foreign parameters now, not at the first save
    return OptimizerAttachment(storage, inner)
