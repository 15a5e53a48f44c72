"""The rerun state machine always emits its ShardedObject, so fault checkpoints load.

In megatron-core before 0.18 ``RerunStateMachine.state_dict()`` returns None in steady state
and a ``ShardedObject("rerun_state_machine_state", ...)`` only while a fault is pending, so
the checkpoint's structure changes exactly when a fault checkpoint is written. The sentinel
keeps the structure constant: in NOT_RUNNING_YET the same object is emitted with the
machine's idle values (and no data-iterator state), built by upstream's own code path
(``force=True`` with no data iterator). Upstream's semantics are kept: DISABLED mode and
non-``torch_dist`` formats still return None on save; ``force=True`` (the load template) is
untouched; ``validate_state_dict`` already ignores a NOT_RUNNING_YET state, so sentinels load
as no-ops. The structure signature (:mod:`megatron_ckpt_fixes.fixes.structure`) would replan
anyway; the sentinel additionally keeps the cached fast path on fault checkpoints.

Whether upstream already does this is asked of upstream itself
(:func:`upstream_emits_sentinel`): the wheels of 0.17.x still return None, 0.18.0 is the
first that emits the sentinel.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.compat.detect import probe_world, quiet

RERUN_STATE_KEY = "rerun_state_machine_state"
_RSM = "megatron.core.rerun_state_machine"
#: where the replacement keeps upstream's own ``state_dict``, for :func:`upstream_emits_sentinel`
_UPSTREAM = "_mcf_upstream"


def upstream_emits_sentinel() -> str | None:
    """Ask a fresh machine in NOT_RUNNING_YET (validate mode) for its torch_dist state dict.

    Asks upstream's own ``state_dict`` even where ``install()`` has replaced it: callers
    (the Megatron-LM scenarios, the fault tests) want plain upstream's behaviour, and in a
    patched process the replacement would always answer "emits".

    Returns why the patch is not needed (upstream emits the object), or None.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

    current = RerunStateMachine.state_dict
    upstream_state_dict = getattr(current, _UPSTREAM, current)
    with quiet(_RSM), probe_world():
        machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
        emitted = upstream_state_dict(machine, None, "torch_dist")
    if emitted is None:
        return None
    if not any(isinstance(v, ShardedObject) for v in emitted.values()):
        raise TypeError(f"RerunStateMachine.state_dict returned {sorted(emitted)} in "
                        "NOT_RUNNING_YET, without a ShardedObject: unknown behaviour")
    return "RerunStateMachine.state_dict already emits its ShardedObject in NOT_RUNNING_YET"


def always_emit(original: Callable[..., Any]) -> Callable[..., Any]:
    from megatron.core.rerun_state_machine import RerunMode, RerunState

    @functools.wraps(original)
    def state_dict(self: Any, data_iterator: Any, ckpt_format: str,
                   force: bool = False) -> dict[str, Any] | None:
        steady = self.state == RerunState.NOT_RUNNING_YET
        if not force and steady and self.mode != RerunMode.DISABLED and ckpt_format == "torch_dist":
            return original(self, None, ckpt_format, force=True)
        return original(self, data_iterator, ckpt_format, force)

    setattr(state_dict, _UPSTREAM, original)
    return state_dict


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="rerun.sentinel.state_dict",
        target=f"{_RSM}:RerunStateMachine",
        attr="state_dict",
        build=always_emit,
        reads=(f"{_RSM}:RerunMode", f"{_RSM}:RerunState"),
        not_needed=upstream_emits_sentinel,
        why="the rerun state ShardedObject exists in every torch_dist checkpoint, not only "
            "in fault checkpoints",
    ),
)
