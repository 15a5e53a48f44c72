"""Sharding validation whose verdict reaches every rank, with the work split across ranks.

megatron-core's ``validate_sharding_integrity`` gathers every rank's shardings to every rank,
then checks them on rank 0 only: an invalid state dict raises on rank 0 while the other ranks
walk on into the save's next collective and hang. Here every rank checks its share of the
keys (by a stable hash of the key) with upstream's own per-key validators, and the verdict
is agreed, so every rank raises the same ``CheckpointingException`` naming the key and the
cause. Splitting the keys also takes the O(keys) check off rank 0's critical path, which the
agreement would otherwise put every rank behind.

Upstream checks only regular grids of equal chunks and skips a key without one ("we defer
the validation to DCP"). DCP's global-plan check then runs on the coordinator alone: rank 0
raises "Failed to validate global plan: key:w invalid fill ..." and the other ranks die with
"Connection closed by peer". Uneven and empty shards (an FSDP2 DTensor with 5 rows on 2
ranks) have no regular grid, so for them the check here is chunk-exact instead
(:func:`chunk_exact_problems`): every element of the global tensor is covered by exactly one
main replica, agreed like every other key.
"""

from __future__ import annotations

import bisect
import functools
import zlib
from collections import defaultdict
from typing import Any, Callable

import numpy as np
from megatron.core.dist_checkpointing import mapping, validation
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.agreement import check, describe_failures, rank_and_size
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError


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
        is_object = isinstance(shardings[0][1], ShardedObject)
        check = (validation._validate_objects_for_key if is_object
                 else validation._validate_sharding_for_key)
        try:
            found = list(check(shardings) or ())
        except CheckpointingException as exc:
            found = [exc]
        if not found and not is_object and not shardings[0][1].has_regular_grid:
            found = chunk_exact_problems(shardings)
        problems.extend(str(p) for p in found)
    return problems


def _region(cuts: list[list[int]], cell: Any) -> str:
    return "[" + ", ".join(f"{c[i]}:{c[i + 1]}" for c, i in zip(cuts, cell)) + "]"


def chunk_exact_problems(shardings: list[tuple[int, Any]]) -> list[str]:
    """For a key whose chunks are not a regular grid: problems unless every element of the
    global tensor is covered by exactly one main replica (empty chunks cover nothing).

    ``shardings`` are ``(rank, ShardedTensor)`` for one key, as upstream's per-key validators
    take them (same global shape and dtype, checked there). The chunk boundaries cut the
    global tensor into a grid of regions; each main replica counts once on the regions it
    covers, and every region must count exactly 1. Cost: one counter per region, which for
    the layouts megatron produces is about one per chunk.
    """
    first = shardings[0][1]
    key, shape = first.key, tuple(first.global_shape)
    problems: list[str] = []
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    for rank, sharding in shardings:
        if not mapping.is_main_replica(sharding.replica_id):
            continue
        local = (1,) * sharding.prepend_axis_num + tuple(sharding.local_shape)
        start = tuple(sharding.global_offset)
        stop = tuple(o + n for o, n in zip(start, local))
        if not all(local):
            continue
        if len(start) != len(shape) or any(o < 0 or e > g for o, e, g in zip(start, stop, shape)):
            problems.append(f"Invalid access pattern for {key!r}: the chunk of rank {rank} at "
                            f"offset {list(start)} with shape {list(local)} lies outside the "
                            f"global shape {list(shape)}")
            continue
        boxes.append((rank, start, stop))
    if problems:
        return problems
    cuts = [sorted({0, size, *(b[1][d] for b in boxes), *(b[2][d] for b in boxes)})
            for d, size in enumerate(shape)]
    counts = np.zeros([len(c) - 1 for c in cuts], dtype=np.int64)
    for _, start, stop in boxes:
        counts[tuple(slice(bisect.bisect_left(c, a), bisect.bisect_left(c, b))
                     for c, a, b in zip(cuts, start, stop))] += 1
    missing = np.argwhere(counts == 0)
    if len(missing):
        cells = np.prod([np.diff(c)[missing[:, d]] for d, c in enumerate(cuts)], axis=0)
        problems.append(f"Invalid access pattern for {key!r} (chunks of unequal shapes, "
                        f"checked element by element): {int(cells.sum())} of "
                        f"{int(np.prod(shape))} elements are covered by no main replica "
                        f"(first: {_region(cuts, missing[0])})")
    doubled = np.argwhere(counts > 1)
    if len(doubled):
        cell = doubled[0]
        lo = [c[i] for c, i in zip(cuts, cell)]
        ranks = [r for r, a, b in boxes if all(x >= s and x < e for x, s, e in zip(lo, a, b))]
        problems.append(f"Invalid access pattern for {key!r} (chunks of unequal shapes, "
                        f"checked element by element): elements {_region(cuts, cell)} are "
                        f"written by more than one main replica (ranks {ranks})")
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
            "_validate_common_state_dict")) + (f"{_DC}.mapping:is_main_replica",),
        aliases=(f"{_DC}.state_dict_utils", f"{_DC}.strategies.fully_parallel"),
        why="sharding is validated by all ranks (keys split) and an invalid one raises the same "
            "error on every rank instead of hanging the rest",
    ),
)
