"""Who owns which part of each flat parameter in a :class:`~flatten_parametrize.ShardedOptimizer`.

A :class:`Partition` holds this rank's :class:`~.shard.Shard` of every flat
parameter the optimizer shards, in the storage's group order (the order every
rank starts its collectives in), made by the optimizer's ownership rule
(``sharded_strategies.py``), and its **units**: the shards that move together
in one padded buffer (the rule's choice; most move alone); it follows flat
parameters that ``module.to()`` and the like replaced or moved to other memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .shard import Shard
from .sharded_strategies import Strategy

__all__ = ["Partition"]


class Partition:
    """This rank's shards, made by an ownership rule.

    Args:
        strategy: the ownership rule.
        world: the number of ranks.
        rank: this rank.
        max_padding: the collectives take one padded buffer where it pads at most this fraction
            (``None``: each owner's ranges move on their own); the rule lays the ownership out for it.
    """

    def __init__(self, strategy: Strategy, world: int, rank: int, max_padding: float | None) -> None:
        self.world = world
        self.rank = rank
        self.max_padding = max_padding
        self._strategy = strategy
        self._shards: list[Shard] = []
        self._units: list[list[Shard]] = []

    @property
    def shards(self) -> Sequence[Shard]:
        """This rank's shards, in the storage's group order."""
        return self._shards

    @property
    def units(self) -> Sequence[Sequence[Shard]]:
        """The shards that move together (one padded buffer, where it pads little), in order."""
        return self._units

    def shard_of(self, flat: Tensor) -> Shard | None:
        """Return this rank's shard of ``flat`` (``None``: not sharded here)."""
        return next((s for s in self._shards if s.flat is flat), None)

    def index_of(self, flat: Tensor) -> int | None:
        """Return the position of ``flat``'s shard in :attr:`shards` (``None``: not sharded here)."""
        return next((i for i, s in enumerate(self._shards) if s.flat is flat), None)

    def add(self, flat_params: Sequence[Tensor], flats: Sequence[Tensor]) -> None:
        """Shard each flat parameter of ``flats`` that requires grad (the others get no shard).

        Args:
            flat_params: every flat parameter of the storage, in group order.
            flats: the ones to shard.
        """
        new = []
        for g, flat in enumerate(flat_params):
            if flat.requires_grad and any(flat is f for f in flats) and self.shard_of(flat) is None:
                ranges = self._strategy.ranges(g, flat.numel(), self.world, self.max_padding)
                new.append(Shard(g, flat, self.rank, ranges, self._strategy.pieces(g, ranges[self.rank])))
        self._shards = sorted(self._shards + new, key=lambda s: s.g)
        units = self._strategy.units(self.world, self.max_padding)
        together = {g: i for i, unit in enumerate(units) for g in unit}
        self._units = []
        for shard in self._shards:
            unit = together.get(shard.g)
            if unit is not None and self._units and together.get(self._units[-1][0].g) == unit:
                self._units[-1].append(shard)
            else:
                self._units.append([shard])

    def bind(self) -> None:
        """Point every shard's pieces at their flat buffer's current memory."""
        for shard in self._shards:
            shard.bind()

    def follow(
        self, flats: Sequence[Tensor], names: Sequence[str], strict: bool
    ) -> list[tuple[Tensor, Tensor]]:
        """Follow flat parameters replaced or moved to other memory; return the ``(old, new)`` replaced.

        A flat parameter converted to another dtype or moved to another
        device cannot be followed (the pieces and the state are the old one's):
        raise (``strict``) or leave it.

        Args:
            flats: the storage's flat parameters now, in group order.
            names: the storage's group names (for the error).
            strict: raise on a flat parameter that cannot be followed.

        Raises:
            RuntimeError: if ``strict`` and a flat parameter changed dtype or device.
        """
        replaced = []
        for shard in self._shards:
            flat = flats[shard.g]
            if flat.dtype != shard.dtype or flat.device != shard.device:
                if not strict:
                    continue
                raise RuntimeError(
                    f"ShardedOptimizer: flat parameter {names[shard.g]!r} moved to "
                    f"{flat.dtype} on {flat.device} after the optimizer was built for {shard.dtype} on "
                    f"{shard.device}; build the optimizer after model.to(...)"
                )
            if flat is not shard.flat:
                replaced.append((shard.flat, flat))
                shard.flat = flat
            if flat.data_ptr() != shard.ptr:
                shard.bind()  # new memory
        return replaced
