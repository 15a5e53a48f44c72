"""``--dist-ckpt-strictness log_all`` (Megatron-Bridge's recipes): a resume into a model the
checkpoint does not fully hold says so once, alike on both ranks, and trains on; with
``--ckpt-verify-checksums`` the job refuses before any tensor data is read, naming the keys.

The checkpoint is saved while the embedding is frozen (``--freeze-embedding-until``): Adam has
no state for it. The job that resumes without the flag asks for that state: under
``log_all`` megatron-core leaves it out of the load and the job trains on without it. The
dist_checkpointing-level twins (upstream's per-rank lines): test_strictness.py.
"""

from __future__ import annotations

import pytest
from training_runs import COMMON, run_job

pytestmark = pytest.mark.varies_with("megatron-core")

JOB = [*COMMON[:2], "--tensor-model-parallel-size", "2"]
UNLOADED = "'optimizer.state.exp_avg.embedding.word_embeddings.weight' (ranks 0, 1)"


@pytest.fixture(scope="module")
def frozen_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    ckpt = root / "ckpt"
    job = run_job(root, [*JOB, "--train-iters", "2", "--save", str(ckpt),
                         "--freeze-embedding-until", "5"], name="frozen")
    assert job.exit_codes == [0], job.output[-6000:]
    return ckpt


def _resume(ckpt, tmp_path, *extra: str):
    return run_job(tmp_path, [*JOB, "--train-iters", "3", "--load", str(ckpt),
                              "--dist-ckpt-strictness", "log_all", *extra])


def test_log_all_names_the_unloaded_keys_once_on_every_rank(frozen_ckpt, tmp_path):
    job = _resume(frozen_ckpt, tmp_path)
    lines = [line.split(" ", 1)[1] for line in job.output.splitlines()
             if "megatron_ckpt_fixes: loading" in line and "with strict=log_all" in line]
    assert len(lines) == 2 and lines[0] == lines[1], job.output[-6000:]
    assert "Unexpected keys (requested, not in the checkpoint: left unloaded" in lines[0], \
        lines[0]
    assert UNLOADED in lines[0], lines[0]
    assert job.exit_codes == [0], job.output[-6000:]  # the load asked for: it trains on


def test_verify_checksums_refuses_before_reading_data(frozen_ckpt, tmp_path):
    job = _resume(frozen_ckpt, tmp_path, "--ckpt-verify-checksums")
    assert job.exit_codes == [1], job.output[-6000:]
    errors = [line for line in job.output.splitlines() if line.startswith("train.py: error")]
    assert len(errors) == 1, job.output[-6000:]
    text = job.output[job.output.index(errors[0]):]
    assert "pre-flight" in text and "optimizer.state.exp_avg.embedding.word_embeddings.weight" \
        in text and "not in the checkpoint" in text, text[:3000]
    assert "with strict=log_all" not in job.output  # refused before the load
    assert "checksums of" not in job.output  # ... and before the byte check
