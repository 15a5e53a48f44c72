"""Ranks that load a checkpoint lacking some requested keys under a logging strictness.

Saved: ``model.w`` (a chunk per rank) and ``model.only_saved``. Requested: ``model.w``,
``model.new`` (both ranks: a layer the checkpoint does not have) and, on rank 1 only,
``model.expert.1`` (an expert this rank alone holds). Each load is made with upstream's
logging (``compat.cpu``, and ``compat.tensor_metadata`` that lets megatron-core's strict
loads run on torch 2.15), then with ``install()``; each records what the rank logged,
what it loaded and what the pre-flight says, the pre-flight also on a copy of the
checkpoint without its data files.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

LOGGERS = ("megatron.core.dist_checkpointing.validation", "megatron_ckpt_fixes.fixes.strictness")
STRICT = ("log_unexpected", "log_all")
SAVED_W = torch.arange(6.0).reshape(2, 3)


def _saved(rank: int, ws: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"model.w": ShardedTensor.from_rank_offsets("model.w", SAVED_W[rank:rank + 1] + 0,
                                                       (0, rank, ws)),
            "model.only_saved": ShardedTensor.from_rank_offsets("model.only_saved",
                                                                torch.ones(3), replica_id=rank)}


def template(rank: int, ws: int) -> dict:
    """What this rank asks for; its tensors hold 7 (what "not loaded" leaves)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    asked = {"model.w": ShardedTensor.from_rank_offsets("model.w", torch.zeros(1, 3),
                                                        (0, rank, ws)),
             "model.new": ShardedTensor.from_rank_offsets("model.new", torch.full((4,), 7.0),
                                                          replica_id=rank)}
    if rank == 1:
        asked["model.expert.1"] = ShardedTensor.from_rank_offsets("model.expert.1",
                                                                  torch.full((2,), 7.0))
    return asked


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _load(directory: str, rank: int, ws: int, strict: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    lines = _Lines()
    for name in LOGGERS:
        logging.getLogger(name).addHandler(lines)
    try:
        loaded = dist_checkpointing.load(template(rank, ws), directory, strict=strict)
    finally:
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(lines)
    return {"lines": lines.lines, "keys": sorted(loaded),
            "w": loaded["model.w"].clone()}


def _preflight(directory: str, rank: int, ws: int) -> str:
    from megatron_ckpt_fixes.tools.preflight import check_loadable

    try:
        check_loadable(template(rank, ws), directory)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return "passed"


def _no_data_copy(directory: str) -> str:
    """The checkpoint without its data files (a pre-flight that reads data fails on it)."""
    bare = directory + "-no-data"
    if dist.get_rank() == 0:
        shutil.copytree(directory, bare,
                        ignore=lambda _d, names: [n for n in names if n.endswith(".distcp")])
    dist.barrier()
    return bare


def strictness_worker(rank: int, ws: int, root: str) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing

    megatron_ckpt_fixes.install(["compat.cpu", "compat.tensor_metadata"])
    directory = os.path.join(root, "ckpt")
    if rank == 0:
        os.makedirs(directory)
    dist.barrier()
    dist_checkpointing.save(_saved(rank, ws), directory)
    upstream = {strict: _load(directory, rank, ws, strict) for strict in STRICT}
    megatron_ckpt_fixes.install()
    fixed = {strict: _load(directory, rank, ws, strict) for strict in STRICT}
    return {"upstream": upstream, "fixed": fixed,
            "preflight": _preflight(_no_data_copy(directory), rank, ws)}
