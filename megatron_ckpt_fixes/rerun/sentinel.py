"""The rerun state machine always emits its ShardedObject (upstream from megatron-core 0.17).

In megatron-core 0.16 ``RerunStateMachine.state_dict()`` returns None in steady state and a
``ShardedObject("rerun_state_machine_state", ...)`` only while a fault is pending, so the
checkpoint's structure changes exactly when a fault checkpoint is written. The sentinel
keeps the structure constant: in NOT_RUNNING_YET the same object is emitted with the
machine's idle values (and no data-iterator state), built by upstream's own code path
(``force=True`` with no data iterator). Upstream's semantics are kept: DISABLED mode and
non-``torch_dist`` formats still return None on save; ``force=True`` (the load template) is
untouched; ``validate_state_dict`` already ignores a NOT_RUNNING_YET state, so sentinels load
as no-ops. The structure signature (:mod:`megatron_ckpt_fixes.structure`) would replan
anyway; the sentinel additionally keeps the cached fast path on fault checkpoints.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from packaging.version import Version

from .._patching import Patch
from ..compat import versions

RERUN_STATE_KEY = "rerun_state_machine_state"

#: First megatron-core release that emits the sentinel itself.
UPSTREAM_SENTINEL_SINCE = Version("0.17")


def upstream_lacks_sentinel() -> bool:
    return Version(versions.mcore_version().base_version) < UPSTREAM_SENTINEL_SINCE


def always_emit(original: Callable[..., Any]) -> Callable[..., Any]:
    from megatron.core.rerun_state_machine import RerunMode, RerunState

    @functools.wraps(original)
    def state_dict(self: Any, data_iterator: Any, ckpt_format: str,
                   force: bool = False) -> dict[str, Any] | None:
        steady = self.state == RerunState.NOT_RUNNING_YET
        if not force and steady and self.mode != RerunMode.DISABLED and ckpt_format == "torch_dist":
            return original(self, None, ckpt_format, force=True)
        return original(self, data_iterator, ckpt_format, force)

    return state_dict


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="rerun.sentinel",
        target="megatron.core.rerun_state_machine:RerunStateMachine",
        attr="state_dict",
        build=always_emit,
        needed=upstream_lacks_sentinel,
        why="the rerun state ShardedObject exists in every torch_dist checkpoint, not only "
            "in fault checkpoints",
    ),
)
