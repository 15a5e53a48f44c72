"""Bad input raises the same clear error on every rank, never a hang."""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks


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
    results = run_ranks(_overlapping_save, 2, ["compat.cpu"], check=False, timeout_s=90,
                        collective_timeout_s=15)
    assert results[0] is not None and results[0].error_type == "CheckpointingException"
    other = results[1]
    assert other is None or other.ok or "Invalid access pattern" not in (other.error or "")


def test_invalid_sharding_raises_the_same_error_on_every_rank():
    results = run_ranks(_overlapping_save, 2, None, check=False, timeout_s=90)
    assert all(r is not None and r.error_type == "ShardingValidationError" for r in results)
    assert all(r.raised("CheckpointingException") and r.raised("MegatronCkptFixesError")
               for r in results)
    assert results[0].error == results[1].error
    assert "'w'" in results[0].error or "key='w'" in results[0].error
    assert re.search(r"rank \d: ", results[0].error)


def _errors_worker(rank: int, ws: int) -> dict[str, str]:
    """One process group for several error paths (each spawn imports megatron-core)."""
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    from megatron_ckpt_fixes.core.agreement import AgreementError, agree, bounds
    from megatron_ckpt_fixes.fixes.load_errors import CheckpointLoadError

    megatron_ckpt_fixes.install()
    out = {}
    assert agree(rank == 1, None, "vote") is True
    assert agree(False, None, "vote") is False
    try:
        agree(False, "key 'emb': cannot plan" if rank == 1 else None, "planning")
    except AgreementError as exc:
        out["agree"] = str(exc)
    assert bounds([5 + rank, None, 7 if rank else None]) == [(5, 6), None, (7, 7)]
    try:  # the digests' reduce also carries the failures (one collective, not two)
        bounds([1], error="cannot digest 'w'" if rank == 0 else None, what="digesting")
    except AgreementError as exc:
        out["bounds"] = str(exc)

    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    w = ShardedTensor.from_rank_offsets("w", torch.ones(4), (0, rank, ws))
    dc.save({"w": w}, root[0])
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, ws)),
                "fault": ShardedObject("rerun_state_machine_state", None, (ws,), (rank,))}
    try:
        dc.load(template, root[0])
    except CheckpointLoadError as exc:  # also a CheckpointException
        out["load"] = str(exc)
    return out


@pytest.fixture(scope="module")
def errors():
    return run_ranks(_errors_worker, 2, timeout_s=120)


def test_an_error_on_one_rank_is_raised_on_all(errors):
    results = errors
    assert results[0].value == results[1].value
    assert "rank 1: key 'emb': cannot plan" in results[0].value["agree"]
    bounds_error = "digesting failed on 1 rank(s):\n  rank 0: cannot digest 'w'"
    assert results[0].value["bounds"] == bounds_error


def test_a_load_mismatch_names_key_rank_and_cause_on_every_rank(errors):
    results = errors
    text = results[0].value["load"]
    assert text == results[1].value["load"]
    for rank in (0, 1):
        assert f"rank {rank}: RuntimeError: Missing key in checkpoint state_dict: " \
               f"rerun_state_machine_state/shard_{rank}_2" in text
    assert "Traceback" not in text
