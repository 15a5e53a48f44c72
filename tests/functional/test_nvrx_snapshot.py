"""nvidia-resiliency-ext's asynchronous save (``--async-strategy nvrx``, megatron-core 0.19+'s
default) is a snapshot with the fixes, and torn without them (issue 22, item 1).

Needs nvidia-resiliency-ext unpacked by ``bash scripts/install_nvrx_cpu.sh`` (pip cannot
install it on glibc < 2.39) and megatron-core >= 0.19 (0.16 has no ``async_strategy``); the
test's ranks put it on their path and open the suite's CPU platform, and pass both to the
worker nvidia-resiliency-ext spawns (tests/functional/nvrx_env: its writer and worker call
``torch.cuda``). Upstream twin: its persistent worker writes the
next step's values into every tensor and moves the trainer's tensors into shared memory.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from optional_systems import NVRX, require
from snapshot_scenarios import nvrx_worker

from megatron_ckpt_fixes._dev.testing import run_ranks

ENV = Path(__file__).resolve().parent / "nvrx_env"


def _megatron_has_nvrx_strategy() -> bool:
    from megatron.core import dist_checkpointing as dc

    return "async_strategy" in inspect.signature(dc.save).parameters


pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not _megatron_has_nvrx_strategy(),
                       reason="this megatron-core has no async_strategy (nvrx is 0.19+'s)"),
]


def _run(tmp_path, mode: str) -> list:
    require("nvrx")  # only where megatron-core can use it (pytestmark)
    return [r.value["nvrx-persistent-scheduled"]
            for r in run_ranks(nvrx_worker, 2, str(tmp_path), mode, str(NVRX), str(ENV),
                               timeout_s=500)]


def test_nvrx_persistent_save_upstream_writes_the_next_steps_values(tmp_path):
    """Every rank's tensors were moved into shared memory, where the worker reads the next
    step's values; whether a rank's writer reads after the change (torn) is a race nothing
    gates here, which a loaded machine can decide the other way on one rank (seen under -n):
    torn on at least one rank."""
    outcomes = _run(tmp_path, "upstream")
    assert all(o.trainer_shared == 8 for o in outcomes), outcomes
    assert any(o.torn > 0 for o in outcomes), outcomes


def test_nvrx_persistent_save_is_a_snapshot_with_the_fixes(tmp_path):
    for rank, outcome in enumerate(_run(tmp_path, "fixed")):
        assert outcome.torn == 0 and outcome.trainer_shared == 0, (rank, outcome)
