"""The exchange plan of FSDP2 state dicts: each rank's rows of each slot, from the shards of the buffer.

The collective itself runs in ``tests/distributed/test_fsdp2_checkpoints.py`` (2 ranks and 1); here the
plan is checked for every world size up to 5 and layouts with padding, a scalar and an empty slot.
"""

from __future__ import annotations

import pytest
import torch

from flatten_parametrize._core.layout import plan_group
from flatten_parametrize._state.sharded_slots import chunk_range, local_shape, pieces

LAYOUTS = [
    ([(7, 5), (7,), (9, 7), (9,), (3, 9), (3,)], 1),
    ([(1, 3), (5,), (), (0, 4), (2, 2, 2), (11,)], 4),
    ([(64,)], 1),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("shapes", "align"), LAYOUTS)
def test_the_pieces_of_every_shard_make_torch_chunks_rows_of_each_slot(shapes, align, world):
    """Concatenated over the holding ranks in order, rank q's pieces of a slot are torch.chunk's q-th rows
    (the whole value for a scalar); the buffer shards are torch.chunk's pieces of the buffer."""
    layout = plan_group(shapes, align)
    flat = torch.arange(float(layout.numel))
    shards = [chunk_range(layout.numel, world, r) for r in range(world)]
    assert [hi - lo for lo, hi in shards] == [piece.numel() for piece in _padded_chunks(flat, world)]
    indices = range(len(shapes))
    for q in range(world):
        got: dict[int, list[torch.Tensor]] = {i: [] for i in indices}
        for held_by in range(world):
            lo_shard, hi_shard = shards[held_by]
            local = flat[lo_shard:hi_shard]
            for index, lo, hi in pieces(layout, indices, rows_of=q, held_by=held_by, world=world):
                assert lo_shard <= lo < hi <= hi_shard
                got[index].append(local[lo - lo_shard : hi - lo_shard])
        for index in indices:
            offset, numel, shape = layout.offsets[index], layout.numels[index], shapes[index]
            value = flat[offset : offset + numel].view(shape)
            rows = value if not shape else _padded_chunks(value, world)[q]  # a scalar: every rank's
            assert local_shape(layout, index, world, q) == tuple(rows.shape)
            expected = rows.reshape(-1)
            joined = torch.cat(got[index]) if got[index] else torch.empty(0)
            assert torch.equal(joined, expected), (index, q)


def _padded_chunks(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    """torch.chunk's pieces along dim 0, with empty pieces for the ranks it leaves out (as FSDP2 does)."""
    pieces = list(tensor.chunk(world)) if tensor.shape[0] else []
    empty = tensor[tensor.shape[0] :]
    return pieces + [empty] * (world - len(pieces))
