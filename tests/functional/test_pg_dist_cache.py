"""megatron-core >= 0.20's shard-distribution cache (``--ckpt-pg-tensors-cache-path``) after
a structure change.

With a cache path the fully-parallel wrapper takes its shard distribution from a memo kept
per (cache directory, process group) for the whole process, filled from a file that an
earlier job wrote (read mode) or by the first save, which writes the file for later jobs
(create mode). Upstream never recomputes it within a job, with or without
``--ckpt-assume-constant-structure``: a tensor added after the first save is in nobody's
share and every rank marks it a non-main replica. Under the flag (no validation after the
first save) the checkpoint that "saved successfully" lacks it; without the flag the save's
sharding validation fails on rank 0 (and the other ranks are left in a collective), at every
save from then on. With ``install()`` the structure check recomputes the group's entry on a
change.

Each run warms the caches on the base structure, adds a sharded tensor on every rank, saves
three times and loads the last checkpoint. Skipped where the wrapper has no cache path
(megatron-core < 0.20).
"""

from __future__ import annotations

import pytest
from structure_scenarios import Outcome, scenario_worker, scenarios_worker

from megatron_ckpt_fixes._dev.testing import run_ranks

WS = 2
RUNS = [("add_tensor_all", kind, False) for kind in ("pg_create", "pg_only", "pg_read")]
MISSING_NEW = 'KeyError: "new from model not in state dict: ['


def _has_pg_cache() -> bool:
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    base = TorchDistSaveShardedStrategy("torch_dist", 1)
    return hasattr(FullyParallelSaveStrategyWrapper(base, None), "pg_cache_path")


pytestmark = pytest.mark.skipif(not _has_pg_cache(),
                                reason="this megatron-core has no pg_cache_path")


def without_memo_reset_worker(rank: int, ws: int, runs: list) -> dict:
    """install() with the structure fix's reset of the distribution memo switched off."""
    from megatron_ckpt_fixes.fixes.structure import cached_save

    object.__setattr__(cached_save.DISTRIBUTION_CACHES, "forget_elsewhere", None)
    return scenarios_worker(rank, ws, None, runs)


def _outcomes(results) -> dict[str, list[Outcome]]:
    per_rank = [r.value for r in results]
    return {name: [outcomes[name] for outcomes in per_rank] for name in per_rank[0]}


@pytest.fixture(scope="module")
def patched() -> dict[str, list[Outcome]]:
    return _outcomes(run_ranks(scenarios_worker, WS, None, RUNS, timeout_s=300))


#: Under the flag: the save succeeds and the ranks stay in step until the load fails.
UPSTREAM_IN_STEP = [run for run in RUNS if run[1] != "pg_only"]


@pytest.fixture(scope="module")
def upstream() -> dict[str, list[Outcome]]:
    return _outcomes(run_ranks(scenarios_worker, WS, ["compat.cpu"], UPSTREAM_IN_STEP,
                               timeout_s=300))


def _name(run: tuple[str, str, bool]) -> str:
    return f"{run[0]}-{run[1]}-fresh"


@pytest.mark.parametrize("run", RUNS, ids=_name)
def test_patched_structure_change_under_the_distribution_cache_loads_exactly(patched, run):
    for rank, outcome in enumerate(patched[_name(run)]):
        assert outcome.exact, f"rank {rank}: {outcome}"


@pytest.mark.parametrize("run", UPSTREAM_IN_STEP, ids=_name)
def test_upstream_still_loses_the_new_tensor(upstream, run):
    for rank, outcome in enumerate(upstream[_name(run)]):
        assert outcome.save_error is None, outcome
        assert outcome.load_error is not None and MISSING_NEW in outcome.load_error, \
            f"rank {rank}: {outcome}"


def test_upstream_without_the_flag_fails_every_save_after_the_change():
    """The validation that runs on every save catches the stale distribution on rank 0;
    the other rank is left in the next collective (it crashes on the closed connection)."""
    results = run_ranks(scenario_worker, WS, ["compat.cpu"], "add_tensor_all", "pg_only",
                        False, check=False, timeout_s=200, collective_timeout_s=20)
    errors = [r.value.save_error if r is not None and r.ok else r for r in results]
    assert errors[0].startswith("CheckpointingException: Invalid sharding pattern validation")
    assert "ShardedTensor(key='new'" in errors[0] and "replica_id=1" in errors[0], errors
    assert any(p in str(errors[1]) for p in ("Connection closed by peer",
                                             "Connection reset by peer", "imed out")), errors


def test_resetting_only_the_wrappers_own_cache_is_not_enough():
    """The trivial wrong version: ``cached_distribution`` dropped, the memo left stale. The
    wrapper then validates its first distribution again and the stale one fails it (agreed,
    on every rank): the change can no longer be saved."""
    results = _outcomes(run_ranks(without_memo_reset_worker, WS, RUNS[:1], timeout_s=300))
    for rank, outcome in enumerate(results[_name(RUNS[0])]):
        assert (outcome.save_error or "").startswith("ShardingValidationError: sharding "
                                                     "validation of the state dict to save"), \
            f"rank {rank}: {outcome}"
        assert "ShardedTensor(key='new'" in outcome.save_error
