"""Placements that follow transposes, permutes, splits and concats of sharded weights.

Upstream's HF<->native adapter transposed dims 1 and 2 of expert weights but rebuilt the
DTensor with the old ``Shard(1)``: the global shape came out as [288, 8192, 640] instead of
[288, 4096, 1280] and DCP load failed with a size mismatch. The patch swapped ``Shard``
only; ``_StridedShard`` (not a ``Shard`` subclass) stayed wrong. These helpers move every
shard-like placement with its dim, for any permutation, and rebuild the DTensor with the
matching global shape and stride. They work on the local tensor only: no communication,
and the result shares storage with the input, so loading into it loads into the weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from megatron_ckpt_fixes.dtensor.errors import PlacementError
from megatron_ckpt_fixes.dtensor.placements import is_shard_like, normalize_placements, with_dim
from megatron_ckpt_fixes.dtensor.wrap import from_local_exact


def _check_perm(perm: Sequence[int], ndim: int, key: str) -> tuple[int, ...]:
    norm = tuple(d + ndim if d < 0 else d for d in perm)
    if sorted(norm) != list(range(ndim)):
        raise PlacementError(key, None, f"{list(perm)} is not a permutation of {ndim} dims")
    return norm


def permute_placements(placements: Sequence[Placement], perm: Sequence[int],
                       key: str = "<tensor>") -> tuple[Placement, ...]:
    """Placements of ``t.permute(perm)`` for a tensor with ``placements``.

    Output dim ``i`` is input dim ``perm[i]``, so a shard of input dim ``d`` becomes a shard
    of output dim ``perm.index(d)``; ``_StridedShard`` keeps its split factor.
    """
    perm = _check_perm(perm, len(perm), key)
    out = []
    for p in placements:
        if is_shard_like(p):
            dim = p.dim + len(perm) if p.dim < 0 else p.dim
            p = with_dim(p, perm.index(dim))
        out.append(p)
    return tuple(out)


def transpose_perm(ndim: int, dim0: int, dim1: int) -> tuple[int, ...]:
    """The permutation that swaps ``dim0`` and ``dim1``."""
    perm = list(range(ndim))
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    return tuple(perm)


def transpose_placements(placements: Sequence[Placement], ndim: int, dim0: int, dim1: int,
                         key: str = "<tensor>") -> tuple[Placement, ...]:
    """Placements of ``t.transpose(dim0, dim1)`` for an ``ndim``-d tensor."""
    return permute_placements(placements, transpose_perm(ndim, dim0, dim1), key)


def permute(tensor: torch.Tensor, perm: Sequence[int], key: str = "<tensor>") -> torch.Tensor:
    """``tensor.permute(perm)``; for a DTensor, done on the local shard (a view) with the
    placements and global shape permuted and the contiguous stride of the new shape."""
    perm = _check_perm(perm, tensor.ndim, key)
    if not isinstance(tensor, DTensor):
        return tensor.permute(perm)
    placements = normalize_placements(key, None, tensor.placements, tensor.device_mesh.ndim,
                                      tensor.ndim)
    shape = tuple(tensor.shape[d] for d in perm)
    return from_local_exact(tensor.to_local().permute(perm), tensor.device_mesh,
                            permute_placements(placements, perm, key), shape)


def transpose(tensor: torch.Tensor, dim0: int, dim1: int, key: str = "<tensor>") -> torch.Tensor:
    """``tensor.transpose(dim0, dim1)`` with placements swapped (see :func:`permute`)."""
    return permute(tensor, transpose_perm(tensor.ndim, dim0, dim1), key)


def _unsharded_dim(tensor: DTensor, dim: int, key: str, what: str) -> int:
    dim = dim + tensor.ndim if dim < 0 else dim
    for axis, p in enumerate(tensor.placements):
        if is_shard_like(p) and p.dim == dim:
            raise PlacementError(key, None, f"cannot {what} along dim {dim}: mesh axis {axis} "
                                            f"shards it ({p}); split/concat on the local shard "
                                            "would mix other ranks' slices")
    return dim


def split(tensor: torch.Tensor, sizes: Sequence[int], dim: int,
          key: str = "<tensor>") -> list[torch.Tensor]:
    """Split along an unsharded dim (e.g. a fused gate/up projection) into views, each a
    DTensor with the same mesh and placements and its own global shape."""
    if sum(sizes) != tensor.shape[dim]:
        raise PlacementError(key, None, f"split sizes {list(sizes)} do not add up to dim {dim} "
                                        f"of size {tensor.shape[dim]}")
    if not isinstance(tensor, DTensor):
        return list(tensor.split(list(sizes), dim))
    dim = _unsharded_dim(tensor, dim, key, "split")
    parts = tensor.to_local().split(list(sizes), dim)
    return [from_local_exact(part, tensor.device_mesh, tensor.placements,
                             tensor.shape[:dim] + (size,) + tensor.shape[dim + 1:])
            for part, size in zip(parts, sizes)]


def cat(tensors: Sequence[torch.Tensor], dim: int, key: str = "<tensor>") -> torch.Tensor:
    """Concatenate along an unsharded dim; DTensors must share mesh and placements."""
    first = tensors[0]
    if not isinstance(first, DTensor):
        return torch.cat(list(tensors), dim)
    dim = _unsharded_dim(first, dim, key, "concatenate")
    for t in tensors[1:]:
        if not isinstance(t, DTensor) or t.device_mesh != first.device_mesh or \
                tuple(t.placements) != tuple(first.placements):
            raise PlacementError(key, None, "concatenated tensors must share mesh and "
                                            f"placements, got {getattr(t, 'placements', None)} "
                                            f"and {first.placements}")
    local = torch.cat([t.to_local() for t in tensors], dim)
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return from_local_exact(local, first.device_mesh, first.placements, shape)
