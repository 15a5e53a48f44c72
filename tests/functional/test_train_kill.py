"""6c: a rank SIGKILLed mid-save; the relaunch resumes from the previous complete checkpoint.

Rank 1 kills itself (``MCF_TEST_KILL_DURING_SAVE_ITER``, a test hook from ``rank_env/``)
after writing its shards of the
iteration-4 checkpoint and before the save is finalized. The tracker must still name
iteration 2, and the relaunch must continue from there to the same losses and final state as
the uninterrupted run.
"""

from __future__ import annotations

import signal

from training_runs import (
    COMMON,
    KILL_DURING_SAVE_ENV,
    assert_same_tensors,
    load_dump,
    reference,
    run_job,
)

from megatron_ckpt_fixes._dev.training import layout


def test_killed_save_leaves_previous_checkpoint(tmp_path, tmp_path_factory):
    ref_losses, ref_state = reference(tmp_path_factory)
    ckpt, dump = tmp_path / "ckpt", tmp_path / "final.pt"
    args = [*COMMON, "--tensor-model-parallel-size", "2", "--rerun-mode", "validate_results",
            "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
            "--ckpt-assume-constant-structure"]

    killed = run_job(tmp_path, args, env={KILL_DURING_SAVE_ENV: "4"}, name="killed")
    assert killed.attempts[0]["rank_codes"][1] == 128 + signal.SIGKILL, killed.output[-6000:]
    assert killed.exit_codes[0] != 0
    assert layout.read_tracker(ckpt) == 2
    assert layout.iteration_dir(ckpt, 2).is_dir()
    assert not layout.iteration_dir(ckpt, 4).exists()
    assert layout.staging_dir(ckpt, 4).is_dir()  # the unfinished save, never named

    resumed = run_job(tmp_path, args, name="resumed", dump=dump)
    assert resumed.exit_codes == [0], resumed.output[-6000:]
    assert "starting at iteration 2" in resumed.output
    assert resumed.losses() == {i: ref_losses[i] for i in range(3, 9)}
    assert_same_tensors(load_dump(dump), ref_state)
