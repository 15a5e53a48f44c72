"""Launch scripts/train.py jobs (through scripts/run_with_restarts.py) and read what they left.

Every job runs as real processes on gloo, the way a scheduler starts them, so exit codes,
relaunches and killed ranks are the real thing. One uninterrupted reference run per test
session is shared by the tests that compare against it. Test-only behaviour (dumping the
final state, killing a rank mid-save) is patched into the ranks from ``rank_env/``. The
runner and its ranks are forks of a preloaded launcher (:mod:`zygote`) unless a test asks
for new interpreters (``fresh``) or changes what an interpreter's start-up reads.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import zygote  # noqa: E402

RUNNER = REPO / "scripts" / "run_with_restarts.py"
RANK_ENV = Path(__file__).resolve().parent / "rank_env"
DUMP_STATE_ENV = "MCF_TEST_DUMP_STATE"
KILL_DURING_SAVE_ENV = "MCF_TEST_KILL_DURING_SAVE_ITER"

#: Every rank's environment: one thread per rank (the machine has few cores); dynamo off, so
#: torch.compile'd functions run eagerly (the ranks' test hooks then skip wrapping them).
RANK_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}

#: Bound per job (all its attempts); a hang fails the test instead of blocking CI.
JOB_TIMEOUT_S = 240

#: What the preloaded launcher imports: the ranks' test hooks (first: with dynamo disabled
#: ``torch.compile`` is then the identity when megatron-core decorates its fusions) and the
#: training loop with all it imports (torch, megatron-core, this package).
PRELOAD = ["mcf_test_hooks:install", "megatron_ckpt_fixes._dev.training.loop"]

#: The model/data/seed every comparable run shares. With this seed and
#: ``--error-injection-rate 10`` upstream's injector first fires in step 5 (after four saves).
COMMON = ["--seed", "1237", "--train-iters", "8"]
FAULT = ["--rerun-mode", "validate_results", "--error-injection-rate", "10",
         "--error-injection-type", "persistent_error"]


@dataclass
class Job:
    attempts: list[dict]
    output: str
    log: list[dict]

    @property
    def exit_codes(self) -> list[int]:
        return [a["exit_code"] for a in self.attempts]

    def losses(self) -> dict[int, str]:
        """iteration -> loss (float.hex) of the steps that completed (no exit code)."""
        return {r["iteration"]: r["loss"] for r in self.log if r["exit_code"] is None}


def run_job(workdir: Path, train_args: list[str], *, max_restarts: int = 0,
            env: dict[str, str] | None = None, name: str = "job",
            runner_args: tuple[str, ...] = (), nproc: int = 2, dump: Path | None = None,
            wrap: tuple[str, ...] = (), fresh: bool = False) -> Job:
    """Run one job (relaunched on exit 16 up to ``max_restarts``) and collect its traces.

    ``dump``: where rank 0 writes the final full state when the job ends normally.
    ``wrap``: a command prefix for the runner (e.g. a mount namespace; new interpreters).
    ``fresh``: new interpreters for the runner and its ranks (else forks of the preloaded
    launcher whose start-up variables are the job's).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    report, log = workdir / f"{name}.attempts.json", workdir / f"{name}.log.jsonl"
    report.unlink(missing_ok=True)
    log.unlink(missing_ok=True)
    args = ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), "--report",
            str(report), *runner_args, "--", *train_args, "--log-file", str(log)]
    output = workdir / f"{name}.out"
    path = os.pathsep.join(filter(None, [str(RANK_ENV), os.environ.get("PYTHONPATH")]))
    base_env = {**os.environ, **RANK_ENVIRONMENT, "PYTHONPATH": path}
    job_env = {**base_env, **(env or {})}
    if dump is not None:
        job_env[DUMP_STATE_ENV] = str(dump)
    if fresh or wrap or zygote.startup_variables(job_env) != zygote.startup_variables(base_env):
        with open(output, "w") as out:
            subprocess.run([*wrap, sys.executable, str(RUNNER), *args], cwd=REPO, env=job_env,
                           stdout=out, stderr=subprocess.STDOUT, timeout=JOB_TIMEOUT_S)
    else:
        zygote.for_environment(base_env, PRELOAD).run(RUNNER, ["--fork-ranks", *args], job_env, REPO, output,
                              JOB_TIMEOUT_S)
    text = output.read_text()
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert report.exists(), f"runner wrote no report:\n{text[-6000:]}"
    return Job(json.loads(report.read_text()), text, records)


def load_dump(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["tensors"]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ (not bitwise equal): {different}"


def reference_dir(tmp_path_factory) -> Path:
    """Under the session's base temp dir; with pytest-xdist, under the one its workers'
    share (``popen-gwN``'s parent), so the workers compute it once between them."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "train_reference"


def reference(tmp_path_factory) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    """The uninterrupted run (TP=2, 8 steps): its losses and final weights/optimizer state.

    It also leaves its final checkpoint in ``reference_dir(...) / "ckpt"`` (iteration 8).
    Computed once per session (cached in :func:`reference_dir`; a worker that finds another
    computing it waits on the lock).
    """
    root = reference_dir(tmp_path_factory)
    dump = root / "final.pt"
    done = root / "losses.json"
    root.mkdir(parents=True, exist_ok=True)
    with open(root.parent / "train_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            job = run_job(root, [*COMMON, "--tensor-model-parallel-size", "2",
                                 "--rerun-mode", "validate_results", "--save",
                                 str(root / "ckpt")], name="reference", dump=dump)
            assert job.exit_codes == [0], job.output[-6000:]
            done.write_text(json.dumps(job.losses()))
    losses = {int(k): v for k, v in json.loads(done.read_text()).items()}
    return losses, load_dump(dump)
