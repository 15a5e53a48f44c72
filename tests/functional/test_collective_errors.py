"""Bad input raises the same clear error on every rank, never a hang."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from megatron_ckpt_fixes.testing import run_ranks


def _overlapping_save(rank: int, ws: int, features: list[str] | None) -> str:
    """Both ranks claim the main replica of the same shard of 'w' (invalid sharding)."""
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    megatron_ckpt_fixes.install(features)
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, 0, ws))}
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    dc.save(sd, root[0], sharded_strategy=strategy)
    return "saved"


def test_upstream_invalid_sharding_fails_on_rank0_only():
    """Upstream: rank 0 raises, the other rank never gets that error (it hangs or breaks)."""
    results = run_ranks(_overlapping_save, 2, ["cpu"], check=False, timeout_s=90,
                        collective_timeout_s=15)
    assert results[0] is not None and results[0].error_type == "CheckpointingException"
    other = results[1]
    assert other is None or other.ok or "Invalid access pattern" not in (other.error or "")


def test_invalid_sharding_raises_the_same_error_on_every_rank():
    results = run_ranks(_overlapping_save, 2, None, check=False, timeout_s=90)
    assert all(r is not None and r.error_type == "CheckpointingException" for r in results)
    assert results[0].error == results[1].error
    assert "'w'" in results[0].error or "key='w'" in results[0].error
    assert "rank 0" in results[0].error


def _one_rank_error(rank: int, ws: int) -> str:
    from megatron_ckpt_fixes.collective import CollectiveError, agree

    assert agree(rank == 1, None, "vote") is True
    assert agree(False, None, "vote") is False
    try:
        agree(False, "key 'emb': cannot plan" if rank == 1 else None, "planning")
    except CollectiveError as exc:
        return str(exc)
    return "no error"


def test_an_error_on_one_rank_is_raised_on_all():
    results = run_ranks(_one_rank_error, 2, timeout_s=60)
    assert results[0].value == results[1].value
    assert "rank 1: key 'emb': cannot plan" in results[0].value
