"""``FlatStorage``: the object users hold, a facade over the private coordinator core.

Its public names are exactly the user API of the product contract (the
"Public surface" list, checked by ``tests/guarantees/test_structure.py``); each
delegates to the :class:`~._install.coordinator.StorageCore` behind it, or to
a feature composed on that core (gradient sync, disk backing, ensembles),
which the facade creates on first use. The library itself never calls the
facade: the injected classes, the view cache, surgery and features see the
core. :func:`facade_of` gives the one facade of a core.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from torch import Tensor, nn

from ._core.features import Feature
from ._core.flat_parameter import FlatParameter
from ._core.records import ParamInfo
from ._distributed.grad_sync import GradSync
from ._features.functional import Functional, StackedTensors
from ._features.mixed_precision.feature import MixedPrecision
from ._features.offload import DiskOffload
from ._guards.left_out import say_left_out
from ._inspect.plot import plot_layout
from ._inspect.summary import storage_html, storage_repr, summary_table
from ._install.coordinator import FlatTensors, StorageCore
from ._install.leaf_writes import settle
from ._state.attach_optim import OptimizerAttachment, attach_optimizer

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["FlatStorage", "FlatTensors", "ParamInfo", "facade_of"]

F = TypeVar("F", bound=Feature)


class FlatStorage:
    """The coordinator of a module's flat parameters, returned by ``register_flat_storage``.

    It owns one :class:`FlatParameter` per group (registered on the module as
    ``flat_param_<group>``), serves every flattened attribute as a view of it,
    and switches between flat and unflattened mode. It holds the module weakly.
    Get it with ``register_flat_storage`` or ``get_flat_storage``; it is not
    constructed directly.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from flatten_parametrize import register_flat_storage
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> storage = register_flat_storage(model)
        >>> storage.group_names, storage["0"].numel()
        (['0'], 26)
        >>> [name for name, _ in model.named_parameters()]
        ['flat_param_0']
    """

    __slots__ = ("__weakref__", "_held")
    _held: StorageCore

    @property
    def _core(self) -> StorageCore:
        # In per-tensor mode outside code writes to plain modules: each call that works on the buffers or
        # shows the layout lands what it changed first (``_install/leaf_writes.py``), which may lay the
        # groups out again (a new core). The module, group names and mode read ``_held``.
        # A removed storage (detached) raises here: its buffers are gone (``release_buffers``).
        core = self._held
        if core.is_flattened:
            return core
        core = settle(core)  # a no-op for a detached core
        _ = core.module  # raises for a detached storage, also one the change removed (nothing was left)
        return core

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "FlatStorage is not constructed directly; call register_flat_storage(module) "
            "(or get_flat_storage(module) for the storage already registered)"
        )

    def _feature(self, kind: type[F], *, settle_first: bool = True) -> F:
        """Return the feature of type ``kind`` on the core, composing a new one on first use."""
        core = self._core if settle_first else self._held
        feature = core.feature(kind)
        if feature is None:
            feature = kind(core)  # type: ignore[call-arg]
            core.add_feature(feature)
        return feature

    def __getstate__(self) -> None:
        # Refused as the core refuses it: the registered module pickles itself (``_install/pickling.py``).
        self._held.__getstate__()

    def _shown(self) -> StorageCore:
        """Return the core that inspection shows: the layout as the model now is where it can be had.

        A removed storage, or a change that a holder of the layout refuses, shows what the storage holds.
        """
        try:
            return self._core
        except RuntimeError:  # removed, or a holder refuses the new layout: what the storage holds
            return self._held

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatStorage:
        # The storage of the copied module: copying the module copies its core (``_install/copying.py``).
        copy.deepcopy(self._held.module_unchecked, memo)
        return facade_of(memo[id(self._held)])

    @property
    def module(self) -> nn.Module:
        """Return the registered module.

        Raises:
            RuntimeError: if the module was garbage collected or the storage removed.
        """
        return self._held.module

    @property
    def flat_params(self) -> list[FlatParameter]:
        """Return the flat parameters, one per group, in group order."""
        core = self._core
        say_left_out(core, "storage.flat_params")
        return core.flat_params

    @property
    def group_names(self) -> list[str]:
        """Return the group names, in group order."""
        return self._held.group_names

    def __getitem__(self, group: str) -> FlatParameter:
        """Return the flat parameter of ``group``.

        Raises:
            TypeError: if ``group`` is not a str.
            KeyError: if there is no such group.
        """
        return self._core.flat_of(group)

    def __len__(self) -> int:
        return len(self._held.groups())

    @property
    def param_infos(self) -> list[ParamInfo]:
        """Return one :class:`ParamInfo` per flattened slot, in group and buffer order."""
        return self._shown().param_infos

    @property
    def is_flattened(self) -> bool:
        """Return whether the module is in flat mode (attributes are views)."""
        return self._held.is_flattened

    @property
    def mixed_precision(self) -> dict[str, MixedPrecisionPolicy | None]:
        """Return the mixed-precision policy of every group, by group name (``None``: its own dtype).

        Set by ``register_flat_storage(..., mixed_precision=...)``; a storage
        registered without one has ``None`` for every group.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from torch.distributed.fsdp import MixedPrecisionPolicy
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
            >>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            >>> storage = register_flat_storage(
            ...     model, {"linear": [model[0]], "norm": [model[1]]}, mixed_precision={"linear": policy}
            ... )
            >>> {name: p and p.param_dtype for name, p in storage.mixed_precision.items()}
            {'linear': torch.bfloat16, 'norm': None}
            >>> model[0].weight.dtype, storage["linear"].dtype
            (torch.bfloat16, torch.float32)
        """
        feature = self._held.feature(MixedPrecision)
        if feature is None:
            return dict.fromkeys(self._held.group_names)
        return dict(feature.policies)

    def named_views(self, remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(name, tensor)`` for every flattened parameter, as the module serves it.

        In flat mode the tensors are views of the flat storage currently in use
        (the flat parameters, or the tensors given to :meth:`using`); in
        unflattened mode they are the leaf parameters.

        Args:
            remove_duplicate: yield a tied parameter once, under its first
                name (as ``named_parameters`` does). Default: ``True``.

        Returns:
            An iterator of ``(name, tensor)`` pairs, in ``param_infos`` order.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 3)
            >>> storage = register_flat_storage(layer)
            >>> [(name, tuple(view.shape)) for name, view in storage.named_views()]
            [('weight', (3, 2)), ('bias', (3,))]
        """
        core = self._core
        say_left_out(core, "storage.named_views()")
        return core.named_views(remove_duplicate)

    def named_grads(self, remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor | None]]:
        """Yield ``(name, gradient)`` for every flattened parameter.

        In flat mode each gradient is a view of its flat parameter's ``.grad``
        (``None`` while that is ``None``); in unflattened mode it is the leaf
        parameter's ``.grad``.

        Args:
            remove_duplicate: yield a tied parameter's gradient once, under its
                first name (as ``named_parameters`` does); ``False`` yields it
                under every name. Default: ``True``.

        Returns:
            An iterator of ``(name, gradient or None)`` pairs, in
            ``param_infos`` order.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 1)
            >>> storage = register_flat_storage(layer)
            >>> layer(torch.ones(1, 2)).sum().backward()
            >>> dict(storage.named_grads())["bias"]
            tensor([1.])
        """
        core = self._core
        say_left_out(core, "storage.named_grads()")
        return core.named_grads(remove_duplicate)

    def views_of(self, tensors: FlatTensors, remove_duplicate: bool = True) -> dict[str, Tensor]:
        """Return ``{name: view}`` over tensors shaped like the flat parameters.

        Useful for anything kept per flat parameter: an optimizer's
        ``exp_avg``, an EMA copy, a gradient. Views share memory with (and
        carry autograd from) the given tensors; dtypes and devices may differ.

        Args:
            tensors: one tensor per group: a list in group order, a dict by
                group name, or a single tensor when there is one group.
            remove_duplicate: list a tied parameter once. Default: ``True``.

        Returns:
            A dict from parameter name to view.

        Raises:
            TypeError: if ``tensors`` or an entry has a wrong type.
            ValueError: if the count, group names or sizes do not match.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 3)
            >>> storage = register_flat_storage(layer)
            >>> ema = storage["0"].detach().clone()
            >>> {k: tuple(v.shape) for k, v in storage.views_of([ema]).items()}
            {'weight': (3, 2), 'bias': (3,)}
        """
        core = self._core
        say_left_out(core, "storage.views_of()")
        return core.views_of(tensors, remove_duplicate)

    def flatten(self) -> None:
        """Switch to flat mode: attributes become views of the flat buffers again.

        Values, ``.data`` swaps, reassigned same-shaped parameters and
        gradients set in unflattened mode are written into the flat buffers
        (a slot whose ``.grad`` is ``None`` while others have one gets zeros).
        Does nothing in flat mode.

        A module swap that re-hosts a parameter (``new.weight = old.weight``)
        keeps its slot; a weight replaced by a tensor that cannot live in a flat
        buffer (a quantized tensor subclass, another dtype) leaves the storage
        with a warning naming it; slots of replaced modules (dead space) are
        dropped. Then the groups are laid out again (the same ``FlatParameter``
        objects; optimizer state follows at the next step), or the storage is
        removed when nothing is left.

        Raises:
            RuntimeError: if a parameter was reassigned with another shape, set
                to ``None``, or a tie was broken, or if the groups must be laid
                out again while features hold the layout; the module is left
                unchanged.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 2)
            >>> storage = register_flat_storage(layer)
            >>> storage.unflatten(); storage.flatten()
            >>> storage.is_flattened
            True
        """
        self._held.flatten(relayout=True)

    def unflatten(self) -> None:
        """Switch to unflattened (per-tensor) mode: every attribute is a real leaf ``nn.Parameter``.

        The parameters share memory with the flat buffers (no copy), and
        their ``.grad`` are views of their group's flat gradient, also after
        backward (a parameter that got no gradient keeps ``None``; a flat
        parameter's ``.grad`` is its leaves' gradients in one tensor);
        ``module.parameters()`` yields them instead of the flat parameters.
        Call it before building an optimizer whose math works per tensor
        (Adafactor, Muon, LAMB) and keep it for the run: grad sync,
        ``named_grads()`` and a clip over ``flat_params`` keep working. Does
        nothing in unflattened mode.

        Raises:
            RuntimeError: inside :meth:`using`.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 2)
            >>> storage = register_flat_storage(layer)
            >>> storage.unflatten()
            >>> [name for name, _ in layer.named_parameters()]
            ['weight', 'bias']
        """
        self._core.unflatten()

    @contextmanager
    def unflattened(self) -> Iterator[FlatStorage]:
        """Run a block in unflattened mode, then restore the previous mode (also on error).

        Yields:
            This storage.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 2)
            >>> storage = register_flat_storage(layer)
            >>> with storage.unflattened():
            ...     isinstance(layer.weight, nn.Parameter)
            True
            >>> isinstance(layer.weight, nn.Parameter)
            False
        """
        with self._core.unflattened():
            yield self

    @contextmanager
    def using(self, flat_tensors: FlatTensors) -> Iterator[FlatStorage]:
        """Serve every view from ``flat_tensors`` instead of the flat parameters.

        Autograd flows into the given tensors (functional calls,
        hypernetworks, evaluating an EMA copy). The substitution is visible to
        all threads, as with ``torch.func.functional_call``.

        Args:
            flat_tensors: one tensor per group, each of its flat parameter's
                shape, dtype and device: a list in group order, a dict by
                group name, or a single tensor when there is one group.

        Raises:
            TypeError: if ``flat_tensors`` or an entry has a wrong type.
            ValueError: if the count, group names, sizes, dtypes or devices
                do not match.
            RuntimeError: in unflattened mode.

        Yields:
            This storage.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 1)
            >>> storage = register_flat_storage(layer)
            >>> with storage.using([torch.zeros(3)]):
            ...     layer(torch.ones(1, 2))
            tensor([[0.]])
        """
        with self._core.using(flat_tensors):
            yield self

    def flat_state_dict(self) -> OrderedDict[str, Any]:
        """Return the module's state dict in flat form.

        The flat parameters (``flat_param_<group>``, zero copy) and a layout
        record per group (``flat_layout_<group>``, a small uint8 tensor) take
        the place of the flattened parameters; every other entry is as in
        ``module.state_dict()``. ``module.load_state_dict`` accepts it, and
        refuses it for a module with another layout.

        Returns:
            An ``OrderedDict`` in ``module.state_dict()``'s order.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
            >>> storage = register_flat_storage(model)
            >>> list(storage.flat_state_dict())[:3]
            ['flat_param_0', 'flat_layout_0', '1.running_mean']
        """
        return self._core.flat_state_dict()

    def __repr__(self) -> str:
        return storage_repr(self._shown())

    def summary(self) -> str:
        """Return a text table of every flattened parameter: name, group, offset, numel, shape, dtype.

        Returns:
            The table, one row per flattened parameter in ``param_infos`` order.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(2, 3)
            >>> print(register_flat_storage(layer).summary())
            name    group  offset  numel  shape   dtype
            ------  -----  ------  -----  ------  -------
            weight  0           0      6  (3, 2)  float32
            bias    0           6      3  (3,)    float32
        """
        return summary_table(self._shown())

    def attach_optimizer(self, optimizer: Any) -> OptimizerAttachment:
        """Make ``optimizer`` save and load the plain model's per-parameter format.

        Afterwards ``optimizer.state_dict()`` is what the same optimizer of the
        plain model returns (one entry per original parameter, names, order,
        ``step`` and param groups; converted with
        :func:`plain_optim_state_dict`), and ``optimizer.load_state_dict()``
        accepts that format as well as its own flat one (converted with
        :func:`flat_optim_state_dict`). So training checkpoints (Trainer,
        Lightning, Fabric, accelerate) resume across the plain and the
        flattened model in both directions. A plain state dict must come from an
        optimizer built the same way (the same param groups, each in
        ``module.parameters()`` order, as frameworks build them). Attaching the
        same optimizer again returns the existing attachment.

        Args:
            optimizer: a ``torch.optim.Optimizer`` over the flattened module's
                parameters, or a framework's wrapper of one (accelerate's
                ``AcceleratedOptimizer``, Lightning's and Fabric's).

        Returns:
            The attachment; its ``remove()`` detaches the optimizer again.

        Raises:
            TypeError: if ``optimizer`` is not an optimizer.
            ValueError: if it holds parameters that are not the module's.
            RuntimeError: if it is already attached to another storage.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(2, 2)
            >>> storage = register_flat_storage(model)
            >>> optimizer = torch.optim.Adam(model.parameters())
            >>> _ = storage.attach_optimizer(optimizer)
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> optimizer.step()
            >>> [tuple(s["exp_avg"].shape) for s in optimizer.state_dict()["state"].values()]
            [(2, 2), (2,)]
        """
        return attach_optimizer(self, optimizer)

    def _repr_html_(self) -> str:
        return storage_html(self._shown())

    def plot_layout(self, **kwargs: Any) -> Any:
        """Draw the flat buffers: which parameter occupies which range (needs matplotlib).

        One bar per group; padding is white and hatched. Made without
        ``pyplot``, so it works headless (``fig.savefig(path)``).

        Args:
            **kwargs: ``figsize`` (``(width, height)`` in inches), ``labels``
                (write each name in its box when it fits; default ``True``),
                ``min_label_fraction`` (the narrowest box, as a fraction of its
                bar, that gets a label; default ``0.05``), ``title`` (default:
                the storage's one-line summary).

        Returns:
            A ``matplotlib.figure.Figure``, one axes per group.

        Raises:
            ImportError: if matplotlib is not installed.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> storage = register_flat_storage(nn.Linear(2, 3), align=4)
            >>> fig = storage.plot_layout(figsize=(6, 1.5))
            >>> len(fig.axes)
            1
        """
        return plot_layout(self._shown(), **kwargs)

    def all_reduce_grads(self, group: dist.ProcessGroup | None = None, op: str = "mean") -> None:
        """All-reduce the gradient of every flat parameter across ranks, one collective per group.

        Call it on every rank of ``group`` after backward (instead of, or
        without, :meth:`enable_grad_sync`). Groups whose flat parameter does
        not require grad are skipped; one that requires grad but has no
        ``.grad`` on this rank contributes zeros and receives the result, so
        every rank issues the same collectives. In unflattened mode the
        parameters' gradients are written to the flat buffers first and are
        views of the reduced gradients afterwards. The module's parameters
        that no group holds (and that require grad) are reduced too, one
        collective per dtype: a gradient no rank produced stays ``None``.

        Args:
            group (ProcessGroup, optional): the ranks to reduce over.
                Default: ``None``, the default process group.
            op (str): ``"mean"`` (average over ranks, as DDP does) or ``"sum"``.
                Default: ``"mean"``.

        Raises:
            TypeError: if ``op`` is not a str or ``group`` not a process group.
            ValueError: if ``op`` is not one of ``"mean"``, ``"sum"``, or this
                rank is not a member of ``group``.
            RuntimeError: if no default process group is initialized.

        Example:
            >>> import torch
            >>> import torch.distributed as dist
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500",
            ...                         rank=0, world_size=1)  # doctest: +SKIP
            >>> layer = nn.Linear(2, 1)
            >>> storage = register_flat_storage(layer)
            >>> layer(torch.ones(1, 2)).sum().backward()
            >>> storage.all_reduce_grads()  # doctest: +SKIP
            >>> storage["0"].grad  # doctest: +SKIP
            tensor([1., 1., 1.])
        """
        self._feature(GradSync).all_reduce(group, op)

    def broadcast_params(self, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
        """Copy the flat parameters of rank ``src`` to every rank, one collective per group.

        Use it once after building the model so that every rank starts from
        the same weights (DDP does this in its constructor). Every group is
        broadcast, frozen ones included, and the module's parameters that no
        group holds (one collective per dtype); buffers (e.g. BatchNorm running
        statistics) are left alone.

        Args:
            src (int): global rank whose values every rank receives. Default: ``0``.
            group (ProcessGroup, optional): the ranks to broadcast to.
                Default: ``None``, the default process group.

        Raises:
            TypeError: if ``src`` is not an int or ``group`` not a process group.
            ValueError: if ``src`` is not a rank of ``group``, or this rank is
                not a member of ``group``.
            RuntimeError: if no default process group is initialized.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> storage = register_flat_storage(nn.Linear(2, 1))
            >>> storage.broadcast_params(src=0)  # doctest: +SKIP
        """
        self._feature(GradSync).broadcast(src, group)

    def enable_grad_sync(self, group: dist.ProcessGroup | None = None) -> None:
        """Average the module's gradients across ranks during each backward, as DDP does.

        Once enabled, every flat gradient is averaged over ``group`` by the
        time ``loss.backward()`` returns. The collective of a group starts as
        soon as its flat gradient is final for this backward (a
        post-accumulate-grad hook), so, with the model split into several
        groups (``register_flat_storage(..., bucket_cap_mb=25)``, or one group
        per block), communication overlaps the rest of backward; an
        autograd-engine callback waits for all of them at the end of backward.

        Semantics:

        * Collectives start in one order shared by all ranks: group order in
          the first synced backward, then the order in which rank 0's first
          synced backward finished the groups.
        * A group that this rank's backward did not reach (an unused branch)
          is still reduced at the end of backward, contributing zeros, so
          ranks never wait on each other (like DDP's
          ``find_unused_parameters=True``). Its ``.grad`` is then set, to zeros
          if no rank produced one. Every rank's backward must reach at least
          one flat parameter or one parameter that no group holds.
        * Groups that do not require grad are never reduced.
        * The module's parameters that no group holds (left out at
          registration, a new head put in after it) are averaged too, as DDP
          averages every parameter: at the end of each synced backward, one
          collective per dtype; a gradient no rank produced stays ``None``.
          They are noticed at the forward (two integer comparisons when
          nothing was registered since). Every rank must hold the same ones.
        * Inside :meth:`no_sync` nothing is reduced; gradients accumulate
          locally and the next synced backward averages the sum.
        * Backward passes that reach the flat parameters are synced, and in
          unflattened mode those that reach the leaf parameters (their
          gradients are reduced through the flat gradient at the end of
          backward); ``using()`` substitutes are not (call
          :meth:`all_reduce_grads` there).
        * Call ``backward`` once per step outside ``no_sync`` (a second
          synced backward reduces the already averaged gradient again).
          Reentrant activation checkpointing (``use_reentrant=True``) runs a
          nested backward and is refused with a ``RuntimeError`` from
          ``backward``; use ``use_reentrant=False``.
        * A flat parameter replaced by ``module.to()`` gets its hook again at
          once; a group unfrozen later (``requires_grad_(True)``) gets it at the
          next forward of the registered module.
        * Where the backend cannot average inside the collective (gloo),
          backward divides a flat gradient by the world size while copying it
          together and the collective only sums, saving a pass over the
          gradient (DDP divides while copying into its buckets). A tensor
          hook on a flat parameter still sees the local, undivided gradient.

        A rank that fails or stops makes the others' collectives fail after
        the process group's timeout (``init_process_group(timeout=...)``),
        raised from ``backward``; they never wait forever.

        Args:
            group (ProcessGroup, optional): the ranks to average over.
                Default: ``None``, the default process group.

        Raises:
            TypeError: if ``group`` is not a process group.
            ValueError: if this rank is not a member of ``group``.
            RuntimeError: if no default process group is initialized, grad
                sync is already enabled on this storage, or a ``ShardedOptimizer``
                that still exists syncs its gradients (each would be reduced twice).

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
            >>> storage = register_flat_storage(model, bucket_cap_mb=25)
            >>> storage.broadcast_params()  # doctest: +SKIP
            >>> storage.enable_grad_sync()  # doctest: +SKIP
            >>> model(torch.randn(8, 4)).pow(2).mean().backward()  # grads averaged here
        """
        self._feature(GradSync).enable(group)

    def disable_grad_sync(self) -> None:
        """Stop syncing gradients in backward and remove every hook that sync added.

        Does nothing if grad sync is not enabled. A backward already in
        flight still completes its collectives.

        Example:
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> storage = register_flat_storage(nn.Linear(2, 1))
            >>> storage.disable_grad_sync()
        """
        sync = self._held.feature(GradSync)
        if sync is not None:
            sync.disable()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient sync inside the block, for gradient accumulation (like DDP's ``no_sync``).

        Backward passes inside only accumulate local gradients; the first
        synced backward after the block averages the accumulated sum. Nests;
        without :meth:`enable_grad_sync` it changes nothing.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(2, 1)
            >>> storage = register_flat_storage(model)
            >>> micro_batches = torch.randn(4, 3, 2).unbind()
            >>> with storage.no_sync():
            ...     for x in micro_batches[:-1]:
            ...         model(x).sum().backward()
            >>> model(micro_batches[-1]).sum().backward()  # syncs the sum, if enabled
        """
        with self._held.no_sync():
            yield

    @property
    def is_offloaded(self) -> bool:
        """Return whether flat buffers are file-backed (by :meth:`offload_to_disk`).

        ``False`` again after :meth:`load_to_memory`, ``remove_flat_storage``,
        or a ``module.to()`` that converted or moved the buffers.
        """
        disk = self._held.feature(DiskOffload)
        return disk is not None and bool(disk.backed())

    @property
    def offload_files(self) -> dict[str, Path]:
        """Return the file backing each offloaded group's flat buffer, by group name.

        Each file holds the raw bytes of the flat parameter (padding included)
        in native byte order. Empty when nothing is offloaded.
        """
        disk = self._held.feature(DiskOffload)
        return {} if disk is None else disk.files()

    def offload_to_disk(self, directory: str | os.PathLike[str]) -> None:
        """Move the flat buffers to memory-mapped files in ``directory``, releasing their RAM.

        Each group's buffer is written to its own file (named after the group
        and a random tag, so several storages can share a directory) with
        ordinary writes, fsynced, then mapped back with
        ``torch.from_file(..., shared=True)`` and swapped in as the flat
        parameter's ``.data``. The flat parameters stay the same objects, so
        an optimizer built before keeps working. Pages are read from the file
        on access; in-place updates (optimizer steps, ``load_state_dict``,
        ``copy_``) write through to the file. Forward, backward and state dicts
        work as before.

        Gradients and optimizer state stay in RAM. Resident memory drops by the
        buffers' size only if nothing else holds the old buffers: an autograd
        graph kept from an earlier forward, a ``state_dict()`` or
        ``named_views()`` result, or your own views do.

        What moves the weights back to RAM (and deletes the files):
        :meth:`load_to_memory`, ``remove_flat_storage`` (ordinary parameters
        in RAM), and a ``module.to()`` / ``.double()`` / ``.cuda()`` that
        converts or moves a buffer (a no-op ``.to()`` keeps it offloaded).
        ``copy.deepcopy`` of the module gives a copy in RAM. Calling this again
        with the same directory offloads only groups that are in RAM.

        Args:
            directory (str or os.PathLike): an existing, writable directory,
                ideally on a fast local disk.

        Raises:
            TypeError: if ``directory`` is not a path.
            RuntimeError: if a flat buffer is not on the CPU, or the buffers
                are already offloaded to another directory.
            FileNotFoundError: if ``directory`` does not exist.
            NotADirectoryError: if ``directory`` is not a directory.
            OSError: if the disk has too little free space (``errno.ENOSPC``)
                or a file cannot be written (``PermissionError`` for a
                read-only directory). In every case the weights stay in
                memory, unchanged, and no file is left behind.

        Example:
            >>> import os, tempfile, torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(4, 2)
            >>> storage = register_flat_storage(model)
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     storage.offload_to_disk(directory)
            ...     print(storage.is_offloaded, len(os.listdir(directory)))
            ...     print(model(torch.ones(1, 4)).shape)
            ...     storage.load_to_memory()
            ...     print(storage.is_offloaded, os.listdir(directory))
            True 1
            torch.Size([1, 2])
            False []
        """
        self._feature(DiskOffload).offload(directory)

    def load_to_memory(self, keep_files: bool = False) -> None:
        """Bring offloaded flat buffers back into RAM.

        The values (including every update made while offloaded) are copied
        into fresh RAM buffers, swapped in as the flat parameters' ``.data``
        (the same objects, so optimizers keep working), and the files are
        deleted. Does nothing if nothing is offloaded.

        Args:
            keep_files (bool): keep the files (fsynced, holding the current
                values) instead of deleting them; see :attr:`offload_files`
                for their paths, read before this call. Default: ``False``.

        Raises:
            TypeError: if ``keep_files`` is not a bool.
            RuntimeError: if the RAM for the buffers cannot be allocated; the
                buffers then stay offloaded, unchanged.

        Example:
            >>> import tempfile, torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(4, 2)
            >>> storage = register_flat_storage(model)
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     storage.offload_to_disk(directory)
            ...     with torch.no_grad():
            ...         _ = model.bias.fill_(7.0)  # writes through to the file
            ...     [path] = storage.offload_files.values()
            ...     storage.load_to_memory(keep_files=True)
            ...     print(storage.is_offloaded, model.bias.tolist())
            ...     print(torch.from_file(str(path), size=10)[-2:])
            False [7.0, 7.0]
            tensor([7., 7.])
        """
        self._feature(DiskOffload, settle_first=False).load(keep_files)  # a release: not refused

    def stack(self, k: int, *, requires_grad: bool = False) -> list[Tensor]:
        """Return ``k`` copies of every flat parameter, stacked: one ``(k, numel)`` tensor per group.

        The copies are independent of the module (perturb them, train them,
        average them) and :meth:`call_stacked` evaluates the module once per row.
        While a stack lives it holds the layout: operations that lay the groups
        out again (``quantize_``, ``resize_token_embeddings``, a module swap
        flattened again) are refused until the stacks are dropped.

        Args:
            k: number of weight sets (``>= 1``).
            requires_grad: make the stacks leaves that require grad. Default: ``False``.

        Returns:
            A list in group order.

        Raises:
            ValueError: if ``k`` is smaller than 1.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(3, 2)
            >>> storage = register_flat_storage(layer)
            >>> [tuple(s.shape) for s in storage.stack(4)]
            [(4, 8)]
        """
        return self._feature(Functional).stack(k, requires_grad)

    def call_stacked(self, stacked: StackedTensors, *args: Any, **kwargs: Any) -> Any:
        """Evaluate the module once per row of ``stacked``, in one vectorized call.

        ``torch.vmap`` over ``torch.func.functional_call`` with the flat
        parameters replaced by each row: an ensemble of ``k`` weight sets on
        the same inputs. Gradients flow to ``stacked``.

        Args:
            stacked: one ``(k, numel)`` tensor per group (see :meth:`stack`).
            *args: positional inputs of the module's forward (shared by all rows).
            **kwargs: keyword inputs of the module's forward.

        Returns:
            The module's output with a leading dimension of size ``k``.

        Raises:
            TypeError: if ``stacked`` or an entry has a wrong type.
            ValueError: if counts, group names or shapes do not match.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> layer = nn.Linear(3, 2)
            >>> storage = register_flat_storage(layer)
            >>> out = storage.call_stacked(storage.stack(5), torch.randn(7, 3))
            >>> out.shape
            torch.Size([5, 7, 2])
        """
        return Functional(self._core).call_stacked(stacked, args, kwargs)


def facade_of(core: StorageCore) -> FlatStorage:
    """Return the one ``FlatStorage`` of ``core``, made on first request."""
    facade = core.facade
    if facade is None:
        facade = object.__new__(FlatStorage)
        facade._held = core
        core.facade = facade
    return facade
