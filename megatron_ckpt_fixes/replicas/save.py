"""Where the replica check enters megatron-core: between ``save_preprocess`` and the first write.

``dist_checkpointing.save`` calls ``save_preprocess`` (factories applied, the common state
split off, the sharding optionally validated) before it writes anything: before 0.16's
``common.pt``, before the strategy's ``save`` or ``async_save`` (so synchronous and
asynchronous saves alike, on the trainer), before 0.19's ``common_state`` object is added.
The patched ``save_preprocess`` runs upstream's, then the collective check
(:func:`~.exchange.check_replicas`) on what it returned, with the common state as the caller
preprocesses it for upstream's own consistency check (Megatron-LM drops the per-rank ``rank``
and ``local_rank`` args that way). When upstream ran the caller's function (it does so only
when it validates) its result is reused, otherwise the function is called here.

The patched ``save`` passes the checkpoint directory and whether the strategy reuses a cached
plan (``use_cached_ckpt_structure`` on it or on the fully-parallel wrapper's base; a strategy
without it is taken as planning every save, which only checks more) to the check. Only the
``serialization`` module's name is patched: ``save_preprocess``'s other caller, the local
(non-collective) checkpoints of ``tensor_aware_state_dict``, keeps upstream's.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from .._patching import Patch
from .exchange import check_replicas

_DC = "megatron.core.dist_checkpointing"
_PREPROCESS = "preprocess_common_before_consistancy_check"


@dataclass(frozen=True)
class SaveCall:
    """What the check needs from the ``dist_checkpointing.save`` call in progress."""

    checkpoint_dir: Any
    plan_cached: bool


_CALL: contextvars.ContextVar[SaveCall | None] = contextvars.ContextVar("mcf_replicas_save",
                                                                        default=None)


def reuses_cached_plan(strategy: Any) -> bool:
    """Whether a save strategy (or the fully-parallel wrapper's base) reuses cached plans."""
    for candidate in (strategy, getattr(strategy, "base_strategy", None)):
        if getattr(candidate, "use_cached_ckpt_structure", False):
            return True
    return False


def recording_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``dist_checkpointing.save``: record the call for the patched ``save_preprocess``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        call = SaveCall(bound.arguments["checkpoint_dir"],
                        reuses_cached_plan(bound.arguments.get("sharded_strategy")))
        token = _CALL.set(call)
        try:
            return original(*args, **kwargs)
        finally:
            _CALL.reset(token)

    return save


def checked_preprocess(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``save_preprocess``: upstream's, then the collective replica check."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_preprocess(*args: Any, **kwargs: Any) -> Any:
        call = _CALL.get()
        if call is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        callers = bound.arguments.get(_PREPROCESS)
        results: list[Any] = []
        if callers is not None:
            def keeping(common_state: Any) -> Any:
                results.append(callers(common_state))
                return results[-1]

            bound.arguments[_PREPROCESS] = keeping
        sharded_part, common_state = original(*bound.args, **bound.kwargs)

        def preprocessed() -> Any:
            if callers is None:
                return common_state
            return results[-1] if results else callers(common_state)

        check_replicas(sharded_part, preprocessed, call.checkpoint_dir, call.plan_cached)
        return sharded_part, common_state

    return save_preprocess


def _parameter_problems() -> list[str]:
    from megatron.core.dist_checkpointing import serialization

    wanted = {"save": ("checkpoint_dir", "sharded_strategy"), "save_preprocess": (_PREPROCESS,)}
    return [f"{_DC}.serialization.{name} has no parameter {param!r}"
            for name, params in wanted.items() for param in params
            if param not in inspect.signature(getattr(serialization, name)).parameters]


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="replicas.save.call",
        target=f"{_DC}.serialization",
        attr="save",
        build=recording_save,
        aliases=(_DC,),
        probes=(_parameter_problems,),
        why="a save tells the replica check its directory and whether its plan is cached",
    ),
    Patch(
        name="replicas.save.check",
        target=f"{_DC}.serialization",
        attr="save_preprocess",
        build=checked_preprocess,
        reads=(f"{_DC}.dict_utils:nested_values", f"{_DC}.mapping:is_main_replica",
               f"{_DC}.core:CheckpointingException"),
        probes=(_parameter_problems,),
        why="ranks declaring one chunk (replicas) must hold equal values, checked by digest "
            "on every rank before anything is written; else the save fails on every rank",
    ),
)
