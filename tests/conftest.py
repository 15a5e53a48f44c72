"""Shared fixtures: an in-process world-size-1 gloo group for single-process tests."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

# Spawned ranks import helper modules that live beside the tests.
sys.path.insert(0, str(Path(__file__).parent / "functional"))


@pytest.fixture
def single_rank_group(tmp_path):
    """A real gloo process group of one rank (megatron-core code asks for rank/world size)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.fixture
def clean_install():
    """Leave the process without patches, whatever a test installed."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.uninstall()
    yield megatron_ckpt_fixes
    megatron_ckpt_fixes.uninstall()
