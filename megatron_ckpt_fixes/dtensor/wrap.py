"""Turn local shards into the DTensors that DCP saves and loads, with the checkpoint's layout.

Upstream wrapped local shards with the *parameter's* mesh and placements (FSDP2's), so
under expert parallelism two ranks claimed the same expert slice and one rank loaded
another's experts. Here the checkpoint layout wins whenever it really shards; the
parameter's own layout is kept only when the checkpoint layout is unsharded, so an empty
local shard never forces a full tensor to be materialized. Global shape and contiguous
stride are always passed to ``DTensor.from_local``: without them it assumes equal local
shapes on every rank and infers a wrong global shape for uneven shards.

:func:`wrap_state_dict` is collective: one ``all_gather_object`` of every rank's local
shapes and local errors, from which every rank computes the same global shapes and the same
verdict, so a bad layout on one rank is the same :class:`LayoutAgreementError` everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from .errors import LayoutAgreementError, PlacementError
from .placements import (Coord, Shape, check_local_shapes, check_strided_divisible,
                         contiguous_stride, infer_global_shape, is_sharded,
                         merge_param_sharding, normalize_placements)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointLayout:
    """How the checkpoint sees one tensor: the mesh, the placements on it and, optionally,
    the global shape (inferred from all ranks' local shapes when ``None``)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    global_shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class WrapPlan:
    """One rank's decision for one key, before the ranks agree on global shapes.

    ``keep`` means the value goes to DCP as it is (unsharded checkpoint layout).
    """

    key: str
    value: torch.Tensor
    local: torch.Tensor
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] = ()
    global_shape: tuple[int, ...] | None = None
    keep: bool = False


def from_local_exact(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
                     global_shape: Sequence[int]) -> DTensor:
    """``DTensor.from_local`` with the global shape and contiguous stride given explicitly."""
    return DTensor.from_local(local, mesh, tuple(placements), run_check=False,
                              shape=torch.Size(global_shape),
                              stride=contiguous_stride(global_shape))


def plan_wrap(key: str, value: torch.Tensor, layout: CheckpointLayout, rank: int) -> WrapPlan:
    """Decide, on this rank only, how ``value`` is wrapped for the checkpoint.

    A DTensor ``value`` (an FSDP2 parameter) whose own mesh shards it further has its shard
    axes merged into the checkpoint mesh axes of the same name.
    """
    local = value.to_local() if isinstance(value, DTensor) else value
    placements = normalize_placements(key, rank, layout.placements, layout.mesh.ndim, local.ndim)
    if not is_sharded(placements):
        return WrapPlan(key, value, local, keep=True)
    if isinstance(value, DTensor) and is_sharded(value.placements):
        names = layout.mesh.mesh_dim_names
        param_names = value.device_mesh.mesh_dim_names
        if names is None or param_names is None:
            raise PlacementError(key, rank, "merging a sharded parameter into the checkpoint "
                                            "layout needs named mesh axes on both meshes")
        placements = merge_param_sharding(key, placements, names, layout.mesh.shape,
                                          value.placements, param_names)
    return WrapPlan(key, value, local, layout.mesh, placements, layout.global_shape)


def wrap_state_dict(state_dict: Mapping[str, Any], layouts: Mapping[str, CheckpointLayout],
                    group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """The state dict DCP should see: every key with a layout wrapped as a checkpoint
    DTensor whose local tensor is (shares storage with) the value's local shard.

    Collective over ``group`` (all ranks of the DCP call). Raises
    :class:`LayoutAgreementError` on every rank if any rank finds a bad layout.
    """
    rank = dist.get_rank()
    plans: dict[str, WrapPlan] = {}
    errors: list[tuple[str, int | None, str]] = []
    for key, layout in layouts.items():
        if key not in state_dict:
            continue
        try:
            plans[key] = plan_wrap(key, state_dict[key], layout, rank)
        except PlacementError as exc:
            errors.append((key, rank, exc.problem))
    report = (rank, errors, {k: _describe(p) for k, p in plans.items() if not p.keep})
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    shapes = _agree(reports)
    if shapes.errors:
        raise LayoutAgreementError(shapes.errors)
    out = dict(state_dict)
    for key, plan in plans.items():
        if not plan.keep:
            out[key] = from_local_exact(plan.local, plan.mesh, plan.placements,
                                        shapes.global_shapes[key])
    logger.debug("wrapped %d of %d keys with checkpoint layouts", len(plans), len(state_dict))
    return out


@dataclass(frozen=True)
class _Agreement:
    global_shapes: dict[str, Shape]
    errors: list[tuple[str, int | None, str]]


def _describe(plan: WrapPlan) -> tuple:
    """What a rank tells the others about one key: its layout and its local shape."""
    mesh = plan.mesh
    coord = tuple(mesh.get_coordinate() or ())
    return (tuple(mesh.shape), mesh.mesh.flatten().tolist(), repr(plan.placements),
            plan.placements, plan.global_shape, coord, tuple(plan.local.shape))


def _agree(reports: list[Any]) -> _Agreement:
    """Compute, identically on every rank, the global shape of every key or the errors."""
    errors = [e for _, errs, _ in reports for e in errs]
    by_key: dict[str, dict[int, tuple]] = {}
    for rank, _, described in reports:
        for key, desc in described.items():
            by_key.setdefault(key, {})[rank] = desc
    global_shapes: dict[str, Shape] = {}
    failed = {key for key, _, _ in errors}
    for key in sorted(by_key.keys() - failed):
        try:
            global_shapes[key] = _global_shape(key, by_key[key])
        except PlacementError as exc:
            errors.append((exc.key, exc.rank, exc.problem))
    return _Agreement(global_shapes, errors)


def _global_shape(key: str, descs: dict[int, tuple]) -> Shape:
    first_rank = min(descs)
    mesh_shape, mesh_ranks, placement_repr, placements, given, _, _ = descs[first_rank]
    for rank, desc in sorted(descs.items()):
        if desc[:3] != (mesh_shape, mesh_ranks, placement_repr) or desc[4] != given:
            raise PlacementError(key, rank, f"layout {desc[2]} on mesh {desc[0]} with global "
                                            f"shape {desc[4]} differs from rank {first_rank}'s "
                                            f"{placement_repr} on mesh {mesh_shape} with global "
                                            f"shape {given}")
    local_shapes: dict[Coord, Shape] = {d[5]: d[6] for d in descs.values()}
    rank_of = {d[5]: r for r, d in descs.items()}
    if given is None:
        global_shape = infer_global_shape(key, local_shapes, mesh_shape, placements)
    else:
        global_shape = tuple(given)
        missing = set(mesh_ranks) - set(descs)
        if missing:
            raise PlacementError(key, None, f"ranks {sorted(missing)} of the checkpoint mesh "
                                            "did not report this key")
    if len(global_shape) != len(next(iter(local_shapes.values()))):
        raise PlacementError(key, None, f"global shape {list(global_shape)} has "
                                        f"{len(global_shape)} dims, local shards have "
                                        f"{len(next(iter(local_shapes.values())))}")
    check_local_shapes(key, global_shape, local_shapes, mesh_shape, placements, rank_of)
    check_strided_divisible(key, global_shape, placements)
    return global_shape


def copy_into(key: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy loaded values into a parameter's local shard; an empty local shard is a no-op
    (no gather, no materialization), as is a source that already is the destination."""
    dst_local = dst.to_local() if isinstance(dst, DTensor) else dst
    src_local = src.to_local() if isinstance(src, DTensor) else src
    if dst_local.numel() == 0 or src_local is dst_local:
        return
    if dst_local.shape != src_local.shape:
        raise PlacementError(key, dist.get_rank() if dist.is_initialized() else None,
                             f"loaded local shape {list(src_local.shape)} does not match the "
                             f"destination {list(dst_local.shape)}")
    with torch.no_grad():
        dst_local.copy_(src_local)
