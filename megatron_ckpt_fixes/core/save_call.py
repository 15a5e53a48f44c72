"""The ``dist_checkpointing.save`` call in progress, built once per save for every feature.

Features that act inside a save (the structure check in the strategies, the replica check in
``save_preprocess``) need facts only the outermost call knows: the directory, whether the
caller asked megatron-core to validate the sharding, whether the strategy reuses a cached
plan, whether the save is asynchronous. One patch of ``dist_checkpointing.save`` records them
in a :class:`SaveCall` for the duration of the call; features read :func:`current` instead of
each wrapping ``save`` again.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch

_DC = "megatron.core.dist_checkpointing"

#: The parameters of ``dist_checkpointing.save`` a :class:`SaveCall` is built from.
PARAMETERS = ("checkpoint_dir", "sharded_strategy", "validate_access_integrity",
              "async_sharded_save")


@dataclass
class SaveCall:
    """One checkpoint save, from ``dist_checkpointing.save`` (or, without it, the outermost
    guarded strategy call) down to the nested calls it makes."""

    checkpoint_dir: Any
    #: Whether megatron-core's sharding validation ran (or runs) on this save's state dict;
    #: set by a feature that runs it.
    validated: bool
    #: Whether the strategy (or the fully-parallel wrapper's base) reuses a cached plan.
    plan_cached: bool = False
    #: Whether the caller asked for an asynchronous save.
    is_async: bool = False
    #: A guarded strategy already checked the structure in this save (a nested strategy logs
    #: the same change at debug level only).
    structure_checked: bool = False


_CALL: contextvars.ContextVar[SaveCall | None] = contextvars.ContextVar("mcf_save_call",
                                                                        default=None)


def current() -> SaveCall | None:
    """The save in progress in this context, or None outside ``dist_checkpointing.save``."""
    return _CALL.get()


@contextmanager
def making(call: SaveCall) -> Iterator[SaveCall]:
    """``call`` is the save in progress within the block (nested blocks see theirs)."""
    token = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(token)


def reuses_cached_plan(strategy: Any) -> bool:
    """Whether a save strategy (or the fully-parallel wrapper's base) reuses cached plans."""
    for candidate in (strategy, getattr(strategy, "base_strategy", None)):
        if getattr(candidate, "use_cached_ckpt_structure", False):
            return True
    return False


def recording_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``dist_checkpointing.save``: its :class:`SaveCall` is current during the call."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        call = SaveCall(checkpoint_dir=arguments["checkpoint_dir"],
                        validated=bool(arguments["validate_access_integrity"]),
                        plan_cached=reuses_cached_plan(arguments["sharded_strategy"]),
                        is_async=bool(arguments["async_sharded_save"]))
        with making(call):
            return original(*args, **kwargs)

    return save


def _parameter_problems() -> list[str]:
    from megatron.core.dist_checkpointing import serialization

    params = inspect.signature(serialization.save).parameters
    return [f"{_DC}.serialization.save has no parameter {name!r}"
            for name in PARAMETERS if name not in params]


#: Declared by every feature that reads :func:`current` (applied once, whoever asks first).
PATCH = Patch(
    name="save_call.save",
    target=f"{_DC}.serialization",
    attr="save",
    build=recording_save,
    aliases=(_DC,),
    probes=(_parameter_problems,),
    why="each save records its directory, whether its caller validated the sharding, "
        "whether its plan is cached and whether it is asynchronous, for the checks inside it",
)
