"""Sharding validation whose verdict reaches every rank.

megatron-core's ``validate_sharding_integrity`` gathers all shardings, then checks them on
rank 0 only: an invalid state dict raises on rank 0 while the other ranks walk on into the
save's next collective and hang. Here the verdict is agreed, so every rank raises the same
``CheckpointingException`` naming the key and the cause.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from megatron.core.dist_checkpointing.core import CheckpointingException

from .._patching import Patch
from ..collective import CollectiveError, agree


def collective_validation(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def validate_sharding_integrity(global_metadata: Any, common_state_dict: Any = None) -> None:
        error = None
        try:
            original(global_metadata, common_state_dict)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
        try:
            agree(False, error, "sharding validation of the state dict to save")
        except CollectiveError as exc:
            raise CheckpointingException(str(exc)) from exc

    return validate_sharding_integrity


_DC = "megatron.core.dist_checkpointing"

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="structure.collective_validation",
        target=f"{_DC}.validation",
        attr="validate_sharding_integrity",
        build=collective_validation,
        aliases=(f"{_DC}.state_dict_utils", f"{_DC}.strategies.fully_parallel"),
        why="an invalid sharding raises the same error on every rank instead of hanging the rest",
    ),
)
