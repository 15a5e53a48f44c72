"""Signature-checked plan caching for ``--ckpt-assume-constant-structure``.

megatron-core caches, under that flag, the local and central save plans, the global
metadata (also the one read back at load), and in the fully-parallel wrapper the shard
distribution; none of them is ever checked against the state dict being saved. These patches
wrap the strategies' save entry points (``save`` and ``async_save``; the fully-parallel
wrapper's ``save`` does not go through its ``async_save``): before the upstream code runs,
the :class:`~.guard.StructureGuard` decides collectively whether the structure changed (or
the previous save failed on some rank), and if so every rank resets every cache layer of
that strategy so upstream replans from scratch. Unchanged structure takes upstream's cached
fast path untouched.

The cache attributes are upstream's private state, so the patches probe a freshly built
caching strategy at ``install()``: each attribute reset here must exist, and any attribute
that looks like a cache but is not known here is refused (a cache this fix cannot reset is
a stale plan waiting to happen).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
from typing import Any, Callable

from .._patching import Patch
from .guard import StructureGuard

_STRATEGIES = "megatron.core.dist_checkpointing.strategies"

#: Every save-plan cache attribute of TorchDistSaveShardedStrategy, with its empty value.
PLAN_CACHES: dict[str, Any] = {
    "cached_central_plan": None,
    "cached_local_plan": None,
    "cached_global_metadata": None,
    "validated_cache_reuse": False,
    "validated_loaded_metadata_reuse": False,
    "_metadata_cache": None,
}
#: Caches not every supported release has: the CheckpointMetadataCache of megatron-core >= 0.17.
LATER_PLAN_CACHES = frozenset({"_metadata_cache"})
#: The fully-parallel wrapper's cached shard distribution.
DISTRIBUTION_CACHES: dict[str, Any] = {"cached_distribution": None}

_GUARD_ATTR = "_mcf_structure_guard"
_ACTIVE_ATTR = "_mcf_structure_checked"
#: Set while a guarded save runs, so a nested strategy (the fully-parallel wrapper's base)
#: reports the same change at debug level only: each change is logged once per rank.
_OUTER_SAVE: contextvars.ContextVar[bool] = contextvars.ContextVar("mcf_outer_save",
                                                                   default=False)


def drop_caches(strategy: Any, caches: dict[str, Any]) -> None:
    """Reset the cache attributes ``strategy`` has (checked at install, see the probes)."""
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
    from megatron.core.dist_checkpointing.strategies import cached_metadata_filesystem_reader

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
            guard.save_failed()
            raise
        finally:
            _OUTER_SAVE.reset(token)
            self.__dict__[_ACTIVE_ATTR] = False

    return save


def cache_attribute_problems(fresh: Any, switch: str, caches: dict[str, Any],
                             optional: frozenset[str] = frozenset()) -> list[str]:
    """What a freshly built caching strategy lacks, or holds beyond what the fix resets."""
    what = type(fresh).__name__
    attrs = set(vars(fresh))
    problems = [f"a caching {what} has no attribute {a!r}"
                for a in (switch, *caches) if a not in attrs and a not in optional]
    unknown = sorted(a for a in attrs - set(caches) - {switch}
                     if "cache" in a.lower() or a.startswith("validated"))
    problems += [f"a caching {what} has attribute {a!r}, which looks like a cache the "
                 "structure fix does not know how to reset" for a in unknown]
    return problems


def _plan_cache_probe() -> list[str]:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return cache_attribute_problems(
        TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True),
        "use_cached_ckpt_structure", PLAN_CACHES, LATER_PLAN_CACHES)


def _distribution_cache_probe() -> list[str]:
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    base = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    return cache_attribute_problems(
        FullyParallelSaveStrategyWrapper(base, None, do_cache_distribution=True),
        "do_cache_distribution", DISTRIBUTION_CACHES)


def _guarded_entry_points(prefix: str, target: str, switch: str, caches: dict[str, Any],
                          probe: Callable[[], list[str]], why: str) -> tuple[Patch, ...]:
    def caching(strategy: Any) -> bool:
        return bool(getattr(strategy, switch))

    return tuple(
        Patch(name=f"{prefix}.{attr}", target=target, attr=attr,
              build=lambda original: guarded_save(original, caching, caches),
              reads=(f"{_STRATEGIES}.cached_metadata_filesystem_reader:"
                     "CachedMetadataFileSystemReader",),
              probes=(probe,), why=why)
        for attr in ("save", "async_save")
    )


PATCHES: tuple[Patch, ...] = _guarded_entry_points(
    "structure.cached_save.plan",
    f"{_STRATEGIES}.torch:TorchDistSaveShardedStrategy",
    "use_cached_ckpt_structure",
    PLAN_CACHES,
    _plan_cache_probe,
    "cached save plans are reused only while every rank's structure signature holds",
) + _guarded_entry_points(
    "structure.cached_save.distribution",
    f"{_STRATEGIES}.fully_parallel:FullyParallelSaveStrategyWrapper",
    "do_cache_distribution",
    DISTRIBUTION_CACHES,
    _distribution_cache_probe,
    "the cached fully-parallel shard distribution is dropped when the structure changes",
)
