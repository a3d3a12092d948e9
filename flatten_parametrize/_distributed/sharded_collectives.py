"""The collectives of :class:`~flatten_parametrize.ShardedOptimizer` over its process group.

Every collective the optimizer starts is here: the construction broadcast,
the layout check, the reduction of a flat gradient to the slices' owners,
the gather of the updated slices after ``step()``, the norm all-reduce of
``clip_grad_norm_`` and the gather of a state value for ``state_dict()``.
What moves is described by the :class:`Shard` of each flat parameter (who
owns which element range); no collective decides ownership.

Collectives per backend, measured on gloo (``benchmarks/bench_zero.py
--collectives``, 25 MiB bucket, 2 and 3 ranks): a broadcast from each owner
gathers the updated slices 1.8-5x faster than ``all_gather_into_tensor`` and
2.1-2.8x faster than an all-reduce of a zero-padded buffer; a reduce to each
owner reduces gradients 1.8-3.9x faster than ``reduce_scatter_tensor``. NCCL
has in-place ``all_gather`` / ``reduce_scatter`` over one padded buffer, which
is what it is built for. The uneven ranges of whole tensors take that path on
NCCL too where the padding is small (at most :data:`MAX_PADDING` of the
bucket): each owner's range is copied to a place of ``chunk`` elements (the
largest range) of one padded buffer, so a bucket is one ``reduce_scatter``
and one ``all_gather``, at the cost of one copy of the bucket each way; a
bucket whose ranges differ more moves by owner, so that the bytes moved stay
within that fraction of element-wise ZeRO-2's. Where the ownership was laid
out for it (``Partition.units``), a **unit** of several buckets moves as one:
each rank's ranges of all of them packed into one slot of one padded buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .shard import Shard
from .sharded_plan import pads_little
from .sharded_staging import UnitBuffer

__all__ = ["Collectives", "UnitWorks", "Works", "all_gather", "one_buffer", "reduce_scatter", "unit_chunk"]

#: The one-buffer collectives (newer torch names them ``*_single``).
all_gather: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)

#: The most padding (a fraction of the bucket) for which uneven ranges take the one-buffer path.
MAX_PADDING = 0.05

#: The handles of the collectives in flight for one flat gradient, and what gives its result after them.
Works = tuple[list[Any], Callable[[], Tensor]]

#: The handles of the collectives in flight for a unit's gradients, what gives each shard's result after
#: them, and what they read (kept alive until then).
UnitWorks = tuple[list[Any], Callable[[], list[Tensor]], list[Tensor]]


def one_buffer(chunk: int, numel: int, world: int) -> bool:
    """Return whether a bucket of ``numel`` elements whose largest owner holds ``chunk`` moves in one buffer.

    NCCL's path: one ``reduce_scatter`` and one ``all_gather`` of ``world * chunk`` elements, taken where
    that pads the bucket by at most :data:`MAX_PADDING`, or by less than one element per rank (ZeRO's equal
    slices of a small bucket); else each owner's ranges move on their own, and the bytes stay the bucket's.

    Example:
        >>> one_buffer(25, 100, 4), one_buffer(100, 100, 4)  # even slices; one owner of the whole bucket
        (True, False)
        >>> one_buffer(3, 10, 4)  # equal slices of a small bucket
        True
    """
    return pads_little(chunk, numel, world, MAX_PADDING)


def unit_chunk(unit: Sequence[Shard], world: int) -> int:
    """Return the most elements one rank owns of a unit's shards: its slot in one padded buffer.

    Example:
        >>> from flatten_parametrize._distributed.shard import Shard
        >>> import torch
        >>> a = Shard(0, torch.zeros(4), 0, [[(0, 4)], []], [])
        >>> b = Shard(1, torch.zeros(6), 0, [[(0, 1)], [(1, 6)]], [])
        >>> unit_chunk([a, b], 2)  # rank 0: 4 + 1, rank 1: 5
        5
    """
    return max(sum(b - a for shard in unit for a, b in shard.ranges[r]) for r in range(world))


class Collectives:
    """The process group of a ``ShardedOptimizer`` and every collective it runs over it.

    Args:
        process_group: the ranks to shard over (``None``: the default group).
        world: the number of ranks in ``process_group``.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, world: int) -> None:
        self.group = process_group
        self.world = world
        #: This rank's index in the group.
        self.rank = dist.get_rank(process_group)
        #: Group rank -> global rank (what ``broadcast`` and ``reduce`` name a peer by).
        self.owners = [
            dist.get_global_rank(process_group, r) if process_group is not None else r for r in range(world)
        ]
        self.nccl = "nccl" in str(dist.get_backend(process_group))
        #: Move slices with one broadcast / reduce per owner (fastest on gloo), not one padded buffer (NCCL).
        self.by_owner = not self.nccl

    @property
    def max_padding(self) -> float | None:
        """Return the padding up to which uneven ranges take one buffer (``None``: they move by owner)."""
        return None if self.by_owner else MAX_PADDING

    def by_owner_for(self, shard: Shard) -> bool:
        """Return whether ``shard``'s ranges move one owner at a time (else: one padded buffer)."""
        return self.by_owner or not one_buffer(shard.chunk, shard.numel, self.world)

    def one_buffer_for(self, unit: Sequence[Shard]) -> bool:
        """Return whether a unit of several shards moves in one padded buffer (else: each on its own)."""
        return self._slot(unit) is not None

    def _slot(self, unit: Sequence[Shard]) -> int | None:
        """Return a rank's slot in a unit's one padded buffer (``None``: its shards move on their own)."""
        if len(unit) < 2 or self.by_owner or len({(s.dtype, s.device) for s in unit}) > 1:
            return None
        chunk = unit_chunk(unit, self.world)
        return chunk if one_buffer(chunk, sum(s.numel for s in unit), self.world) else None

    def device(self, flats: Sequence[Tensor]) -> torch.device:
        """Return the device for small collectives (the backend's: CUDA for NCCL)."""
        if self.nccl:
            return torch.device("cuda", torch.cuda.current_device())
        return flats[0].device if flats else torch.device("cpu")

    def all_gather_ints(self, mine: int, device: torch.device) -> list[int]:
        """Return every rank's ``mine``, in rank order (one collective)."""
        everyone = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world)]
        dist.all_gather(everyone, torch.tensor([mine], dtype=torch.int64, device=device), group=self.group)
        return [int(t.item()) for t in everyone]

    def broadcast_from_first(self, flats: Sequence[Tensor]) -> None:
        """Copy rank 0's values of ``flats`` to every rank."""
        with torch.no_grad():
            works = [
                dist.broadcast(f.detach(), self.owners[0], group=self.group, async_op=True) for f in flats
            ]
            for work in works:
                work.wait()
            for flat in flats:
                torch.autograd.graph.increment_version(flat)

    def all_reduce_mean(self, grad: Tensor) -> Works:
        """Start averaging the whole ``grad`` in place over the ranks (ZeRO-1)."""
        if not self.nccl:
            grad.div_(self.world)  # gloo has no average: divide, then sum
            return [dist.all_reduce(grad, group=self.group, async_op=True)], lambda: grad
        return [dist.all_reduce(grad, dist.ReduceOp.AVG, group=self.group, async_op=True)], lambda: grad

    def reduce_to_owners(self, shard: Shard, grad: Tensor) -> Works:
        """Start summing each owner's ranges of ``grad`` on that owner (ZeRO-2).

        Returns:
            The handles and what gives this rank's summed ranges, packed (maybe padded), once they finished.
        """
        pg, world = self.group, self.world
        if self.by_owner_for(shard):
            works = [
                dist.reduce(grad[lo:hi], self.owners[owner], group=pg, async_op=True)
                for owner in range(world)
                for lo, hi in shard.ranges[owner]
            ]
            return works, lambda: shard.pack(grad)
        out = grad.new_empty(shard.chunk)
        sent = self._spread(shard, grad)
        return [reduce_scatter(out, sent, group=pg, async_op=True)], lambda: out

    def reduce_unit(self, unit: Sequence[Shard], grads: Sequence[Tensor]) -> UnitWorks:
        """Start summing each owner's ranges of a unit's gradients on that owner (ZeRO-2).

        Returns:
            The handles, what gives this rank's summed ranges of each shard, and the buffer they read.
        """
        staged = None if len({g.dtype for g in grads}) > 1 else self.unit_buffer(unit, grads[0].dtype)
        if staged is None:
            started = [self.reduce_to_owners(shard, grad) for shard, grad in zip(unit, grads)]
            works = [work for handles, _ in started for work in handles]
            return works, lambda: [result() for _, result in started], list(grads)
        for position, grad in enumerate(grads):
            staged.put(position, grad)
        return self.reduce_staged(unit, staged)

    def unit_buffer(self, unit: Sequence[Shard], dtype: torch.dtype) -> UnitBuffer | None:
        """Return an empty padded buffer for a unit's gradients (``None``: its shards move on their own)."""
        chunk = self._slot(unit)
        return None if chunk is None else UnitBuffer(unit, chunk, self.world, dtype, unit[0].device)

    def reduce_staged(self, unit: Sequence[Shard], staged: UnitBuffer) -> UnitWorks:
        """Start one ``reduce_scatter`` of a unit's filled buffer (see :meth:`reduce_unit`)."""
        sent = staged.buffer
        out = sent.new_empty(staged.chunk)
        work = reduce_scatter(out, sent, group=self.group, async_op=True)

        def result() -> list[Tensor]:
            parts, at = [], 0
            for shard in unit:
                parts.append(out[at : at + shard.owned])
                at += shard.owned
            return parts

        return [work], result, [sent]

    def _spread(self, shard: Shard, grad: Tensor) -> Tensor:
        """Return ``grad`` in one buffer, a slot of ``shard.chunk`` per rank, each owner's ranges first.

        ZeRO's equal slices of one shard are already in place (padded at the end, if at all).
        """
        size = shard.chunk * self.world
        if shard.aligned:  # each owner's range is already at its slot: pad the end
            return grad if grad.numel() == size else torch.cat([grad, grad.new_zeros(size - grad.numel())])
        staged = UnitBuffer([shard], shard.chunk, self.world, grad.dtype, grad.device)
        staged.put(0, grad)
        return staged.buffer

    def gather_ranges(self, shard: Shard, full: Tensor) -> list[Any]:
        """Start filling every owner's ranges of ``full`` (shaped like the flat buffer) from that owner.

        ``full`` holds this rank's ranges. By owner: a broadcast of each range into ``full``, in place.
        In one padded buffer: this rank's ranges packed into a slot, one ``all_gather``, and the others'
        copied into ``full`` when :meth:`finish` runs the returned handles' follow-ups.

        Returns:
            The handles, and the copies to run after them (see :meth:`finish`).
        """
        world, pg = self.world, self.group
        if self.by_owner_for(shard):
            works = [
                dist.broadcast(full[lo:hi], self.owners[owner], group=pg, async_op=True)
                for owner in range(world)
                for lo, hi in shard.ranges[owner]
            ]
            return [(works, None)]
        chunk = shard.chunk
        if shard.aligned and full.numel() == chunk * world and full.is_contiguous():
            lo = shard.rank * chunk
            return [([all_gather(full, full[lo : lo + chunk], group=pg, async_op=True)], None)]
        return self._gather_packed([shard], [full], chunk)

    def gather_unit(self, unit: Sequence[Shard], fulls: Sequence[Tensor]) -> list[Any]:
        """Start filling every owner's ranges of a unit's ``fulls`` (as :meth:`gather_ranges`, one buffer).

        Returns:
            The handles, and the copies to run after them (see :meth:`finish`).
        """
        chunk = self._slot(unit)
        if chunk is None:
            return [part for shard, full in zip(unit, fulls) for part in self.gather_ranges(shard, full)]
        return self._gather_packed(unit, fulls, chunk)

    def _gather_packed(self, unit: Sequence[Shard], fulls: Sequence[Tensor], chunk: int) -> list[Any]:
        """Start one ``all_gather`` of each rank's ranges of a unit's ``fulls``, in slots of ``chunk``."""
        world = self.world
        mine = torch.cat([shard.pack(full) for shard, full in zip(unit, fulls)])
        if mine.numel() < chunk:
            mine = torch.cat([mine, mine.new_zeros(chunk - mine.numel())])
        out = mine.new_empty(chunk * world)

        def unpack() -> None:
            for owner in range(world):
                at = owner * chunk
                for shard, full in zip(unit, fulls):
                    for lo, hi in shard.ranges[owner]:
                        full[lo:hi].copy_(out[at : at + hi - lo])
                        at += hi - lo

        return [([all_gather(out, mine, group=self.group, async_op=True)], unpack)]

    @staticmethod
    def finish(started: list[Any]) -> None:
        """Wait for what :meth:`gather_ranges` started, then run its copies."""
        for works, _ in started:
            for work in works:
                work.wait()
        for _, after in started:
            if after is not None:
                after()

    def gather_slices(self, units: Sequence[Sequence[Shard]]) -> None:
        """Copy every owner's updated ranges into every rank's flat buffers (``units``: what moves as one)."""
        with torch.no_grad():
            started = [
                part for unit in units for part in self.gather_unit(unit, [s.flat.detach() for s in unit])
            ]
            self.finish(started)
            for unit in units:
                for shard in unit:
                    torch.autograd.graph.increment_version(shard.flat)

    def total_norm(self, local: Tensor, p: float, device: torch.device) -> Tensor:
        """Return the p-norm over all ranks from this rank's part (its max for ``inf``, else a p-th power)."""
        return self.total_norms(local.reshape(1), p, device)[0]

    def total_norms(self, local: Tensor, p: float, device: torch.device) -> Tensor:
        """Return p-norms over all ranks, one all-reduce, from this rank's parts (as :meth:`total_norm`).

        ``p = 0`` counts the non-zero elements (the parts are counts).
        """
        total = local.reshape(-1).to(device)
        if math.isinf(p):
            dist.all_reduce(total, dist.ReduceOp.MAX, group=self.group)
            return total
        dist.all_reduce(total, group=self.group)
        return total if p == 0 else total ** (1.0 / p)
