"""No checkpoint after a transient fault: the relaunch resumes from the last good one.

With ``--rerun-mode validate_results`` a fatal check that fails (NaN or Inf in the loss) makes
the rerun state machine rerun the step in place; a different result the second time is a
transient error, and the job exits 17. megatron-core 0.16's ``should_checkpoint_and_exit``
asks for a checkpoint first, in state ``RERUNNING_IN_PLACE``, and the tracker names it. A
scheduler that relaunches the job loads it, the machine resumes in ``RERUNNING_IN_PLACE``
without the state that an in-place rerun restores (``saved_state`` is not checkpointed),
and the next step crashes: ``TypeError: 'NoneType' object is not subscriptable`` in
``_restore_state`` (Megatron-LM issue 3884). Later releases take no checkpoint there
(Megatron-LM PR 3981: "The job can be resumed from a previous checkpoint").

The patch gives a release that still asks for it the later releases' answer: exit 17, no
checkpoint, so the tracker keeps naming the last checkpoint saved before the fault, which
every release resumes from. Whether upstream still asks is asked of upstream's own
``should_checkpoint_and_exit`` in ``RERUNNING_IN_PLACE`` (:func:`upstream_skips_checkpoint`).
A checkpoint that plain 0.16 already saved after a transient fault stays unloadable, as on
every release.

The same answer is also bounded on every release: a checkpoint that brings the same fault
back is relaunched (exit 16) a bounded number of times (:mod:`.relaunch_bound`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.agreement import rank_and_size
from megatron_ckpt_fixes.compat.detect import probe_world, quiet
from megatron_ckpt_fixes.fixes.rerun import relaunch_bound

logger = logging.getLogger(__name__)

_RSM = "megatron.core.rerun_state_machine"
#: where the replacement keeps upstream's own method, for :func:`upstream_skips_checkpoint`
_UPSTREAM = "_mcf_upstream"


def upstream_skips_checkpoint() -> str | None:
    """Ask a machine in ``RERUNNING_IN_PLACE`` (validate mode) whether to checkpoint and
    exit: why the patch is not needed (upstream exits without a checkpoint), or None."""
    from megatron.core.rerun_state_machine import RerunMode, RerunState, RerunStateMachine

    current = RerunStateMachine.should_checkpoint_and_exit
    upstream = getattr(current, _UPSTREAM, current)
    with quiet(_RSM), probe_world():
        machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
        machine.state = RerunState.RERUNNING_IN_PLACE
        checkpoint, exits, code = upstream(machine)
    if not exits:
        raise TypeError("RerunStateMachine.should_checkpoint_and_exit does not exit after a "
                        "transient error: unknown behaviour")
    if checkpoint:
        return None
    return ("RerunStateMachine.should_checkpoint_and_exit takes no checkpoint after a "
            f"transient error (exit code {code})")


def no_checkpoint_after_transient_fault(original: Callable[..., Any]) -> Callable[..., Any]:
    from megatron.core.rerun_state_machine import RerunState

    transient_rule = upstream_skips_checkpoint() is None  # asked of upstream's own method

    @functools.wraps(original)
    def should_checkpoint_and_exit(self: Any) -> tuple[bool, bool, int]:
        in_place = self.state == RerunState.RERUNNING_IN_PLACE
        checkpoint, exits, code = original(self)
        if transient_rule and in_place and checkpoint and exits:
            if rank_and_size()[0] == 0:
                logger.warning("megatron_ckpt_fixes: no checkpoint after all: this one would "
                               "hold the rerun state RERUNNING_IN_PLACE, which no release can "
                               "resume from; the job can be resumed from the previous "
                               "checkpoint (exit code %d)", code)
            return False, exits, code
        # Every release: exit 16 for the same fault from the same checkpoint a bounded
        # number of times, then 17 (relaunch_bound.py).
        return relaunch_bound.bounded(self, checkpoint, exits, code)

    setattr(should_checkpoint_and_exit, _UPSTREAM, original)
    return should_checkpoint_and_exit


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="rerun.transient_fault.should_checkpoint_and_exit",
        target=f"{_RSM}:RerunStateMachine",
        attr="should_checkpoint_and_exit",
        build=no_checkpoint_after_transient_fault,
        reads=(f"{_RSM}:RerunState",),
        why="after a transient fault (exit 17) no checkpoint is taken in RERUNNING_IN_PLACE "
            "where upstream still takes one, which a relaunch cannot resume from (TypeError in "
            "_restore_state); and a checkpoint that brings the same fault back is relaunched "
            "(exit 16) a bounded number of times, then exit 17",
    ),
)
