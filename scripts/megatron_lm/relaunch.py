#!/usr/bin/env python
"""A scheduler relaunches Megatron-LM's job after a transient fault (exit 17).

    python scripts/megatron_lm/relaunch.py [--upstream] [--out DIR]

Megatron-LM's own ``gpt3_mcore_reruns_transient`` case (``--rerun-mode validate_results``,
an injected transient error: the step's loss is bad once, fine when rerun in place) with
``--save-interval 2`` (checkpoints before the fault), run by ``pretrain_gpt.py`` on CPU
ranks as the case runner runs it (:mod:`run_case`); it ends with exit 17 (result validation
failed). A scheduler that relaunches failed jobs then starts the same command again: the
relaunch resumes from the checkpoint the tracker names. megatron-core 0.16 saved one at the
fault, in ``RERUNNING_IN_PLACE``, and the relaunch crashes in ``_restore_state``
(``TypeError: 'NoneType' object is not subscriptable``, Megatron-LM issue 3884); later
releases save none there (PR 3981) and the relaunch resumes from the checkpoint before the
fault; with the fixes (``rerun.transient_fault``) 0.16 does the same.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import adapt  # noqa: E402
import upstream_snapshots  # noqa: E402
from cases import load_case  # noqa: E402
from run_case import CaseResult, CaseRun, Mode  # noqa: E402

CASE = "gpt3_mcore_reruns_transient"
#: Saves every 2 iterations: the tracker names a checkpoint from before the fault.
FLAGS = (("--save-interval", 2),)
TRACKER = "latest_checkpointed_iteration.txt"
#: What the relaunch of plain megatron-core 0.16 dies of.
CRASH = "TypeError: 'NoneType' object is not subscriptable"


@dataclass
class Relaunch:
    """The first job (to its fault) and its relaunch with the same command."""

    first_exit_codes: list[int]
    #: the iteration the tracker named after the fault, and the iteration that faulted
    tracker_after_fault: int | None
    fault_iteration: int | None
    relaunch_exit_codes: list[int]
    relaunch_error: str | None
    relaunch_log: str
    result: CaseResult


def _tracker(ckpt: Path) -> int | None:
    path = ckpt / TRACKER
    return int(path.read_text().strip()) if path.exists() else None


def _fault_iteration(log: str) -> int | None:
    """The iteration megatron-core's rerun state machine names for the transient error."""
    import re

    found = re.search(r"iteration #(\d+): .*Possible transient error", log)
    return int(found.group(1)) if found else None


def relaunch_after_transient_fault(tree: Path, ref: str, fixes: bool, out: Path,
                                   nproc: int | None = None) -> Relaunch:
    case = load_case(tree, CASE)
    nproc = adapt.world_size_of(case, nproc)
    mode = Mode(fixes, False, FLAGS)
    result = CaseResult(CASE, mode.label, version("megatron-core"), ref, nproc)
    run = CaseRun(tree, case, mode, out / CASE / mode.label, nproc, False, result)
    directory = run.out / "run"
    argv = run.argv(directory, directory / "ckpt")
    first = run.job("run", argv, max_restarts=0)
    tracker = _tracker(directory / "ckpt")
    relaunch = run.job("relaunch", argv, max_restarts=0)
    return Relaunch(first.exit_codes, tracker, _fault_iteration(first.logs()),
                    relaunch.exit_codes, result.errors.get("relaunch"), relaunch.logs(), result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", action="store_true",
                        help="plain megatron-core (MEGATRON_CKPT_FIXES=compat.tensor_metadata: "
                             "jobs.UPSTREAM_FEATURES)")
    parser.add_argument("--out", type=Path,
                        default=Path(tempfile.gettempdir()) / "megatron_lm_relaunch")
    args = parser.parse_args(argv)
    ref = upstream_snapshots.ref_for_installed()
    outcome = relaunch_after_transient_fault(upstream_snapshots.training_tree(ref), ref,
                                             not args.upstream, args.out.resolve())
    print(f"first job: exit {outcome.first_exit_codes}; transient fault at iteration "
          f"{outcome.fault_iteration}; the tracker names {outcome.tracker_after_fault}")
    print(f"relaunch: exit {outcome.relaunch_exit_codes}"
          + (f"; {outcome.relaunch_error}" if outcome.relaunch_error else ""))
    return 0 if outcome.relaunch_error is None else 1


if __name__ == "__main__":
    sys.exit(main())
