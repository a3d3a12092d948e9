"""The averaged gradients as the model shows them, and what a step takes from there.

ZeRO-1 (:class:`TakenGrads`): each flat gradient is whole and averaged; before
a step or a clip each rank's slices take their gradients from it again, so
that what was cleared, zeroed or scaled through the model's parameters is what
the inner optimizer steps.

ZeRO-2 (:class:`ShownGrads`): placeholders that reach the shards.

With ``shard_gradients=True`` each rank keeps its averaged part of each flat
gradient only; the full flat gradient is released during backward. So that
code written for the plain model finds a gradient where the plain model has
one, each sliced group's gradient owner lends a :class:`ShardedGrad` out
(``_core/grad/owner.GroupGrad.lend``): it is the flat parameter's ``.grad`` and, in
per-tensor mode, each leaf's, a tensor of the parameter's shape that holds no
values of its own and takes to the shards what can be done to a gradient that
lives in parts:

* clearing (``p.grad = None``, ``zero_grad()`` of the model or of an optimizer,
  either ``set_to_none``): the cleared part of this rank's gradient is dropped
  at the next step, backward or clip (:meth:`ShownGrads.settle`), so a new
  gradient is not added to the old one;
* ``zero_()``, ``mul_``, ``div_``, ``clamp_`` and their ``torch._foreach_``
  forms (what ``clip_grad_norm_``, ``clip_grad_value_`` and ``zero_grad``
  call): on this rank's part;
* norms (``torch.linalg.vector_norm``, ``Tensor.norm``, ``torch.norm``,
  ``torch._foreach_norm``): the norm of the whole averaged gradient, from one
  all-reduce for every placeholder of the optimizer at once (collective: every
  rank asks, as ``torch.nn.utils.clip_grad_norm_`` on every rank does), so that
  frameworks' clipping (Lightning's ``gradient_clip_val``, accelerate's and the
  Trainer's ``clip_grad_norm_``) clips by the global norm, as
  ``ShardedOptimizer.clip_grad_norm_`` does;
* anything else raises, saying what works.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .sharded_feature import live_core

if TYPE_CHECKING:
    from .._core.records import Coordinator
    from .shard import Shard
    from .sharded_collectives import Collectives
    from .sharded_partition import Partition

__all__ = ["ShardedGrad", "ShownGrads", "TakenGrads", "model_grads"]


class ShardedGrad(Tensor):
    """The ``.grad`` of a parameter whose averaged gradient lives sharded over the ranks (ZeRO-2).

    What ``ShardedOptimizer(shard_gradients=True)`` shows where the plain model
    has a gradient: clearing it, zeroing it, its norms and scaling it by a number
    reach the ranks' parts (see the module's docstring); its values cannot be read.
    """

    _loan: weakref.ref[_Loan]
    _index: int | None
    _what: str

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        attribute, access = _attribute(func)
        if attribute == "data":
            return _data(access, *args)
        if access == "__get__" or func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise _unsupported(func, args, kwargs)


def _placeholder(
    shape: Sequence[int], like: Tensor, loan: _Loan, index: int | None, what: str
) -> ShardedGrad:
    """Return a :class:`ShardedGrad` of ``shape`` (``like``'s dtype and device) for an entry of ``loan``."""
    base = torch.zeros((), dtype=like.dtype, device=like.device).expand(tuple(shape))
    shown = Tensor._make_subclass(ShardedGrad, base, False)
    shown._loan = weakref.ref(loan)
    shown._index = index
    shown._what = what
    return shown


class _Loan:
    """One group's averaged gradient, lent to its gradient owner (``_core/grad/owner.Lent``).

    An entry is the whole flat gradient (``None``) or one member's gradient (its
    index in the layout); :meth:`parts` are this rank's elements of an entry, views
    of the shard's gradient.

    Args:
        registry: the optimizer's placeholders (held weakly).
        shard: this rank's shard of the group.
        names: each member's qualified name, by member index.
        group: the group's name.
    """

    def __init__(self, registry: ShownGrads, shard: Shard, names: Sequence[str], group: str) -> None:
        self._registry = weakref.ref(registry)
        self.shard = shard
        self.names = list(names)
        self.group = group
        self.layout: tuple[Sequence[int], Sequence[int], Sequence[Sequence[int]]] = ((), (), ())
        #: Whether the whole gradient was cleared (the flat parameter's ``.grad`` assigned).
        self.all_cleared = False
        #: The members whose gradient was cleared (per-tensor mode's leaves).
        self.members_cleared: set[int] = set()
        self._shown: ShardedGrad | None = None
        self._leaves: dict[int, ShardedGrad] = {}

    def shown(self) -> Tensor:
        """Return the placeholder of the flat parameter's ``.grad``."""
        if self._shown is None:
            flat = self.shard.flat
            what = f"the flat parameter of group {self.group!r}"
            self._shown = _placeholder((flat.numel(),), flat, self, None, what)
        return self._shown

    def leaf_shown(self, index: int) -> Tensor:
        """Return the placeholder of member ``index``'s leaf ``.grad`` (per-tensor mode)."""
        shown = self._leaves.get(index)
        if shown is None:
            shape = self.layout[2][index]
            shown = self._leaves[index] = _placeholder(shape, self.shard.flat, self, index, self.names[index])
        return shown

    def registry(self) -> ShownGrads | None:
        """Return the optimizer's placeholders (``None``: the optimizer is gone)."""
        return self._registry()

    def current(self) -> bool:
        """Return whether this loan still shows the group's gradient (not cleared, not lent anew)."""
        registry = self._registry()
        return registry is not None and not self.all_cleared and registry.loan_of(self.shard) is self

    def cleared(self, index: int | None) -> None:
        """Take note that member ``index``'s gradient (``None``: the whole one) was cleared."""
        if index is None:
            self.all_cleared = True
        else:
            self.members_cleared.add(index)

    def span(self, index: int | None) -> tuple[int, int]:
        """Return the flat element range of an entry."""
        if index is None:
            return 0, self.shard.numel
        offsets, numels, _ = self.layout
        return offsets[index], offsets[index] + numels[index]

    def parts(self, index: int | None) -> list[Tensor]:
        """Return this rank's elements of an entry (views of the shard's gradient; none without one)."""
        return self.shard.local(*self.span(index))


class ShownGrads:
    """The placeholders of a ``ShardedOptimizer(shard_gradients=True)``: lent after each reduction.

    Args:
        core: the storage's core (held weakly).
        ownership: who owns which part of each flat parameter.
        comm: the optimizer's collectives (the norms' all-reduce).
    """

    def __init__(self, core: Coordinator, ownership: Partition, comm: Collectives) -> None:
        self._core_ref = weakref.ref(core)
        self._ownership = ownership
        self._comm = comm
        #: Group index -> its loan while its gradient is lent.
        self._loans: dict[int, _Loan] = {}
        #: Counts what changes the lent gradients, on every rank alike (a cache of the norms that
        #: compared tensors or versions could hit on one rank and miss on another: then a rank would
        #: skip the all-reduce the others wait in).
        self.generation = 0
        #: ``ord`` -> (the generation the norms were computed at, the norms of every entry).
        self._norms: dict[float, tuple[int, Tensor]] = {}

    def lend(self, shard: Shard) -> None:
        """Show ``shard``'s group's gradient (just reduced into ``shard``) by placeholders."""
        group = live_core(self._core_ref).groups()[shard.g]
        loan = _Loan(self, shard, [slot.name for slot in group.members], group.name)
        layout = group.layout
        loan.layout = (layout.offsets, layout.numels, layout.shapes)
        self._loans[shard.g] = loan
        group.grads.lend(loan)
        self.generation += 1

    def loan_of(self, shard: Shard) -> _Loan | None:
        """Return the loan of ``shard``'s group (``None``: its gradient is not lent)."""
        return self._loans.get(shard.g)

    def settle(self, shard: Shard, *, closing: bool = False) -> None:
        """Drop the parts of ``shard``'s gradient that were cleared since it was lent.

        Args:
            shard: this rank's shard of the group.
            closing: the group's next gradient is being reduced: the loan ends here.
        """
        loan = self._loans.get(shard.g)
        if loan is None:
            return
        grads = live_core(self._core_ref).groups()[shard.g].grads
        if grads.lent is loan:
            grads.check_lent()
        else:  # recalled (the flat gradient assigned) or lent anew
            loan.all_cleared = True
        if len(loan.members_cleared) >= len(loan.names):
            loan.all_cleared = True
        if loan.all_cleared:
            shard.zero_grad(set_to_none=True)
            self.generation += 1
        elif loan.members_cleared:
            for index in sorted(loan.members_cleared):
                for part in loan.parts(index):
                    part.zero_()
                shard.drop_piece(index)
            loan.members_cleared.clear()
            self.generation += 1
        if loan.all_cleared or closing:
            del self._loans[shard.g]

    def settle_all(self) -> None:
        """:meth:`settle` every shard."""
        for shard in self._ownership.shards:
            self.settle(shard)

    def before_update(self) -> None:
        """Settle every shard before a step, a clip or after ``zero_grad()`` (the gradients may change)."""
        self.settle_all()
        self.generation += 1

    def close(self) -> None:
        """End every loan (the optimizer leaves): no gradient is shown where only the shards had one."""
        loans, self._loans = self._loans, {}
        self._norms.clear()
        core = self._core_ref()
        if core is None:
            return
        groups = core.groups()
        for g, loan in loans.items():
            if g < len(groups):
                groups[g].grads.recall(loan)

    # ------------------------------------------------------------------ norms
    def norm(self, shown: ShardedGrad, ord: float) -> Tensor:
        """Return the ``ord``-norm of ``shown``'s whole averaged gradient (collective: see the module)."""
        self.settle_all()
        loan = shown._loan()
        if loan is None or not loan.current():
            raise RuntimeError(
                f"the gradient of {shown._what} that this placeholder showed was cleared or replaced "
                "since; read the parameter's .grad again"
            )
        norms = self._all_norms(ord)
        shards = list(self._ownership.shards)
        position = [s.g for s in shards].index(loan.shard.g)
        start = sum(len(self._entries_of(s)) for s in shards[:position])
        value = norms[start + self._entries_of(loan.shard).index(shown._index)]
        return value.to(dtype=shown.dtype, device=shown.device)

    def _entries_of(self, shard: Shard) -> list[int | None]:
        """Return the entries of the group of ``shard`` , alike on every rank: the gradient, each member."""
        core = live_core(self._core_ref)
        return [None, *range(len(core.groups()[shard.g].layout.numels))]

    def _all_norms(self, ord: float) -> Tensor:
        """Return the norm of every entry of every shard (zeros where nothing is lent), all ranks summed."""
        shards = self._ownership.shards
        key = self.generation
        cached = self._norms.get(ord)
        if cached is not None and cached[0] == key:
            return cached[1]
        local: list[Tensor] = []
        for shard in shards:
            loan = self._loans.get(shard.g)
            for index in self._entries_of(shard):
                parts = [] if loan is None else loan.parts(index)
                local.append(_local_norm(parts, ord))
        total = self._comm.total_norms(torch.stack(local), ord, self._comm.device([s.flat for s in shards]))
        self._norms = {ord: (key, total)}
        return total


def model_grads(
    core: Coordinator, ownership: Partition, comm: Collectives, shard_gradients: bool
) -> ShownGrads | TakenGrads:
    """Return the gradients as the model shows them for ZeRO-2 (``shard_gradients``) or ZeRO-1."""
    return ShownGrads(core, ownership, comm) if shard_gradients else TakenGrads(core, ownership)


class TakenGrads:
    """ZeRO-1: the slices take their gradients from the whole averaged flat gradients before each update.

    Args:
        core: the storage's core (held weakly).
        ownership: who owns which part of each flat parameter.
    """

    def __init__(self, core: Coordinator, ownership: Partition) -> None:
        self._core_ref = weakref.ref(core)
        self._ownership = ownership

    def before_update(self) -> None:
        """Make each shard's gradient its part of its flat gradient (``None`` where that is ``None``)."""
        groups = live_core(self._core_ref).groups()
        for shard in self._ownership.shards:
            shard.take(groups[shard.g].grads.read(shard.flat))

    def close(self) -> None:
        """Nothing is lent out: nothing to end."""


def _local_norm(parts: Sequence[Tensor], ord: float) -> Tensor:
    """Return what this rank adds to an entry's norm: the sum of ``|x| ** ord`` (the max for ``inf``)."""
    zero = torch.zeros((), dtype=torch.float64)
    if not parts:
        return zero
    if math.isinf(ord):
        return torch.stack(
            [p.detach().abs().max().double().cpu() if p.numel() else zero for p in parts]
        ).max()
    if ord == 0:
        return torch.stack([(p.detach() != 0).sum().double().cpu() for p in parts]).sum()
    return torch.stack(
        [torch.linalg.vector_norm(p.detach(), ord, dtype=torch.float64).cpu() ** ord for p in parts]
    ).sum()


# -------------------------------------------------------------------------- handlers
def _shown_grads(shown: ShardedGrad) -> ShownGrads | None:
    loan = shown._loan()
    return None if loan is None else loan.registry()


def _parts(shown: ShardedGrad) -> list[Tensor]:
    """Return this rank's elements of ``shown``'s gradient (none once it was cleared or lent anew)."""
    loan = shown._loan()
    if loan is None or not loan.current():
        return []
    return loan.parts(shown._index)


def _scalar(value: Any, what: str) -> Any:
    if isinstance(value, Tensor) and value.numel() != 1:
        raise _unsupported_with(what, "a tensor of several elements")
    return value


def _in_place(name: str) -> Callable[..., Any]:
    """Return the handler of ``Tensor.<name>`` (an element-wise in-place op by a number) on a placeholder."""

    def handler(shown: ShardedGrad, *args: Any, **kwargs: Any) -> ShardedGrad:
        args = tuple(_scalar(a, f"Tensor.{name}") for a in args)
        kwargs = {k: _scalar(v, f"Tensor.{name}") for k, v in kwargs.items()}
        for part in _parts(shown):
            getattr(part, name)(*args, **kwargs)
        registry = _shown_grads(shown)
        if registry is not None:
            registry.generation += 1
        return shown

    return handler


def _foreach_in_place(name: str) -> Callable[..., Any]:
    """Return the handler of ``torch._foreach_<name>`` over a list holding placeholders."""
    real = getattr(torch, f"_foreach_{name}")
    method = name if name.endswith("_") else f"{name}_"

    def handler(tensors: Sequence[Tensor], *args: Any, **kwargs: Any) -> None:
        tensors = list(tensors)
        per = [_per_tensor(a, len(tensors)) for a in args]
        mine = [i for i, t in enumerate(tensors) if isinstance(t, ShardedGrad)]
        rest = [i for i in range(len(tensors)) if i not in set(mine)]
        for i in mine:
            _in_place(method)(tensors[i], *(a[i] for a in per), **kwargs)
        if rest:
            with torch._C.DisableTorchFunctionSubclass():
                real([tensors[i] for i in rest], *(_pick(a, rest) for a in args), **kwargs)

    return handler


def _per_tensor(arg: Any, n: int) -> list[Any]:
    return list(arg) if isinstance(arg, (list, tuple)) else [arg] * n


def _pick(arg: Any, indices: Sequence[int]) -> Any:
    return [arg[i] for i in indices] if isinstance(arg, (list, tuple)) else arg


def _ord(value: Any, name: str) -> float:
    if value in (None, "fro"):
        return 2.0
    if isinstance(value, str):
        raise _unsupported_with(name, f"ord={value!r}")
    ord = float(value)
    if not (ord >= 0):
        raise _unsupported_with(name, f"ord={value!r} (norms of the sharded gradient take ord >= 0 or inf)")
    return ord


def _norm_of(shown: ShardedGrad, ord: float, name: str) -> Tensor:
    registry = _shown_grads(shown)
    if registry is None:
        raise _unsupported_with(name, "a gradient whose ShardedOptimizer no longer exists")
    return registry.norm(shown, ord)


def _vector_norm(
    shown: ShardedGrad, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> Tensor:
    if dim is not None:
        raise _unsupported_with("torch.linalg.vector_norm", f"dim={dim!r}")
    norm = _norm_of(shown, _ord(ord, "torch.linalg.vector_norm"), "torch.linalg.vector_norm")
    return norm if dtype is None else norm.to(dtype)


def _tensor_norm(
    shown: ShardedGrad, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: Any = None
) -> Tensor:
    if dim is not None:
        raise _unsupported_with("Tensor.norm", f"dim={dim!r}")
    norm = _norm_of(shown, _ord(p, "Tensor.norm"), "Tensor.norm")
    return norm if dtype is None else norm.to(dtype)


def _foreach_norm(tensors: Sequence[Tensor], ord: Any = 2, dtype: Any = None) -> list[Tensor]:
    tensors = list(tensors)
    out: list[Tensor | None] = [None] * len(tensors)
    rest = []
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, ShardedGrad):
            out[i] = _norm_of(tensor, _ord(ord, "torch._foreach_norm"), "torch._foreach_norm")
            if dtype is not None:
                out[i] = out[i].to(dtype)  # type: ignore[union-attr]
        else:
            rest.append(i)
    if rest:
        with torch._C.DisableTorchFunctionSubclass():
            for i, norm in zip(rest, torch._foreach_norm([tensors[i] for i in rest], ord, dtype=dtype)):
                out[i] = norm
    return out  # type: ignore[return-value]


def _itself(shown: ShardedGrad, *args: Any, **kwargs: Any) -> ShardedGrad:
    return shown


def _no_copy(shown: ShardedGrad, *args: Any, **kwargs: Any) -> None:
    return None  # a copy of a model does not take the gradient sharded over the ranks


def _repr(shown: ShardedGrad, *args: Any, **kwargs: Any) -> str:
    return (
        f"ShardedGrad(shape={tuple(shown.shape)}, dtype={shown.dtype}: the gradient of {shown._what}, "
        "sharded over the ranks by ShardedOptimizer(shard_gradients=True))"
    )


def _attribute(func: Any) -> tuple[str | None, str | None]:
    """Return the attribute a ``__torch_function__`` call reads or writes, and how (``"__get__"``)."""
    access = getattr(func, "__name__", None)
    if access in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", None), access
    return None, None


def _data(access: str | None, shown: ShardedGrad, value: Any = None) -> Any:
    """``shown.data`` is itself; assigning itself to it changes nothing (``module._apply`` does)."""
    if access == "__set__" and value is not shown:
        raise _unsupported_with("Tensor.data", "another tensor assigned (assign the parameter's .grad)")
    return shown if access == "__get__" else None


def _converted(func: Any) -> Callable[..., Any]:
    """Return the handler of a conversion (``to``, ``cpu``, ``double``, ...): itself where nothing changes."""

    def handler(shown: ShardedGrad, *args: Any, **kwargs: Any) -> ShardedGrad:
        with torch._C.DisableTorchFunctionSubclass():
            probe = func(torch.zeros((), dtype=shown.dtype, device=shown.device), *args, **kwargs)
        if isinstance(probe, Tensor) and probe.dtype == shown.dtype and probe.device == shown.device:
            return shown
        raise RuntimeError(
            f"the gradient of {shown._what} is sharded over the ranks by a ShardedOptimizer, built for "
            f"{shown.dtype} on {shown.device}, so it cannot be converted to "
            f"{getattr(probe, 'dtype', probe)} on {getattr(probe, 'device', '?')}; move or convert the model "
            "before building the ShardedOptimizer (or after opt.zero_grad(), and build a new one)"
        )

    return handler


_HANDLERS: dict[Any, Callable[..., Any]] = {
    **{
        getattr(Tensor, name): _in_place(name)
        for name in ("zero_", "mul_", "div_", "clamp_", "clamp_min_", "clamp_max_", "nan_to_num_")
    },
    Tensor.__imul__: _in_place("mul_"),
    Tensor.__itruediv__: _in_place("div_"),
    **{
        getattr(torch, f"_foreach_{name}"): _foreach_in_place(name)
        for name in ("zero_", "mul_", "div_", "clamp_min_", "clamp_max_")
    },
    torch.linalg.vector_norm: _vector_norm,
    Tensor.norm: _tensor_norm,
    torch.norm: _tensor_norm,
    torch._foreach_norm: _foreach_norm,
    Tensor.detach: _itself,
    Tensor.detach_: _itself,
    Tensor.requires_grad_: _itself,
    **{
        getattr(Tensor, name): _converted(getattr(Tensor, name))
        for name in ("to", "cpu", "cuda", "type", "float", "double", "half", "bfloat16")
    },
    Tensor.contiguous: _itself,
    Tensor.is_contiguous: lambda shown, *args, **kwargs: True,  # as the gradient it stands for
    Tensor.__deepcopy__: _no_copy,
    Tensor.__repr__: _repr,
    Tensor.__format__: lambda shown, spec: _repr(shown),
}

#: Methods that read what a tensor is, not its values.
_METADATA = {
    torch._has_compatible_shallow_copy_type,
    *(
        getattr(Tensor, name)
        for name in (
            "size", "dim", "numel", "nelement", "element_size", "stride", "is_floating_point", "is_complex",
            "get_device", "__len__", "data_ptr", "storage_offset", "untyped_storage", "__hash__", "is_sparse",
        )
        if hasattr(Tensor, name)
    ),
}  # fmt: skip


_WHAT_WORKS = (
    "what works on it: clearing it (p.grad = None, model.zero_grad(), opt.zero_grad()), zeroing it, "
    "torch.nn.utils.clip_grad_norm_ / clip_grad_value_ and opt.clip_grad_norm_, its norms (global: call "
    "them on every rank) and scaling it by a number; this rank's part is the .grad of the tensors of "
    "opt.local_optimizer, and ShardedOptimizer(..., shard_gradients=False) keeps whole averaged gradients"
)


def _unsupported_with(name: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"a gradient sharded over the ranks (ShardedOptimizer(shard_gradients=True) keeps each rank's "
        f"averaged part only) takes {name} but not with {what}; {_WHAT_WORKS}"
    )


def _unsupported(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> RuntimeError:
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    name = name.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "torch.")
    shown = next((a for a in (*args, *kwargs.values()) if isinstance(a, ShardedGrad)), None)
    whose = "" if shown is None else f" of {shown._what}"
    return RuntimeError(
        f"the gradient{whose} is sharded over the ranks: ShardedOptimizer(shard_gradients=True) keeps "
        f"each rank's averaged part only, so {name} cannot run on it; {_WHAT_WORKS}"
    )
