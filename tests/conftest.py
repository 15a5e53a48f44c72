"""Shared fixtures: an in-process world-size-1 gloo group for single-process tests."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_ckpt_fixes.testing import init_test_group

# Spawned ranks import helper modules that live beside the tests.
sys.path.insert(0, str(Path(__file__).parent / "functional"))


@pytest.fixture
def single_rank_group(tmp_path):
    """A real gloo process group of one rank (megatron-core code asks for rank/world size);
    another backend where ``MCF_TEST_BACKEND`` names one (scripts/gpu_check.sh)."""
    init_test_group(0, 1, f"file://{tmp_path / 'rdzv'}", datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.fixture
def clean_install():
    """Leave the process without patches, whatever a test installed."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.uninstall()
    yield megatron_ckpt_fixes
    megatron_ckpt_fixes.uninstall()


@pytest.fixture(scope="session")
def beside(tmp_path_factory):
    """``beside("pkg==1.2")``: the environment for a subprocess that sees only that package
    from a directory of its own (``pip install --no-deps --target``, from the package registry)
    first on PYTHONPATH, everything else from this environment; one download per session and
    spec."""
    root = tmp_path_factory.mktemp("beside")
    made: dict[str, Path] = {}

    def env(spec: str) -> dict[str, str]:
        if spec not in made:
            target = root / spec.replace("=", "_")
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--ignore-requires-python", "--target", str(target), spec],
                           check=True, timeout=600)
            made[spec] = target
        return {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(made[spec]), *filter(None, [os.environ.get("PYTHONPATH")])])}

    return env
