"""The ownership rules of :class:`~flatten_parametrize.ShardedOptimizer`: one strategy object per rule.

A strategy decides three things, and the rest of the optimizer asks it nothing else:

* its **param groups** (:meth:`Strategy.groups`): what the user's ``params`` mean, checked, each as a
  :class:`ShardedGroup` with its optimizer class, the settings the class is constructed with, and its
  **entries**, the tensors of the gathered state dict (the one-process optimizer's ``state_dict()``
  over them);
* **who owns which elements** of each flat parameter (:meth:`Strategy.ranges`), every rank's ranges;
* this rank's **pieces** (:meth:`Strategy.pieces`): the tensors its inner optimizers step, each inside
  one of its ranges and inside one entry.

The shard (``shard.py``), the inner optimizers (``sharded_local.py``), the collectives, the gradient
path and the state conversion (``sharded_state.py``) work from those for every rule alike.

* :class:`Slices` (ZeRO-1/2): each flat parameter is its own entry, cut into ``W`` equal slices
  (``c = ceil(n / W)`` elements; the last ones shorter or empty): rank ``r`` owns the ``r``-th and
  steps it as one 1-D piece with an element-wise optimizer.
* :class:`WholeTensors` (``whole_tensors=True``): each of the model's tensors is an entry; who owns
  which tensors is decided over every flat parameter at once, balanced by what each tensor's step
  costs (``sharded_plan.py``, ``sharded_costs.py``), never cutting a tensor whose class is not
  element-wise (``sharded_rules.cuttable``); a rank's part of a flat parameter may be several ranges;
  the rank steps its tensors in their shapes with their group's class.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor

from .shard import Piece
from .sharded_args import (
    CLASS_KEY,
    check_class,
    items_of,
    not_in_storage,
    param_groups,
)
from .sharded_plan import Bucket, BucketTensor, Plan, plan_ownership
from .sharded_rules import (
    check_known_settings,
    check_slice_settings,
    check_steps_alone,
    construction_kwargs,
    cuttable,
)

if TYPE_CHECKING:
    from .._core.records import Coordinator

__all__ = ["Entry", "ShardedGroup", "Slices", "Strategy", "WholeTensors", "buckets_of"]


class Entry(NamedTuple):
    """A tensor of the gathered state dict: where it lies in which flat parameter, and its shape."""

    #: Index of its flat parameter in ``storage.flat_params``.
    g: int
    #: Its first element in the flat buffer.
    offset: int
    #: Its number of elements.
    numel: int
    #: Its shape.
    shape: tuple[int, ...]


class ShardedGroup(NamedTuple):
    """One param group of a ``ShardedOptimizer``, checked."""

    #: The group as given, with ``params`` a list of the user's tensors.
    group: dict[str, Any]
    #: Its optimizer class (the group's own, or the constructor's).
    optimizer_class: type[torch.optim.Optimizer]
    #: Its tensors in the gathered state dict, in order.
    entries: list[Entry]
    #: The keyword arguments its class is constructed with (``sharded_rules.construction_kwargs``).
    init: dict[str, Any]
    #: Whether its class's math is element-wise (its tensors may be cut; its state is per element).
    elementwise: bool


class Strategy(Protocol):
    """An ownership rule of ``ShardedOptimizer``."""

    #: What a refusal calls it (``"ShardedOptimizer(whole_tensors=True)"``).
    name: str

    def groups(
        self,
        storage: Coordinator,
        params: Any,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        allow_unlisted: bool,
        taken: Sequence[Tensor] = (),
    ) -> list[ShardedGroup]:
        """Return ``params`` as checked groups (``taken``: tensors already optimized)."""
        ...

    def ranges(
        self, g: int, numel: int, world: int, max_padding: float | None
    ) -> list[list[tuple[int, int]]]:
        """Return each rank's element ranges of flat parameter ``g`` of ``numel`` elements.

        ``max_padding``: the collectives take one padded buffer where it pads at most this fraction
        (``None``: each owner's ranges move on their own).
        """
        ...

    def units(self, world: int, max_padding: float | None) -> list[list[int]]:
        """Return the flat parameters (indices) that move together in one buffer; the others move alone."""
        ...

    def pieces(self, g: int, mine: Sequence[tuple[int, int]]) -> list[Piece]:
        """Return the pieces of flat parameter ``g`` inside this rank's ranges ``mine``."""
        ...

    def check_add_group(self) -> None:
        """Raise if a param group cannot be added after construction."""
        ...


def _entries_of_flats(storage: Coordinator, flats: Iterable[Tensor]) -> list[Entry]:
    index = {id(f): g for g, f in enumerate(storage.flat_params)}
    return [Entry(index[id(f)], 0, f.numel(), (f.numel(),)) for f in flats]


class Slices:
    """ZeRO-1/2: every flat parameter is cut into equal slices, one per rank, stepped element-wise."""

    name = "ShardedOptimizer"

    def groups(
        self,
        storage: Coordinator,
        params: Any,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        allow_unlisted: bool,
        taken: Sequence[Tensor] = (),
    ) -> list[ShardedGroup]:
        """Return groups over flat parameters: each is one entry; one class, constructed with the kwargs."""
        check_class(optimizer_class, allow_unlisted)
        groups = param_groups(storage, params, taken)
        check_slice_settings(optimizer_class, optimizer_kwargs, groups)
        kwargs = dict(optimizer_kwargs)
        return [
            ShardedGroup(group, optimizer_class, _entries_of_flats(storage, group["params"]), kwargs, True)
            for group in groups
        ]

    def ranges(
        self, g: int, numel: int, world: int, max_padding: float | None
    ) -> list[list[tuple[int, int]]]:
        """Return each rank ``r``'s slice ``[r c, (r + 1) c)``, ``c = ceil(numel / world)`` (clipped)."""
        chunk = -(-numel // world)
        return [[(min(r * chunk, numel), min((r + 1) * chunk, numel))] for r in range(world)]

    def units(self, world: int, max_padding: float | None) -> list[list[int]]:
        """Return none: equal slices pad each flat parameter by less than one element per rank."""
        return []

    def pieces(self, g: int, mine: Sequence[tuple[int, int]]) -> list[Piece]:
        """Return this rank's slice as one 1-D piece (empty past the end)."""
        ((lo, hi),) = mine if mine else ((0, 0),)
        return [Piece(0, lo, hi - lo, (hi - lo,))]

    def check_add_group(self) -> None:
        """A group can be added: its flat parameters are cut as they come."""


class WholeTensors:
    """``whole_tensors=True``: each rank owns whole tensors of every flat parameter, one range per rank.

    Args:
        storage: the storage's core (its layouts).
    """

    name = "ShardedOptimizer(whole_tensors=True)"

    def __init__(self, storage: Coordinator) -> None:
        self._layouts = [group.layout for group in storage.groups()]
        #: ``(g, member index)`` -> the class that steps it (filled by :meth:`groups`).
        self._classes: dict[tuple[int, int], type] = {}
        #: Each flat parameter's element size and whether it is trained (it is sharded then).
        self._flats = [(f.element_size(), f.requires_grad) for f in storage.flat_params]
        #: Each flat parameter's dtype and device: flat parameters of one unit share a buffer.
        self._kinds = [(f.dtype, f.device) for f in storage.flat_params]
        #: The ownership of every sharded flat parameter, made once for the world size and padding.
        self._plan: tuple[tuple[int, float | None], dict[int, int], Plan] | None = None

    def groups(
        self,
        storage: Coordinator,
        params: Any,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        allow_unlisted: bool,
        taken: Sequence[Tensor] = (),
    ) -> list[ShardedGroup]:
        """Return groups over the storage's tensors, each with its class and the settings it is built with.

        A group's ``params`` may hold flat parameters (all of their tensors) and, in per-tensor mode,
        the model's parameters (each one tensor). A group may name its own optimizer class under
        ``"optimizer_class"``; each group's class is checked by the rules of ``sharded_rules.py``.

        Raises:
            TypeError: if ``params`` is not an iterable of tensors or of param-group dicts.
            ValueError: if a tensor is not one of the storage's, or is listed twice, or a group's
                class cannot step a rank's tensors alone.
        """
        check_class(optimizer_class, allow_unlisted, whole_tensors=True)
        flats = storage.flat_params
        example = "[{'params': mats, 'optimizer_class': torch.optim.Muon}]"
        items = items_of(flats, params, "tensors", example)
        slots = {
            id(slot.param): (g, slot.index)
            for g, group in enumerate(storage.groups())
            for slot in group.members
        }
        sizes = [len(group.members) for group in storage.groups()]
        seen: dict[tuple[int, int], int] = {}
        out = []
        for i, item in enumerate(items):
            cls = item.get(CLASS_KEY, optimizer_class)
            check_class(cls, allow_unlisted, whole_tensors=True)
            tensors = item["params"]
            tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
            members: list[tuple[int, int]] = []
            for p in tensors:
                g = next((g for g, f in enumerate(flats) if f is p), None)
                if g is not None:
                    found = [(g, index) for index in range(sizes[g])]
                elif id(p) in slots:
                    found = [slots[id(p)]]
                else:
                    raise not_in_storage(storage, p, i)
                for member in found:
                    if member in seen:
                        info = storage.groups()[member[0]].members[member[1]]
                        raise ValueError(
                            f"ShardedOptimizer: {info.name} appears in param groups {seen[member]} and {i}; "
                            "list each parameter once"
                        )
                    seen[member] = i
                members += found
            group = {k: v for k, v in item.items() if k != CLASS_KEY}
            init = construction_kwargs(cls, optimizer_kwargs if cls is optimizer_class else {}, group)
            check_known_settings(cls([torch.zeros(2, 2, requires_grad=True)], **init))
            check_steps_alone(cls, init, [tuple(t.shape) for t in tensors])
            self._classes.update(dict.fromkeys(members, cls))
            entries = [self._entry(g, index) for g, index in members]
            out.append(ShardedGroup({**group, "params": tensors}, cls, entries, init, cuttable(cls)))
        return out

    def _entry(self, g: int, index: int) -> Entry:
        layout = self._layouts[g]
        return Entry(g, layout.offsets[index], layout.numels[index], tuple(layout.shapes[index]))

    def _members(self, g: int) -> list[tuple[int, int, int, tuple[int, ...]]]:
        layout = self._layouts[g]
        return [
            (index, layout.offsets[index], layout.numels[index], tuple(layout.shapes[index]))
            for index in range(len(layout.numels))
        ]

    def _planned(self, world: int, max_padding: float | None) -> tuple[dict[int, int], Plan]:
        """Return each planned flat parameter's bucket (in bucket order), and the plan (made once)."""
        if self._plan is None or self._plan[0] != (world, max_padding):
            used = sorted({g for g, _ in self._classes if self._flats[g][1]})
            members = {g: self._members(g) for g in used}
            buckets = buckets_of(
                [(self._layouts[g].numel, self._flats[g][0], members[g]) for g in used],
                [[self._classes.get((g, m[0])) for m in members[g]] for g in used],
                [self._kinds[g] for g in used],
            )
            index = {g: b for b, g in enumerate(used)}
            self._plan = ((world, max_padding), index, plan_ownership(buckets, world, max_padding))
        return self._plan[1], self._plan[2]

    def ranges(
        self, g: int, numel: int, world: int, max_padding: float | None
    ) -> list[list[tuple[int, int]]]:
        """Return each rank's ranges of flat parameter ``g``, from the plan over every flat parameter."""
        used, plan = self._planned(world, max_padding)
        bucket = used.get(g)
        if bucket is None:  # nothing of it is stepped here: one owner, nothing to balance
            return [[(0, numel)] if r == 0 else [] for r in range(world)]
        return plan.ranges[bucket]

    def units(self, world: int, max_padding: float | None) -> list[list[int]]:
        """Return the plan's units of several flat parameters (laid out for one buffer: ``max_padding``)."""
        used, plan = self._planned(world, max_padding)
        flats = list(used)  # each bucket's flat parameter, in bucket order
        return [flats[first:stop] for first, stop in plan.units if stop - first > 1]

    def pieces(self, g: int, mine: Sequence[tuple[int, int]]) -> list[Piece]:
        """Return each tensor (or part of an element-wise one) inside this rank's ranges, in its shape."""
        out = []
        for lo, hi in mine:
            for index, offset, numel, shape in self._members(g):
                start, stop = max(offset, lo), min(offset + numel, hi)
                if stop > start:
                    whole = start == offset and stop == offset + numel
                    out.append(Piece(index, start, stop - start, shape if whole else (stop - start,)))
        return out

    def check_add_group(self) -> None:
        """Refuse: the flat parameters were cut for the groups given at construction."""
        raise RuntimeError(
            "ShardedOptimizer(whole_tensors=True) cuts every flat parameter at construction, so it cannot "
            "add a param group later; build it with every param group"
        )


def buckets_of(
    flats: Sequence[tuple[int, int, Sequence[tuple[int, int, int, tuple[int, ...]]]]],
    classes: Sequence[Sequence[type | None]],
    kinds: Sequence[Hashable] | None = None,
) -> list[Bucket]:
    """Return the buckets that ``sharded_plan.plan_ownership`` balances, from flat parameters' layouts.

    Args:
        flats: per flat parameter, its numel (padding included), element size and members
            ``(index, offset, numel, shape)``.
        classes: per flat parameter, the class that steps each member (``None``: none).
        kinds: per flat parameter, what two must share to move in one buffer (dtype and device;
            ``None``: anything).

    Returns:
        One bucket per flat parameter.

    Example:
        >>> import torch
        >>> buckets_of([(6, 4, [(0, 0, 6, (2, 3))])], [[torch.optim.Muon]])[0].members[0].shape
        (2, 3)
    """
    return [
        Bucket(
            numel,
            itemsize,
            [BucketTensor(offset, n, shape, cls) for (_, offset, n, shape), cls in zip(members, owners)],
            None if kinds is None else kinds[i],
        )
        for i, ((numel, itemsize, members), owners) in enumerate(zip(flats, classes))
    ]


def strategy_for(storage: Coordinator, whole_tensors: bool) -> Strategy:
    """Return the ownership rule: :class:`WholeTensors` or :class:`Slices`."""
    return WholeTensors(storage) if whole_tensors else Slices()
