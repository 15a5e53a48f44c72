"""Megatron-LM's checkpoint flow on megatron-core, where the training script depends on it.

A structure change under Megatron-LM's save flow is validated again, by every rank.

Megatron-LM keeps one save strategy per job and passes ``validate_access_integrity=False`` on
every save after the first under ``--ckpt-assume-constant-structure``: a state dict whose
sharding became invalid after the first save is never validated. With ``install()`` the
save where every rank agreed to replan runs the (collective) sharding validation, so every
rank raises the same ``ShardingValidationError`` naming the key; saves whose structure did
not change validate nothing (the caller's choice stands). The twin shows plain upstream
saving the invalid state dict without a word (the new key is simply not in the checkpoint).

``--ckpt-fully-parallel-load`` is refused on gloo by ``scripts/train.py``: the last test shows
why, megatron-core's load exchange itself needs CUDA (its twin: if upstream ever runs it on
CPU, that test fails and the refusal can go).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks

WS = 2


def _state_dict(rank: int, ws: int, step: int, invalid: bool) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(step)), (0, rank, ws))}
    if invalid:
        # Three fragments along dim 0, but the ranks hold only the first two: a gap.
        sd["late"] = ShardedTensor.from_rank_offsets("late", torch.ones(2), (0, rank, ws + 1))
    return sd


def megatron_lm_flow(rank: int, ws: int, strategy: str) -> dict:
    """Save like Megatron-LM's save_checkpoint: one kept strategy, validation on the first
    save only; the fourth save's state dict is invalid."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import validation
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    calls: list[int] = []
    checker = validation.validate_sharding_integrity

    def counted(*args, **kwargs):  # the validation a caching save runs by itself
        calls.append(step)
        return checker(*args, **kwargs)

    validation.validate_sharding_integrity = counted
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    save_strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    if strategy == "fully_parallel":
        save_strategy = FullyParallelSaveStrategyWrapper(save_strategy, None, True)
    out: dict = {"error": None}
    try:
        for step in range(4):
            path = os.path.join(root[0], f"iter_{step}")
            if rank == 0:
                os.makedirs(path)
            dist.barrier()
            dc.save(_state_dict(rank, ws, step, invalid=step == 3), path, save_strategy,
                    validate_access_integrity=step == 0)
    except BaseException as exc:  # CheckpointingException derives from BaseException
        out["error"] = (type(exc).__name__, str(exc),
                        tuple(c.__name__ for c in type(exc).__mro__))
    finally:
        validation.validate_sharding_integrity = checker
    out["validated_at"] = calls
    if out["error"] is None and rank == 0:
        from torch.distributed.checkpoint import FileSystemReader

        out["keys"] = sorted(FileSystemReader(path).read_metadata().state_dict_metadata)
    return out


def fully_parallel_load(rank: int, ws: int) -> tuple | None:
    """Load a replicated tensor with megatron-core's fully-parallel load wrapper on gloo."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    def replicated(value: float) -> dict:
        return {"r": ShardedTensor.from_rank_offsets("r", torch.full((4,), value),
                                                     replica_id=rank)}

    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    dc.save(replicated(1.0), root[0])
    wrapper = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), None)
    try:
        dc.load(replicated(0.0), root[0], wrapper)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc)
    return None


def both_strategies(rank: int, ws: int, features: list[str] | None) -> dict:
    """One process group for both strategies (an agreed error leaves the ranks in step)."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install(features)
    out = {strategy: megatron_lm_flow(rank, ws, strategy) for strategy in STRATEGIES}
    if features is not None:  # plain upstream
        out["fully_parallel_load"] = fully_parallel_load(rank, ws)
    return out


STRATEGIES = ("plain", "fully_parallel")


@pytest.fixture(scope="module")
def patched():
    return [r.value for r in run_ranks(both_strategies, WS, None, timeout_s=200)]


@pytest.fixture(scope="module")
def upstream():
    return [r.value for r in run_ranks(both_strategies, WS, ["compat.cpu"], timeout_s=200)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_changed_structure_is_validated_on_every_rank(patched, strategy):
    results = [per_rank[strategy] for per_rank in patched]
    errors = [r["error"] for r in results]
    assert all(e is not None and e[0] == "ShardingValidationError" for e in errors), errors
    assert all("CheckpointingException" in e[2] for e in errors)
    assert errors[0][1] == errors[1][1]
    assert "late" in errors[0][1] and "Invalid access pattern" in errors[0][1]
    # Unchanged cached saves (1, 2) validate nothing; the changed one validates once.
    assert [r["validated_at"] for r in results] == [[3], [3]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_upstream_saves_the_invalid_state_dict_silently(upstream, strategy):
    results = [per_rank[strategy] for per_rank in upstream]
    assert [r["error"] for r in results] == [None, None]
    assert "late" not in results[0]["keys"]


def test_upstream_fully_parallel_load_exchange_needs_cuda(upstream):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the exchange's .cuda() calls would succeed")
    errors = [per_rank["fully_parallel_load"] for per_rank in upstream]
    # A CPU build of torch says "Torch not compiled with CUDA enabled"; a CUDA build on a
    # machine without a GPU (torch 2.14.1 from the package index) "Found no NVIDIA driver".
    assert all(e is not None and ("CUDA" in e[1] or "NVIDIA driver" in e[1])
               for e in errors), errors
