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
within that fraction of element-wise ZeRO-2's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .shard import Shard

__all__ = ["Collectives", "Works", "all_gather", "reduce_scatter"]

#: The one-buffer collectives (newer torch names them ``*_single``).
all_gather: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)

#: The most padding (a fraction of the bucket) for which uneven ranges take the one-buffer path.
MAX_PADDING = 0.05

#: The handles of the collectives in flight for one flat gradient, and the tensor they reduce into.
Works = tuple[list[Any], Tensor]


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

    def by_owner_for(self, shard: Shard) -> bool:
        """Return whether ``shard``'s ranges move one owner at a time (else: one padded buffer)."""
        if self.by_owner:
            return True
        return not shard.even and shard.chunk * self.world - shard.numel > MAX_PADDING * shard.numel

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
            return [dist.all_reduce(grad, group=self.group, async_op=True)], grad
        return [dist.all_reduce(grad, dist.ReduceOp.AVG, group=self.group, async_op=True)], grad

    def reduce_to_owners(self, shard: Shard, grad: Tensor) -> Works:
        """Start summing each slice of ``grad`` on its owner (ZeRO-2); this rank's sum lands in the result.

        By owner, the sum of this rank's slice lands in ``grad[shard.lo:shard.hi]``;
        in one padded buffer, it is the returned slice-sized tensor.
        """
        pg, world = self.group, self.world
        if self.by_owner_for(shard):
            works = []
            for owner in range(world):
                lo, hi = shard.bounds(owner)
                if hi > lo:
                    works.append(dist.reduce(grad[lo:hi], self.owners[owner], group=pg, async_op=True))
            return works, grad
        padded = grad
        if not shard.even:  # whole tensors: each owner's range at the start of its chunk
            padded = self._spread(shard, grad)
        elif grad.numel() != shard.chunk * world:
            padded = torch.cat([grad, grad.new_zeros(shard.chunk * world - grad.numel())])
        out = grad.new_empty(shard.chunk)
        return [reduce_scatter(out, padded, group=pg, async_op=True)], out

    def _spread(self, shard: Shard, values: Tensor) -> Tensor:
        """Return a new buffer of ``chunk`` elements per rank, each owner's range of ``values`` first."""
        chunk = shard.chunk
        out = values.new_zeros(chunk * self.world)
        for owner in range(self.world):
            lo, hi = shard.bounds(owner)
            out[owner * chunk : owner * chunk + hi - lo].copy_(values[lo:hi])
        return out

    def gather_slices(self, shards: Sequence[Shard]) -> None:
        """Copy every owner's updated slice into every rank's flat buffers."""
        world, pg = self.world, self.group
        works, padded = [], []
        spread: list[tuple[Shard, Tensor, Tensor]] = []
        with torch.no_grad():
            for shard in shards:
                flat = shard.flat.detach()
                if shard.shadow:
                    flat[shard.lo : shard.hi].copy_(shard.param[: shard.hi - shard.lo])
                if self.by_owner_for(shard):
                    for owner in range(world):
                        lo, hi = shard.bounds(owner)
                        if hi > lo:
                            works.append(
                                dist.broadcast(flat[lo:hi], self.owners[owner], group=pg, async_op=True)
                            )
                elif not shard.even:  # whole tensors: this rank's range padded to a chunk
                    mine = flat.new_zeros(shard.chunk)
                    mine[: shard.hi - shard.lo].copy_(flat[shard.lo : shard.hi])
                    out = flat.new_empty(shard.chunk * world)
                    works.append(all_gather(out, mine, group=pg, async_op=True))
                    spread.append((shard, flat, out))
                elif shard.numel == shard.chunk * world:  # in place: the input is the output's slice
                    works.append(all_gather(flat, shard.param, group=pg, async_op=True))
                else:
                    out = flat.new_empty(shard.chunk * world)
                    works.append(all_gather(out, shard.param, group=pg, async_op=True))
                    padded.append((flat, out))
            for work in works:
                work.wait()
            for flat, out in padded:
                flat.copy_(out[: flat.numel()])
            for shard, flat, out in spread:
                for owner in range(world):
                    lo, hi = shard.bounds(owner)
                    flat[lo:hi].copy_(out[owner * shard.chunk : owner * shard.chunk + hi - lo])
            for shard in shards:
                if shard.shadow:
                    shard.param[shard.hi - shard.lo :].zero_()  # the padding stays zero
                torch.autograd.graph.increment_version(shard.flat)
                shard.version = shard.flat._version

    def gather_value(self, shard: Shard, value: Tensor) -> Tensor:
        """Return a new tensor of the whole flat parameter from every owner's slice-sized ``value``."""
        world, pg = self.world, self.group
        if shard.even and not self.by_owner:
            out = value.new_empty(shard.chunk * world)
            all_gather(out, value.contiguous(), group=pg)
            return out[: shard.numel].clone()
        full = value.new_zeros(shard.numel)
        full[shard.lo : shard.hi].copy_(value[: shard.hi - shard.lo])
        works = []
        for owner in range(world):
            lo, hi = shard.bounds(owner)
            if hi > lo:
                works.append(dist.broadcast(full[lo:hi], self.owners[owner], group=pg, async_op=True))
        for work in works:
            work.wait()
        return full

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
