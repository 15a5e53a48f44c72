"""6a: stopped at k and resumed == uninterrupted, bitwise (losses per step and final state)."""

from __future__ import annotations

from training_runs import COMMON, assert_same_tensors, load_dump, reference, run_job

from megatron_ckpt_fixes._dev.training import layout


def test_stop_and_resume_is_bitwise_identical(tmp_path, tmp_path_factory):
    ref_losses, ref_state = reference(tmp_path_factory)
    ckpt, dump = tmp_path / "ckpt", tmp_path / "final.pt"
    args = [*COMMON, "--tensor-model-parallel-size", "2", "--rerun-mode", "validate_results",
            "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
            "--ckpt-assume-constant-structure"]

    # Stopped at k=3 (--exit-interval saves first); saves are asynchronous in this phase,
    # through megatron-core's own asynchronous save (Megatron-LM's default, nvrx, needs
    # nvidia-resiliency-ext >= 0.6.0, which cannot be installed here).
    first = run_job(tmp_path, [*args, "--exit-interval", "3", "--async-save",
                               "--async-strategy", "mcore"], name="first")
    assert first.exit_codes == [0], first.output[-6000:]
    assert layout.read_tracker(ckpt) == 3

    second = run_job(tmp_path, args, name="second", dump=dump)
    assert second.exit_codes == [0], second.output[-6000:]
    assert "starting at iteration 3" in second.output

    assert {**first.losses(), **second.losses()} == ref_losses
    assert sorted(ref_losses) == list(range(1, 9))
    assert_same_tensors(load_dump(dump), ref_state)
