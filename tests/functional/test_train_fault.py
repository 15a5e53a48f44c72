"""6b: fault checkpoint with a warm plan cache -> exit 16 -> relaunch -> rerun -> judged.

A persistent error is injected (upstream's RerunErrorInjector) in step 5, after four saves
with ``--ckpt-assume-constant-structure`` (the cached plan is reused from the third save on).
The fault checkpoint is taken before the step's optimizer update, the job exits 16, the
runner relaunches it on another (CPU) placement, the machine goes to
RERUNNING_FROM_CHECKPOINT, reruns step 5 and judges it ("possible persistent error", exit 17,
as upstream does for a fatal check). The rerun reproduces the uninterrupted run's step 5
bitwise, and a relaunch that carries on from the fault checkpoint (rerun state machine off)
ends exactly where the uninterrupted run ends.

The twin runs the same job on plain upstream (``--upstream-only``: only the CPU/gloo support)
and asserts what the installed megatron-core really does, detected from its behaviour: before
0.18 the fault checkpoint does not load (the failure this project fixes); from 0.18 on
upstream emits the rerun state machine's sentinel itself and the fault checkpoint loads.
"""

from __future__ import annotations

import re

from training_runs import (
    COMMON,
    FAULT,
    assert_same_tensors,
    load_dump,
    reference,
    run_job,
)

from megatron_ckpt_fixes.fixes.rerun import relaunch_bound
from megatron_ckpt_fixes.fixes.rerun.sentinel import upstream_emits_sentinel
from megatron_ckpt_fixes._dev.training import layout

FAULT_STEP = 5  # first injection with COMMON's seed; saves at iterations 1..4 came before


def _fault_job_args(ckpt) -> list[str]:
    return [*COMMON, *FAULT, "--tensor-model-parallel-size", "2", "--save", str(ckpt),
            "--load", str(ckpt), "--save-interval", "1", "--ckpt-assume-constant-structure"]


def test_fault_checkpoint_resume_rerun_and_continue(tmp_path, tmp_path_factory):
    ref_losses, ref_state = reference(tmp_path_factory)
    ckpt = tmp_path / "ckpt"
    job = run_job(tmp_path, _fault_job_args(ckpt), max_restarts=2, name="fault")

    assert job.exit_codes == [16, 17], job.output[-8000:]
    assert "Injecting error type Persistent error" in job.output
    outcomes = [(r["iteration"], r["rerun_state"], r["exit_code"]) for r in job.log
                if r["exit_code"] is not None]
    assert outcomes == [(FAULT_STEP, "WILL_RERUN_FROM_CHECKPOINT", 16),
                        (FAULT_STEP, "RERUNNING_FROM_CHECKPOINT", 17)]
    assert "Possible persistent error" in job.output
    assert "starting at iteration 4 (rerun state WILL_RERUN_FROM_CHECKPOINT)" in job.output
    # The fault checkpoint replaces iteration 4's regular one, and the output says so.
    assert job.output.count(f"saved checkpoint {layout.iteration_dir(ckpt, 4)}\n") == 1
    assert (f"saved the fault checkpoint {layout.iteration_dir(ckpt, 4)}: it replaces the "
            "checkpoint saved at iteration 4 before (the rerun state machine saves before step "
            "5's update; the relaunched job reruns that step from it)") in job.output
    # Steps before the fault, the in-place rerun and the rerun from the checkpoint all
    # reproduce the uninterrupted run bitwise.
    assert job.losses() == {i: ref_losses[i] for i in range(1, FAULT_STEP)}
    assert {r["loss"] for r in job.log if r["iteration"] == FAULT_STEP} == {ref_losses[FAULT_STEP]}
    assert layout.read_tracker(ckpt) == FAULT_STEP - 1

    # Carry on from the fault checkpoint: nothing is lost, the run ends as the reference does.
    dump = tmp_path / "final.pt"
    carry = run_job(tmp_path, [*_fault_job_args(ckpt), "--rerun-mode", "disabled"],
                    name="carry-on", dump=dump)
    assert carry.exit_codes == [0], carry.output[-8000:]
    assert carry.losses() == {i: ref_losses[i] for i in range(FAULT_STEP, 9)}
    assert_same_tensors(load_dump(dump), ref_state)


def test_upstream_fault_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = run_job(tmp_path, [*_fault_job_args(ckpt), "--upstream-only"], max_restarts=2,
                  name="upstream")

    assert job.exit_codes[0] == 16, job.output[-8000:]
    if upstream_emits_sentinel() is not None:
        # megatron-core >= 0.18: the structure stays constant, the relaunch reruns and judges.
        assert job.exit_codes == [16, 17], job.output[-8000:]
        assert any(r["rerun_state"] == "RERUNNING_FROM_CHECKPOINT" for r in job.log)
        return
    assert len(job.exit_codes) == 2 and job.exit_codes[1] not in (0, 16, 17), job.output[-8000:]
    assert "Missing key in checkpoint state_dict: rerun_state_machine_state/shard_" in job.output
    # The relaunch never got to rerun the step.
    assert all(r["rerun_state"] != "RERUNNING_FROM_CHECKPOINT" for r in job.log)


#: Relaunches one fault may ask for from one checkpoint in these tests (default 3).
BOUND = {relaunch_bound.LIMIT_ENV: "1"}
#: The fixes that make the fault checkpoint load on every release (the sentinel: upstream
#: from 0.18) and run on CPU, without the relaunch bound.
WITHOUT_BOUND = {"MEGATRON_CKPT_FIXES": "compat.cpu,compat.rerun_device,rerun.sentinel,"
                                        "training.cpu_support", **BOUND}


def test_relaunch_on_the_same_device_is_asked_to_restart_again(tmp_path):
    """Upstream's rule, kept on CPU: a rerun on the suspicious device proves nothing; the
    relaunch is asked for again, once (BOUND), and then the job stops with exit 17, one line
    naming the iteration, the fault, the checkpoint and the count. A launcher that relaunches
    every exit 16 (this one may, three times) no longer loops; the trivial wrong fix, exit 17
    at the first exit 16 from a checkpoint, fails here: the one allowed relaunch happens."""
    ckpt = tmp_path / "ckpt"
    job = run_job(tmp_path, _fault_job_args(ckpt), max_restarts=3, name="same-device",
                  runner_args=("--same-device",), env=BOUND)

    assert job.exit_codes == [16, 16, 17], job.output[-8000:]
    assert "Got rescheduled on the same GPU" in job.output
    outcomes = [(r["rerun_state"], r["exit_code"]) for r in job.log if r["exit_code"] is not None]
    assert outcomes == [("WILL_RERUN_FROM_CHECKPOINT", 16), ("RERUNNING_AGAIN_FROM_CHECKPOINT", 16),
                        ("RERUNNING_AGAIN_FROM_CHECKPOINT", 17)]
    fault_ckpt = layout.iteration_dir(ckpt, FAULT_STEP - 1)
    gave_up = [line for line in job.output.splitlines() if "came back" in line]
    assert len(gave_up) == 1, job.output[-8000:]
    # the machine's iteration count, as its own lines give it ("at iteration #4")
    assert re.search(rf"iteration #{FAULT_STEP - 1}: the fault 'found (NaN|Inf) in local "
                     rf"forward loss calculation \(check #\d+\)' came back 2 times from "
                     rf"{re.escape(str(fault_ckpt))} ", gave_up[0]), gave_up[0]
    assert "exit 17, failed result validation, no checkpoint" in gave_up[0]
    # The fault checkpoint stays, named by the tracker: it reproduces the fault.
    assert layout.read_tracker(ckpt) == FAULT_STEP - 1


def test_upstream_relaunches_the_same_fault_forever(tmp_path):
    """The twin: without the bound every relaunch loads the fault checkpoint, lands on the
    same device and exits 16 again, until the runner gives up (a launcher that does not:
    forever, Megatron-LM issue 5281)."""
    ckpt = tmp_path / "ckpt"
    job = run_job(tmp_path, [*_fault_job_args(ckpt), "--no-install"], max_restarts=3,
                  name="same-device-upstream", runner_args=("--same-device",),
                  env=WITHOUT_BOUND)

    assert job.exit_codes == [16, 16, 16, 16], job.output[-8000:]
    assert "giving up after 3 restarts" in job.output
    assert [r["rerun_state"] for r in job.log if r["exit_code"] is not None][1:] == \
        ["RERUNNING_AGAIN_FROM_CHECKPOINT"] * 3
