"""Where a DTensor parameter's local shard sits in the tensor megatron-core checkpoints.

Pure functions (no process group): the inputs are what every rank knows locally about its
DTensor (global shape, mesh shape, its mesh coordinate, placements, local shape) plus
megatron's own sharding arguments; the output is the :class:`ShardedTensor` fields.

megatron-core describes a parameter to ``dist_checkpointing`` as a ``ShardedTensor``: global
shape, this rank's global offset and local shape, the grid of equal chunks
(``axis_fragmentations``, ``None`` for an irregular grid) and a replica id. For a DTensor
parameter (FSDP2, HSDP, an expert mesh) three layers of sharding compose, outermost first:

1. megatron's prepended axes (``sharded_offsets``: layer, expert index): one slot each;
2. megatron's tensor parallelism: ``tp_axis`` split evenly over the TP group (what the
   layer holds is one TP chunk; megatron's TP chunks are always equal);
3. the DTensor's own mesh and placements, applied to that TP chunk, with torch's chunk rule
   (``ceil(n / k)`` per shard, trailing shards short or empty), several mesh axes on one
   dim and ``_StridedShard`` included.

Upstream used the data-parallel group from ``parallel_state`` as the shard axis and assumed
equal chunks, so uneven shards got a different global shape on every rank and expert
shards landed at the slot of the dense data-parallel rank instead of their own.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement, Replicate, _StridedShard

from megatron_ckpt_fixes.dtensor.errors import PlacementError
from megatron_ckpt_fixes.dtensor.placements import (Coord, Shape, is_shard_like, local_shape_and_offset,
                          normalize_placements, with_dim)

#: megatron's ``(axis, chunk index, number of chunks)`` of one even chunking.
RankOffset = tuple[int, int, int]


@dataclass(frozen=True)
class MeshShard:
    """This rank's block of a DTensor's global tensor, as its mesh and placements say.

    ``fragments[d]`` is the number of blocks along dim ``d`` (the product of the mesh axes
    that shard it); ``regular`` says all blocks have the same shape (megatron's regular
    grid); ``replica`` is this rank's index among the ranks that hold the same block (the
    row-major index of its coordinate over the ``Replicate`` axes; 0 is the main replica).
    """

    global_shape: Shape
    offset: Shape
    local_shape: Shape
    fragments: Shape
    regular: bool
    replica: int


@dataclass(frozen=True)
class ShardedTensorFields:
    """The layout fields of megatron's ``ShardedTensor`` for one rank's local shard."""

    local_shape: Shape
    global_shape: Shape
    global_offset: Shape
    axis_fragmentations: Shape | None
    prepend_axis_num: int


def mesh_shard(key: str, rank: int | None, global_shape: Sequence[int],
               mesh_shape: Sequence[int], coord: Coord, placements: Sequence[Placement],
               local_shape: Sequence[int]) -> MeshShard:
    """The block that ``placements`` give the rank at ``coord``, checked against the local
    shard the rank really holds.

    Raises :class:`PlacementError` for ``Partial`` placements, for a local shape that is not
    the one torch's chunk rule gives (a DTensor built with ``from_local`` and no ``shape=``
    on uneven shards), and for ``_StridedShard`` combinations whose shards are not
    contiguous blocks (they cannot be one ``ShardedTensor`` chunk).
    """
    global_shape, local_shape = tuple(global_shape), tuple(local_shape)
    placements = normalize_placements(key, rank, placements, len(mesh_shape), len(global_shape))
    expected, offset = local_shape_and_offset(global_shape, mesh_shape, coord, placements)
    if expected != local_shape:
        raise PlacementError(key, rank, f"local shard of shape {list(local_shape)} at mesh "
                                        f"coordinate {list(coord)} is not what global shape "
                                        f"{list(global_shape)} with placements "
                                        f"{list(placements)} on mesh {list(mesh_shape)} gives "
                                        f"({list(expected)}): the DTensor's global shape is "
                                        "wrong on this rank (from_local without shape=?)")
    fragments, regular = [], True
    for dim, size in enumerate(global_shape):
        axes = tuple(a for a, p in enumerate(placements) if is_shard_like(p) and p.dim == dim)
        count = math.prod(mesh_shape[a] for a in axes)
        fragments.append(count)
        if any(isinstance(placements[a], _StridedShard) for a in axes):
            problem, sizes = _strided_blocks(size, tuple(mesh_shape[a] for a in axes),
                                             tuple(with_dim(placements[a], 0) for a in axes))
            if problem:
                raise PlacementError(key, rank, f"dim {dim}: {problem}")
            regular = regular and len(sizes) == 1
        else:
            regular = regular and size % count == 0
    replica = 0
    for axis, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            replica = replica * mesh_shape[axis] + coord[axis]
    return MeshShard(global_shape, offset, local_shape, tuple(fragments), regular, replica)


def sharded_tensor_fields(key: str, rank: int | None, shard: MeshShard,
                          prepend_offsets: Sequence[RankOffset] = (),
                          tp: RankOffset | None = None) -> ShardedTensorFields:
    """Compose megatron's prepended axes and tensor parallelism (outer) with the DTensor's
    block (inner) into ``ShardedTensor`` fields.

    ``tp`` is ``(tp_axis, tp_rank, tp_size)`` of the local (unprepended) tensor, ``None`` for
    a tensor replicated over tensor parallelism. The grid is regular (megatron's own
    validation and loaders apply) exactly when the DTensor's blocks are all equal;
    otherwise ``axis_fragmentations`` is ``None`` and the chunk-exact validation applies.
    """
    prepend = len(prepend_offsets)
    global_shape = [1] * prepend + list(shard.global_shape)
    offset = [0] * prepend + list(shard.offset)
    fragments = [1] * prepend + list(shard.fragments)
    for axis, index, count in prepend_offsets:
        if not 0 <= axis < prepend:
            raise PlacementError(key, rank, f"sharded offset {(axis, index, count)} is not on "
                                            f"one of the {prepend} prepended axes")
        if not 0 <= index < count:
            raise PlacementError(key, rank, f"Invalid rank offsets: {(axis, index, count)}")
        global_shape[axis], offset[axis], fragments[axis] = count, index, count
    if tp is not None:
        axis, index, count = tp
        if not 0 <= axis < len(shard.global_shape):
            raise PlacementError(key, rank, f"tensor-parallel axis {axis} of a "
                                            f"{len(shard.global_shape)}-d tensor")
        size = shard.global_shape[axis]
        global_shape[axis + prepend] = size * count
        offset[axis + prepend] += index * size
        fragments[axis + prepend] *= count
    return ShardedTensorFields(
        local_shape=tuple(shard.local_shape),
        global_shape=tuple(global_shape),
        global_offset=tuple(offset),
        axis_fragmentations=tuple(fragments) if shard.regular else None,
        prepend_axis_num=prepend,
    )


@functools.lru_cache(maxsize=1024)
def _strided_blocks(size: int, mesh_sizes: tuple[int, ...], placements: tuple[Placement, ...]
                    ) -> tuple[str | None, frozenset[int]]:
    """``(problem or None, block sizes)`` of one dim of ``size`` sharded by these axes.

    The blocks must tile the dim; then each shard is the contiguous block at its offset (a
    shard's indices start at its offset and number its size, and tiling blocks leave no room
    for a gap). ``_StridedShard`` without the later axes whose split it stands for
    interleaves indices, yet torch still reports one offset for it: saved as one chunk, its
    values would land at the wrong places. Cached: parameters share a few shapes.
    """
    blocks = sorted((offset[0], shape[0]) for shape, offset in (
        local_shape_and_offset((size,), mesh_sizes, coord, placements)
        for coord in itertools.product(*map(range, mesh_sizes))))
    position, tiles = 0, True
    for start, length in blocks:
        tiles = tiles and (length == 0 or start == position)
        position += length
    if not tiles or position != size:
        return (f"placements {list(placements)} on mesh axes of sizes {list(mesh_sizes)} do "
                f"not split {size} elements into contiguous blocks; (offset, length) per "
                f"shard: {blocks}"), frozenset()
    return None, frozenset(length for _, length in blocks)
