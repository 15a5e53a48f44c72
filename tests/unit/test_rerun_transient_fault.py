"""No checkpoint after a transient fault; every other answer of the machine unchanged.

The relaunch through Megatron-LM's own ``pretrain_gpt.py``: test_megatron_lm_relaunch.py.
Here the machine itself, in each state: only ``RERUNNING_IN_PLACE`` (a transient error, exit
17) loses its checkpoint; a fault that must be rerun elsewhere (``WILL_RERUN_FROM_CHECKPOINT``,
exit 16) keeps it: a fix that never checkpoints on exit fails here.
"""

from __future__ import annotations

import pytest

from megatron_ckpt_fixes.fixes.rerun.transient_fault import upstream_skips_checkpoint

STATES = ["NOT_RUNNING_YET", "RERUNNING_IN_PLACE", "WILL_RERUN_FROM_CHECKPOINT",
          "RERUNNING_FROM_CHECKPOINT", "RERUNNING_AGAIN_FROM_CHECKPOINT"]


def _answers(mode: str) -> dict[str, tuple]:
    from megatron.core.rerun_state_machine import RerunMode, RerunState, RerunStateMachine

    answers = {}
    for state in STATES:
        machine = RerunStateMachine(mode=RerunMode(mode))
        machine.state = RerunState[state]
        answers[state] = machine.should_checkpoint_and_exit()
    return answers


@pytest.mark.parametrize("mode", ["validate_results", "disabled", "report_determinism_stats"])
def test_only_the_transient_fault_loses_its_checkpoint(single_rank_group, clean_install, mode):
    upstream = _answers(mode)
    clean_install.install(["rerun.transient_fault"])
    fixed = _answers(mode)
    expected = dict(upstream)
    if mode == "validate_results":
        assert fixed["RERUNNING_IN_PLACE"] == (False, True, 17)
        assert fixed["WILL_RERUN_FROM_CHECKPOINT"] == (True, True, 16)
        expected["RERUNNING_IN_PLACE"] = (False, True, 17)
    assert fixed == expected


def test_the_release_is_asked(single_rank_group, clean_install):
    """The patch applies on every release (it also bounds the relaunches of one fault:
    rerun/relaunch_bound.py); its transient rule changes an answer only where upstream still
    asks for the checkpoint (0.16/0.17)."""
    needed = upstream_skips_checkpoint() is None
    upstream = _answers("validate_results")["RERUNNING_IN_PLACE"]
    assert upstream == ((True, True, 17) if needed else (False, True, 17))
    installed = clean_install.install(["rerun.transient_fault"])
    assert "rerun.transient_fault.should_checkpoint_and_exit" in installed
    assert _answers("validate_results")["RERUNNING_IN_PLACE"] == (False, True, 17)
