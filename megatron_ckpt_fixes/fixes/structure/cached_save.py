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

A caller that trusts the cache also skips megatron-core's sharding validation: Megatron-LM's
``save_checkpoint`` passes ``validate_access_integrity=not ckpt_assume_constant_structure``
on every save after the first, so under the flag a changed structure would never be
validated again. The save where every rank agreed to replan therefore runs upstream's
``validate_sharding_integrity`` (the collective one of :mod:`.integrity`) on the state dict,
unless it already ran in this save: the patched ``dist_checkpointing.save`` records, for the
save it makes, whether the caller asked for validation.

megatron-core >= 0.20 adds a cache outside the strategy objects: with ``pg_cache_path``
(Megatron-LM's ``--ckpt-pg-tensors-cache-path``) the fully-parallel shard distribution is
memoized per (cache directory, process group) for the life of the process, read from a file
that an earlier job wrote (``pg_cache_create`` off) or written for later jobs (on). Every
save uses the memo, with or without ``--ckpt-assume-constant-structure``, so a wrapper with
a cache path is guarded too; on a change its group's entry is computed afresh from the
state dict being saved (in create mode upstream also rewrites the file).

The cache attributes are upstream's private state, so the patches probe a freshly built
caching strategy at ``install()``: each attribute reset here must exist, and any attribute
that looks like a cache but is not known here is refused (a cache this fix cannot reset is
a stale plan waiting to happen).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

from megatron_ckpt_fixes.core import save_call
from megatron_ckpt_fixes.core.patching import Patch, read_problem
from megatron_ckpt_fixes.core.save_call import SaveCall
from megatron_ckpt_fixes.core.agreement import agree
from megatron_ckpt_fixes.fixes.structure.guard import StructureGuard

_STRATEGIES = "megatron.core.dist_checkpointing.strategies"


@dataclass(frozen=True)
class CacheLayers:
    """The caches a strategy class keeps while it assumes a constant structure, and how a
    structure change resets them."""

    #: Instance attributes that turn caching on (any one set); the first exists everywhere.
    switches: tuple[str, ...]
    #: Cache attributes of the instance, with their empty values.
    resets: dict[str, Any]
    #: Attributes (switches, resets, settings) that only later releases have.
    later: frozenset[str] = frozenset()
    #: Known attributes that configure a cache without holding cached state.
    settings: frozenset[str] = frozenset()
    #: Resets what is cached outside the instance: ``(strategy, sharded_state_dict)``.
    forget_elsewhere: Callable[[Any, Any], None] | None = None

    def caching(self, strategy: Any) -> bool:
        return any(getattr(strategy, s, None) not in (None, False) for s in self.switches)

    def reset(self, strategy: Any, sharded_state_dict: Any) -> None:
        """Collective when ``forget_elsewhere`` is: every rank that replans calls it."""
        drop_caches(strategy, self.resets)
        if self.forget_elsewhere is not None:
            self.forget_elsewhere(strategy, sharded_state_dict)

    def known(self) -> set[str]:
        return {*self.switches, *self.resets, *self.settings}


def forget_group_distribution(wrapper: Any, sharded_state_dict: Any) -> None:
    """Collective over the wrapper's group: replace the process-wide memo of its shard
    distribution (megatron-core >= 0.20, ``pg_cache_path``) by one of this state dict.

    In create mode dropping the entry is enough: upstream's next call gathers, rewrites the
    group's file and memoizes. In read mode it would read the file again, written for the
    structure the job had when it was created, so the entry is computed here with
    upstream's own (uncached) call, both variants (save and load) as upstream memoizes them.
    """
    if getattr(wrapper, "pg_cache_path", None) is None:
        return
    from megatron.core.dist_checkpointing import exchange_utils
    from megatron.core.utils import get_pg_size

    group = wrapper.parallelization_group
    if get_pg_size(group=group) <= 1:  # upstream neither computes nor memoizes one
        return
    key = exchange_utils._pg_dist_cache_file_path(wrapper.pg_cache_path, group)
    exchange_utils._PG_DIST_CACHE.pop(key, None)
    if not wrapper.pg_cache_create:
        exchange_utils._PG_DIST_CACHE[key] = {
            ignore_groups: exchange_utils.determine_main_replica_uniform_distribution(
                sharded_state_dict, group, ignore_groups)
            for ignore_groups in (False, True)}


#: TorchDistSaveShardedStrategy's save-plan caches (``_metadata_cache``: the
#: CheckpointMetadataCache of megatron-core >= 0.17).
PLAN_CACHES = CacheLayers(
    switches=("use_cached_ckpt_structure",),
    resets={
        "cached_central_plan": None,
        "cached_local_plan": None,
        "cached_global_metadata": None,
        "validated_cache_reuse": False,
        "validated_loaded_metadata_reuse": False,
        "_metadata_cache": None,
    },
    later=frozenset({"_metadata_cache"}),
)
#: The fully-parallel wrapper's cached shard distribution, and (megatron-core >= 0.20) the
#: process-wide memo behind ``pg_cache_path``.
DISTRIBUTION_CACHES = CacheLayers(
    switches=("do_cache_distribution", "pg_cache_path"),
    resets={"cached_distribution": None},
    later=frozenset({"pg_cache_path", "pg_cache_create"}),
    settings=frozenset({"pg_cache_create"}),
    forget_elsewhere=forget_group_distribution,
)

_GUARD_ATTR = "_mcf_structure_guard"
_ACTIVE_ATTR = "_mcf_structure_checked"
_DC = "megatron.core.dist_checkpointing"
#: What forget_group_distribution reads where the wrapper has ``pg_cache_path``.
_PG_CACHE_READS = (f"{_DC}.exchange_utils:_PG_DIST_CACHE",
                   f"{_DC}.exchange_utils:_pg_dist_cache_file_path",
                   f"{_DC}.exchange_utils:determine_main_replica_uniform_distribution",
                   "megatron.core.utils:get_pg_size")


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


def validate_changed_structure(sharded_state_dict: Any, call: SaveCall, what: str) -> None:
    """Collective: on a save that replans, run megatron-core's sharding validation unless it
    already ran in this save (agreed, so that every rank or none enters the validation)."""
    from megatron.core.dist_checkpointing import validation

    if not agree(not call.validated, None, f"whether to validate the sharding ({what})"):
        return
    call.validated = True
    # Looked up at call time: the collective validation of .integrity when installed.
    validation.validate_sharding_integrity(
        validation.determine_global_metadata(sharded_state_dict)[1])


def guarded_save(original: Callable[..., Any], layers: CacheLayers) -> Callable[..., Any]:
    """Wrap a strategy's ``save``/``async_save`` with the collective structure check.

    A ``save`` that calls ``async_save`` on the same object checks once (the inner call
    sees the check in progress), so every rank runs the same number of agreements.
    """

    @functools.wraps(original)
    def save(self: Any, sharded_state_dict: Any, checkpoint_dir: Any,
             *args: Any, **kwargs: Any) -> Any:
        forget_reader_metadata(checkpoint_dir)
        if not layers.caching(self) or self.__dict__.get(_ACTIVE_ATTR):
            return original(self, sharded_state_dict, checkpoint_dir, *args, **kwargs)
        guard = guard_of(self)
        what = f"structure check of {type(self).__name__} before saving {checkpoint_dir}"
        # Called without dist_checkpointing.save: nothing validated this save yet.
        call = save_call.current() or SaveCall(checkpoint_dir, validated=False)
        level = logging.DEBUG if call.structure_checked else logging.WARNING
        call.structure_checked = True
        self.__dict__[_ACTIVE_ATTR] = True
        try:
            with save_call.making(call):
                if guard.should_replan(sharded_state_dict, what, log_level=level):
                    layers.reset(self, sharded_state_dict)
                    validate_changed_structure(sharded_state_dict, call, str(checkpoint_dir))
                return original(self, sharded_state_dict, checkpoint_dir, *args, **kwargs)
        except BaseException:
            guard.save_failed()
            raise
        finally:
            self.__dict__[_ACTIVE_ATTR] = False

    return save


def cache_attribute_problems(fresh: Any, layers: CacheLayers) -> list[str]:
    """What a freshly built caching strategy lacks, or holds beyond what the fix resets."""
    what = type(fresh).__name__
    attrs = set(vars(fresh))
    problems = [f"a caching {what} has no attribute {a!r}"
                for a in layers.known() if a not in attrs and a not in layers.later]
    unknown = sorted(a for a in attrs - layers.known()
                     if "cache" in a.lower() or a.startswith("validated"))
    problems += [f"a caching {what} has attribute {a!r}, which looks like a cache the "
                 "structure fix does not know how to reset" for a in unknown]
    return problems


def _plan_cache_probe() -> list[str]:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return cache_attribute_problems(
        TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True), PLAN_CACHES)


def _distribution_cache_probe() -> list[str]:
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    base = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    fresh = FullyParallelSaveStrategyWrapper(base, None, do_cache_distribution=True)
    problems = cache_attribute_problems(fresh, DISTRIBUTION_CACHES)
    if hasattr(fresh, "pg_cache_path"):  # the memo that forget_group_distribution resets
        problems += [p for p in map(read_problem, _PG_CACHE_READS) if p]
    return problems


def _guarded_entry_points(prefix: str, target: str, layers: CacheLayers,
                          probe: Callable[[], list[str]], why: str,
                          inherited: dict[str, str] | None = None) -> tuple[Patch, ...]:
    """``save`` and ``async_save`` of ``target``; ``inherited`` names the base class that
    defines one in the releases where ``target`` inherits it."""
    return tuple(
        Patch(name=f"{prefix}.{attr}", target=target, attr=attr,
              build=lambda original: guarded_save(original, layers),
              reads=(f"{_STRATEGIES}.cached_metadata_filesystem_reader:"
                     "CachedMetadataFileSystemReader",
                     f"{_DC}.validation:validate_sharding_integrity",
                     f"{_DC}.validation:determine_global_metadata"),
              probes=(probe,), why=why,
              inherits_from=tuple(filter(None, [(inherited or {}).get(attr)])))
        for attr in ("save", "async_save")
    )


PATCHES: tuple[Patch, ...] = (save_call.PATCH,) + _guarded_entry_points(
    "structure.cached_save.plan",
    f"{_STRATEGIES}.torch:TorchDistSaveShardedStrategy",
    PLAN_CACHES,
    _plan_cache_probe,
    "cached save plans are reused only while every rank's structure signature holds",
    # Up to megatron-core 0.16 the strategy's save is its async-capable base's (async_save,
    # then the request); later releases define it on the strategy.
    inherited={"save": f"{_STRATEGIES}.base:AsyncSaveShardedStrategy"},
) + _guarded_entry_points(
    "structure.cached_save.distribution",
    f"{_STRATEGIES}.fully_parallel:FullyParallelSaveStrategyWrapper",
    DISTRIBUTION_CACHES,
    _distribution_cache_probe,
    "the cached fully-parallel shard distribution is dropped when the structure changes",
)
