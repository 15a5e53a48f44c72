"""A save's write results stay in memory when its writers run in the saving process, and still
reach the trainer through megatron-core's Manager from any other process.

One 2-rank job, tiny tensors, megatron-core's queue behind ``get_write_results_queue``
replaced by a proxy that counts what is read through the Manager: upstream's synchronous save
(``install(["compat.cpu"])``) reads its report through the Manager (the round trip this
feature removes); with ``install()`` the synchronous save reads nothing through it, an
asynchronous save whose writer is a forked process (``AsyncCallsQueue``) reads its report
through it, and both checkpoints load back exactly with plain upstream. The persistent
worker receives the save pickled: the pickled queue is the Manager's proxy itself (the unit
test below, no ranks).

Trivial wrong fixes this fails on: the results in a plain in-process queue always (the
forked writer's report is lost: ``results_queue should not be empty``; it cannot be pickled
for the persistent worker), and a queue that keeps the reports of every process's main
thread (the forked writer writes on its main thread).
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing as mp
import os
import pickle

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import loads_exactly, run_ranks
from megatron_ckpt_fixes.speedups.write_results import InProcessFirst

pytestmark = pytest.mark.varies_with("megatron-core", "torch")


class _CountingReads:
    """The Manager's proxy, counting the reports read through it (in this process)."""

    def __init__(self, proxy) -> None:
        self.proxy, self.reads = proxy, 0

    def get_nowait(self):
        item = self.proxy.get_nowait()
        self.reads += 1
        return item

    def __getattr__(self, name: str):
        return getattr(self.__dict__["proxy"], name)


def _state(rank: int, ws: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {key: ShardedTensor.from_rank_offsets(
        key, torch.arange(256.0, dtype=torch.float64).reshape(16, 16) * (i + 1) + rank,
        (0, rank, ws)) for i, key in enumerate(("a", "b"))}


def _save(directory: str, rank: int, ws: int, counting: _CountingReads,
          asynchronous: bool = False) -> dict:
    """One save: how it ended and how many reports were read through the Manager."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if rank == 0:
        os.makedirs(directory)
    dist.barrier()
    reads = counting.reads
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    try:
        if asynchronous:
            mcore = ({"async_strategy": "mcore"}  # 0.19+: megatron-core's own async save
                     if "async_strategy" in inspect.signature(dc.save).parameters else {})
            calls = AsyncCallsQueue()  # a forked writer process per save
            calls.schedule_async_request(dc.save(_state(rank, ws), directory, strategy,
                                                 async_sharded_save=True, **mcore))
            calls.maybe_finalize_async_calls(blocking=True)
            calls.close()
        else:
            dc.save(_state(rank, ws), directory, strategy)
        outcome = "ok"
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        outcome = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return {"outcome": outcome, "manager reads": counting.reads - reads}


def _worker(rank: int, ws: int, root: str) -> dict:
    import megatron_ckpt_fixes
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    megatron_ckpt_fixes.install(["compat.cpu"])
    _save(os.path.join(root, "warm"), rank, ws, _CountingReads(None))  # starts the queue
    counting = filesystem_async._results_queue = _CountingReads(filesystem_async._results_queue)
    out = {"upstream": _save(os.path.join(root, "upstream"), rank, ws, counting)}
    megatron_ckpt_fixes.install()
    out["fixed"] = _save(os.path.join(root, "fixed"), rank, ws, counting)
    out["fixed async"] = _save(os.path.join(root, "fixed-async"), rank, ws, counting, True)
    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(["compat.cpu"])  # plain upstream reads the fixed saves
    out["exact"] = [loads_exactly(os.path.join(root, name), functools.partial(_state, rank, ws))
                    for name in ("fixed", "fixed-async")]
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("write_results"))
    return [r.value for r in run_ranks(_worker, 2, root, timeout_s=300)]


def test_upstream_reads_a_synchronous_saves_results_through_the_manager(outcomes):
    for out in outcomes:
        assert out["upstream"] == {"outcome": "ok", "manager reads": 1}, out


def test_the_fixed_synchronous_save_keeps_its_results_in_memory(outcomes):
    for out in outcomes:
        assert out["fixed"] == {"outcome": "ok", "manager reads": 0}, out
        assert out["exact"][0], out


def test_a_forked_writers_results_still_reach_the_trainer(outcomes):
    for out in outcomes:
        assert out["fixed async"] == {"outcome": "ok", "manager reads": 1}, out
        assert out["exact"][1], out


def test_the_pickled_queue_is_the_managers_proxy():
    """What the persistent worker receives: a report it puts reaches the trainer's queue."""
    manager = mp.get_context("fork").Manager()
    try:
        wrapped = InProcessFirst(manager.Queue())
        received = pickle.loads(pickle.dumps(wrapped))
        assert not isinstance(received, InProcessFirst)
        received.put({0: ["results"]})
        assert wrapped.get(timeout=10) == {0: ["results"]}
        wrapped.put("in memory")
        assert wrapped.proxy.qsize() == 0 and wrapped.get_nowait() == "in memory"
    finally:
        manager.shutdown()
