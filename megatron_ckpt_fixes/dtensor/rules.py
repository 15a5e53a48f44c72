"""Name-based checkpoint placements as data: an ordered table of glob patterns.

Upstream encoded "which weights are sharded how" in if/else chains, and a generic
``*head*`` rule caught ``hc_head.*`` before its own replicated case. A table is read top to
bottom, first match wins, so the exception is simply written above the generic rule and the
order is visible in one place.

A rule names mesh axes, not positions (``sharded("*.experts.*", ep=0)``: dim 0 sharded over
the ``ep`` axis, replicated on every other axis), so one table serves every mesh that has
the named axes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from megatron_ckpt_fixes.dtensor.errors import PlacementError
from megatron_ckpt_fixes.dtensor.wrap import CheckpointLayout


@dataclass(frozen=True)
class PlacementRule:
    """Keys matching ``pattern`` (``fnmatch`` glob) are sharded as ``shard_dims`` says:
    ``(axis name, tensor dim)`` pairs; axes not named are replicated. Empty = replicated."""

    pattern: str
    shard_dims: tuple[tuple[str, int], ...] = ()

    def placements(self, key: str, mesh: DeviceMesh) -> tuple[Placement, ...]:
        """The placements of this rule on ``mesh``; an unknown axis name is an error."""
        names = mesh.mesh_dim_names
        if self.shard_dims and names is None:
            raise PlacementError(key, None, f"rule {self.pattern!r} names mesh axes but the "
                                            "mesh has no axis names")
        placements: list[Placement] = [Replicate()] * mesh.ndim
        for axis_name, dim in self.shard_dims:
            if axis_name not in names:
                raise PlacementError(key, None, f"rule {self.pattern!r} shards over mesh axis "
                                                f"{axis_name!r}, not one of {list(names)}")
            placements[names.index(axis_name)] = Shard(dim)
        return tuple(placements)


def replicated(pattern: str) -> PlacementRule:
    """A rule that saves matching keys unsharded (the parameter's own layout is kept)."""
    return PlacementRule(pattern)


def sharded(pattern: str, **axis_dims: int) -> PlacementRule:
    """A rule sharding tensor dims over named mesh axes, e.g. ``sharded("*.experts.*", ep=0)``.
    Several axes may shard one dim (``dp=0, ep=0``); they apply in mesh order."""
    return PlacementRule(pattern, tuple(axis_dims.items()))


@dataclass(frozen=True)
class PlacementTable:
    """Ordered rules; the first rule whose pattern matches a key decides its placements."""

    rules: tuple[PlacementRule, ...]

    def rule_for(self, key: str) -> PlacementRule | None:
        """The first matching rule, or ``None`` (the key is saved as it is)."""
        return next((r for r in self.rules if fnmatch.fnmatchcase(key, r.pattern)), None)

    def layouts(self, state_dict: Mapping[str, Any], mesh: DeviceMesh
                ) -> dict[str, CheckpointLayout]:
        """Checkpoint layouts on ``mesh`` for every tensor key some rule matches."""
        out = {}
        for key, value in state_dict.items():
            rule = self.rule_for(key)
            if rule is not None and isinstance(value, torch.Tensor):
                out[key] = CheckpointLayout(mesh, rule.placements(key, mesh))
        return out
