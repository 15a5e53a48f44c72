"""megatron-core 0.16 forks a writer process per bucket file on every save; with the fixes the
bucket files are written by threads, the same files, bitwise loadable by plain megatron-core,
and a failing writer fails the save as upstream's forked one does.

One 2-rank job, tiny tensors, two bucket files per rank (0.16's default ``thread_count``):
upstream (``install(["compat.cpu"])``) forks one process per bucket on each save (the cost
this feature removes: page tables of the whole trainer copied per save), and a writer whose
``open`` fails (rank 1's first bucket file is a directory) ends in ``CheckpointException``
on every rank. With ``install()``: no fork, the same file names as upstream's save, every
value loaded back exactly by plain upstream, and the failing writer's save raises the same
class (``WriteFailedError`` is a ``CheckpointException``) on every rank, naming rank 1 and
the cause. Trivial wrong fixes this fails on: one bucket file per rank instead of
``thread_count`` (other files: the file names differ), and writer threads whose exception is
left to ``threading.excepthook`` (the save's error would not name the cause, or the save
would report success).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import loads_exactly, run_ranks

pytestmark = pytest.mark.varies_with("megatron-core", "torch")

WRITERS = 2


def _forks_writers() -> bool:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    return hasattr(FileSystemWriterAsync, "write_preloaded_data_multiproc")


def _state(rank: int, ws: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {key: ShardedTensor.from_rank_offsets(
        key, torch.arange(4096.0, dtype=torch.float64).reshape(64, 64) * (i + 1) + rank,
        (0, rank, ws)) for i, key in enumerate(("a", "b", "c"))}


def _save(directory: str, rank: int, ws: int, failing: bool = False) -> dict:
    """One synchronous save: the forks it made, the files it wrote, or how it failed."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if rank == 0:
        os.makedirs(directory)
    dist.barrier()
    if failing and rank == 1:
        os.mkdir(os.path.join(directory, f"__{rank}_0.distcp"))
    forks = _forks[0]
    out: dict = {}
    try:
        dc.save(_state(rank, ws), directory,
                TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=WRITERS))
        out["outcome"] = "ok"
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        out.update(outcome="error", error=str(exc),
                   classes=[c.__name__ for c in type(exc).__mro__])
    out["forks"] = _forks[0] - forks
    dist.barrier()
    out["files"] = sorted(f for f in os.listdir(directory) if f.endswith(".distcp"))
    return out


_forks = [0]


def _worker(rank: int, ws: int, root: str) -> dict:
    import megatron_ckpt_fixes

    os.register_at_fork(before=lambda: _forks.__setitem__(0, _forks[0] + 1))
    megatron_ckpt_fixes.install(["compat.cpu"])
    _save(os.path.join(root, "warm"), rank, ws)  # megatron-core's results queue, started once
    out = {"upstream": _save(os.path.join(root, "upstream"), rank, ws),
           "upstream failing": _save(os.path.join(root, "upstream-failing"), rank, ws, True)}
    megatron_ckpt_fixes.install()
    out["fixed"] = _save(os.path.join(root, "fixed"), rank, ws)
    out["fixed failing"] = _save(os.path.join(root, "fixed-failing"), rank, ws, True)
    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(["compat.cpu"])  # plain upstream reads the fixed save
    out["exact"] = loads_exactly(os.path.join(root, "fixed"),
                                 functools.partial(_state, rank, ws))
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    if not _forks_writers():
        pytest.skip("megatron-core writes its bucket files with threads here")
    root = str(tmp_path_factory.mktemp("writer_threads"))
    return [r.value for r in run_ranks(_worker, 2, root, timeout_s=300)]


def test_upstream_forks_a_writer_per_bucket_on_every_save(outcomes):
    for out in outcomes:
        assert out["upstream"]["outcome"] == "ok", out
        assert out["upstream"]["forks"] == WRITERS, out["upstream"]


def test_the_fixed_save_forks_nothing_and_writes_upstreams_files_exactly(outcomes):
    for out in outcomes:
        assert out["fixed"]["outcome"] == "ok" and out["fixed"]["forks"] == 0, out["fixed"]
        assert out["fixed"]["files"] == out["upstream"]["files"], out
        assert len(out["fixed"]["files"]) == 2 * WRITERS, out["fixed"]
        assert out["exact"]


def test_a_failing_writer_thread_fails_the_save_as_a_forked_writer_does(outcomes):
    upstream = [out["upstream failing"] for out in outcomes]
    assert all(o["outcome"] == "error" and "CheckpointException" in o["classes"]
               for o in upstream), upstream
    fixed = [out["fixed failing"] for out in outcomes]
    assert all(o["outcome"] == "error" and {"WriteFailedError", "CheckpointException"}
               <= set(o["classes"]) for o in fixed), fixed
    assert fixed[0]["error"] == fixed[1]["error"], fixed
    assert "rank 1: " in fixed[0]["error"] and "[Errno 21] Is a directory" in \
        fixed[0]["error"], fixed[0]["error"]
    assert fixed[0]["forks"] == fixed[1]["forks"] == 0, fixed
