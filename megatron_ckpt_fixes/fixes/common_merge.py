"""A load whose common state holds rank 0's per-rank lists merges this rank's own instead.

megatron-core saves the common state (everything that is not a ``ShardedBase``) from rank 0
alone, assuming it is the same on every rank, and every load merges it with what the rank's
own template yields (its ``LocalNonpersistentObject`` values, then the tensors it loaded):
``dict_utils.merge`` raises on lists of different lengths and on a value present on both
sides. A writer that leaves a per-rank value in the template, such as the distributed
optimizer's ``dp_reshardable`` bucket entries with the Adam ``step`` left a plain tensor
(``if key == 'step': continue``, in Megatron-LM forks and builds between releases), stores
rank 0's bucket lists in the common state: one entry per parameter slice rank 0 held. Every
rank whose slice holds another number of parameters (uneven sizes: MoE experts, a large
embedding beside small norms), or any rank after a change of data-parallel size, fails
with ``Cannot merge two lists with different lengths``; one holding the same number fails on
the duplicated step (``Duplicate non-dict and non-list values``).

Such a list is not common data: its length and items depend on the rank that wrote it, and
its values are rank 0's, position by position. Where a list of the common state cannot be
merged with this rank's list at the same place, this rank's list is taken and rank 0's is
dropped, with one WARNING line naming where; everything else is merged by upstream's own
``merge``, and a conflict outside any list still raises upstream's error. The values that are
dropped are never this rank's own: the tensors come from the sharded part, the optimizer's
step from its ``param_groups`` (:mod:`.dp_reshardable_step`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch

logger = logging.getLogger(__name__)

_ABSENT = object()  # "drop the common state's value here; the merge takes this rank's"
_SHOWN = 5  # places named in the warning


def conflicts(common: Any, own: Any) -> bool:
    """Whether upstream's ``merge(common, own)`` would raise (read-only)."""
    if isinstance(common, dict) and isinstance(own, dict):
        return any(k in common and conflicts(common[k], v) for k, v in own.items())
    if isinstance(common, list) and isinstance(own, list):
        return len(common) != len(own) or any(map(conflicts, common, own))
    return True


def _skeleton(own: Any) -> Any:
    """What upstream's merge turns into ``own`` itself (list items cannot be left out of a
    list, so a list is replaced by one of empty containers); ``_ABSENT`` for a plain value."""
    if isinstance(own, dict):
        return {}
    if isinstance(own, list):
        items = [_skeleton(item) for item in own]
        return _ABSENT if any(item is _ABSENT for item in items) else items
    return _ABSENT


def _reconciled(common: Any, own: Any, key: tuple, replaced: list[tuple]) -> Any:
    """``common`` with every per-rank list that conflicts with ``own`` made to yield
    ``own``'s (``_ABSENT``: drop it); plain-value conflicts outside lists are left alone."""
    if isinstance(common, dict) and isinstance(own, dict):
        for k, value in own.items():
            if k in common:
                fixed = _reconciled(common[k], value, key + (k,), replaced)
                if fixed is _ABSENT:
                    del common[k]
                else:
                    common[k] = fixed
        return common
    if isinstance(common, list) and isinstance(own, list):
        if len(common) == len(own):
            for i, value in enumerate(own):
                fixed = _reconciled(common[i], value, key + (i,), replaced)
                if fixed is _ABSENT:
                    fixed = _skeleton(value)
                if fixed is not _ABSENT:
                    common[i] = fixed
            if not conflicts(common, own):
                return common
        replaced.append(key)
        return _ABSENT
    return common


def reconcile(common: Any, own: Any, key: tuple = ()) -> list[tuple]:
    """Make ``common`` mergeable with ``own`` where only per-rank lists stand in the way (in
    place); returns where this rank's lists were taken."""
    replaced: list[tuple] = []
    fixed = _reconciled(common, own, key, replaced)
    if fixed is _ABSENT and isinstance(common, list):  # the top level itself: keep its object
        skeleton = _skeleton(own)
        if skeleton is not _ABSENT:
            common[:] = skeleton
    return replaced


def _where(replaced: list[tuple]) -> str:
    shown = ", ".join(".".join(map(str, key)) or "<top>" for key in replaced[:_SHOWN])
    more = len(replaced) - _SHOWN
    return shown + (f" (and {more} more)" if more > 0 else "")


def own_lists_win(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def merge(x1: Any, x2: Any, key: tuple = ()) -> Any:
        replaced = reconcile(x1, x2, key)
        if replaced:
            logger.warning(
                "megatron_ckpt_fixes: the checkpoint's common state (written by rank 0 alone) "
                "holds lists that depend on the rank at %s; this rank's own lists are used "
                "there (their values are in the sharded part and the optimizer's param_groups)",
                _where(replaced))
        return original(x1, x2, key)

    return merge


def upstream_merges_own_lists() -> str | None:
    """Ask upstream's ``merge`` to merge a one-item common list into a two-item list of this
    rank: why the patch is not needed (it does), or None (it raises)."""
    from megatron.core.dist_checkpointing.dict_utils import merge

    try:
        merged = merge({"l": [{"saved": 0}]}, {"l": [{"own": 1}, {"own": 2}]})
    except ValueError:
        return None
    if merged != {"l": [{"own": 1}, {"own": 2}]}:
        raise TypeError(f"dict_utils.merge gave {merged!r}: unknown behaviour")
    return "dict_utils.merge takes this rank's list where the common state's differs"


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="common_merge.merge",
        target="megatron.core.dist_checkpointing.serialization",
        attr="merge",
        build=own_lists_win,
        reads=("megatron.core.dist_checkpointing.dict_utils:merge",),
        not_needed=upstream_merges_own_lists,
        why="a common state holding rank 0's per-rank lists (dp_reshardable bucket entries "
            "with a plain Adam step) loads on every rank and data-parallel size: each rank "
            "merges its own lists there",
    ),
)
