"""State-dict values of a flat parameter that FSDP2 sharded: one ``Shard(0)`` ``DTensor`` per slot.

``fully_shard`` shards the flat parameter itself: rank ``r`` holds the ``r``-th
``torch.chunk`` piece of the one-dimensional buffer, so a slot may start on one
rank and end on the next. The plain model's FSDP2 shards each parameter along
its dimension 0 instead: rank ``r`` holds the ``r``-th chunk of its *rows*. The
state dict of the flattened model gives what the plain model's gives, a
``DTensor`` per name over the same mesh whose local tensor holds this rank's
rows, so a checkpoint costs what the plain model's costs and loads into either
form at any world size.

Those rows are not all in this rank's shard of the buffer: one
``all_to_all_single`` per group moves each element from the rank whose buffer
shard holds it to the rank whose rows need it (:func:`slot_values`), and loading
runs the same plan backwards (:func:`local_writes`). Each rank sends and
receives about ``numel / world`` elements of the group (what crosses a shard
boundary; a rank's own elements take the same call); the values are new tensors
(one per slot), so they are the weights at the time of the ``state_dict()`` call
in any grad mode, not aliases that later steps update (the plain model's are its
parameters). Every rank must take the state dict, as for any collective.

A slot without dimensions (FSDP2 refuses scalar parameters, but the flat buffer
holds them) is ``Replicate()`` on every rank. A flat parameter that is
``Replicate()`` gives ``Replicate()`` views of its local tensor, with no
communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._core.layout import GroupLayout

__all__ = [
    "ShardedFlat",
    "chunk_range",
    "local_shape",
    "local_writes",
    "pieces",
    "row_range",
    "sharded_flat",
    "slot_values",
]


@dataclass(frozen=True)
class ShardedFlat:
    """A flat parameter that FSDP2 registered as a ``DTensor`` on a one-dimensional mesh.

    Attributes:
        tensor: the ``DTensor``.
        local: the elements this rank holds.
        start: their offset in the whole buffer.
        sharded: ``Shard(0)`` (else ``Replicate()``: every rank holds every element).
        world: the mesh's size.
        rank: this rank's coordinate on the mesh.
    """

    tensor: Any
    local: Tensor
    start: int
    sharded: bool
    world: int
    rank: int

    def group(self) -> Any:
        """Return the mesh's process group."""
        return self.tensor.device_mesh.get_group(0)


def sharded_flat(tensor: Any, numel: int) -> ShardedFlat | None:
    """Return ``tensor`` as a :class:`ShardedFlat` if FSDP2 sharded it as this module expects, else ``None``.

    Expected: a one-dimensional ``DTensor`` of ``numel`` elements on a
    one-dimensional mesh, ``Replicate()`` or ``Shard(0)`` in ``torch.chunk``'s
    pieces (rank ``r`` holds ``[r * ceil(numel / world), ...)``).
    """
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if not isinstance(tensor, DTensor) or tensor.shape != (numel,) or tensor.device_mesh.ndim != 1:
        return None
    placement = tensor.placements[0]
    mesh = tensor.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    local = tensor.to_local()
    if type(placement) is Replicate:
        return ShardedFlat(tensor, local, 0, False, world, rank) if local.shape == (numel,) else None
    if type(placement) is not Shard or placement.dim != 0:
        return None
    start, end = chunk_range(numel, world, rank)
    if local.shape != (end - start,):
        return None
    return ShardedFlat(tensor, local, start, True, world, rank)


def chunk_range(size: int, world: int, rank: int) -> tuple[int, int]:
    """Return rank's piece ``[lo, hi)`` of ``range(size)`` cut by ``torch.chunk`` (as ``Shard`` does)."""
    step = -(-size // world) if size else 0
    return min(rank * step, size), min((rank + 1) * step, size)


def row_range(layout: GroupLayout, index: int, world: int, rank: int) -> tuple[int, int]:
    """Return the elements ``[lo, hi)`` of the buffer that hold rank's rows of slot ``index``.

    A slot without dimensions is every rank's (``Replicate()``).
    """
    shape, offset, numel = layout.shapes[index], layout.offsets[index], layout.numels[index]
    if not shape:
        return offset, offset + numel
    lo, hi = chunk_range(shape[0], world, rank)
    row = numel // shape[0] if shape[0] else 0
    return offset + lo * row, offset + hi * row


def pieces(
    layout: GroupLayout, indices: Sequence[int], rows_of: int, held_by: int, world: int
) -> list[tuple[int, int, int]]:
    """Return ``(index, lo, hi)``: the elements of ``rows_of``'s rows in ``held_by``'s shard of the buffer."""
    held_lo, held_hi = chunk_range(layout.numel, world, held_by)
    out = []
    for index in indices:
        lo, hi = row_range(layout, index, world, rows_of)
        lo, hi = max(lo, held_lo), min(hi, held_hi)
        if lo < hi:
            out.append((index, lo, hi))
    return out


def local_shape(layout: GroupLayout, index: int, world: int, rank: int) -> tuple[int, ...]:
    shape = layout.shapes[index]
    if not shape:
        return ()
    lo, hi = chunk_range(shape[0], world, rank)
    return (hi - lo, *shape[1:])


def slot_values(flat: ShardedFlat, layout: GroupLayout) -> list[Tensor]:
    """Return each slot of the group as a ``DTensor`` sharded like the plain model's parameter.

    A collective (for a ``Shard(0)`` flat parameter): every rank of the mesh calls it.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = flat.tensor.device_mesh
    local = flat.local.detach()
    indices = range(len(layout.shapes))
    if not flat.sharded:
        return [
            DTensor.from_local(
                local[layout.offsets[i] : layout.offsets[i] + layout.numels[i]].view(layout.shapes[i]),
                mesh,
                [Replicate()],
                run_check=False,
            )
            for i in indices
        ]
    world, me = flat.world, flat.rank
    sends, in_splits = [], []
    for peer in range(world):
        mine = pieces(layout, indices, rows_of=peer, held_by=me, world=world)
        sends += [local[lo - flat.start : hi - flat.start] for _, lo, hi in mine]
        in_splits.append(sum(hi - lo for _, lo, hi in mine))
    received = [pieces(layout, indices, rows_of=me, held_by=peer, world=world) for peer in range(world)]
    out_splits = [sum(hi - lo for _, lo, hi in got) for got in received]
    recv = _exchange(flat, sends, in_splits, out_splits, local)
    parts: dict[int, list[Tensor]] = {i: [] for i in indices}
    cursor = 0
    for got in received:
        for index, lo, hi in got:
            parts[index].append(recv[cursor : cursor + hi - lo])
            cursor += hi - lo
    values: list[Tensor] = []
    for index in indices:
        shape = layout.shapes[index]
        rows = local_shape(layout, index, world, me)
        chunks = parts[index]
        value = torch.cat(chunks) if chunks else local.new_empty(0)
        placement = Shard(0) if shape else Replicate()
        values.append(
            DTensor.from_local(
                value.view(rows),
                mesh,
                [placement],
                run_check=False,
                shape=torch.Size(shape),
                stride=_contiguous_stride(shape),
            )
        )
    return values


def local_writes(
    flat: ShardedFlat, layout: GroupLayout, items: Sequence[tuple[int, Tensor]]
) -> list[tuple[Tensor, Tensor]]:
    """Return ``(target, value)`` pairs that write ``items`` (slot index, source) into this rank's shard.

    A ``Shard(0)`` ``DTensor`` source on the flat parameter's mesh with the
    slot's shape (what :func:`slot_values` gives, what the plain model's FSDP2
    state dict holds) travels by one ``all_to_all_single`` for all of them; a
    ``Replicate()`` one or a plain tensor is read where it is; any other
    ``DTensor`` is gathered (``full_tensor()``). A collective: every rank of the
    mesh calls it with the same slots, in the same order.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    local = flat.local.detach()
    end = flat.start + local.numel()
    writes: list[tuple[Tensor, Tensor]] = []
    moved: dict[int, Tensor] = {}
    for index, source in items:
        if isinstance(source, DTensor):
            placement = source.placements[0] if source.device_mesh.ndim == 1 else None
            if (
                flat.sharded
                and type(placement) is Shard
                and placement.dim == 0
                and source.device_mesh == flat.tensor.device_mesh
                and tuple(source.shape) == tuple(layout.shapes[index])
                and layout.shapes[index]
            ):
                moved[index] = (
                    source.to_local().detach().reshape(-1).to(dtype=local.dtype, device=local.device)
                )
                continue
            source = source.to_local() if type(placement) is Replicate else source.full_tensor()
        offset = layout.offsets[index]
        lo, hi = max(offset, flat.start), min(offset + layout.numels[index], end)
        if lo < hi:
            value = source.detach().reshape(-1)[lo - offset : hi - offset]
            writes.append(
                (local[lo - flat.start : hi - flat.start], value.to(dtype=local.dtype, device=local.device))
            )
    if not moved:
        return writes
    indices = sorted(moved)
    world, me = flat.world, flat.rank
    sends, in_splits = [], []
    for peer in range(world):
        mine = pieces(layout, indices, rows_of=me, held_by=peer, world=world)
        for index, lo, hi in mine:
            first = row_range(layout, index, world, me)[0]
            sends.append(moved[index][lo - first : hi - first])
        in_splits.append(sum(hi - lo for _, lo, hi in mine))
    received = [pieces(layout, indices, rows_of=peer, held_by=me, world=world) for peer in range(world)]
    out_splits = [sum(hi - lo for _, lo, hi in got) for got in received]
    recv = _exchange(flat, sends, in_splits, out_splits, local)
    cursor = 0
    for got in received:
        for _, lo, hi in got:
            writes.append((local[lo - flat.start : hi - flat.start], recv[cursor : cursor + hi - lo]))
            cursor += hi - lo
    return writes


def _exchange(
    flat: ShardedFlat, sends: list[Tensor], in_splits: list[int], out_splits: list[int], like: Tensor
) -> Tensor:
    """Send ``sends`` (``in_splits[r]`` elements to rank ``r``); return what arrives (``out_splits``)."""
    import torch.distributed as dist

    send = torch.cat(sends) if sends else like.new_empty(0)
    recv = like.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=flat.group())
    return recv


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))
