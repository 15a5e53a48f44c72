"""Sharding validation whose verdict reaches every rank, with the work split across ranks.

megatron-core's ``validate_sharding_integrity`` gathers every rank's shardings to every rank,
then checks them on rank 0 only: an invalid state dict raises on rank 0 while the other ranks
walk on into the save's next collective and hang. Here every rank checks its share of the
keys (by a stable hash of the key) with upstream's own per-key validators, and the verdict
is agreed, so every rank raises the same ``CheckpointingException`` naming the key and the
cause. Splitting the keys also takes the O(keys) check off rank 0's critical path, which the
agreement would otherwise put every rank behind.
"""

from __future__ import annotations

import functools
import zlib
from collections import defaultdict
from typing import Any, Callable

from megatron.core.dist_checkpointing import validation
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject

from .._patching import Patch
from ..agreement import check, describe_failures, rank_and_size
from ..errors import MegatronCkptFixesError


class ShardingValidationError(MegatronCkptFixesError, CheckpointingException):
    """The state dict to save is sharded inconsistently; raised on every rank (upstream
    raises its ``CheckpointingException`` on rank 0 only)."""

    def __init__(self, what: str, errors: dict[int, Any]) -> None:
        self.errors = errors
        super().__init__(describe_failures(what, errors))


def key_owner(key: str, world_size: int) -> int:
    """The rank that validates ``key``: the same on every rank and in every process."""
    return zlib.crc32(key.encode()) % world_size


def problems_of_my_keys(global_metadata: list[list[Any]], rank: int, world_size: int) -> list[str]:
    """Upstream's per-key checks for the keys this rank owns (0.16 raises, 0.19 returns)."""
    by_key: dict[str, list[tuple[int, Any]]] = defaultdict(list)
    for holder, shardings in enumerate(global_metadata):
        for sharding in shardings:
            if key_owner(sharding.key, world_size) == rank:
                by_key[sharding.key].append((holder, sharding))
    problems: list[str] = []
    for shardings in by_key.values():
        check = (validation._validate_objects_for_key if isinstance(shardings[0][1], ShardedObject)
                 else validation._validate_sharding_for_key)
        try:
            found = check(shardings)
        except CheckpointingException as exc:
            found = [exc]
        problems.extend(str(p) for p in found or ())
    return problems


def collective_validation(_rank0_only: Callable[..., None]) -> Callable[..., None]:
    """Replaces the rank-0-only check; the per-key validators are upstream's."""

    def validate_sharding_integrity(global_metadata: Any, common_state_dict: Any = None) -> None:
        rank, world_size = rank_and_size()
        error = None
        try:
            if common_state_dict is not None:
                validation._validate_common_state_dict(common_state_dict)
            problems = problems_of_my_keys(global_metadata, rank, world_size)
            if problems:
                error = "; ".join(problems)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
        check(error, "sharding validation of the state dict to save",
              raise_as=ShardingValidationError)

    return functools.wraps(_rank0_only)(validate_sharding_integrity)


_DC = "megatron.core.dist_checkpointing"

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="structure.integrity.validate_sharding_integrity",
        target=f"{_DC}.validation",
        attr="validate_sharding_integrity",
        build=collective_validation,
        reads=tuple(f"{_DC}.validation:{name}" for name in (
            "_validate_sharding_for_key", "_validate_objects_for_key",
            "_validate_common_state_dict")),
        aliases=(f"{_DC}.state_dict_utils", f"{_DC}.strategies.fully_parallel"),
        why="sharding is validated by all ranks (keys split) and an invalid one raises the same "
            "error on every rank instead of hanging the rest",
    ),
)
