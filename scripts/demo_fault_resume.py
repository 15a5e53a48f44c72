#!/usr/bin/env python
"""One-command demo: fault -> exit 16 -> relaunch -> rerun -> continue; then a structure change.

    python scripts/demo_fault_resume.py            # with the fixes (install())
    python scripts/demo_fault_resume.py --upstream # plain megatron-core (CPU/gloo support only)
    python scripts/demo_fault_resume.py --verbose  # and the ranks' Python warnings
    python scripts/demo_fault_resume.py --out DIR  # checkpoints and logs in DIR (new or empty)

Part 1. A 2-rank job (TP=2, gloo on CPU) saves every iteration with
``--ckpt-assume-constant-structure``; megatron-core's error injector makes step 5 give a
persistent error. The rerun state machine reruns the step in place, saves a fault checkpoint
(a warm cached plan by then) and exits 16; ``run_with_restarts.py`` relaunches the job on
another placement, which loads the fault checkpoint, reruns step 5 (RERUNNING_FROM_CHECKPOINT)
and judges it (a persistent error: exit 17, as upstream does for a fatal check). The job
then carries on from the fault checkpoint to the end, and its loss history is compared with
an uninterrupted run's, bitwise. On plain megatron-core before 0.18 the relaunch fails to
load the fault checkpoint; from 0.18 on megatron-core emits the rerun state itself (the
"sentinel") and part 1 works upstream too.

Part 2. What the package still fixes on every release: a structure change inside a run.
Two ranks (TP=1, so Megatron-LM's fully-parallel save splits each save between them) train
with the embedding frozen for 3 iterations (``--freeze-embedding-until 3``), saving every
iteration under the cached plan; at iteration 4 the embedding's Adam state appears. The job
is resumed from its checkpoint of iteration 5 and must continue bitwise like the
uninterrupted run. Upstream keeps the stale cached plan: the state is missing from the
checkpoints and the resume fails at load.

The demo checks that every outcome is the one expected for the megatron-core installed
(detected from its behaviour), and exits 1 otherwise; its last line sums it up
(``demo OK: ...`` or ``demo FAILED: ...``) and names the folder that holds its checkpoints and
logs: a new one per run (``tempfile.mkdtemp``), or ``--out DIR``, which must be new or empty.
megatron-core's Python warnings (its import-time notes that Apex and Transformer Engine are
absent, its deprecations: two thirds of the output) are not printed unless ``--verbose``: the
ranks are ``scripts/train.py``, which hides them itself, as this process does
(:mod:`megatron_ckpt_fixes.core.verbosity`); ``--verbose`` sets ``MEGATRON_CKPT_FIXES_VERBOSE=1``
for them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))

from megatron_ckpt_fixes.core.verbosity import VERBOSE_ENV, quiet_unless  # noqa: E402

RUNNER = SCRIPTS / "run_with_restarts.py"
JOB = ["--seed", "1237", "--train-iters", "8"]
FAULT = ["--rerun-mode", "validate_results", "--error-injection-rate", "10",
         "--error-injection-type", "persistent_error"]
#: The relaunch's load failure upstream (megatron-core < 0.18, no sentinel).
MISSING_RERUN_STATE = "Missing key in checkpoint state_dict: rerun_state_machine_state/shard_"
#: The resume's load failure upstream after the embedding unfroze (0.16 and 0.19 word the
#: missing key differently; both name it).
MISSING_ADAM_STATE = re.compile(r"optimizer\.state\.exp_avg(_sq)?\.embedding\.\S+")
RESUME_AT = 5


@dataclass
class Run:
    codes: list[int]
    output: str


def run(step: str, workdir: Path, train_args: list[str], max_restarts: int = 0) -> Run:
    """Run a job through the runner, echoing its output, and collect its exit codes."""
    print(f"\n=== {step} ===", flush=True)
    report = workdir / f"{re.sub(r'[^a-z]+', '-', step.lower()).strip('-')}.attempts.json"
    proc = subprocess.Popen([sys.executable, str(RUNNER), "--nproc-per-node", "2",
                             "--max-restarts", str(max_restarts), "--report", str(report), "--",
                             *train_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    proc.wait()
    attempts = json.loads(report.read_text()) if report.exists() else []
    return Run([a["exit_code"] for a in attempts], "".join(lines))


def losses(log: Path) -> dict[int, str]:
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {r["iteration"]: r["loss"] for r in records if r["exit_code"] is None}


def verdict(ok: bool, text: str) -> bool:
    print(f"{'OK ' if ok else 'UNEXPECTED'}: {text}", flush=True)
    return ok


def fault_part(workdir: Path, upstream: bool, sentinel_upstream: bool) -> bool:
    ckpt, log = workdir / "fault-ckpt", workdir / "fault.log.jsonl"
    fault_job = [*JOB, *FAULT, "--tensor-model-parallel-size", "2", "--save", str(ckpt),
                 "--load", str(ckpt), "--save-interval", "1",
                 "--ckpt-assume-constant-structure", "--log-file", str(log)]
    if upstream:
        fault_job.append("--upstream-only")
    fault = run("Part 1: fault job (relaunched on exit 16)", workdir, fault_job, max_restarts=2)
    if upstream and not sentinel_upstream:
        return verdict(
            fault.codes[:1] == [16] and len(fault.codes) == 2 and fault.codes[1] not in (0, 16, 17)
            and MISSING_RERUN_STATE in fault.output,
            f"exit codes {fault.codes}: plain megatron-core saved the fault checkpoint with a "
            "stale cached plan and the relaunch cannot load it (Missing key "
            "rerun_state_machine_state)")
    if fault.codes != [16, 17]:
        return verdict(False, f"exit codes {fault.codes}, expected [16, 17]: the fault "
                              "checkpoint could not be resumed")
    if upstream:
        print("megatron-core emits the rerun state machine's sentinel itself (0.18 and later): "
              "the fault checkpoint loads on plain upstream too.", flush=True)
    run("Part 1: carry on from the fault checkpoint", workdir,
        [*fault_job, "--rerun-mode", "disabled"])
    ref_log = workdir / "reference.log.jsonl"
    reference = run("Part 1: reference (uninterrupted)", workdir,
                    [*JOB, "--tensor-model-parallel-size", "2", "--rerun-mode",
                     "validate_results", "--log-file", str(ref_log)]
                    + (["--upstream-only"] if upstream else []))
    return verdict(reference.codes == [0] and losses(log) == losses(ref_log) != {},
                   f"exit codes {fault.codes} (16: resume to disambiguate, 17: validation "
                   "failed after the rerun from the checkpoint); the loss of every step equals "
                   "the uninterrupted run's, bitwise")


def structure_part(workdir: Path, upstream: bool) -> bool:
    ckpt = workdir / "unfreeze-ckpt"
    job = [*JOB, "--tensor-model-parallel-size", "1", "--save", str(ckpt), "--load", str(ckpt),
           "--save-interval", "1", "--ckpt-assume-constant-structure",
           "--freeze-embedding-until", "3"] + (["--upstream-only"] if upstream else [])
    log, resumed_log = workdir / "unfreeze.log.jsonl", workdir / "resumed.log.jsonl"
    whole = run("Part 2: the embedding unfreezes at iteration 4 (saved every iteration)",
                workdir, [*job, "--log-file", str(log)])
    if whole.codes != [0]:
        return verdict(False, f"exit codes {whole.codes}, expected [0]")
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    tracker.write_text(f"{RESUME_AT}\n")  # as a job that died after its fifth save leaves it
    resumed = run(f"Part 2: resume from iteration {RESUME_AT}", workdir,
                  [*job, "--log-file", str(resumed_log)])
    if upstream:
        missing = MISSING_ADAM_STATE.search(resumed.output)
        return verdict(resumed.codes == [1] and missing is not None,
                       "plain megatron-core reused its cached plan after the structure "
                       "changed: the checkpoint lacks "
                       f"{missing.group(0) if missing else 'the embedding Adam state'} and the "
                       "resume fails at load")
    expected = {i: loss for i, loss in losses(log).items() if i > RESUME_AT}
    return verdict(resumed.codes == [0] and losses(resumed_log) == expected != {},
                   "every rank replanned at the change; the resume from iteration "
                   f"{RESUME_AT} continues bitwise like the uninterrupted run")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's options; ``out`` is a new folder (``tempfile.mkdtemp``) unless given."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="checkpoints and logs go here (a new or empty folder; default: a new "
                        "temporary folder per run)")
    p.add_argument("--upstream", action="store_true",
                   help="plain megatron-core (only CPU/gloo support): shows what still fails")
    p.add_argument("--verbose", action="store_true",
                   help="print megatron-core's warnings too (import-time notes, deprecations) "
                        "and the ranks' tracebacks")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="megatron_ckpt_fixes_demo-"))
    elif args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        p.error(f"--out {args.out}: not an empty folder (the demo never overwrites files)")
    else:
        args.out.mkdir(parents=True, exist_ok=True)
    return args


def summary(results: dict[str, bool], upstream: bool, out: Path) -> str:
    """The demo's last line: every part's verdict and where its checkpoints and logs are."""
    ok = all(results.values())
    mode = "plain megatron-core, every failure as expected" if upstream else "with the fixes"
    parts = "; ".join(f"{name} {'ok' if good else 'UNEXPECTED'}"
                      for name, good in results.items())
    return f"demo {'OK' if ok else 'FAILED'} ({mode}): {parts}; checkpoints and logs at {out}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if quiet_unless(args.verbose):  # this process imports megatron-core below
        os.environ[VERBOSE_ENV] = "1"  # the ranks: train.py reads it

    from megatron_ckpt_fixes.fixes.rerun.sentinel import upstream_emits_sentinel

    sentinel_upstream = upstream_emits_sentinel() is not None
    results = {"part 1 (fault, exit 16, relaunch, rerun)":
               fault_part(args.out, args.upstream, sentinel_upstream),
               "part 2 (structure change, resume)": structure_part(args.out, args.upstream)}
    print(f"\n{summary(results, args.upstream, args.out)}", flush=True)
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
