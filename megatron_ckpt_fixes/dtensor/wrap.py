"""Turn local shards into the DTensors that DCP saves and loads, with the checkpoint's layout.

Upstream wrapped local shards with the *parameter's* mesh and placements (FSDP2's), so
under expert parallelism two ranks claimed the same expert slice and one rank loaded
another's experts. Here the checkpoint layout wins whenever it really shards; the
parameter's own layout is kept only when the checkpoint layout is unsharded, so an empty
local shard never forces a full tensor to be materialized. Global shape and contiguous
stride are always passed to ``DTensor.from_local``: without them it assumes equal local
shapes on every rank and infers a wrong global shape for uneven shards.

:func:`wrap_state_dict` is collective: one gather of every rank's local shapes and local
errors (:func:`megatron_ckpt_fixes.core.agreement.gather`), from which every rank computes the same
global shapes and the same
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

from megatron_ckpt_fixes.core.agreement import gather
from megatron_ckpt_fixes.dtensor.verdict import KeyReport, Problem, RankReport, verdict
from megatron_ckpt_fixes.dtensor.errors import LayoutAgreementError, PlacementError
from megatron_ckpt_fixes.dtensor.placements import (axes_of_lines, check_local_shapes, contiguous_stride, is_sharded,
                         lines_through, merge_param_sharding, normalize_placements)

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


def from_local_checked(key: str, local: torch.Tensor, mesh: DeviceMesh,
                       placements: Sequence[Placement], global_shape: Sequence[int]) -> DTensor:
    """:func:`from_local_exact` after checking, on this rank alone, that ``local`` is the
    block torch's chunk rule gives this rank for ``global_shape`` (no collective: a wrong
    global shape or placement raises :class:`PlacementError` where it is seen)."""
    rank = dist.get_rank() if dist.is_initialized() else None
    placements = normalize_placements(key, rank, placements, mesh.ndim, local.ndim)
    coord = tuple(mesh.get_coordinate())
    check_local_shapes(key, tuple(global_shape), {coord: tuple(local.shape)}, mesh.shape,
                       placements, {coord: rank})
    return from_local_exact(local, mesh, placements, global_shape)


def plan_wrap(key: str, value: torch.Tensor, layout: CheckpointLayout, rank: int) -> WrapPlan:
    """Decide, on this rank only, how ``value`` is wrapped for the checkpoint.

    A DTensor ``value`` already on the checkpoint mesh must have the checkpoint placements.
    A DTensor on another mesh (an FSDP2 parameter) whose placements shard the checkpoint
    shard further has its shard axes merged into the checkpoint mesh axes of the same name.
    """
    local = value.to_local() if isinstance(value, DTensor) else value
    if layout.mesh.get_coordinate() is None:
        raise PlacementError(key, rank, f"rank is not part of the checkpoint mesh {layout.mesh}")
    placements = normalize_placements(key, rank, layout.placements, layout.mesh.ndim, local.ndim)
    if not is_sharded(placements):
        return WrapPlan(local, keep=True)
    if isinstance(value, DTensor) and value.device_mesh == layout.mesh:
        if tuple(value.placements) != placements:
            raise PlacementError(key, rank, f"already a DTensor on the checkpoint mesh with "
                                            f"placements {list(value.placements)}, but the "
                                            f"checkpoint layout says {list(placements)}")
        return WrapPlan(local, layout.mesh, placements,
                        layout.global_shape or tuple(value.shape))
    if isinstance(value, DTensor) and is_sharded(value.placements):
        names, param_names = paired_axis_names(key, rank, layout.mesh, value.device_mesh)
        placements = merge_param_sharding(key, placements, names, layout.mesh.shape,
                                          value.placements, param_names)
    return WrapPlan(local, layout.mesh, placements, layout.global_shape)


def paired_axis_names(key: str, rank: int, mesh: DeviceMesh, param_mesh: DeviceMesh
                      ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Axis names of the checkpoint mesh and of a parameter's mesh under which
    :func:`merge_param_sharding` pairs them: their own names when both meshes are named.

    A checkpoint mesh without names (MLite builds its meshes so) has its axes named by
    index, and each parameter axis gets the name of the checkpoint axis whose ranks through
    this rank are the parameter axis's ranks, in order (an axis that matches none keeps a
    name that says so, and the merge refuses it).
    """
    names, param_names = mesh.mesh_dim_names, param_mesh.mesh_dim_names
    if names is not None and param_names is not None:
        return tuple(names), tuple(param_names)
    if names is not None:
        raise PlacementError(key, rank, "merging a sharded parameter into a named checkpoint "
                                        "mesh needs named axes on the parameter's mesh")
    names = tuple(f"axis {a}" for a in range(mesh.ndim))
    lines = lines_through(param_mesh.mesh, tuple(param_mesh.get_coordinate()))
    axes = axes_of_lines(mesh.mesh, tuple(mesh.get_coordinate()), lines)
    return names, tuple(names[a] if a is not None else f"ranks {line} (no checkpoint axis)"
                        for a, line in zip(axes, lines))


def wrap_state_dict(state_dict: Mapping[str, Any], layouts: Mapping[str, CheckpointLayout],
                    group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """The state dict DCP should see: every key with a layout wrapped as a checkpoint
    DTensor whose local tensor is (shares storage with) the value's local shard.

    Collective over ``group`` (all ranks of the DCP call). Raises
    :class:`LayoutAgreementError` on every rank if any rank finds a bad layout.
    """
    rank = dist.get_rank()
    plans: dict[str, WrapPlan] = {}
    problems: list[Problem] = []
    for key, layout in layouts.items():
        if key not in state_dict:
            continue
        try:
            plans[key] = plan_wrap(key, state_dict[key], layout, rank)
        except PlacementError as exc:
            problems.append((key, rank, exc.problem))
    mine = RankReport(rank, tuple(problems),
                      {k: _report(p) for k, p in plans.items() if not p.keep})
    agreed = verdict(gather(mine, group))
    if agreed.problems:
        raise LayoutAgreementError(list(agreed.problems))
    out = dict(state_dict)
    for key, plan in plans.items():
        if not plan.keep:
            out[key] = from_local_exact(plan.local, plan.mesh, plan.placements,
                                        agreed.global_shapes[key])
    logger.debug("wrapped %d of %d keys with checkpoint layouts", len(plans), len(state_dict))
    return out


def _report(plan: WrapPlan) -> KeyReport:
    mesh = plan.mesh
    return KeyReport(tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()), plan.placements,
                     plan.global_shape, tuple(mesh.get_coordinate()), tuple(plan.local.shape))


def copy_into(key: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy loaded values into a parameter's local shard; an empty local shard is a no-op
    (no gather, no materialization), as is a source that is the destination's storage."""
    dst_local = dst.to_local() if isinstance(dst, DTensor) else dst
    src_local = src.to_local() if isinstance(src, DTensor) else src
    if dst_local.numel() == 0:
        return
    if dst_local.shape != src_local.shape:
        raise PlacementError(key, dist.get_rank() if dist.is_initialized() else None,
                             f"loaded local shape {list(src_local.shape)} does not match the "
                             f"destination {list(dst_local.shape)}")
    if (src_local.data_ptr(), src_local.stride()) == (dst_local.data_ptr(), dst_local.stride()):
        return  # DCP loaded straight into the parameter's storage
    with torch.no_grad():
        dst_local.copy_(src_local)
