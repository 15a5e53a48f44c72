"""6d: resume with another tensor-parallel size: weights and optimizer state follow exactly.

megatron-core's non-distributed optimizer shards its Adam moments like the parameters, so
dist_checkpointing reshards both. The loaded state is compared, gathered to full tensors,
with the state that was saved (bitwise). World size stays 2 (TP=2 <-> TP=1 x DP=2), so the
per-rank RNG states load too; a different world size needs ``--no-load-rng`` (clear error
otherwise, tested below), and ``--no-load-optim`` loads weights only.
"""

from __future__ import annotations

from training_runs import COMMON, assert_same_tensors, load_dump, reference, reference_dir, run_job


def _load_only(ckpt, tp: int, iteration: int) -> list[str]:
    """A job that loads ``ckpt`` with TP=tp and trains no step (run it with ``dump=``)."""
    return ["--seed", "1237", "--train-iters", str(iteration), "--tensor-model-parallel-size",
            str(tp), "--load", str(ckpt)]


def test_tp2_checkpoint_loads_exactly_with_tp1(tmp_path, tmp_path_factory):
    _, ref_state = reference(tmp_path_factory)  # TP=2, checkpoint at iteration 8
    dump = tmp_path / "tp1.pt"
    job = run_job(tmp_path, _load_only(reference_dir(tmp_path_factory) / "ckpt", 1, 8),
                  dump=dump)
    assert job.exit_codes == [0], job.output[-6000:]
    assert "saved with TP=2" in job.output
    assert_same_tensors(load_dump(dump), ref_state)


def test_tp1_checkpoint_loads_exactly_with_tp2(tmp_path):
    ckpt, saved, loaded = tmp_path / "ckpt", tmp_path / "tp1.pt", tmp_path / "tp2.pt"
    first = run_job(tmp_path, [*COMMON[:2], "--train-iters", "3", "--tensor-model-parallel-size",
                               "1", "--save", str(ckpt)], name="tp1", dump=saved)
    assert first.exit_codes == [0], first.output[-6000:]
    second = run_job(tmp_path, _load_only(ckpt, 2, 3), name="tp2", dump=loaded)
    assert second.exit_codes == [0], second.output[-6000:]
    assert "saved with TP=1" in second.output
    assert_same_tensors(load_dump(loaded), load_dump(saved))


def test_world_size_change_needs_no_load_rng(tmp_path, tmp_path_factory):
    """2 ranks -> 1 rank: per-rank RNG states cannot follow (clear error); with --no-load-rng
    the weights and optimizer state still load exactly."""
    _, ref_state = reference(tmp_path_factory)
    ckpt, dump = reference_dir(tmp_path_factory) / "ckpt", tmp_path / "one.pt"
    refused = run_job(tmp_path, _load_only(ckpt, 1, 8), nproc=1, name="refused", dump=dump)
    assert refused.exit_codes == [1]
    assert "holds per-rank RNG states of 2 ranks, this job has 1" in refused.output
    assert "--no-load-rng" in refused.output

    loaded = run_job(tmp_path, [*_load_only(ckpt, 1, 8), "--no-load-rng"], nproc=1,
                     name="loaded", dump=dump)
    assert loaded.exit_codes == [0], loaded.output[-6000:]
    assert_same_tensors(load_dump(dump), ref_state)
