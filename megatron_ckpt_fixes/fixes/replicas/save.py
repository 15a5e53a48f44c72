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

The save in progress (:mod:`..save_call`) gives the check the checkpoint directory and whether
the strategy reuses a cached plan (a strategy without ``use_cached_ckpt_structure`` is taken
as planning every save, which only checks more). Only the
``serialization`` module's name is patched: ``save_preprocess``'s other caller, the local
(non-collective) checkpoints of ``tensor_aware_state_dict``, keeps upstream's.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from megatron_ckpt_fixes.core import save_call
from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.fixes.replicas.exchange import check_replicas

_DC = "megatron.core.dist_checkpointing"
_PREPROCESS = "preprocess_common_before_consistancy_check"


def checked_preprocess(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``save_preprocess``: upstream's, then the collective replica check."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_preprocess(*args: Any, **kwargs: Any) -> Any:
        call = save_call.current()
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

    if _PREPROCESS in inspect.signature(serialization.save_preprocess).parameters:
        return []
    return [f"{_DC}.serialization.save_preprocess has no parameter {_PREPROCESS!r}"]


PATCHES: tuple[Patch, ...] = (
    save_call.PATCH,
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
