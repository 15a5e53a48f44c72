#!/usr/bin/env python
"""Run megatron-core's own dist_checkpointing unit tests on CPU/gloo, once per feature set of
megatron_ckpt_fixes, and compare the runs test by test.

    python scripts/mcore_suite/run.py --out /tmp/mcore-suite-0.16.1 [--ref core_v0.16.1] \\
        [--nproc 8] [--features compat.cpu,compat.tensor_metadata --features all] [-- tests...]

The suite comes from the Megatron-LM snapshot REF (``scripts/upstream_snapshots.py``; default:
the snapshot matching the installed megatron-core): its ``tests/unit_tests``, conftest files
and ``tests/test_utils`` are copied into OUT/suite and run unedited against the megatron-core
installed in the running Python (never a megatron/ source tree: the plugin checks). Where the
installed wheel does not ship ``megatron.training`` (0.16), the suite's helpers import it from
the same snapshot.

Runs one feature set at a time (the machine may be shared), or all at once with
``--concurrent`` (a run's ranks wait on each other about 40 % of the time at 2 ranks: two runs
side by side keep the cores busy; CI). Each run writes OUT/<features>/rank<N>.xml and
rank<N>.log, and cuda_sites-rank<N>.json (the lines that asked for CUDA).
OUT/compare-<a>-vs-<b>.md is the comparison (see compare.py). Exit code 1 if any test's
outcome, or the exception class of a test failing in both, differs between the first feature
set and another.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import psutil

import compare

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import run_with_restarts  # noqa: E402 - scripts/ itself is not a package
import upstream_snapshots  # noqa: E402

SUITE_PATHS = ("tests/__init__.py", "tests/test_utils", "tests/unit_tests")
TRAINING_PATHS = ("megatron/training", "megatron/legacy", "megatron/rl")
DEFAULT_TESTS = "tests/unit_tests/dist_checkpointing"


def copy_paths(tree: Path, paths: tuple[str, ...], dest: Path) -> list[str]:
    """Copy the paths of ``paths`` that exist in the snapshot ``tree`` into ``dest``."""
    present = [p for p in paths if (tree / p).exists()]
    for path in present:
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if (tree / path).is_dir():
            shutil.copytree(tree / path, target, dirs_exist_ok=True)
        else:
            shutil.copy2(tree / path, target)
    return present


def write_pytest_ini(tree: Path, suite: Path) -> None:
    """The suite's own pytest settings (markers, file pattern) as ``suite/pytest.ini``, so that
    pytest's rootdir is the suite and no configuration above it (this project's, when OUT is
    inside the checkout) applies. Upstream's ``addopts`` stay out: its ``-x`` would stop at
    the first failure and hide every later difference; run.py passes its own options."""
    options = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    lines = ["[pytest]", f"python_files = {options['python_files']}", "markers ="]
    lines += [f"    {marker}" for marker in options.get("markers", [])]
    (suite / "pytest.ini").write_text("\n".join(lines) + "\n")


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports for the runs' stores, free now and drawn below the kernel's
    ephemeral range, where the gloo connections of a run started beside them cannot take
    them (``run_with_restarts.free_port``)."""
    ports: list[int] = []
    while len(ports) < count:
        port = run_with_restarts.free_port()
        if port not in ports:
            ports.append(port)
    return ports


#: The baseline: plain upstream made runnable here, on gloo (``compat.cpu``) and on a torch
#: whose tensor metadata megatron-core cannot read unaided (``compat.tensor_metadata``: torch
#: 2.15's ``strides``; not applied where upstream reads it), so that a difference comes from
#: the fixes. That fix's own twin is ``tests/unit/test_tensor_metadata.py``.
UPSTREAM = "compat.cpu,compat.tensor_metadata"

#: Exit code of a run that outlived ``--run-timeout`` (as ``timeout(1)`` says it).
TIMED_OUT = 124


def start_suite(suite: Path, features: str, out: Path, nproc: int, python_path: list[Path],
                pytest_args: list[str], port: int) -> subprocess.Popen:
    """Start one run of the suite on ``nproc`` ranks with ``MCF_FEATURES=features``."""
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
    return subprocess.Popen(command, cwd=suite, env=env)


def wait_suite(process: subprocess.Popen, deadline: float) -> int:
    """The run's exit code. A rank stuck in a collective that its peer left (a gloo
    connection that failed under load, say) can block the run for good; past ``deadline``
    (``time.monotonic()``) every process of the run is killed and the run counts as failed
    (:data:`TIMED_OUT`)."""
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: kill the whole tree
        for child in [*psutil.Process(process.pid).children(recursive=True), process]:
            child.kill()
        process.wait()
        return TIMED_OUT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", help="Megatron-LM snapshot of the tests (core_v0.16.1, "
                        "core_v0.19.0, main; default: the installed megatron-core's)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--features", action="append",
                        help=f"MCF_FEATURES of a run (repeatable; default: {UPSTREAM}, all); "
                             "the first is the baseline")
    parser.add_argument("--nproc", type=int, default=1, help="ranks (torchrun when > 1)")
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout, seconds")
    parser.add_argument("--run-timeout", type=float, default=3600,
                        help="limit of one feature set's run (of the runs side by side), seconds "
                             "(a hang fails the run)")
    parser.add_argument("--concurrent", action="store_true",
                        help="run the feature sets side by side (a machine of their own)")
    parser.add_argument("pytest_args", nargs="*",
                        help=f"tests and pytest options after -- (default: {DEFAULT_TESTS})")
    args = parser.parse_args(argv)
    feature_sets = args.features or [UPSTREAM, "all"]
    # the ranks run in the copied suite's folder: a relative --out would land inside it
    args.out = args.out.resolve()

    tree = upstream_snapshots.snapshot(args.ref)
    suite = args.out / "suite"
    copy_paths(tree, SUITE_PATHS, suite)
    write_pytest_ini(tree, suite)
    python_path = []
    if importlib.util.find_spec("megatron.training") is None:
        copy_paths(tree, TRAINING_PATHS, suite / "_mlm")
        python_path.append(suite / "_mlm")
    pytest_args = [f"--timeout={args.timeout}", "-p", "no:warnings", "-q", "-rA",
                   "--continue-on-collection-errors",
                   *(args.pytest_args or [DEFAULT_TESTS])]

    outs = [args.out / features.replace(",", "+") for features in feature_sets]
    # side by side: every run starts now; one after the other: each starts when the last ended
    batches = [list(range(len(outs)))] if args.concurrent else [[i] for i in range(len(outs))]
    for batch in batches:
        start = time.monotonic()
        processes = {}
        for i, port in zip(batch, _free_ports(len(batch))):
            outs[i].mkdir(parents=True, exist_ok=True)
            processes[i] = start_suite(suite, feature_sets[i], outs[i], args.nproc, python_path,
                                       pytest_args, port)
        codes = {i: wait_suite(process, start + args.run_timeout)
                 for i, process in processes.items()}
        seconds = time.monotonic() - start
        for i, code in codes.items():
            print(f"MCF_FEATURES={feature_sets[i]}: pytest exit {code} ({outs[i]})")
        print(f"{' and '.join(feature_sets[i] for i in batch)}: {seconds:.0f} s")
        hung = [i for i, code in codes.items() if code == TIMED_OUT]
        if hung:
            for i in hung:
                print(f"MCF_FEATURES={feature_sets[i]}: killed after --run-timeout "
                      f"{args.run_timeout:.0f} s (a rank hung; see {outs[i]}/rank*.log); "
                      "no comparison")
            return 1

    differs = False
    for other in outs[1:]:  # every run ended (a hung one returned above)
        text, diff = compare.report(outs[0].name, other.name,
                                    compare.load_run(outs[0]), compare.load_run(other))
        (args.out / f"compare-{outs[0].name}-vs-{other.name}.md").write_text(text)
        print(text)
        differs |= diff
    return 1 if differs else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except upstream_snapshots.SnapshotMissing as exc:
        sys.exit(f"error: {exc}")
