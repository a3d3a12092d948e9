"""``FlatParameter``: the ``nn.Parameter`` that owns one group's flat buffer."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .compiling import never_traced
from .grad.owner import BASE_GRAD, GroupGrad, set_grad

__all__ = ["FlatParameter", "allow_weights_only_loads", "serve"]

#: torch's own descriptor of ``Tensor.data``, which the property below extends (``.grad``: ``BASE_GRAD``).
_BASE_DATA: Any = vars(torch._C.TensorBase)["data"]
#: torch's own descriptor of ``Tensor.requires_grad``, which the property below extends.
_BASE_REQUIRES_GRAD: Any = vars(torch._C.TensorBase)["requires_grad"]
_is_compiling = torch.compiler.is_compiling
#: Attribute (in the flat parameter's ``__dict__``) holding a weak reference to the views it serves.
_SERVED_BY = "_flat_served_by"


class _Served(Protocol):
    """What a flat parameter tells the view cache of the group it serves (``_view_cache.GroupViews``)."""

    def sync(self) -> None:
        """Land the values assigned to views' ``.data`` in the flat buffer."""

    def on_data_read(self, flat: torch.Tensor) -> None:
        """Take note that ``flat.data``, an alias no version counter follows, was handed out."""

    def on_data_replaced(self) -> None:
        """Drop the cached views: the flat buffer is about to be replaced."""

    def on_requires_grad_set(self) -> None:
        """Check the cached views at their next read: ``requires_grad`` was set."""

    @property
    def grads(self) -> GroupGrad:
        """The owner of the group's gradient (``_core/grad/``)."""


def serve(flat: torch.Tensor, views: _Served) -> None:
    """Record that ``flat`` (a ``FlatParameter``) is the flat parameter whose views ``views`` serves."""
    flat.__dict__[_SERVED_BY] = weakref.ref(views)


def _served(flat: torch.Tensor) -> _Served | None:
    ref = flat.__dict__.get(_SERVED_BY)
    return None if ref is None else ref()


def _requires_grad_set(flat: torch.Tensor) -> None:
    views = _served(flat)
    if views is not None:
        views.on_requires_grad_set()


class FlatParameter(nn.Parameter):
    """A one-dimensional ``nn.Parameter`` that stores several tensors back to back.

    One is created per group by :func:`~flatten_parametrize.register_flat_storage`
    and registered on the module as ``flat_param_<group>``. It carries the
    layout of its group, so it keeps meaning after ``torch.save`` /
    ``pickle`` and ``copy.deepcopy``.

    Its ``.data`` and ``.grad`` behave as torch's, with additions for the
    group it serves: assigning ``.data`` (``module.to()``, ``vector_to_parameters``,
    disk offload) drops the group's cached views; reading ``.data`` under a
    mixed-precision policy has the compute copy cast again before its next use
    (``p.data.add_(...)`` moves no version counter); and reading ``.grad`` (as every
    optimizer step and ``zero_grad`` do) first copies the values written into
    views (``layer.weight.data = t``) into the buffer. In unflattened mode
    ``.grad`` is the members' leaf gradients in one tensor (they are views of
    it; ``None`` while none has one), and assigning it assigns theirs. After a
    ``ShardedOptimizer(shard_gradients=True)`` backward it is a placeholder of
    the gradient sharded over the ranks (clearing, zeroing, norms and scaling
    reach the shards).

    Args:
        data: the one-dimensional buffer.
        requires_grad: whether the parameter requires a gradient. Default: ``True``.
        names: qualified name of each tensor stored in the buffer.
        shapes: shape of each tensor.
        numels: element count of each tensor.
        offsets: element offset of each tensor; packed back to back when omitted.

    Raises:
        ValueError: if ``data`` is not one-dimensional or the layout does not
            fit in it.

    Example:
        >>> flat = FlatParameter(torch.zeros(5), names=["w", "b"],
        ...                      shapes=[(2, 2), (1,)], numels=[4, 1])
        >>> flat.metadata()
        (['w', 'b'], [torch.Size([2, 2]), torch.Size([1])], [4, 1])
    """

    _names: tuple[str, ...]
    _shapes: tuple[torch.Size, ...]
    _numels: tuple[int, ...]
    _offsets: tuple[int, ...]

    def __new__(
        cls,
        data: torch.Tensor | None = None,
        requires_grad: bool = True,
        *,
        names: Sequence[str] = (),
        shapes: Sequence[Sequence[int]] = (),
        numels: Sequence[int] = (),
        offsets: Sequence[int] | None = None,
    ) -> FlatParameter:
        if data is None:
            data = torch.empty(0)
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"FlatParameter data must be a Tensor; got {type(data).__name__}")
        if isinstance(data, nn.Parameter):
            data = data.detach()
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self._set_layout(names, shapes, numels, offsets)
        return self

    def _set_layout(
        self,
        names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        numels: Sequence[int],
        offsets: Sequence[int] | None,
    ) -> None:
        names, numels = tuple(names), tuple(int(n) for n in numels)
        if not all(isinstance(name, str) for name in names):
            raise TypeError(f"FlatParameter names must be str; got {list(names)!r}")
        sizes = tuple(torch.Size(s) for s in shapes)
        if offsets is None:
            starts, cursor = [], 0
            for n in numels:
                starts.append(cursor)
                cursor += n
            offsets = starts
        offsets = tuple(int(o) for o in offsets)
        if not len(names) == len(sizes) == len(numels) == len(offsets):
            raise ValueError(
                "FlatParameter layout needs one name, shape, numel and offset per tensor; "
                f"got {len(names)} names, {len(sizes)} shapes, {len(numels)} numels, "
                f"{len(offsets)} offsets"
            )
        for name, size, numel in zip(names, sizes, numels):
            if size.numel() != numel:
                raise ValueError(
                    f"FlatParameter layout: '{name}' has shape {tuple(size)} ({size.numel()} "
                    f"elements) but numel {numel}; give numels that match the shapes"
                )
        if self.dim() != 1:
            raise ValueError(f"FlatParameter data must be one-dimensional; got shape {tuple(self.shape)}")
        end = max((o + n for o, n in zip(offsets, numels)), default=0)
        if end > self.numel():
            raise ValueError(f"FlatParameter layout needs {end} elements but the buffer holds {self.numel()}")
        self._names, self._shapes, self._numels, self._offsets = names, sizes, numels, offsets

    # ``.data`` and ``.grad`` are torch's, with additions for the group's view cache: replacing
    # ``.data`` drops the cached views (so a read never compares ``data_ptr()``); reading ``.data``
    # tells views served from a copy (mixed precision) that the buffer may be written behind its
    # version counter; reading ``.grad`` first lands the values written into views (an optimizer
    # step reads ``.grad`` of every parameter before it changes any: it steps the landed values).
    @property
    def data(self) -> torch.Tensor:
        """The parameter's values, detached (as ``torch.Tensor.data``); assigning replaces the buffer."""
        if not _is_compiling():
            views = _served(self)
            if views is not None:
                views.on_data_read(self)
        return _BASE_DATA.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        views = _served(self)
        if views is not None:
            views.on_data_replaced()
        _BASE_DATA.__set__(self, value)

    # Setting ``requires_grad`` (``p.requires_grad = False``, ``requires_grad_()``, which
    # ``module.requires_grad_()`` calls) tells the view cache, so that a cached read need not
    # read the flag (a getter of a Parameter subclass, which costs a third of a plain read).
    @property
    def requires_grad(self) -> bool:
        """Whether autograd records operations on the parameter (as ``torch.Tensor.requires_grad``)."""
        return _BASE_REQUIRES_GRAD.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        _BASE_REQUIRES_GRAD.__set__(self, value)
        _requires_grad_set(self)

    @property
    @never_traced
    def grad(self) -> torch.Tensor | None:
        """The flat gradient (as ``torch.Tensor.grad``), read after landing the views' ``.data`` writes."""
        # Never traced: dynamo would resolve ``BASE_GRAD.__get__`` on a Parameter subclass to
        # this property again (endless recursion), and a compiled frame that reads ``.grad``
        # eagerly (graph inputs, the optimizers' ``_init_group``) would compile this getter
        # as a frame of its own.
        if not _is_compiling():
            views = _served(self)
            if views is not None:
                views.sync()
                # in unflattened mode: the leaves' gradients; a lent one's placeholder (ZeRO-2)
                return views.grads.visible(self)
        return BASE_GRAD.__get__(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        views = _served(self)
        if views is not None:
            views.grads.assign(self, value)
        else:
            set_grad(self, value)

    @grad.deleter
    def grad(self) -> None:
        views = _served(self)
        if views is not None:
            views.grads.release(self)
        else:
            set_grad(self, None)

    def register_post_accumulate_grad_hook(self, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """Register ``hook`` as torch does; in per-tensor mode it runs once the group's leaves landed.

        In per-tensor mode the members are leaf parameters that backward accumulates into: the
        group's gradient owner then hooks them, so that the flat parameter's hooks run as soon as
        its last leaf of a backward got its gradient (``_core/grad/leaf_slots.py``).

        Args:
            hook: called with the flat parameter after its gradient of a backward is final.

        Returns:
            A handle whose ``remove()`` removes the hook.

        Example:
            >>> flat = FlatParameter(torch.zeros(3), names=["a"], shapes=[(3,)], numels=[3])
            >>> seen = []
            >>> handle = flat.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.sum()))
            >>> (flat * 2).sum().backward()
            >>> seen
            [tensor(6.)]
            >>> handle.remove()
        """
        handle = super().register_post_accumulate_grad_hook(hook)
        views = _served(self)
        if views is not None:
            views.grads.flat_hooked()
        return handle

    def metadata(self) -> tuple[list[str], list[torch.Size], list[int]]:
        """Return ``(names, shapes, numels)`` of the tensors stored in this buffer.

        The same triple as fairscale's ``FlatParameter.metadata()``.

        Returns:
            Three lists, one entry per stored tensor, in buffer order.

        Example:
            >>> flat = FlatParameter(torch.zeros(3), names=["a"], shapes=[(3,)], numels=[3])
            >>> names, shapes, numels = flat.metadata()
            >>> names, numels
            (['a'], [3])
        """
        return list(self._names), list(self._shapes), list(self._numels)

    @property
    def offsets(self) -> list[int]:
        """Return the element offset of each stored tensor."""
        return list(self._offsets)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"FlatParameter({len(self._names)} tensors) containing:\n" + torch.Tensor.__repr__(self)

    def detach(self) -> FlatParameter:
        """Return a ``FlatParameter`` with this layout over the same storage, without history.

        torch requires ``detach()`` of a ``Parameter`` subclass to keep its type, so that
        ``nn.Parameter(flat)`` works (tensordict's ``to_module`` wraps parameters again so).
        """
        return self._over(torch.Tensor.detach(self), False)

    def requires_grad_(self, requires_grad: bool = True) -> FlatParameter:
        """Set ``requires_grad`` as torch does; inside a functorch transform, on a new alias.

        ``nn.Parameter(flat)`` sets the flag on a fresh detached copy, which torch refuses
        inside ``vmap`` for any tensor; the copy has no history, so an alias with the flag
        set (as ``nn.Parameter`` makes for a plain tensor) stands in for it there.
        """
        if torch._C._functorch.maybe_current_level() is None or torch._C._functorch.is_batchedtensor(self):
            torch.Tensor.requires_grad_(self, requires_grad)
            _requires_grad_set(self)
            return self
        return self._over(torch.Tensor.detach(self), requires_grad)

    def _over(self, data: torch.Tensor, requires_grad: bool) -> FlatParameter:
        out = torch.Tensor._make_subclass(FlatParameter, data, requires_grad)
        out._names, out._shapes, out._numels, out._offsets = (
            self._names,
            self._shapes,
            self._numels,
            self._offsets,
        )
        return out

    def __reduce_ex__(self, proto: Any) -> tuple[Any, ...]:
        return (
            rebuild_flat_parameter,
            (
                _BASE_DATA.__get__(self),
                self.requires_grad,
                self._names,
                tuple(tuple(s) for s in self._shapes),
                self._numels,
                self._offsets,
            ),
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatParameter:
        if id(self) in memo:
            return memo[id(self)]
        result = FlatParameter(
            _BASE_DATA.__get__(self).clone(memory_format=torch.preserve_format),
            self.requires_grad,
            names=self._names,
            shapes=self._shapes,
            numels=self._numels,
            offsets=self._offsets,
        )
        memo[id(self)] = result
        return result


def rebuild_flat_parameter(
    data: torch.Tensor,
    requires_grad: bool,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    numels: Sequence[int],
    offsets: Sequence[int],
) -> FlatParameter:
    return FlatParameter(data, requires_grad, names=names, shapes=shapes, numels=numels, offsets=offsets)


def as_flat_parameter(
    tensor: torch.Tensor,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    numels: Sequence[int],
    offsets: Sequence[int],
) -> FlatParameter:
    """Turn ``tensor`` (a parameter that took a flat parameter's place) into one, in place."""
    if type(tensor) is not FlatParameter:
        tensor.__class__ = FlatParameter
    flat: FlatParameter = tensor  # type: ignore[assignment]
    flat._set_layout(names, shapes, numels, offsets)
    return flat


#: Where pickles find the rebuild function: the top-level ``flatten_parametrize._flat_parameter``,
#: the path that checkpoints written before the package had sub-packages refer to, kept stable
#: so that a later move of this module cannot break a checkpoint (pickle checks that the path
#: leads back to this very function).
STABLE_MODULE = "flatten_parametrize._flat_parameter"
rebuild_flat_parameter.__module__ = STABLE_MODULE
rebuild_flat_parameter.__qualname__ = rebuild_flat_parameter.__name__ = "_rebuild_flat_parameter"


def allow_weights_only_loads() -> None:
    """Make ``torch.load(weights_only=True)`` accept the class and the rebuild function by those paths.

    ``_core/__init__.py`` calls it when the package is imported.
    """
    torch.serialization.add_safe_globals(
        [
            (FlatParameter, f"{FlatParameter.__module__}.FlatParameter"),
            (FlatParameter, f"{STABLE_MODULE}.FlatParameter"),
            (rebuild_flat_parameter, f"{STABLE_MODULE}._rebuild_flat_parameter"),
        ]
    )
