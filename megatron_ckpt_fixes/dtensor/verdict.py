"""The verdict every rank computes from every rank's report: global shapes or errors.

A rank alone cannot know the global shape of an unevenly sharded tensor, nor whether the
other ranks use the same layout. So each rank reports, per key, its layout and local shape
(:class:`KeyReport`); after one gather (:func:`megatron_ckpt_fixes.core.agreement.gather`) every
rank runs :func:`verdict` on the same reports and reaches the same verdict. Pure functions:
testable without processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch.distributed.tensor.placement_types import Placement

from megatron_ckpt_fixes.dtensor.errors import PlacementError
from megatron_ckpt_fixes.dtensor.placements import (Coord, Shape, check_local_shapes, check_strided_divisible,
                         infer_global_shape)

Problem = tuple[str, int | None, str]  # key, rank (None: not one rank's fault), mismatch


@dataclass(frozen=True)
class KeyReport:
    """One rank's view of one key: the checkpoint layout it uses and its local shard."""

    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    placements: tuple[Placement, ...]
    global_shape: tuple[int, ...] | None
    coord: Coord
    local_shape: Shape

    def layout(self) -> tuple:
        return self.mesh_shape, self.mesh_ranks, self.placements, self.global_shape


@dataclass(frozen=True)
class RankReport:
    """All a rank sends: its local problems and one :class:`KeyReport` per wrapped key."""

    rank: int
    problems: tuple[Problem, ...] = ()
    keys: dict[str, KeyReport] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    global_shapes: dict[str, Shape]
    problems: tuple[Problem, ...]


def verdict(reports: Sequence[RankReport]) -> Verdict:
    """Global shape of every key, or every problem found on any rank (same on all ranks)."""
    problems = [p for r in reports for p in r.problems]
    by_key: dict[str, dict[int, KeyReport]] = {}
    for report in reports:
        for key, key_report in report.keys.items():
            by_key.setdefault(key, {})[report.rank] = key_report
    failed = {key for key, _, _ in problems}
    global_shapes: dict[str, Shape] = {}
    for key in sorted(by_key.keys() - failed):
        try:
            global_shapes[key] = global_shape_of(key, by_key[key])
        except PlacementError as exc:
            problems.append((exc.key, exc.rank, exc.problem))
    return Verdict(global_shapes, tuple(problems))


def global_shape_of(key: str, reports: dict[int, KeyReport]) -> Shape:
    """The checked global shape of ``key`` from its reports (rank -> report)."""
    first_rank = min(reports)
    first = reports[first_rank]
    for rank, rep in sorted(reports.items()):
        if rep.layout() != first.layout():
            raise PlacementError(key, rank, f"layout {list(rep.placements)} on mesh "
                                            f"{list(rep.mesh_shape)} (global shape "
                                            f"{rep.global_shape}) differs from rank "
                                            f"{first_rank}'s {list(first.placements)} on mesh "
                                            f"{list(first.mesh_shape)} (global shape "
                                            f"{first.global_shape})")
    missing = sorted(set(first.mesh_ranks) - set(reports))
    if missing:
        raise PlacementError(key, None, f"ranks {missing} of the checkpoint mesh have no "
                                        "local shard for this key")
    local_shapes = {rep.coord: rep.local_shape for rep in reports.values()}
    rank_of = {rep.coord: rank for rank, rep in reports.items()}
    if first.global_shape is None:
        global_shape = infer_global_shape(key, local_shapes, first.mesh_shape, first.placements)
    else:
        global_shape = tuple(first.global_shape)
    if len(global_shape) != len(first.local_shape):
        raise PlacementError(key, None, f"global shape {list(global_shape)} has "
                                        f"{len(global_shape)} dims, local shards have "
                                        f"{len(first.local_shape)}")
    check_local_shapes(key, global_shape, local_shapes, first.mesh_shape, first.placements,
                       rank_of)
    check_strided_divisible(key, global_shape, first.placements)
    return global_shape
