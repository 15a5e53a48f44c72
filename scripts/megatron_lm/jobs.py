"""Launch Megatron-LM's ``pretrain_gpt.py`` as a job on CPU ranks and read what it left.

A job is launched like a cluster job: ``scripts/run_with_restarts.py`` starts one process
per rank with torchrun's environment, relaunches the job when it exits 16 (resume to
disambiguate) as Megatron-LM's CI scheduler does (``ft_launcher --max-restarts=3``), and
gives every attempt a new CPU "device" (``MCF_CPU_DEVICE_INDEX``), as a relaunch on other
hardware would be. Each rank's output goes to ``<job>/logs/attempt_N/rank_K.log`` (the
``LOG_DIR`` a case's ``AFTER_SCRIPT`` greps); the runner's own output stays short.

The ranks get the CPU platform (``rank_env/``) and, with ``fixes=True``, the zero-code
activation ``MEGATRON_CKPT_FIXES=1``; without it they run plain upstream, with only
:data:`UPSTREAM_FEATURES`.

The runner and its ranks are forks of a preloaded launcher (``scripts/zygote.py``) that
imported torch, transformers and megatron-core (:data:`PRELOAD`); each rank arms the fixes'
switch, opens the platform and imports Megatron-LM's training package itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUNNER = REPO / "scripts" / "run_with_restarts.py"
RANK_ENV = HERE / "rank_env"
sys.path.insert(0, str(REPO / "scripts"))
import zygote  # noqa: E402
ACTIVATION_ENV = "MEGATRON_CKPT_FIXES"
#: What plain upstream runs with: megatron-core's reading of the tensor metadata of a torch
#: that records a field ``torch.empty`` does not take (torch 2.15's ``strides``: every resume
#: fails with a ``TypeError`` otherwise; not applied where upstream reads it), so that a twin
#: shows upstream's own behaviour; that fix's twin is ``tests/unit/test_tensor_metadata.py``.
UPSTREAM_FEATURES = "compat.tensor_metadata"

#: Seconds a job (all its attempts) may take before it counts as hung.
JOB_TIMEOUT_S = 420
#: Relaunches after exit 16, as CI's ft_launcher (``--max-restarts=3``).
MAX_RESTARTS = 3

#: Environment every rank gets: one thread per rank (the machine has few cores), and
#: torch.compile'd fusions run eagerly (``TORCHDYNAMO_DISABLE``): on CPU inductor would
#: build C++ for every rank, minutes of compiling for kernels that exist for GPUs.
RANK_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
#: What the launcher imports for the ranks (about 6 of a rank's 7.5 s of imports): the
#: platform's module (importable once ``sitecustomize`` put its folder on the path) and,
#: with dynamo disabled, ``torch.compile`` as the identity (:mod:`eager_compile`), before
#: megatron-core decorates its fusions; then what ``pretrain_gpt.py`` imports from torch,
#: transformers and megatron-core. The fixes and the platform are put in by each rank.
PRELOAD = ["training_platform", "eager_compile:install", "numpy", "transformers",
           "megatron.core", "megatron.core.models.gpt", "megatron.core.tokenizers"]


@dataclass
class Job:
    """What one launched job did."""

    name: str
    directory: Path
    attempts: list[dict]
    #: iteration -> ``lm loss`` as float.hex, as the last pipeline stage logged it.
    losses: dict[int, str] = field(default_factory=dict)

    @property
    def exit_codes(self) -> list[int]:
        return [a["exit_code"] for a in self.attempts]

    @property
    def log_dir(self) -> Path:
        return self.directory / "logs"

    def logs(self) -> str:
        """Every rank's output of every attempt, concatenated."""
        return "\n".join(p.read_text(errors="replace")
                         for p in sorted(self.log_dir.glob("attempt_*/rank_*.log")))

    def attempt_log(self, attempt: int, rank: int = 0) -> str:
        path = self.log_dir / f"attempt_{attempt}" / f"rank_{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cuda_sites(self) -> dict[str, int]:
        """Every CUDA call site the platform mapped in this job's processes, summed."""
        sites: dict[str, int] = {}
        for path in (self.directory / "cuda_sites").glob("*.json"):
            for site, count in json.loads(path.read_text()).items():
                sites[site] = sites.get(site, 0) + count
        return sites


def _read_losses(path: Path) -> dict[int, str]:
    """iteration -> loss, from the ranks' records (every last-stage rank logs the same value;
    a later attempt's record of an iteration replaces an earlier one's)."""
    losses: dict[int, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            losses[record["iteration"]] = record["lm loss"]
    return losses


def launch(tree: Path, name: str, directory: Path, argv: list[str], *, nproc: int,
           fixes: bool, env: dict[str, str] | None = None,
           max_restarts: int = MAX_RESTARTS) -> Job:
    """Run ``pretrain_gpt.py argv`` of ``tree`` on ``nproc`` ranks in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    report = directory / "attempts.json"
    losses = directory / "losses.jsonl"
    for stale in (report, losses):
        stale.unlink(missing_ok=True)
    job_env = {key: value for key, value in os.environ.items() if key != ACTIVATION_ENV}
    job_env.update(RANK_ENVIRONMENT)
    job_env.update(env or {})
    job_env.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [str(RANK_ENV),
                                                    os.environ.get("PYTHONPATH")])),
        "MCF_MLM_TREE": str(tree),
        "MCF_MLM_LOSS_LOG": str(losses),
        "MCF_MLM_SITES_DIR": str(directory / "cuda_sites"),
    })
    job_env[ACTIVATION_ENV] = "1" if fixes else UPSTREAM_FEATURES
    args = ["--fork-ranks", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--report", str(report), "--script", str(tree / "pretrain_gpt.py"), "--log-dir",
            str(directory / "logs"), "--", *argv]
    launcher = zygote.for_environment(job_env, PRELOAD)
    try:  # on a timeout the runner is stopped: it stops the ranks and reaps what they left
        launcher.run(RUNNER, args, job_env, directory, directory / "runner.out", JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"job {name} hung: stopped after {JOB_TIMEOUT_S} s; "
                           f"see {directory}/logs") from None
    if not report.exists():
        raise RuntimeError(f"job {name}: the runner wrote no report; see {directory}/runner.out:"
                           f"\n{(directory / 'runner.out').read_text()[-3000:]}")
    return Job(name, directory, json.loads(report.read_text()), _read_losses(losses))
