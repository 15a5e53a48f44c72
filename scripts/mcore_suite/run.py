#!/usr/bin/env python
"""Run megatron-core's own dist_checkpointing unit tests on CPU/gloo, once per feature set of
megatron_ckpt_fixes, and compare the runs test by test.

    python scripts/mcore_suite/run.py --megatron-lm PATH --ref core_v0.16.1 \\
        --out /tmp/mcore-suite-0.16.1 [--nproc 8] [--features compat.cpu --features all]

PATH is a Megatron-LM git repository (a clone or a bare mirror); the suite's files at REF
(``tests/unit_tests``, its conftest files and ``tests/test_utils``) are extracted with
``git archive`` into OUT/suite and run unedited against the megatron-core installed in the
running Python (never a megatron/ source tree: the plugin checks). Where the installed wheel
does not ship ``megatron.training`` (0.16), the suite's helpers import it from the same REF.

Runs one feature set at a time (the machine may be shared); each run writes OUT/<features>/
rank<N>.xml and rank<N>.log, and cuda_sites-rank<N>.json (the lines that asked for CUDA).
OUT/compare-<a>-vs-<b>.md is the comparison (see compare.py). Exit code 1 if any test's
outcome differs between the first feature set and another.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import compare

HERE = Path(__file__).resolve().parent
SUITE_PATHS = ("tests/__init__.py", "tests/test_utils", "tests/unit_tests")
TRAINING_PATHS = ("megatron/training", "megatron/legacy", "megatron/rl")
DEFAULT_TESTS = "tests/unit_tests/dist_checkpointing"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def extract(repo: Path, ref: str, paths: tuple[str, ...], dest: Path) -> list[str]:
    """``git archive`` the paths of ``paths`` that exist at ``ref`` into ``dest``."""
    listed = _git(repo, "ls-tree", "--name-only", ref, *paths).stdout.decode().split()
    present = [p for p in paths if p in listed]
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as archive:
        archive.write(_git(repo, "archive", "--format=tar", ref, *present).stdout)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(dest, filter="data")
    return present


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_suite(suite: Path, features: str, out: Path, nproc: int, python_path: list[Path],
              pytest_args: list[str]) -> tuple[int, float]:
    """One run of the suite on ``nproc`` ranks with ``MCF_FEATURES=features``."""
    port = _free_port()
    env = dict(os.environ,
               MCF_FEATURES=features,
               MCF_SITES_OUT=str(out / "cuda_sites-rank{rank}.json"),
               PYTHONPATH=os.pathsep.join(map(str, [HERE, *python_path])),
               OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    launcher = [sys.executable, str(HERE / "rank_pytest.py"), str(out),
                "-p", "mcf_suite_plugin", "-p", "no:cacheprovider", *pytest_args]
    if nproc == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        command = launcher
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   f"--master-port={port}", *launcher[1:]]
    start = time.monotonic()
    code = subprocess.run(command, cwd=suite, env=env).returncode
    return code, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, required=True,
                        help="Megatron-LM git repository (clone or bare mirror)")
    parser.add_argument("--ref", required=True, help="tag or commit of the tests, e.g. core_v0.16.1")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--features", action="append",
                        help="MCF_FEATURES of a run (repeatable; default: compat.cpu, all); "
                             "the first is the baseline")
    parser.add_argument("--nproc", type=int, default=1, help="ranks (torchrun when > 1)")
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout, seconds")
    parser.add_argument("pytest_args", nargs="*",
                        help=f"tests and pytest options after -- (default: {DEFAULT_TESTS})")
    args = parser.parse_args(argv)
    feature_sets = args.features or ["compat.cpu", "all"]

    suite = args.out / "suite"
    extract(args.megatron_lm, args.ref, SUITE_PATHS, suite)
    python_path = []
    if importlib.util.find_spec("megatron.training") is None:
        extract(args.megatron_lm, args.ref, TRAINING_PATHS, suite / "_mlm")
        python_path.append(suite / "_mlm")
    pytest_args = [f"--timeout={args.timeout}", "-p", "no:warnings", "-q", "-rA",
                   "--continue-on-collection-errors",
                   *(args.pytest_args or [DEFAULT_TESTS])]

    runs = []
    for features in feature_sets:
        out = args.out / features.replace(",", "+")
        out.mkdir(parents=True, exist_ok=True)
        code, seconds = run_suite(suite, features, out, args.nproc, python_path, pytest_args)
        print(f"MCF_FEATURES={features}: pytest exit {code} in {seconds:.0f} s ({out})")
        runs.append(out)

    differs = False
    for other in runs[1:]:
        text, diff = compare.report(runs[0].name, other.name,
                                    compare.load_run(runs[0]), compare.load_run(other))
        (args.out / f"compare-{runs[0].name}-vs-{other.name}.md").write_text(text)
        print(text)
        differs |= diff
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
