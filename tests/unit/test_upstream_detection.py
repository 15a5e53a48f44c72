"""install() decides from upstream's behaviour, on every supported megatron-core minor.

Each release (0.16.1, 0.17.1, 0.18.2, 0.19.2) is installed beside the test environment
(``pip install --no-deps --target``, from the package registry) and a subprocess asks it,
through the package's own detection, which fixes it already has and what it lacks; then it
runs a real ``install()``. The 0.17.x wheels still return None from
``RerunStateMachine.state_dict`` in NOT_RUNNING_YET (the sentinel ships from 0.18.0): a
version gate of ">= 0.17" would have skipped the fix there.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties

from megatron_ckpt_fixes.compat.tensor_metadata import empty_takes

from megatron_ckpt_fixes import OPTIONAL_FEATURES

pytestmark = pytest.mark.varies_with("torch", "python")

RELEASES = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
SENTINEL = {"rerun.sentinel.state_dict"}
STATS_REPORT = {"rerun.stats_report.filename", "rerun.stats_report.lineno"}
#: megatron-core's file writer forks a process per bucket in 0.16, runs threads from 0.17 on:
#: the patches for the other kind do not apply (and 0.16's forks need no replacing by threads).
THREADED_WRITER = {"writer_failures.threads.collection"}
FORKED_WRITERS = {"writer_failures.processes.mp", "writer_failures.processes.multiproc",
                  "writer_threads.buckets"}
#: No checkpoint after a transient fault is upstream from 0.18 (Megatron-LM PR 3981); the
#: patch still applies there: it also bounds the relaunches of one fault (every release).
#: common.pt goes through the common-state strategy classes in 0.16, through module functions
#: from 0.17 on (the common state is an item; a legacy common.pt only): the checksum patches
#: of the other way do not apply.
COMMON_BY_CLASSES = {"checksums.save_common", "checksums.load_common"}
COMMON_BY_FUNCTIONS = {"checksums.save_common_strategy", "checksums.load_common_strategy"}
LATER = FORKED_WRITERS | COMMON_BY_FUNCTIONS
#: Patches each release does not need (detected); every other patch must apply there.
UPSTREAM_HAS = {
    "0.16.1": THREADED_WRITER | COMMON_BY_CLASSES,
    "0.17.1": LATER,
    "0.18.2": SENTINEL | LATER,
    "0.19.2": SENTINEL | STATS_REPORT | LATER,
}
#: Every release passes each field of torch's TensorProperties to torch.empty; whether that
#: needs help is a property of torch (its 2.15 records ``strides``), the same on every release.
THIS_TORCH_RECORDS_MORE = not all(map(empty_takes, vars(
    TensorProperties.create_from_tensor(torch.zeros(1)))))
TENSOR_METADATA = set() if THIS_TORCH_RECORDS_MORE else {
    "compat.tensor_metadata.load_tensors_metadata"}
PROBE = Path(__file__).with_name("upstream_probe.py")


@pytest.fixture(scope="session")
def release_env(beside):
    """A subprocess environment per release with only megatron-core from it (its
    dependencies are ours)."""
    if importlib.util.find_spec("triton") is None:
        pytest.fail("megatron-core >= 0.18 imports triton: install the test extra "
                    "(pip install -e '.[test]')")
    return lambda release: beside(f"megatron-core=={release}")


def _probe(env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("release", RELEASES)
def test_install_detects_what_each_release_already_does(release_env, release):
    found = _probe(release_env(release))
    assert found["megatron-core"] == release
    patches = found["patches"]
    assert {name for name, p in patches.items() if p["missing"]} == set(), patches
    not_needed = {name for name, p in patches.items() if p["not_needed"]}
    assert not_needed == UPSTREAM_HAS[release] | TENSOR_METADATA, \
        {n: patches[n] for n in not_needed}
    assert set(found["installed"]) == {
        name for name in patches if name not in not_needed
        and not name.startswith(tuple(f"{f}." for f in OPTIONAL_FEATURES))}
