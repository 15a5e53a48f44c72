"""Zero-code activation of an unchanged training script, under a real launcher.

scripts/train.py runs with ``--no-install``: the script calls no ``install()`` at all, so
every fix in these jobs comes from the activation, once through ``torchrun -m
megatron_ckpt_fixes.run`` and once through the ``MEGATRON_CKPT_FIXES`` switch under a
launcher whose command does not change (scripts/run_with_restarts.py). The checksums feature
is the witness: each rank's writer records the checksum of every item it writes only if that
rank has the fixes, so a complete record proves every rank had them. The resume then checks
the record (``--ckpt-verify-checksums``), and a byte flipped on disk stops the next resume on
every rank, naming the key and the file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from ckpt_files import flip_tensor_byte, read_metadata
from script_modules import script_module

from megatron_ckpt_fixes.fixes.checksums import read_record
from megatron_ckpt_fixes.tools.cli import main as cli_main
from megatron_ckpt_fixes._dev.training import layout

pytestmark = pytest.mark.varies_with("torch", "python")

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "scripts" / "train.py"
RUNNER = REPO / "scripts" / "run_with_restarts.py"
FEATURES = "default,training.cpu_support"  # the script installs nothing, not even CPU support
JOB = ["--no-install", "--seed", "1237", "--tensor-model-parallel-size", "2",
       "--save-interval", "2"]
TIMEOUT_S = 300


def _run(cmd: list[str], out: Path, switch: str | None = None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_CKPT_FIXES"}
    env["OMP_NUM_THREADS"] = "1"
    if switch is not None:
        env["MEGATRON_CKPT_FIXES"] = switch
    with open(out, "w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=TIMEOUT_S).returncode
    return code, out.read_text()


def _runner(root: Path, name: str, train_args: list[str]) -> tuple[int, str, list[int]]:
    report = root / f"{name}.json"
    code, text = _run([sys.executable, str(RUNNER), "--nproc-per-node", "2", "--max-restarts",
                       "0", "--report", str(report), "--", *JOB, *train_args],
                      root / f"{name}.out", switch=FEATURES)
    return code, text, json.loads(report.read_text())[-1]["rank_codes"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("activation")
    ckpt = root / "ckpt"
    with script_module("run_with_restarts") as runner:  # its port, free of other jobs' traffic
        port = runner.free_port()
    first = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                  "--master-port", str(port), "-m", "megatron_ckpt_fixes.run",
                  "--features", FEATURES, "--", str(TRAIN), *JOB, "--train-iters", "2",
                  "--save", str(ckpt)], root / "torchrun.out")
    assert first[0] == 0, f"the torchrun job failed:\n{first[1][-6000:]}"
    shutil.copytree(layout.checkpoint_dir(ckpt, 2), root / "iter2")
    second = _runner(root, "switch", ["--train-iters", "4", "--save", str(ckpt), "--load",
                                      str(ckpt), "--ckpt-verify-checksums"])
    return root, first, second


def _fully_recorded(checkpoint: Path) -> None:
    """Every item of every rank's files has its checksum: every rank had the fixes."""
    record = read_record(checkpoint)
    assert record is not None, f"no checksums in {checkpoint}: the fixes were not installed"
    saved = {(info.relative_path, info.offset)
             for info in read_metadata(checkpoint).storage_data.values()}
    assert set(record.checksums) == saved
    assert {file.split("_")[2] for file, _ in saved} == {"0", "1"}  # __<rank>_<n>.distcp


def test_torchrun_module_run_installs_the_fixes_in_every_rank(jobs, capsys):
    root = jobs[0]
    _fully_recorded(root / "iter2")
    assert cli_main(["verify", str(root / "iter2")]) == 0, capsys.readouterr().out


def _activation_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "megatron_ckpt_fixes: activated" in line]


@pytest.mark.parametrize("job", [1, 2], ids=["torchrun", "switch"])
def test_rank_0_says_once_what_was_activated(jobs, job):
    """One line per job, from rank 0, naming the release (before: INFO, never shown)."""
    text = jobs[job][1]
    assert _activation_lines(text) == [next(
        line for line in text.splitlines() if line.startswith(
            f"megatron_ckpt_fixes: activated on megatron-core {version('megatron-core')} "
            f"(MEGATRON_CKPT_FIXES={FEATURES}): "))], text[-6000:]
    assert "warnings.warn(" not in text  # train.py hides megatron-core's warnings


def test_the_environment_switch_activates_an_unchanged_launch(jobs):
    root, _, (code, text, ranks) = jobs
    assert code == 0 and ranks == [0, 0], text[-6000:]
    assert "starting at iteration 2" in text
    _fully_recorded(layout.checkpoint_dir(root / "ckpt", 4))


def test_the_resume_checks_the_recorded_checksums(jobs):
    root, _, (_, text, _) = jobs
    items = len(read_metadata(root / "iter2").storage_data)
    # first the pre-flight: every key the model asks for is there, and a record of this save
    assert (f"pre-flight of {layout.checkpoint_dir(root / 'ckpt', 2)}: will load: ") in text
    assert (f"checksums of {layout.checkpoint_dir(root / 'ckpt', 2)}: {items} of {items} "
            "item(s) match their xxh3_64 checksums") in text


def test_a_flipped_byte_stops_the_resume_on_every_rank(jobs):
    root = jobs[0]
    ckpt = root / "flipped"
    shutil.copytree(root / "ckpt", ckpt)
    last = layout.checkpoint_dir(ckpt, 4)
    file = flip_tensor_byte(last, "embedding.word_embeddings.weight", (0, 0))
    code, text, ranks = _runner(root, "flipped", ["--train-iters", "6", "--save", str(ckpt),
                                                  "--load", str(ckpt), "--ckpt-verify-checksums"])
    assert code != 0 and all(c != 0 for c in ranks), text[-6000:]
    line = (f"'embedding.word_embeddings.weight' chunk at (0, 0) in {file} (bytes ")
    # A ChecksumError, the same on every rank: printed once, by rank 0.
    assert "error: checking the checksums of" in text and text.count(line) == 1, text[-6000:]
    assert layout.read_tracker(ckpt) == 4  # nothing was trained or saved on bad weights
