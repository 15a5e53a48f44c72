"""Checksummed saves and loads on real gloo ranks (run by test_checksums.py).

Every rank saves the same kinds of items megatron-core checkpoints hold: a tensor split
across ranks, a replicated one (written once, by its main replica), a tensor above the
writer's in-memory limit (checksummed through the tap, piece by piece as the writer writes
it), per-rank objects and common state. Each save path's
checkpoint is then copied with one byte of the large tensor flipped: the collective check
and the plain load (which checks what it reads) must each name it on every rank.
"""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckpt_files import change_bytes, flip_tensor_byte

ROWS = 4


def local_values(rank: int) -> dict[str, torch.Tensor]:
    from megatron_ckpt_fixes.fixes.checksums.writer import BUFFER_LIMIT

    big = BUFFER_LIMIT // 4 + 1000  # float32 elements: just above the in-memory limit
    return {
        "w": torch.arange(ROWS * 8, dtype=torch.float32).reshape(ROWS, 8) + 1000 * rank,
        "emb": torch.linspace(-1, 1, 24).reshape(4, 6),
        "big": torch.arange(big, dtype=torch.float32) * (rank + 1),
    }


def sharded_state(rank: int, ws: int, values: dict[str, torch.Tensor] | None = None) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    values = local_values(rank) if values is None else values
    return {
        "w": ShardedTensor.from_rank_offsets("w", values["w"], (0, rank, ws)),
        "emb": ShardedTensor.from_rank_offsets("emb", values["emb"], replica_id=rank),
        "big": ShardedTensor.from_rank_offsets("big", values["big"], (0, rank, ws)),
        "obj": ShardedObject("obj", {"rank": rank, "note": "per-rank"}, (ws,), (rank,)),
        "step": 7,
    }


def template(rank: int, ws: int) -> dict:
    return sharded_state(rank, ws, {k: torch.zeros_like(v) for k, v in local_values(rank).items()})


def exact(loaded: dict, rank: int) -> bool:
    values = local_values(rank)
    return (all(torch.equal(loaded[k], v) for k, v in values.items())
            and loaded["obj"] == {"rank": rank, "note": "per-rank"} and loaded["step"] == 7)


def _fresh_dir(root: str, name: str) -> str:
    path = os.path.join(root, name)
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    return path


def _save(sd: dict, path: str, strategy: Any = None, asynchronous: bool = False) -> None:
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if not asynchronous:
        dc.save(sd, path, strategy)
        return
    kwargs = ({"async_strategy": "mcore"}
              if "async_strategy" in inspect.signature(dc.save).parameters else {})
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dc.save(sd, path, strategy, async_sharded_save=True, **kwargs))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()


def _failure(exc: BaseException) -> dict[str, Any]:
    return {"error": str(exc), "classes": [c.__name__ for c in type(exc).__mro__]}


def _verify(path: str, required: bool = False) -> dict[str, Any]:
    from megatron_ckpt_fixes.fixes.checksums import verify_checkpoint

    try:
        summary = verify_checkpoint(path, required=required)
    except BaseException as exc:  # noqa: BLE001 - the class and message are the result
        return _failure(exc)
    return {"status": summary.status, "items": summary.items, "checked": summary.checked,
            "unrecorded": summary.unrecorded, "files": summary.files,
            "present": sum(os.path.exists(os.path.join(path, name))
                           for name in ("common.pt", ".metadata", "metadata.json"))}


def _load_exact(path: str, rank: int, ws: int) -> bool:
    from megatron.core import dist_checkpointing as dc

    return exact(dc.load(template(rank, ws), path), rank)


def _load(path: str, rank: int, ws: int) -> dict[str, Any]:
    """A plain load (no verify first): exact or not, or the error every rank raised."""
    try:
        return {"exact": _load_exact(path, rank, ws)}
    except BaseException as exc:  # noqa: BLE001 - the class and message are the result
        return _failure(exc)


def checksum_worker(rank: int, ws: int, root: str) -> dict[str, Any]:
    import megatron_ckpt_fixes
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_ckpt_fixes.fixes.checksums import SIDECAR

    out: dict[str, Any] = {}
    megatron_ckpt_fixes.install()
    sd = sharded_state(rank, ws)

    runs = {
        "sync": (None, False),
        "async": (TorchDistSaveShardedStrategy("torch_dist", 1), True),
        "fully_parallel": (FullyParallelSaveStrategyWrapper(
            TorchDistSaveShardedStrategy("torch_dist", 1)), False),
    }
    for name, (strategy, asynchronous) in runs.items():
        path = _fresh_dir(root, name)
        _save(sd, path, strategy, asynchronous)
        out[name] = {**_verify(path), "exact": _load_exact(path, rank, ws),
                     "sidecar": os.path.exists(os.path.join(path, SIDECAR))}
        flipped = f"{path}-flipped"
        if rank == 0:  # a byte of rank 0's chunk of "big" (hashed through the tap)
            shutil.copytree(path, flipped)
            out[name]["flipped_file"] = flip_tensor_byte(Path(flipped), "big", (0,))
        dist.barrier()
        out[name]["flipped"] = _verify(flipped)
        out[name]["flipped_load"] = _load(flipped, rank, ws)

    # A byte of rank 1's chunk of "w" flipped on disk after the save.
    corrupt = os.path.join(root, "corrupt")
    if rank == 0:
        shutil.copytree(os.path.join(root, "sync"), corrupt)
        out["flipped_file"] = flip_tensor_byte(Path(corrupt), "w", (ROWS, 0))
    dist.barrier()
    out["corrupt"] = {**_verify(corrupt), "patched_load": _load(corrupt, rank, ws)}

    # A changed byte in .metadata (a key's name) and in common.pt (the step, megatron-core
    # 0.16; 0.19+ writes none): every rank's load fails naming the file, before parsing it.
    for name, old, new, after in ((".metadata", b"emb", b"emc", b""),
                                  ("common.pt", bytes([0x4B, 7]), bytes([0x4B, 8]), b"step")):
        changed = os.path.join(root, f"changed{name}")
        if rank == 0:
            shutil.copytree(os.path.join(root, "sync"), changed)
            if os.path.exists(os.path.join(changed, name)):
                change_bytes(os.path.join(changed, name), old, new, after)
        dist.barrier()
        if os.path.exists(os.path.join(changed, name)):
            out[f"changed {name}"] = {**_load(changed, rank, ws),
                                      "size": os.path.getsize(os.path.join(changed, name))}
    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(["compat.cpu"])  # plain upstream: its load checks nothing
    out["corrupt"]["upstream_load_exact"] = _load_exact(corrupt, rank, ws)

    # Saved without the checksums feature: no record, and it still loads exactly.
    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install([f for f in megatron_ckpt_fixes.FEATURES if f != "checksums"])
    path = _fresh_dir(root, "without")
    _save(sd, path)
    megatron_ckpt_fixes.install()
    out["without"] = {**_verify(path), "exact": _load_exact(path, rank, ws),
                      "sidecar": os.path.exists(os.path.join(path, SIDECAR)),
                      "required": _verify(path, required=True)}
    return out
