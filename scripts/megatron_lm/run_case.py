#!/usr/bin/env python
"""Run one of Megatron-LM's own functional test cases with its unchanged ``pretrain_gpt.py``
on CPU/gloo ranks, as Megatron-LM's CI runs it, and prove its resumes bitwise.

    python scripts/megatron_lm/run_case.py gpt3_mcore_reruns_persistent_1 \\
        [--upstream] [--constant-structure] [--set=FLAG=VALUE ...] [--nproc N] [--ref REF]
        [--out DIR] [--verbose]

The case's ``model_config.yaml`` comes from the Megatron-LM snapshot that matches the
installed megatron-core (``scripts/upstream_snapshots.py``; ``--ref`` picks another). Its
flags are adapted (:mod:`adapt`: every change printed), the fixes are switched on by the
environment alone (``MEGATRON_CKPT_FIXES=1``; ``--upstream`` leaves them off: plain
megatron-core on the same CPU platform, with ``jobs.UPSTREAM_FEATURES`` only), and
``--constant-structure`` adds ``--ckpt-assume-constant-structure`` to every job. What runs,
by the case's ``TEST_TYPE``:

- ``regular``: the job, relaunched on exit 16 (up to 3 times, as CI's ``ft_launcher``); its
  ``AFTER_SCRIPT`` checks. When it ended on a fault (16/17), a ``continue`` job carries on
  from the checkpoint it left (``--rerun-mode disabled``: the diagnosis is done) and a
  ``reference`` job trains the same flags without error injection, uninterrupted.
- ``ckpt-resume``: CI's two runs: the job to ``--train-iters``, then (its last checkpoint
  removed, the tracker set to the middle, as ``run_ci_test.sh`` does) the same job resumed.
- ``frozen-start``: the job starts from a recorded checkpoint; CI's comes from a 4B job we
  do not have, so it is the fault checkpoint the runner's ``gpt3_mcore_reruns_persistent_1``
  leaves (exit 16): the checkpoint a relaunch of that job loads (:data:`FROZEN_SOURCE`).
- ``checkpoint-consistency``: every ``MODEL_ARGS_<n>`` layout trains one step from the same
  recorded checkpoint; Megatron-LM's own ``test_optimizer_grads_match.py`` compares them.

Proof: every resumed job's per-iteration ``lm loss`` (recorded as ``float.hex``) must equal
the uninterrupted job's, bitwise. Exit code 0 when the case's checks and every comparison
pass. Ranks' output is in ``OUT/<case>/<mode>/<job>/logs`` (``--verbose`` prints rank 0's).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import adapt  # noqa: E402
import jobs  # noqa: E402
import upstream_snapshots  # noqa: E402
from after_script import Check, Checks, run_checks  # noqa: E402
from cases import Case, load_case  # noqa: E402

#: The case whose fault checkpoint the frozen-start cases start from.
FROZEN_SOURCE = "gpt3_mcore_reruns_persistent_1"
CONSTANT_STRUCTURE = "--ckpt-assume-constant-structure"
EXIT_MEANING = {0: "done", 16: "resume to disambiguate", 17: "result validation failed"}
_PREFIX = re.compile(r"^(?:\[rank\d+\]:\s*)+")
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception)\b")


@dataclass(frozen=True)
class Mode:
    """How a case runs: with the fixes (environment switch) or plain upstream, with or
    without ``--ckpt-assume-constant-structure`` added, and with the flags a scenario sets
    (``flags``: flag -> value, e.g. a shorter ``--save-interval``)."""

    fixes: bool
    constant_structure: bool
    flags: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        return ("fixes" if self.fixes else "upstream") + (
            "+constant-structure" if self.constant_structure else "")

    def extra(self) -> dict[str, object]:
        """The flags this mode adds to (or sets in) every job of the case."""
        added: dict[str, object] = {CONSTANT_STRUCTURE: True} if self.constant_structure else {}
        return {**added, **dict(self.flags)}


@dataclass
class Comparison:
    """A resumed job's losses against the uninterrupted job's, iteration by iteration."""

    job: str
    reference: str
    iterations: list[int]
    differing: list[int]

    @property
    def equal(self) -> bool:
        return bool(self.iterations) and not self.differing

    def __str__(self) -> str:
        if not self.iterations:
            return f"{self.job} vs {self.reference}: no common iteration"
        span = f"iterations {self.iterations[0]}..{self.iterations[-1]}"
        if self.equal:
            return f"{self.job} = {self.reference}, bitwise, {span} ({len(self.iterations)})"
        return f"{self.job} != {self.reference} at iterations {self.differing[:8]} ({span})"


@dataclass
class CaseResult:
    case: str
    mode: str
    megatron_core: str
    ref: str
    nproc: int
    exit_codes: dict[str, list[int]] = field(default_factory=dict)
    checks: Checks | None = None
    comparisons: list[Comparison] = field(default_factory=list)
    #: job -> the first error line its ranks logged, for jobs that ended with an error.
    errors: dict[str, str] = field(default_factory=dict)
    #: part of the case -> why it cannot run here.
    not_run: dict[str, str] = field(default_factory=dict)
    #: job -> its folder (logs/attempt_N/rank_K.log, cuda_sites/, ckpt/).
    job_dirs: dict[str, str] = field(default_factory=dict)
    #: CUDA call sites the platform mapped (summed over the jobs' processes).
    cuda_sites: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def logs(self, job: str, attempt: int | None = None) -> str:
        """Every rank's output of ``job`` (of one attempt, if given)."""
        pattern = f"attempt_{attempt or '*'}/rank_*.log"
        return "\n".join(p.read_text(errors="replace")
                         for p in sorted((Path(self.job_dirs[job]) / "logs").glob(pattern)))

    @property
    def passed(self) -> bool:
        return (not self.errors and (self.checks is None or self.checks.passed)
                and all(c.equal for c in self.comparisons))

    def to_json(self) -> dict:
        data = asdict(self)
        data["passed"] = self.passed
        data["checks"] = None if self.checks is None else asdict(self.checks)
        return data


@dataclass
class CaseRun:
    """Everything one case run needs: the tree, the case, the mode, where to write."""

    tree: Path
    case: Case
    mode: Mode
    out: Path
    nproc: int
    verbose: bool
    result: CaseResult
    #: False: only the case's own job(s), no continuation/reference (an upstream twin
    #: whose outcome is read from the relaunch).
    proof: bool = True

    @property
    def train_iters(self) -> int:
        return int(dict(self.mode.flags).get("--train-iters")
                   or self.case.int_arg("--train-iters", 0))

    def argv(self, directory: Path, load: Path, extra: dict[str, object] | None = None,
             ) -> list[str]:
        adapted = adapt.adapt(self.case, adapt.Paths(directory / "ckpt", load,
                                                      directory / "tensorboard"),
                              world_size=self.nproc, async_strategy_needed=needs_async_strategy(),
                              extra={**self.mode.extra(), **(extra or {})})
        return adapted.argv

    def job(self, name: str, argv: list[str], max_restarts: int = jobs.MAX_RESTARTS
            ) -> jobs.Job:
        job = jobs.launch(self.tree, name, self.out / name, argv, nproc=self.nproc,
                          fixes=self.mode.fixes, env=self.case.env_vars,
                          max_restarts=max_restarts)
        self.result.exit_codes[name] = job.exit_codes
        self.result.job_dirs[name] = str(job.directory)
        for site, count in job.cuda_sites().items():
            self.result.cuda_sites[site] = self.result.cuda_sites.get(site, 0) + count
        meanings = ", ".join(f"{c} ({EXIT_MEANING.get(c, 'error')})" for c in job.exit_codes)
        span = (f"; iterations {min(job.losses)}..{max(job.losses)} logged" if job.losses
                else "")
        print(f"  {name}: exit {meanings}{span}", flush=True)
        if any(code not in EXIT_MEANING for code in job.exit_codes):
            self.result.errors[name] = first_error(job)
            print(f"    error: {self.result.errors[name]}", flush=True)
        if self.verbose:
            for attempt in range(1, len(job.attempts) + 1):
                print(f"---- {name} attempt {attempt}, rank 0 ----\n"
                      f"{job.attempt_log(attempt)}", flush=True)
        return job

    def compare(self, resumed: jobs.Job, reference: jobs.Job) -> None:
        common = sorted(set(resumed.losses) & set(reference.losses))
        comparison = Comparison(resumed.name, reference.name, common,
                                [i for i in common if resumed.losses[i] != reference.losses[i]])
        self.result.comparisons.append(comparison)
        print(f"  lm loss: {comparison}", flush=True)


def needs_async_strategy() -> bool:
    """Whether megatron-core's async save defaults to nvidia-resiliency-ext's strategy
    (0.17+ do): asked of the save strategy's own signature, not of a version number."""
    import inspect

    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    parameter = inspect.signature(TorchDistSaveShardedStrategy.async_save).parameters.get(
        "async_strategy")
    return parameter is not None and parameter.default not in ("mcore", inspect.Parameter.empty)


def first_error(job: jobs.Job) -> str:
    """The first exception line the job's ranks logged (rank prefixes removed), with the
    source line that raised it when the exception has no message (a bare assert). A rank
    that only lost its peers (gloo's "Connection closed by peer") is a consequence: the
    cause is looked for on the other ranks first."""
    errors = []
    for attempt in range(1, len(job.attempts) + 1):
        for rank in range(len(job.attempts[attempt - 1]["rank_codes"])):
            lines = [_PREFIX.sub("", line).strip()
                     for line in job.attempt_log(attempt, rank).splitlines()]
            errors += [_error_at(lines, i) for i, line in enumerate(lines)
                       if _ERROR_LINE.match(line) and "Warning" not in line]
    causes = [e for e in errors if "Connection closed by peer" not in e]
    return (causes or errors or [f"exit codes {job.exit_codes}, no exception logged"])[0]


def _error_at(lines: list[str], i: int) -> str:
    error = lines[i][:400]
    source = [x for x in lines[max(0, i - 4):i] if x.strip("^~ ")]
    if ":" not in error and len(source) >= 2 and source[-2].startswith("File "):
        error += f" ({source[-2].split('/')[-1]}: {source[-1]})"
    return error


def _regular(run: CaseRun) -> None:
    directory = run.out / "run"
    job = run.job("run", run.argv(directory, directory / "ckpt"))
    run.result.checks = run_checks(run.case.after_script, job.log_dir)
    print(f"  AFTER_SCRIPT: {run.result.checks}", flush=True)
    if job.exit_codes[-1] not in (16, 17) or not run.proof:
        return
    # The job ended on a fault: carry on from its checkpoint, diagnosis done, and compare
    # with the same job run without error injection.
    carry_on = run.job("continue", run.argv(run.out / "continue", directory / "ckpt",
                                            {"--rerun-mode": "disabled"}))
    reference = run.job("reference", run.argv(run.out / "reference",
                                              run.out / "reference" / "ckpt",
                                              {"--error-injection-rate": 0}))
    run.compare(job, reference)
    run.compare(carry_on, reference)


def _ckpt_resume(run: CaseRun) -> None:
    directory = run.out / "run"
    argv = run.argv(directory, directory / "ckpt")
    first = run.job("run1", argv)
    if first.exit_codes[-1] != 0:
        return
    # run_ci_test.sh: remove the last checkpoint, point the tracker at the middle.
    train_iters = run.train_iters
    ckpt = directory / "ckpt"
    shutil.rmtree(ckpt / f"iter_{train_iters:07d}", ignore_errors=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{train_iters // 2}\n")
    second = run.job("run2", argv)
    run.compare(second, first)


def _frozen_start(run: CaseRun) -> None:
    source = fault_checkpoint(run)
    directory = run.out / "run"
    frozen = run.out / "frozen_ckpt"
    shutil.rmtree(frozen, ignore_errors=True)
    shutil.copytree(source, frozen)
    job = run.job("run", run.argv(directory, frozen))
    run.result.checks = run_checks(run.case.after_script, job.log_dir)
    print(f"  AFTER_SCRIPT: {run.result.checks}", flush=True)


def fault_checkpoint(run: CaseRun) -> Path:
    """The checkpoint :data:`FROZEN_SOURCE` leaves at its fault (run once per mode)."""
    source_case = load_case(run.tree, FROZEN_SOURCE)
    source = CaseRun(run.tree, source_case, run.mode,
                     run.out.parent.parent / f"_source-{FROZEN_SOURCE}" / run.mode.label,
                     adapt.world_size_of(source_case), run.verbose, run.result)
    ckpt = source.out / "fault" / "ckpt"
    if not (ckpt / "latest_checkpointed_iteration.txt").exists():
        print(f"  recording the frozen checkpoint: {FROZEN_SOURCE} up to its fault", flush=True)
        job = source.job("source", source.argv(source.out / "fault", ckpt), max_restarts=0)
        if job.exit_codes != [16]:
            raise RuntimeError(f"{FROZEN_SOURCE} did not stop at a fault: {job.exit_codes}")
    return ckpt


#: Megatron-LM's own comparison of the optimizer states of checkpoint-consistency layouts.
GRADS_TEST = "tests/functional_tests/python_test_utils/test_optimizer_grads_match.py"


def _checkpoint_consistency(run: CaseRun) -> None:
    """CI's ``checkpoint-consistency`` flow: every ``MODEL_ARGS_<n>`` layout loads the
    recorded checkpoint (``--finetune --no-load-optim``), trains one step with Adam's betas
    at 0 (its moments are the gradients) and saves; Megatron-LM's own
    ``test_optimizer_grads_match.py`` then compares their optimizer states. CI's recorded
    checkpoint is a 4B job's; here it is the first layout's flags trained one step from
    scratch and saved."""
    def layout(key: str) -> CaseRun:
        case = Case(f"{run.case.name}:{key}", run.case.test_type, run.case.variants[key],
                    run.case.env_vars)
        return CaseRun(run.tree, case, run.mode, run.out, run.case.gpus.get(key, 1),
                       run.verbose, run.result)

    base = layout("MODEL_ARGS")
    recorded = run.out / "recorded"
    base.job("record", base.argv(recorded, recorded / "none",
                                 {"--finetune": False, "--no-load-optim": False}))
    checkpoints = []
    for key in run.case.variants:
        step = layout(key)
        if step.case.int_arg("--context-parallel-size", 1) > 1:
            run.result.not_run[key] = ("context parallelism needs Transformer Engine's "
                                       "attention (megatron-core's local attention refuses it)")
            print(f"  {key}: not run: {run.result.not_run[key]}", flush=True)
            continue
        job = step.job(key, step.argv(run.out / key, recorded / "ckpt"))
        if job.exit_codes == [0]:
            checkpoints.append(run.out / key / "ckpt" / "iter_0000001")
    done = subprocess.run([sys.executable, str(run.tree / GRADS_TEST), *map(str, checkpoints)],
                          capture_output=True, text=True, check=False, timeout=600)
    (run.out / "grads_match.out").write_text(done.stdout + done.stderr)
    status = "ok" if done.returncode == 0 and len(checkpoints) > 1 else "failed"
    run.result.checks = Checks([Check(f"{Path(GRADS_TEST).name} over {len(checkpoints)} "
                                      "layouts", status)])
    print(f"  {Path(GRADS_TEST).name}: {run.result.checks}", flush=True)


FLOWS = {"regular": _regular, "ckpt-resume": _ckpt_resume, "frozen-start": _frozen_start,
         "checkpoint-consistency": _checkpoint_consistency}


def run_case(tree: Path, ref: str, name: str, mode: Mode, out: Path, nproc: int | None = None,
             verbose: bool = False, print_changes: bool = True, proof: bool = True
             ) -> CaseResult:
    """Run case ``name`` of ``tree`` in ``mode`` under ``out/<name>/<mode>`` (``proof``:
    see :attr:`CaseRun.proof`)."""
    case = load_case(tree, name)
    if case.test_type not in FLOWS:
        raise ValueError(f"{name}: TEST_TYPE {case.test_type} is not run here "
                         f"(runs: {sorted(FLOWS)})")
    nproc = adapt.world_size_of(case, nproc)
    result = CaseResult(name, mode.label, version("megatron-core"), ref, nproc)
    run = CaseRun(tree, case, mode, out / name / mode.label, nproc, verbose, result, proof)
    shutil.rmtree(run.out, ignore_errors=True)
    print(f"== {name} ({case.test_type}; megatron-core {result.megatron_core}, Megatron-LM "
          f"{ref}; {nproc} ranks; {mode.label})", flush=True)
    if print_changes:
        changes = adapt.adapt(case, adapt.Paths(Path("SAVE"), Path("LOAD"), Path("TB")),
                              world_size=nproc, async_strategy_needed=needs_async_strategy(),
                              extra=mode.extra()).changes
        print("  changes to the case's flags:", flush=True)
        for change in changes:
            print(f"    {change}", flush=True)
    start = time.monotonic()
    FLOWS[case.test_type](run)
    result.seconds = round(time.monotonic() - start, 1)
    print(f"  => {'passed' if result.passed else 'FAILED'} ({result.seconds} s)", flush=True)
    (run.out / "result.json").write_text(json.dumps(result.to_json(), indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", help="case names (tests/functional_tests/"
                                                 "test_cases/gpt/<name>)")
    parser.add_argument("--upstream", action="store_true",
                        help="plain megatron-core (MEGATRON_CKPT_FIXES=compat.tensor_metadata: "
                             "jobs.UPSTREAM_FEATURES)")
    parser.add_argument("--constant-structure", action="store_true",
                        help=f"add {CONSTANT_STRUCTURE} to every job")
    parser.add_argument("--set", action="append", default=[], metavar="FLAG=VALUE",
                        help="set a flag of every job (VALUE 'true': a bare flag, 'false': "
                             "no flag), e.g. --set=--save-interval=1")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks (default: TP x PP x CP, data-parallel size 1)")
    parser.add_argument("--ref", default=None, help="Megatron-LM snapshot (default: the one "
                                                     "matching the installed megatron-core)")
    parser.add_argument("--out", type=Path,
                        default=Path(tempfile.gettempdir()) / "megatron_lm_cases")
    parser.add_argument("--verbose", action="store_true", help="print rank 0's output")
    args = parser.parse_args(argv)
    try:
        ref = args.ref or upstream_snapshots.ref_for_installed()
        tree = upstream_snapshots.training_tree(ref)
    except upstream_snapshots.SnapshotMissing as exc:
        parser.error(str(exc))
    flags = tuple((flag, {"true": True, "false": False}.get(value, value))
                  for flag, _, value in (item.partition("=") for item in args.set))
    mode = Mode(not args.upstream, args.constant_structure, flags)
    results = [run_case(tree, ref, name, mode, args.out.resolve(), args.nproc, args.verbose)
               for name in args.cases]
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
