"""Megatron-LM's own ``pretrain_gpt.py`` with ``--async-save --use-persistent-ckpt-worker``:
the resumed run equals the uninterrupted one bitwise with the fixes, and not upstream.

CI's ``ckpt-resume`` flow of ``gpt3_mcore_tp1_pp2_resume_torch_dist`` (scripts/megatron_lm):
the job trains to ``--train-iters`` saving asynchronously through megatron-core's persistent
worker, then resumes from the middle checkpoint. The tiny CPU model's checkpoint is written in
a blink, so the checkpoint workers hold their writes into the middle checkpoint (the one the
resume reads: ``MCF_MLM_CKPT_HELD_SAVE``) until an optimizer step after it has changed the
parameters on every rank, as a large model's writer is still writing then. (The case trains
with ``--fp16``: its first iterations overflow and are skipped; the hold waits for a step
that was not.) Upstream the middle checkpoint then holds a later step's parameters and the
resumed losses leave the uninterrupted run's; with the fixes (the environment switch alone)
every resumed iteration's loss is bitwise the same.
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
from run_case import CaseResult, Mode, run_case  # noqa: E402

pytestmark = pytest.mark.timeout(900)

CASE = "gpt3_mcore_tp1_pp2_resume_torch_dist"
FLAGS = (("--async-save", True), ("--use-persistent-ckpt-worker", True),
         ("--save-interval", 10), ("--train-iters", 20))
#: The checkpoint the resume reads: the middle of ``--train-iters``.
HELD_SAVE = "10"


def _run(tmp_path: Path, monkeypatch, fixes: bool) -> CaseResult:
    monkeypatch.setenv("MCF_MLM_CKPT_HELD_SAVE", HELD_SAVE)
    ref = upstream_snapshots.ref_for_installed()
    tree = upstream_snapshots.training_tree(ref)
    result = run_case(tree, ref, CASE, Mode(fixes, False, FLAGS), tmp_path, proof=False)
    assert not result.errors, result.errors
    assert result.exit_codes["run1"] == [0] and result.exit_codes["run2"] == [0], result
    return result


def _compared(result: CaseResult) -> tuple[int, int]:
    iterations = sum(len(c.iterations) for c in result.comparisons)
    return iterations, sum(len(c.differing) for c in result.comparisons)


def test_resume_from_an_async_persistent_checkpoint_is_bitwise_with_the_fixes(
        tmp_path, monkeypatch):
    result = _run(tmp_path, monkeypatch, fixes=True)
    iterations, differing = _compared(result)
    assert iterations == 10 and differing == 0, [str(c) for c in result.comparisons]


def test_resume_from_an_async_persistent_checkpoint_upstream(tmp_path, monkeypatch):
    """The twin: the middle checkpoint holds later steps' values, the resume diverges."""
    result = _run(tmp_path, monkeypatch, fixes=False)
    iterations, differing = _compared(result)
    assert iterations == 10 and differing > 0, [str(c) for c in result.comparisons]
