"""--rerun-mode report_determinism_stats: every step is rerun in place and reported on.

Upstream 0.16 crashes at the first report (``Caller`` has no ``filename``); with the
``rerun.stats_report`` fix the job finishes, and rerunning each step changes no result.
"""

from __future__ import annotations

from training_runs import COMMON, reference, run_job


def test_report_determinism_stats_runs_and_changes_nothing(tmp_path, tmp_path_factory):
    ref_losses, _ = reference(tmp_path_factory)
    job = run_job(tmp_path, [*COMMON, "--tensor-model-parallel-size", "2",
                             "--rerun-mode", "report_determinism_stats"])
    assert job.exit_codes == [0], job.output[-6000:]
    assert job.losses() == ref_losses
