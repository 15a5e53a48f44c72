"""Each rank's own RNG state in Megatron-LM's checkpoints: the ``megatron_lm.rng_state`` feature.

Megatron-LM (``megatron/training/checkpointing.py``, core_v0.17.0 to core_v0.19.0, main
d98e8a64, the megatron-core 0.19.2 wheel) saves the RNG states as
``ShardedObject('rng_state', [state], (pp, tp), (pp_rank, tp_rank), replica_id=dp_cp_rank)``:
every data-parallel rank claims to be a replica of data-parallel rank 0. They are not: the
tensor-parallel tracker seeds the ``expert-parallel-rng`` stream per expert-parallel rank
(``seed + 1024 + 100 * ep_rank + etp_rank``) and the MoE router and expert dropout draw from
it. megatron-core writes only replica 0 and hands it to every rank at load, so after a resume
with expert parallelism most ranks run another rank's stream, silently (Megatron-LM PR 6858:
"expert-parallel-rng differed from the saved value on 252 of 256 ranks").

The fix has PR 6858's semantics, as a patch of the two functions involved:

- ``get_rng_state``: where upstream folds the data-parallel rank into the replica id (detected
  from what it returns: a ``(pp, tp)`` object whose replica id is this rank's data-parallel
  rank, never from a version), the object is sharded by data-parallel rank instead,
  ``(pp, tp, dp_cp)`` with replica id 0: every rank's state is written and each rank reads its
  own. This is the layout core_v0.16.1 used under expert parallelism (replaced by PR 3736),
  so its checkpoints read the same way. Upstream's other returns (0.16.1's own per-rank
  object, the ``fsdp_dtensor`` dict, a release that has PR 6858) pass unchanged.
- ``_load_global_dist_base_checkpoint``: before the load, the template built by the patched
  ``get_rng_state`` is matched with the layout in the checkpoint's metadata: the same layout
  loads as is; the folded ``(pp, tp)`` layout of a checkpoint saved before the fix loads as
  upstream loads it (every rank gets the one state written); a per-rank layout of another
  data-parallel size keeps every rank's freshly seeded state (the streams of a different
  layout are not this run's), as Megatron-LM does when TP or PP change (``RNG state will be
  ignored``). The decision is agreed by every rank (:mod:`..agreement`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import weakref
from enum import Enum
from typing import Any, Callable

from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

from megatron_ckpt_fixes.core import agreement
from megatron_ckpt_fixes.core.patching import Patch, resolve

logger = logging.getLogger(__name__)

CHECKPOINTING = "megatron.training.checkpointing"
#: The entry of Megatron-LM's state dict that holds the RNG states.
STATE_KEY = "rng_state"

#: The per-rank objects this patch built (by id; a ShardedObject is unhashable), so that the
#: load adapts only templates of ours, never upstream's own layouts.
_built: dict[int, weakref.ref] = {}


def _group_rank_and_size(group: Any) -> tuple[int, int]:
    """This rank and the size of the data-parallel (with context-parallel) group upstream
    used: the group it was given, else megatron-core's global one."""
    if group is not None:
        return group.rank(), group.size()
    return (mpu.get_data_parallel_rank(with_context_parallel=True),
            mpu.get_data_parallel_world_size(with_context_parallel=True))


def folds_data_parallel(state: Any, dp_cp_rank: int) -> bool:
    """Whether ``state`` (what upstream's ``get_rng_state`` returned) is one ``(pp, tp)``
    object that this data-parallel rank declares a replica of (replica id = its rank)."""
    return (isinstance(state, ShardedObject) and len(state.global_shape) == 2
            and state.replica_id == dp_cp_rank)


def per_rank(state: ShardedObject, dp_cp_rank: int, dp_cp_size: int) -> ShardedObject:
    """``state`` sharded by data-parallel rank: ``(pp, tp, dp_cp)``, replica id 0."""
    return dataclasses.replace(state, global_shape=(*state.global_shape, dp_cp_size),
                               global_offset=(*state.global_offset, dp_cp_rank), replica_id=0)


def folded(template: ShardedObject) -> ShardedObject:
    """The inverse of :func:`per_rank`: upstream's folded object for this rank."""
    return dataclasses.replace(template, global_shape=template.global_shape[:2],
                               global_offset=template.global_offset[:2],
                               replica_id=template.global_offset[2])


def _ours(obj: Any) -> bool:
    ref = _built.get(id(obj))
    return ref is not None and ref() is obj


def _remember(obj: ShardedObject) -> None:
    for key in [k for k, ref in _built.items() if ref() is None]:
        del _built[key]
    _built[id(obj)] = weakref.ref(obj)


def _per_rank_get_rng_state(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_rng_state(*args: Any, **kwargs: Any) -> Any:
        state = original(*args, **kwargs)
        if not isinstance(state, ShardedObject):  # fsdp_dtensor's dict, torch_dcp's list
            return state
        group = signature.bind(*args, **kwargs).arguments.get("dp_cp_group")
        dp_cp_rank, dp_cp_size = _group_rank_and_size(group)
        if not folds_data_parallel(state, dp_cp_rank):
            return state
        sharded = per_rank(state, dp_cp_rank, dp_cp_size)
        _remember(sharded)
        return sharded

    return get_rng_state


class Layout(Enum):
    """How the checkpoint holds the RNG object a per-rank template asks for."""

    SAME = "the same per-rank layout"
    FOLDED = "upstream's folded (pp, tp) layout, saved before the fix"
    OTHER_DP = "a per-rank layout of another data-parallel size"
    ABSENT = "no such object"


def saved_layout(template: ShardedObject, saved_shapes: set[tuple[int, ...]]) -> Layout:
    """Which layout of ``template``'s key the checkpoint holds (``saved_shapes``: the global
    shapes of the objects of that key in its metadata)."""
    if template.global_shape in saved_shapes:
        return Layout.SAME
    if template.global_shape[:2] in saved_shapes:
        return Layout.FOLDED
    if any(len(s) == 3 and s[:2] == template.global_shape[:2] for s in saved_shapes):
        return Layout.OTHER_DP
    return Layout.ABSENT


def _saved_shapes(checkpoint_dir: str, key: str) -> set[tuple[int, ...]]:
    return {tuple(obj.global_shape) for obj in load_sharded_metadata(checkpoint_dir).values()
            if isinstance(obj, ShardedObject) and obj.key == key}


def adapted(template: ShardedObject, layout: Layout) -> Any:
    """What the load asks for, given the checkpoint's layout (see the module's docstring)."""
    if layout is Layout.FOLDED:
        return folded(template)
    if layout is Layout.OTHER_DP:
        return LocalNonpersistentObject(template.data)
    return template


def _adapt_rng_template(checkpoint_dir: str, state_dict: dict[str, Any]) -> None:
    template = state_dict[STATE_KEY]
    layout = agreement.run(
        lambda: saved_layout(template, _saved_shapes(checkpoint_dir, template.key)),
        f"reading the layout of {template.key!r} in {checkpoint_dir}")
    agreement.same(layout.name, f"the layout of {template.key!r} in {checkpoint_dir}")
    if layout is Layout.OTHER_DP and agreement.rank_and_size()[0] == 0:
        logger.warning("megatron_ckpt_fixes: %s in %s was saved with %s: every rank keeps its "
                       "freshly seeded RNG state", template.key, checkpoint_dir, layout.value)
    elif layout is not Layout.SAME:
        logger.info("megatron_ckpt_fixes: %s in %s: %s", template.key, checkpoint_dir,
                    layout.value)
    state_dict[STATE_KEY] = adapted(template, layout)


def _matching_load(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    module = resolve(CHECKPOINTING)

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind(*args, **kwargs).arguments
        state_dict = given.get("sharded_state_dict")
        if not given["rank0"] and isinstance(state_dict, dict) and _ours(
                state_dict.get(STATE_KEY)):
            checkpoint_dir = module.get_checkpoint_name(
                given["load_dir"], given["iteration"], given["release"], return_base_dir=True)
            _adapt_rng_template(checkpoint_dir, state_dict)
        return original(*args, **kwargs)

    return load


PATCHES: tuple[Patch, ...] = (
    Patch(name="megatron_lm.rng_state.get_rng_state", target=CHECKPOINTING,
          attr="get_rng_state", build=_per_rank_get_rng_state,
          why="each data-parallel rank saves and restores its own RNG states (upstream declares "
              "them replicas of data-parallel rank 0: with expert parallelism most ranks "
              "resume on another rank's stream; Megatron-LM PR 6858)"),
    Patch(name="megatron_lm.rng_state.load_layout", target=CHECKPOINTING,
          attr="_load_global_dist_base_checkpoint", build=_matching_load,
          reads=(f"{CHECKPOINTING}:get_checkpoint_name",),
          why="a checkpoint saved before the fix still loads its RNG states as upstream "
              "did; one of another data-parallel size keeps the fresh states"),
)
