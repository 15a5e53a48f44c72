"""A scheduler relaunches Megatron-LM's ``pretrain_gpt.py`` after a transient fault (exit 17).

Megatron-LM's own ``gpt3_mcore_reruns_transient`` case with ``--save-interval 2``, unchanged
``pretrain_gpt.py`` on CPU ranks (``scripts/megatron_lm/relaunch.py``): the injected transient
error ends the job with exit 17, and the same command is started again. On megatron-core
0.16 the job saved a checkpoint in ``RERUNNING_IN_PLACE`` at the fault and the relaunch
crashes in ``_restore_state`` (Megatron-LM issue 3884); with the fixes
(``rerun.transient_fault``) it saves none there and the relaunch resumes from the previous
checkpoint; releases with upstream's own fix (PR 3981, detected) behave so without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from optional_systems import require

require("megatron-lm")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "megatron_lm"))

import upstream_snapshots  # noqa: E402
from relaunch import CRASH, relaunch_after_transient_fault  # noqa: E402

from megatron_ckpt_fixes.fixes.rerun.transient_fault import upstream_skips_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(900)
#: What the fixes log where they take upstream's checkpoint away.
NO_CHECKPOINT = "megatron_ckpt_fixes: no checkpoint after all"


@pytest.fixture(scope="module")
def snapshot() -> tuple[Path, str]:
    ref = upstream_snapshots.ref_for_installed()
    return upstream_snapshots.training_tree(ref), ref


def _resumed_from_before_the_fault(outcome) -> None:
    assert outcome.first_exit_codes == [17], outcome.result.exit_codes
    assert outcome.relaunch_error is None, outcome.relaunch_error
    assert outcome.relaunch_exit_codes == [17]  # the injected error comes back, and is judged
    assert outcome.fault_iteration is not None and \
        outcome.tracker_after_fault < outcome.fault_iteration
    assert (f"successfully loaded checkpoint from {outcome.result.job_dirs['run']}/ckpt"
            in outcome.relaunch_log)
    assert f"at iteration {outcome.tracker_after_fault}" in outcome.relaunch_log


def test_the_relaunch_resumes_from_the_checkpoint_before_the_fault(snapshot, tmp_path):
    outcome = relaunch_after_transient_fault(*snapshot, True, tmp_path)
    _resumed_from_before_the_fault(outcome)
    first = outcome.result.logs("run")
    assert (NO_CHECKPOINT in first) == (upstream_skips_checkpoint() is None)


def test_the_relaunch_upstream(snapshot, tmp_path):
    """The twin: plain megatron-core on the same CPU platform."""
    outcome = relaunch_after_transient_fault(*snapshot, False, tmp_path)
    if upstream_skips_checkpoint() is None:  # megatron-core 0.16: the fault checkpoint
        assert outcome.first_exit_codes == [17]
        assert outcome.relaunch_exit_codes == [1] and outcome.relaunch_error == CRASH
    else:  # upstream's own fix: the same as with the fixes
        _resumed_from_before_the_fault(outcome)
    assert NO_CHECKPOINT not in outcome.result.logs("run")
