"""Signature-checked plan caching for ``--ckpt-assume-constant-structure``.

megatron-core caches, under that flag, the local and central save plans, the global
metadata (also the one read back at load), and in the fully-parallel wrapper the shard
distribution; none of them is ever checked against the state dict being saved. These patches
wrap the strategies' save entry points (``save`` and ``async_save``; the fully-parallel
wrapper's ``save`` does not go through its ``async_save``): before the upstream code runs, the :class:`~.guard.StructureGuard` decides collectively whether the
structure changed, and if so every cache layer of that strategy is reset so upstream replans
from scratch. Unchanged structure takes upstream's cached fast path untouched.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
from typing import Any, Callable

from megatron.core.dist_checkpointing.strategies import cached_metadata_filesystem_reader

from .._patching import Patch
from .guard import StructureGuard

#: Every save-plan cache attribute of TorchDistSaveShardedStrategy, with its empty value.
#: ``_metadata_cache`` is the nvidia-resiliency-ext cache of megatron-core >= 0.19.
PLAN_CACHES: dict[str, Any] = {
    "cached_central_plan": None,
    "cached_local_plan": None,
    "cached_global_metadata": None,
    "validated_cache_reuse": False,
    "validated_loaded_metadata_reuse": False,
    "_metadata_cache": None,
}
#: The fully-parallel wrapper's cached shard distribution.
DISTRIBUTION_CACHES: dict[str, Any] = {"cached_distribution": None}

_GUARD_ATTR = "_mcf_structure_guard"
_ACTIVE_ATTR = "_mcf_structure_checked"
#: Set while a guarded save runs, so a nested strategy (the fully-parallel wrapper's base)
#: reports the same change at debug level only: each change is logged once per rank.
_OUTER_SAVE: contextvars.ContextVar[bool] = contextvars.ContextVar("mcf_outer_save",
                                                                   default=False)


def drop_caches(strategy: Any, caches: dict[str, Any]) -> None:
    """Reset the cache attributes ``strategy`` has (attribute sets differ across versions)."""
    for attr, empty in caches.items():
        if hasattr(strategy, attr):
            setattr(strategy, attr, empty)


def guard_of(strategy: Any) -> StructureGuard:
    """The guard attached to one strategy object (created on first use)."""
    return strategy.__dict__.setdefault(_GUARD_ATTR, StructureGuard())


def forget_reader_metadata(checkpoint_dir: Any) -> None:
    """Drop a class-level cached ``.metadata`` for a directory that is being (re)written.

    megatron-core >= 0.19 caches loaded metadata per path for the life of the process, so
    a checkpoint rewritten at the same path would be read with its old metadata.
    """
    cache = getattr(cached_metadata_filesystem_reader.CachedMetadataFileSystemReader,
                    "_metadata_cache", None)
    if isinstance(cache, dict):
        cache.pop(os.path.abspath(os.fspath(checkpoint_dir)), None)


def guarded_save(original: Callable[..., Any], caching: Callable[[Any], bool],
                 caches: dict[str, Any]) -> Callable[..., Any]:
    """Wrap a strategy's ``save``/``async_save`` with the collective structure check.

    A ``save`` that calls ``async_save`` on the same object checks once (the inner call
    sees the check in progress), so every rank runs the same number of agreements.
    """

    @functools.wraps(original)
    def save(self: Any, sharded_state_dict: Any, checkpoint_dir: Any,
             *args: Any, **kwargs: Any) -> Any:
        forget_reader_metadata(checkpoint_dir)
        if not caching(self) or self.__dict__.get(_ACTIVE_ATTR):
            return original(self, sharded_state_dict, checkpoint_dir, *args, **kwargs)
        guard = guard_of(self)
        what = f"structure check of {type(self).__name__} before saving {checkpoint_dir}"
        level = logging.DEBUG if _OUTER_SAVE.get() else logging.WARNING
        if guard.should_replan(sharded_state_dict, what, log_level=level):
            drop_caches(self, caches)
        self.__dict__[_ACTIVE_ATTR] = True
        token = _OUTER_SAVE.set(True)
        try:
            return original(self, sharded_state_dict, checkpoint_dir, *args, **kwargs)
        except BaseException:
            drop_caches(self, caches)
            guard.forget()
            raise
        finally:
            _OUTER_SAVE.reset(token)
            self.__dict__[_ACTIVE_ATTR] = False

    return save


def _guarded_entry_points(prefix: str, target: str, caching: Callable[[Any], bool],
                          caches: dict[str, Any], why: str) -> tuple[Patch, ...]:
    return tuple(
        Patch(name=f"{prefix}.{attr}", target=target, attr=attr,
              build=lambda original: guarded_save(original, caching, caches), why=why)
        for attr in ("save", "async_save")
    )


_STRATEGIES = "megatron.core.dist_checkpointing.strategies"

PATCHES: tuple[Patch, ...] = _guarded_entry_points(
    "structure.cached_plan",
    f"{_STRATEGIES}.torch:TorchDistSaveShardedStrategy",
    lambda s: bool(getattr(s, "use_cached_ckpt_structure", False)),
    PLAN_CACHES,
    "cached save plans are reused only while every rank's structure signature holds",
) + _guarded_entry_points(
    "structure.cached_distribution",
    f"{_STRATEGIES}.fully_parallel:FullyParallelSaveStrategyWrapper",
    lambda s: bool(getattr(s, "do_cache_distribution", False)),
    DISTRIBUTION_CACHES,
    "the cached fully-parallel shard distribution is dropped when the structure changes",
)
