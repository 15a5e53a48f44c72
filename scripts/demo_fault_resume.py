#!/usr/bin/env python
"""One-command demo: fault -> exit 16 -> relaunch -> rerun from the checkpoint -> continue.

    python scripts/demo_fault_resume.py            # with the fixes (install())
    python scripts/demo_fault_resume.py --upstream # plain megatron-core: the load fails

A 2-rank job (TP=2, gloo on CPU) saves every iteration with
``--ckpt-assume-constant-structure``; megatron-core's error injector makes step 5 give a
persistent error. The rerun state machine reruns the step in place, saves a fault checkpoint
(a warm cached plan by then) and exits 16; ``run_with_restarts.py`` relaunches the job on
another placement, which loads the fault checkpoint, reruns step 5 (RERUNNING_FROM_CHECKPOINT)
and judges it (a persistent error: exit 17, as upstream does for a fatal check). The job
then carries on from the fault checkpoint to the end, and its loss history is compared with
an uninterrupted run's, bitwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
RUNNER = SCRIPTS / "run_with_restarts.py"
JOB = ["--tensor-model-parallel-size", "2", "--seed", "1237", "--train-iters", "8"]
FAULT = ["--rerun-mode", "validate_results", "--error-injection-rate", "10",
         "--error-injection-type", "persistent_error"]


def run(step: str, workdir: Path, train_args: list[str], max_restarts: int) -> list[dict]:
    print(f"\n=== {step} ===", flush=True)
    report = workdir / f"{step.split()[0].lower()}.attempts.json"
    subprocess.run([sys.executable, str(RUNNER), "--nproc-per-node", "2", "--max-restarts",
                    str(max_restarts), "--report", str(report), "--", *train_args], check=False)
    return json.loads(report.read_text())


def losses(log: Path) -> dict[int, str]:
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {r["iteration"]: r["loss"] for r in records if r["exit_code"] is None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path,
                   default=Path(tempfile.gettempdir()) / "megatron_ckpt_fixes_demo",
                   help="checkpoints and logs go here (emptied first)")
    p.add_argument("--upstream", action="store_true",
                   help="plain megatron-core (only CPU/gloo support): shows the load failure")
    args = p.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    ckpt, log = args.workdir / "ckpt", args.workdir / "fault.log.jsonl"
    fault_job = [*JOB, *FAULT, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1",
                 "--ckpt-assume-constant-structure", "--log-file", str(log)]
    if args.upstream:
        fault_job.append("--upstream-only")

    attempts = run("Fault job (relaunched on exit 16)", args.workdir, fault_job, max_restarts=2)
    codes = [a["exit_code"] for a in attempts]
    if codes[:1] != [16] or len(codes) < 2 or codes[1] not in (16, 17):
        print(f"\nexit codes {codes}: the fault checkpoint could not be resumed"
              + (" (the upstream failure)" if args.upstream else ""))
        return 1
    run("Carry on from the fault checkpoint", args.workdir, [*fault_job, "--rerun-mode",
                                                             "disabled"], max_restarts=0)
    ref_log = args.workdir / "reference.log.jsonl"
    run("Reference (uninterrupted)", args.workdir,
        [*JOB, "--rerun-mode", "validate_results", "--log-file", str(ref_log)], max_restarts=0)

    same = losses(log) == losses(ref_log)
    print(f"\nexit codes of the fault job: {codes} (16: resume to disambiguate, "
          "17: validation failed after the rerun from the checkpoint)")
    print(f"loss per step equals the uninterrupted run's, bitwise: {same}")
    print(f"checkpoints and logs: {args.workdir}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
