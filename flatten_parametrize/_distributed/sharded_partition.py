"""Who owns which part of each flat parameter in a :class:`~flatten_parametrize.ShardedOptimizer`.

The ownership rule is an object behind the :class:`Partition` protocol: the
collectives (``sharded_collectives.py``), the backward reductions
(``sharded_reducer.py``), the local step (``sharded_local.py``) and the state
conversion (``sharded_state.py``) read only what it says: for each flat
parameter, the :class:`Shard` with each rank's element range and this rank's
parameter for the inner optimizer. :class:`SliceOwnership` is the rule of
ZeRO-1/2: rank ``r`` owns the ``r``-th of ``W`` equal contiguous slices of
every flat parameter. :class:`TensorOwnership` (``whole_tensors=True``)
cuts each flat parameter at tensor boundaries into uneven ranges, one per
rank; its shards say so (``Shard.even`` is false): the collectives move
them by owner (``Shard.bounds``), or on NCCL through one buffer padded to
``Shard.chunk`` elements per rank; the per-rank state format, which assumes
equal slices of the flat parameter, is not theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from torch import Tensor

from .shard import Shard, TensorShard

#: ``(member index, flat offset, numel, shape, atomic)`` of one member of a flat parameter, where
#: ``atomic`` says that its optimizer needs it whole (its math is per tensor).
Member = tuple[int, int, int, tuple[int, ...], bool]

__all__ = ["Member", "Partition", "SliceOwnership", "TensorOwnership", "cut_whole_tensors"]


class Partition(Protocol):
    """An ownership rule.

    ``sharded.py`` builds it and calls all of it; the collectives, the
    reducer, the local step and the state conversion read only ``world``,
    ``rank``, ``shards``, ``shard_of`` and ``index_of``.
    """

    #: The number of ranks the flat parameters are cut over.
    world: int
    #: This rank's index among them.
    rank: int

    @property
    def shards(self) -> Sequence[Shard]:
        """This rank's shards, in the storage's group order (the order collectives start in on every rank)."""
        ...

    def shard_of(self, flat: Tensor) -> Shard | None:
        """Return this rank's shard of ``flat`` (``None``: not sharded here)."""
        ...

    def index_of(self, flat: Tensor) -> int | None:
        """Return the position of ``flat``'s shard in :attr:`shards` (``None``: not sharded here)."""
        ...

    def add(self, flat_params: Sequence[Tensor], flats: Sequence[Tensor]) -> list[Tensor]:
        """Shard the trainable flat parameters of ``flats``; return the inner optimizer's parameters."""
        ...

    def bind(self) -> None:
        """Point every shard at its flat buffer's current memory."""
        ...

    def follow(
        self, flats: Sequence[Tensor], names: Sequence[str], strict: bool
    ) -> list[tuple[Tensor, Tensor]]:
        """Follow replaced or moved flat parameters; return the ``(old, new)`` replaced."""
        ...


class SliceOwnership:
    """Rank ``r`` owns the ``r``-th of ``world`` contiguous slices of every trainable flat parameter.

    Args:
        world: the number of ranks.
        rank: this rank.
    """

    def __init__(self, world: int, rank: int) -> None:
        self.world = world
        self.rank = rank
        self._shards: list[Shard] = []

    @property
    def shards(self) -> Sequence[Shard]:
        """This rank's slices, in the storage's group order."""
        return self._shards

    def shard_of(self, flat: Tensor) -> Shard | None:
        """Return this rank's slice of ``flat`` (``None``: not sliced here)."""
        return next((s for s in self._shards if s.flat is flat), None)

    def index_of(self, flat: Tensor) -> int | None:
        """Return the position of ``flat``'s slice in :attr:`shards` (``None``: not sliced here)."""
        return next((i for i, s in enumerate(self._shards) if s.flat is flat), None)

    def add(self, flat_params: Sequence[Tensor], flats: Sequence[Tensor]) -> list[Tensor]:
        """Slice each trainable flat parameter of ``flats``; return the inner parameters, in ``flats`` order.

        Args:
            flat_params: every flat parameter of the storage, in group order.
            flats: the ones to slice (those that do not require grad get no slice).
        """
        new = [
            self._shard(g, flat)
            for g, flat in enumerate(flat_params)
            if flat.requires_grad and any(flat is f for f in flats)
        ]
        self._shards = sorted(self._shards + new, key=lambda s: s.g)
        by_flat = {id(s.flat): s for s in new}
        return [by_flat[id(f)].param for f in flats if id(f) in by_flat]

    def _shard(self, g: int, flat: Tensor) -> Shard:
        """Return this rank's part of flat parameter ``g``: its ``r``-th equal slice."""
        return Shard(g, flat, self.rank, self.world)

    def bind(self) -> None:
        """Point every slice at its flat buffer's current memory (or refresh its padded copy)."""
        for shard in self._shards:
            shard.bind()

    def follow(
        self, flats: Sequence[Tensor], names: Sequence[str], strict: bool
    ) -> list[tuple[Tensor, Tensor]]:
        """Follow flat parameters replaced or moved to other memory; return the ``(old, new)`` replaced.

        A flat parameter converted to another dtype or moved to another
        device cannot be followed (the slices are the old one's): raise
        (``strict``) or leave it.

        Args:
            flats: the storage's flat parameters now, in group order.
            names: the storage's group names (for the error).
            strict: raise on a flat parameter that cannot be followed.

        Raises:
            RuntimeError: if ``strict`` and a flat parameter changed dtype or device.
        """
        return _follow(self._shards, flats, names, strict)


class TensorOwnership(SliceOwnership):
    """Each rank owns whole tensors of every trainable flat parameter: one contiguous range per rank.

    Each flat parameter's members, in their layout order, are cut into one
    range per rank by :func:`cut_whole_tensors`: balanced by elements, and
    never through a member whose optimizer needs it whole (its math is per
    tensor: Muon, Adafactor, Shampoo, LAMB). No reordering and no padding: the
    ranges are uneven, so the collectives move them one owner at a time.

    Args:
        world: the number of ranks.
        rank: this rank.
        members: ``g -> `` the members of flat parameter ``g`` (:data:`Member`), in layout order.
    """

    def __init__(self, world: int, rank: int, members: Callable[[int], Sequence[Member]]) -> None:
        super().__init__(world, rank)
        self._members = members

    def _shard(self, g: int, flat: Tensor) -> Shard:
        """Return this rank's range of flat parameter ``g``, cut at whole tensors, and its pieces."""
        members = self._members(g)
        cuts = cut_whole_tensors(flat.numel(), members, self.world)
        lo, hi = cuts[self.rank], cuts[self.rank + 1]
        pieces, spans = [], {}
        for index, offset, numel, shape, _ in members:
            start, stop = max(offset, lo), min(offset + numel, hi)
            if stop > start:
                whole = start == offset and stop == offset + numel
                pieces.append((index, start, stop - start, shape if whole else (stop - start,)))
                spans[index] = (offset, numel, shape)
        return TensorShard(g, flat, self.rank, cuts, pieces, spans)


def cut_whole_tensors(numel: int, members: Sequence[Member], world: int) -> list[int]:
    """Return the ``world + 1`` boundaries of the ranks' ranges of a flat buffer of ``numel`` elements.

    Rank ``r`` gets ``[cuts[r], cuts[r + 1])``. Each boundary is the even cut
    ``round(numel * r / world)``, moved to the nearer end of an atomic member
    that it would split (never before the previous boundary): each rank's
    range differs from ``numel / world`` by at most half the largest atomic
    member, and a member that may be split (element-wise math) keeps the even
    cut.

    Args:
        numel: the flat buffer's size, padding included.
        members: its members (:data:`Member`), in any order.
        world: the number of ranks.

    Returns:
        The boundaries, from 0 to ``numel``, non-decreasing.

    Example:
        >>> cut_whole_tensors(10, [(0, 0, 6, (2, 3), True), (1, 6, 4, (4,), False)], 2)
        [0, 6, 10]
        >>> cut_whole_tensors(10, [(0, 0, 6, (2, 3), False), (1, 6, 4, (4,), False)], 2)
        [0, 5, 10]
    """
    atomic = sorted((offset, offset + n) for _, offset, n, _, whole in members if whole and n > 1)
    cuts = [0]
    for r in range(1, world):
        cut = (numel * r + world // 2) // world
        for start, stop in atomic:
            if start < cut < stop:
                cut = start if cut - start <= stop - cut else stop
                break
        cuts.append(max(cut, cuts[-1]))
    cuts.append(numel)
    return cuts


def _follow(
    shards: Sequence[Shard], flats: Sequence[Tensor], names: Sequence[str], strict: bool
) -> list[tuple[Tensor, Tensor]]:
    replaced = []
    for shard in shards:
        flat = flats[shard.g]
        if flat.dtype != shard.param.dtype or flat.device != shard.param.device:
            if not strict:
                continue
            raise RuntimeError(
                f"ShardedOptimizer: flat parameter {names[shard.g]!r} moved to "
                f"{flat.dtype} on {flat.device} after the optimizer was built for {shard.param.dtype} on "
                f"{shard.param.device}; build the optimizer after model.to(...)"
            )
        if flat is not shard.flat:
            replaced.append((shard.flat, flat))
            shard.flat = flat
        if flat.data_ptr() != shard.ptr or (shard.shadow and flat._version != shard.version):
            shard.bind()  # new memory, or values written into a padded slice's range (a load)
    return replaced
