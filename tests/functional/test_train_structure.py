"""A structure change inside a real training run: the embedding unfreezes mid-run.

``--freeze-embedding-until 3``: steps 1-3 train without the embedding, so Adam has no state
for it; from step 4 on it trains and its state (``optimizer.state.exp_avg(_sq).embedding.*``)
appears in the checkpoint. The job saves every iteration with Megatron-LM's flow under
``--ckpt-assume-constant-structure``: TP=1 on two ranks, so the fully-parallel wrapper
(on by default) splits each save between the data-parallel ranks, and from the third save on
megatron-core reuses its cached plan and shard distribution. With ``install()`` the change
is detected at save 4 and every rank replans; resuming from the checkpoint after the change
continues bitwise like the uninterrupted run. The twin (plain upstream) saves 4 and 5 with
the stale plan: the embedding's Adam state is missing from the checkpoint and the resume
fails at load.
"""

from __future__ import annotations

import re

import pytest
from torch.distributed.checkpoint import FileSystemReader
from training_runs import COMMON, assert_same_tensors, load_dump, run_job

from megatron_ckpt_fixes._dev.training import layout

UNFROZEN_STATE = "optimizer.state.exp_avg.embedding.word_embeddings.weight"
RESUME_AT = 5  # two saves after the change at iteration 4


def _args(ckpt) -> list[str]:
    return [*COMMON, "--tensor-model-parallel-size", "1", "--save", str(ckpt), "--load",
            str(ckpt), "--save-interval", "1", "--ckpt-assume-constant-structure",
            "--freeze-embedding-until", "3"]


def _saved(ckpt, iteration: int) -> dict[str, tuple]:
    """Key -> (global size, dtype) of every tensor in a checkpoint's ``.metadata``."""
    md = FileSystemReader(str(layout.iteration_dir(ckpt, iteration))).read_metadata()
    return {key: (tuple(entry.size), entry.properties.dtype)
            for key, entry in md.state_dict_metadata.items() if hasattr(entry, "size")}


def _saved_keys(ckpt, iteration: int) -> set[str]:
    return set(FileSystemReader(str(layout.iteration_dir(ckpt, iteration)))
               .read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """8 steps, a checkpoint after each; then the tracker is put back on iteration 5, as a
    job that died after its fifth save leaves it."""
    root = tmp_path_factory.mktemp("unfreeze")
    ckpt, dump = root / "ckpt", root / "final.pt"
    job = run_job(root, _args(ckpt), name="uninterrupted", dump=dump)
    assert job.exit_codes == [0], job.output[-6000:]
    layout.write_tracker(ckpt, RESUME_AT)
    return root, job, load_dump(dump)


def test_unfreezing_is_a_structure_change_under_the_cached_plan(uninterrupted):
    root, job, _ = uninterrupted
    assert sorted(job.losses()) == list(range(1, 9))
    # Logged once per rank at save 4, where the embedding's Adam state appeared.
    assert job.output.count("structure changed since the previous save (added 4: "
                            "[optimizer.state.exp_avg.embedding.position_embeddings.weight") == 2
    assert UNFROZEN_STATE not in _saved_keys(root / "ckpt", 3)
    assert UNFROZEN_STATE in _saved_keys(root / "ckpt", 4)
    assert UNFROZEN_STATE in _saved_keys(root / "ckpt", RESUME_AT)


def test_resume_after_the_change_is_bitwise(uninterrupted, tmp_path):
    root, job, final = uninterrupted
    ckpt, dump = root / "ckpt", tmp_path / "resumed.pt"
    before = _saved(ckpt, RESUME_AT)
    resumed = run_job(tmp_path, _args(ckpt), name="resumed", dump=dump)
    assert resumed.exit_codes == [0], resumed.output[-6000:]
    assert f"starting at iteration {RESUME_AT}" in resumed.output
    assert resumed.losses() == {i: job.losses()[i] for i in range(RESUME_AT + 1, 9)}
    assert_same_tensors(load_dump(dump), final)
    # The resumed job's saves started from the metadata its load read (Megatron-LM's
    # hand-over); what they wrote describes every tensor as the checkpoint it resumed from.
    assert _saved(ckpt, 8) == before


def test_upstream_loses_the_unfrozen_state_and_cannot_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*_args(ckpt), "--upstream-only"]
    first = run_job(tmp_path, [*args, "--exit-interval", str(RESUME_AT)], name="upstream")
    assert first.exit_codes == [0], first.output[-6000:]  # every save "succeeded"
    assert layout.read_tracker(ckpt) == RESUME_AT
    assert UNFROZEN_STATE not in _saved_keys(ckpt, RESUME_AT)

    resumed = run_job(tmp_path, args, name="upstream-resume")
    assert resumed.exit_codes == [1], resumed.output[-6000:]
    # megatron-core 0.16 and 0.19 word it differently; both name the embedding's Adam state.
    assert re.search(r"train\.py: error on rank \d: .*optimizer\.state\.exp_avg(_sq)?\."
                     r"embedding\.", resumed.output), resumed.output[-3000:]
    assert "Traceback" not in resumed.output
    # DCP's KeyError lists every key of the checkpoint (7,000 characters): the first few and
    # a count instead.
    errors = [line for line in resumed.output.splitlines() if line.startswith("train.py: error")]
    assert errors and all(len(line) <= 800 for line in errors), errors
    assert all(re.search(r"\.\.\. \d+ more \(\d+ in all\)", line) for line in errors), errors
