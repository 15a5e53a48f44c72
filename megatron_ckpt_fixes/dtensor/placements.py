"""Pure shape/stride/placement math for checkpoint layouts (no process group needed).

The global shape of a sharded tensor cannot be read off one rank's local shard when shards
are uneven (torch's chunk semantics: ``ceil(n / k)`` per shard, trailing shards smaller or
empty), so these functions either check a given global shape against every rank's local
shape or infer it from all local shapes. Local sizes and offsets always come from torch's own
``_compute_local_shape_and_global_offset`` so our view never drifts from what DCP computes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import (Partial, Placement, Replicate, Shard,
                                                    _StridedShard)

from megatron_ckpt_fixes.dtensor.errors import PlacementError

Shape = tuple[int, ...]
Coord = tuple[int, ...]


def is_shard_like(placement: Placement) -> bool:
    """``Shard`` or ``_StridedShard`` (the latter is not a ``Shard`` subclass in torch)."""
    return isinstance(placement, (Shard, _StridedShard))


def is_sharded(placements: Sequence[Placement]) -> bool:
    """Whether any mesh axis really shards the tensor (all-Replicate is not sharded)."""
    return any(is_shard_like(p) for p in placements)


def with_dim(placement: Placement, dim: int) -> Placement:
    """The same kind of shard placement on another tensor dim (split factor kept)."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(dim, split_factor=placement.split_factor)
    return Shard(dim)


def normalize_placements(key: str, rank: int | None, placements: Sequence[Placement],
                         mesh_ndim: int, tensor_ndim: int) -> tuple[Placement, ...]:
    """Check that ``placements`` fit a mesh of ``mesh_ndim`` axes and a tensor of
    ``tensor_ndim`` dims; return them with negative shard dims made positive.

    ``Partial`` is rejected: a checkpoint holds values, not pending reductions.
    """
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise PlacementError(key, rank, f"{len(placements)} placements {list(placements)} for a "
                                        f"mesh with {mesh_ndim} axes")
    out: list[Placement] = []
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            raise PlacementError(key, rank, f"mesh axis {axis} has {p}; checkpoints need "
                                            "Shard/Replicate placements")
        if is_shard_like(p):
            dim = p.dim + tensor_ndim if p.dim < 0 else p.dim
            if not 0 <= dim < tensor_ndim:
                raise PlacementError(key, rank, f"mesh axis {axis} shards dim {p.dim} of a "
                                                f"{tensor_ndim}-d tensor")
            p = with_dim(p, dim)
        elif not isinstance(p, Replicate):
            raise PlacementError(key, rank, f"unsupported placement {p!r} on mesh axis {axis}")
        out.append(p)
    return tuple(out)


def contiguous_stride(shape: Sequence[int]) -> Shape:
    """Row-major strides for ``shape``: what DCP assumes for the global tensor."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def local_shape_and_offset(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Coord,
                           placements: Sequence[Placement]) -> tuple[Shape, Shape]:
    """Local shard shape and global offset at mesh coordinate ``coord`` (torch's rules)."""
    shape, offset = _compute_local_shape_and_global_offset(
        tuple(global_shape), tuple(mesh_shape), list(coord), list(placements))
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def infer_global_shape(key: str, local_shapes: Mapping[Coord, Shape], mesh_shape: Sequence[int],
                       placements: Sequence[Placement]) -> Shape:
    """The global shape implied by every mesh coordinate's local shape.

    Ranks that differ only on axes that do not shard dim ``d`` hold the same slice of ``d``;
    ranks that differ on the sharding axes hold disjoint slices covering it. So the global
    size of ``d`` is the sum of the local sizes over the distinct sharding coordinates. This
    holds for uneven and empty shards, several axes on one dim and ``_StridedShard``; the
    result is then checked rank by rank with :func:`check_local_shapes`.
    """
    missing = [c for c in _all_coords(mesh_shape) if c not in local_shapes]
    if missing:
        raise PlacementError(key, None, f"no local shard reported for mesh coordinates {missing}")
    ndims = {len(s) for s in local_shapes.values()}
    if len(ndims) != 1:
        raise PlacementError(key, None, f"local shards have different ranks (ndim): "
                                        f"{sorted(ndims)}")
    ndim = ndims.pop()
    global_shape = []
    for dim in range(ndim):
        axes = [a for a, p in enumerate(placements) if is_shard_like(p) and p.dim == dim]
        seen: dict[Coord, int] = {}
        for coord, shape in sorted(local_shapes.items()):
            seen.setdefault(tuple(coord[a] for a in axes), shape[dim])
        global_shape.append(sum(seen.values()))
    return tuple(global_shape)


def check_local_shapes(key: str, global_shape: Sequence[int],
                       local_shapes: Mapping[Coord, Shape], mesh_shape: Sequence[int],
                       placements: Sequence[Placement],
                       rank_of: Mapping[Coord, int] | None = None) -> None:
    """Raise :class:`PlacementError` unless each coordinate's local shape is exactly what
    ``placements`` give for ``global_shape`` (torch's chunk semantics)."""
    for coord, shape in sorted(local_shapes.items()):
        expected, _ = local_shape_and_offset(global_shape, mesh_shape, coord, placements)
        if tuple(shape) != expected:
            rank = None if rank_of is None else rank_of[coord]
            raise PlacementError(key, rank, f"local shape {list(shape)} at mesh coordinate "
                                            f"{list(coord)} does not match global shape "
                                            f"{list(global_shape)} with placements "
                                            f"{list(placements)} (expected {list(expected)})")


def merge_param_sharding(key: str, ckpt_placements: Sequence[Placement],
                         ckpt_axis_names: Sequence[str], ckpt_mesh_shape: Sequence[int],
                         param_placements: Sequence[Placement],
                         param_axis_names: Sequence[str]) -> tuple[Placement, ...]:
    """Placements on the checkpoint mesh for a local shard that a parameter wrapper (FSDP2)
    has sharded further.

    The parameter's local tensor is the parameter sharding applied *after* the checkpoint
    sharding (FSDP2 shards what expert/tensor parallelism left on the rank). Each shard
    axis of the parameter mesh is matched by name to a checkpoint mesh axis, which must be
    ``Replicate`` in the checkpoint placements. If checkpoint axes to its right also shard
    the same dim, left-to-right order is wrong for it, so it becomes
    ``_StridedShard(dim, split_factor=<their total size>)``, torch's spelling of
    right-to-left sharding.
    """
    merged = list(ckpt_placements)
    for p_axis, p in enumerate(param_placements):
        if not is_shard_like(p):
            if not isinstance(p, Replicate):
                raise PlacementError(key, None, f"parameter placement {p!r} on axis "
                                                f"{param_axis_names[p_axis]!r} cannot be saved")
            continue
        name = param_axis_names[p_axis]
        if name not in ckpt_axis_names:
            raise PlacementError(key, None, f"parameter mesh axis {name!r} (placement {p}) is "
                                            f"not an axis of the checkpoint mesh "
                                            f"{list(ckpt_axis_names)}")
        axis = list(ckpt_axis_names).index(name)
        if not isinstance(ckpt_placements[axis], Replicate):
            raise PlacementError(key, None, f"mesh axis {name!r} shards both the parameter "
                                            f"({p}) and the checkpoint ({ckpt_placements[axis]})")
        if isinstance(p, _StridedShard):
            raise PlacementError(key, None, f"parameter placement {p!r} cannot be merged")
        later = [ckpt_mesh_shape[a] for a in range(axis + 1, len(ckpt_placements))
                 if is_shard_like(ckpt_placements[a]) and ckpt_placements[a].dim == p.dim]
        split = math.prod(later)
        merged[axis] = _StridedShard(p.dim, split_factor=split) if split > 1 else Shard(p.dim)
    return tuple(merged)


def without_trivial_shards(placements: Sequence[Placement],
                           mesh_shape: Sequence[int]) -> tuple[Placement, ...]:
    """``placements`` with every shard over a mesh axis of size 1 made ``Replicate``.

    Such a shard splits nothing. Placement functions written for a fixed mesh rank (MLite's
    ``[PP, DP, CP, TP]``) return ``Shard`` for an axis whose size is 1 in a given run; read
    literally, the layout would count as sharded, and a parameter that another mesh shards
    (FSDP2) would be merged into it instead of keeping its own mesh.
    """
    return tuple(Replicate() if is_shard_like(p) and size == 1 else p
                 for p, size in zip(placements, mesh_shape))


def axes_of_lines(mesh_ranks: Sequence, coord: Coord,
                  lines: Sequence[Sequence[int]]) -> tuple[int | None, ...]:
    """For each rank line, the mesh axis whose ranks through ``coord`` are exactly that
    line, in order (``None``: no axis).

    ``mesh_ranks`` is the mesh's rank array (a tensor or nested lists). This pairs the axes
    of a parameter's mesh with those of an unnamed checkpoint mesh: FSDP2's one-axis mesh of
    the expert-data-parallel group is the line of the checkpoint mesh's expert-dp axis.
    """
    axis_lines = lines_through(mesh_ranks, coord)
    return tuple(next((a for a, line in enumerate(axis_lines) if line == list(target)), None)
                 for target in lines)


def lines_through(mesh_ranks: Sequence, coord: Coord) -> list[list[int]]:
    """The ranks along each axis of a mesh (its rank array) through ``coord``."""
    ranks = torch.as_tensor(mesh_ranks)
    return [ranks[tuple(coord[:a]) + (slice(None),) + tuple(coord[a + 1:])].tolist()
            for a in range(ranks.ndim)]


def shape_from_reference(key: str, local_shape: Sequence[int],
                         placements: Sequence[Placement], ref_shape: Sequence[int],
                         ref_placements: Sequence[Placement]) -> Shape:
    """The global shape of a local tensor made from a reference DTensor's local tensor by
    local steps only (a transpose or permute, a split or concat along unsharded dims), on the
    same mesh: a dim that mesh axis ``a`` shards has the reference's global size of the dim
    axis ``a`` shards there; an unsharded dim is whole on every rank.

    This is what ``DTensor.from_local`` cannot know without ``shape=``: NeMo Automodel's
    adapters rebuild DTensors after such steps and let it multiply the local size.
    """
    if len(placements) != len(ref_placements):
        raise PlacementError(key, None, f"{len(placements)} placements for a reference with "
                                        f"{len(ref_placements)}")
    shape = list(local_shape)
    for axis, (p, ref) in enumerate(zip(placements, ref_placements)):
        if is_shard_like(p) != is_shard_like(ref):
            raise PlacementError(key, None, f"mesh axis {axis} has {p}, the reference {ref}: "
                                            "not a local transform of the reference")
        if is_shard_like(p):
            shape[p.dim] = ref_shape[ref.dim]
    return tuple(shape)


def check_strided_divisible(key: str, global_shape: Sequence[int],
                            placements: Sequence[Placement]) -> None:
    """``_StridedShard`` reproduces chunk-of-a-chunk sharding only when the dim divides by
    its split factor (torch splits into ``split_factor`` groups first); refuse otherwise
    rather than save shards at the wrong offsets."""
    for axis, p in enumerate(placements):
        if isinstance(p, _StridedShard) and global_shape[p.dim] % p.split_factor:
            raise PlacementError(key, None, f"dim {p.dim} of size {global_shape[p.dim]} is not "
                                            f"divisible by the split factor {p.split_factor} of "
                                            f"{p!r} on mesh axis {axis}")


def _all_coords(mesh_shape: Sequence[int]) -> list[Coord]:
    coords: list[Coord] = [()]
    for size in mesh_shape:
        coords = [c + (i,) for c in coords for i in range(size)]
    return coords
