"""The save and load strategies, built the way Megatron-LM's ``checkpointing.py`` builds them.

Megatron-LM's ``save_checkpoint`` (core_v0.16.1 and core_v0.19.0 alike), for ``torch_dist``:

- the first save builds the strategy: ``get_default_save_sharded_strategy`` with
  ``use_cached_ckpt_structure = --ckpt-assume-constant-structure``; under that flag the
  metadata the *load* strategy read at resume (``cached_global_metadata``) is plugged into
  it; it is wrapped in ``FullyParallelSaveStrategyWrapper`` over the data-parallel group
  (with context parallel) unless ``--no-ckpt-fully-parallel-save``, caching the shard
  distribution under the flag;
- the strategy is kept in ``checkpointing_context['save_strategy']`` and reused by every
  later save of the job, which then passes ``validate_access_integrity = not
  ckpt_assume_constant_structure`` (the first save validates);
- ``async_strategy`` is ``mcore`` unless ``--async-save`` (megatron-core >= 0.17 only).

``_load_global_dist_base_checkpoint`` builds ``get_default_load_sharded_strategy(checkpoint)``,
wrapped in ``FullyParallelLoadStrategyWrapper`` with ``--ckpt-fully-parallel-load``, and keeps
it in ``checkpointing_context['load_strategy']``.

:class:`CheckpointingContext` is that dictionary; the functions below are those steps.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

from megatron_ckpt_fixes.compat.device import backend_uses_cuda
from megatron_ckpt_fixes._dev.training.errors import ConfigError

#: Megatron-LM's default ``--async-strategy`` (megatron-core >= 0.17).
DEFAULT_ASYNC_STRATEGY = "nvrx"
#: The strategy Megatron-LM uses for synchronous saves, and megatron-core's own.
MCORE = "mcore"


@dataclass(frozen=True)
class StrategyOptions:
    ckpt_format: str = "torch_dist"
    assume_constant_structure: bool = False
    fully_parallel_save: bool = True
    fully_parallel_load: bool = False
    async_save: bool = False
    #: ``--async-strategy``; None: Megatron-LM's default where megatron-core has strategies.
    async_strategy: str | None = None


@dataclass
class CheckpointingContext:
    """Megatron-LM's ``checkpointing_context``: what one job keeps across saves and loads."""

    save_strategy: Any = None
    load_strategy: Any = None


def has_async_strategies() -> bool:
    """Whether ``dist_checkpointing.save`` takes ``async_strategy`` (megatron-core >= 0.17)."""
    return "async_strategy" in inspect.signature(dist_checkpointing.save).parameters


def resolve_async_strategy(options: StrategyOptions) -> str | None:
    """The ``async_strategy`` to pass to ``dist_checkpointing.save`` (None: the parameter does
    not exist). Raises :class:`ConfigError` for one that cannot run here, before training."""
    requested = options.async_strategy
    if not has_async_strategies():
        if requested == DEFAULT_ASYNC_STRATEGY:
            raise ConfigError("--async-strategy nvrx needs megatron-core >= 0.17; this "
                              "megatron-core has only its own asynchronous save")
        return None
    if not options.async_save:
        return MCORE  # as Megatron-LM: a synchronous save always uses megatron-core's own
    strategy = requested or DEFAULT_ASYNC_STRATEGY
    if strategy != MCORE:
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

        try:
            get_async_strategy(strategy)
        except (ImportError, AssertionError) as exc:
            raise ConfigError(
                f"--async-save with --async-strategy {strategy} (Megatron-LM's default) cannot "
                f"run here: {exc}; pass --async-strategy mcore for megatron-core's own") from exc
    return strategy


def async_calls_queue(strategy: str | None) -> Any:
    """megatron-core's queue of asynchronous saves for that strategy (temporal workers)."""
    if strategy is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    else:
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

        AsyncCallsQueue = get_async_strategy(strategy)[1]["AsyncCallsQueue"]  # noqa: N806
    return AsyncCallsQueue()


def data_parallel_group() -> Any:
    """The group Megatron-LM parallelizes checkpoint I/O over (data parallel with CP)."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def check_fully_parallel_load(options: StrategyOptions) -> None:
    """megatron-core's fully-parallel load exchanges the loaded shards on CUDA.

    ``exchange_utils`` builds the exchange buffers with ``init_data("cuda")`` and
    ``.cuda()`` (every algorithm), which no ``torch`` stand-in can redirect; with
    collectives off CUDA the flag is refused rather than crash mid-load.
    """
    if options.fully_parallel_load and not backend_uses_cuda():
        raise ConfigError("--ckpt-fully-parallel-load needs CUDA collectives (NCCL): "
                          "megatron-core's load exchange moves every shard with .cuda(); "
                          "drop the flag on CPU/gloo")


def save_strategy(options: StrategyOptions, context: CheckpointingContext) -> tuple[Any, bool]:
    """The strategy for the next save and its ``validate_access_integrity``, as Megatron-LM.

    The first call builds the strategy and keeps it in ``context``; later calls reuse it.
    """
    if context.save_strategy is not None:
        return context.save_strategy, not options.assume_constant_structure
    strategy = get_default_save_sharded_strategy(options.ckpt_format)
    if options.assume_constant_structure:
        strategy.use_cached_ckpt_structure = True
        loaded = getattr(context.load_strategy, "cached_global_metadata", None)
        if loaded is not None:
            strategy.cached_global_metadata = loaded
    if options.fully_parallel_save:
        strategy = FullyParallelSaveStrategyWrapper(strategy, data_parallel_group(),
                                                    options.assume_constant_structure)
    context.save_strategy = strategy
    return strategy, True


def load_strategy(options: StrategyOptions, context: CheckpointingContext,
                  checkpoint_dir: str) -> Any:
    """The strategy for loading ``checkpoint_dir``, kept in ``context`` as Megatron-LM does."""
    strategy = get_default_load_sharded_strategy(checkpoint_dir)
    if options.fully_parallel_load:
        strategy = FullyParallelLoadStrategyWrapper(strategy, data_parallel_group())
    context.load_strategy = strategy
    return strategy
