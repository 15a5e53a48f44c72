"""Rank functions for megatron-core's persistent async checkpoint worker (spawned ranks)."""

from __future__ import annotations

import inspect
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

#: How long to wait for a save at all: no verdict depends on it, it only bounds a real hang
#: (a loaded machine took over 150 s to spawn and import a worker, in CI once).
DEADLINE_S = 420.0
#: Where upstream's trainer waits for its persistent worker (megatron-core's
#: ``PersistentAsyncCaller``): for the staging (``preload_q.join()``) and for the report
#: (a ``comp_q.get_nowait()`` poll). Neither looks at the worker's life: once it is dead, a
#: trainer in one of them waits forever.
UPSTREAM_WAITS = ("schedule_async_call", "is_current_async_call_done")


def worker_dies(*_args: Any, **_kwargs: Any) -> None:
    """An async_fn that kills the persistent worker in the middle of its save."""
    os._exit(7)


#: Elements of the large tensor: above the checksummed writer's in-memory limit, so its
#: checksum is taken through the tap, piece by piece as the worker writes it.
BIG = 40_000


def _save_request(rank: int, ws: int, root: str, step: int):
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor

    values = torch.arange(4.0) + 4 * rank + 100 * step
    tensor = ShardedTensor.from_rank_offsets("w", values, (0, rank, ws))
    big = ShardedTensor.from_rank_offsets("big", torch.arange(float(BIG)) + rank, (0, rank, ws))
    path = os.path.join(root, f"step{step}")
    if rank == 0:
        os.makedirs(path)
    dist.barrier()
    # From megatron-core 0.17 async saves default to nvidia-resiliency-ext's strategy; these
    # tests are about megatron-core's own persistent worker.
    mcore_async = ({"async_strategy": "mcore"}
                   if "async_strategy" in inspect.signature(dc.save).parameters else {})
    return dc.save({"w": tensor, "big": big}, path, async_sharded_save=True,
                   **mcore_async), path


def _flipped_verdict(rank: int, path: str) -> tuple[str, str] | None:
    """The collective check of a copy of ``path`` with one byte of rank 0's chunk of "big"
    flipped: (error class, message), or None if it passed."""
    from ckpt_files import flip_tensor_byte

    from megatron_ckpt_fixes.fixes.checksums import verify_checkpoint

    flipped = f"{path}-flipped"
    if rank == 0:
        shutil.copytree(path, flipped)
        flip_tensor_byte(Path(flipped), "big", (0,))
    dist.barrier()
    try:
        verify_checkpoint(flipped)
    except BaseException as exc:  # noqa: BLE001 - the class and message are the verdict
        return type(exc).__name__, str(exc)
    return None


def _in_upstream_wait(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside megatron-core's persistent caller, in a wait only its
    worker could end."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name in UPSTREAM_WAITS and \
                frame.f_code.co_filename.endswith(os.path.join("strategies", "async_utils.py")):
            return True
        frame = frame.f_back
    return False


def _in_thread(fn: Callable[[], Any], worker: Callable[[], Any], upstream: bool) -> dict:
    """Run ``fn`` (schedule + blocking finalize) in a thread; report how it ended, or that
    it waits for good: ``upstream`` (no fix installed), its worker dead and the thread in
    one of :data:`UPSTREAM_WAITS`, which nothing but that worker can end. With the fixes
    there is no such rule: the save must end (a hang shows at :data:`DEADLINE_S`)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            out["error"] = (type(exc).__name__, str(exc),
                            tuple(c.__name__ for c in type(exc).__mro__))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while thread.is_alive() and time.monotonic() < deadline:
        process = worker()
        if upstream and process is not None and not process.is_alive() \
                and _in_upstream_wait(thread):
            break
        thread.join(0.2)
    process = worker()
    out["waiting"] = thread.is_alive()
    out["worker_exit"] = None if process is None or process.is_alive() else process.exitcode
    return out


def persistent_save_worker(rank: int, ws: int, subset: str, kill_rank: int | None) -> dict:
    """Save once with a persistent worker (and, with ``kill_rank``, save again while that
    rank's worker dies); ``subset`` = "upstream-cpu" (compat.cpu without the worker fix, i.e.
    plain upstream on gloo) or "all" (install())."""
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from megatron_ckpt_fixes.core.patching import PatchSet
    from megatron_ckpt_fixes.fixes.checksums import verify_checkpoint

    if subset == "all":
        megatron_ckpt_fixes.install()
    else:
        PatchSet().install([p for p in megatron_ckpt_fixes.feature_patches("compat.cpu")
                            if p.name != "compat.cpu.persistent_worker"])
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    queue = AsyncCallsQueue(persistent=True)

    def worker():
        # The caller is per queue in megatron-core 0.16, shared by the class from 0.17 on; it
        # exists only once the first request was scheduled (the poll may come first).
        caller = (getattr(queue, "persistent_caller", None)
                  or getattr(AsyncCallsQueue, "_persistent_caller", None))
        return None if caller is None else caller.process

    def save(step: int, die: bool):
        def go():
            request, path = _save_request(rank, ws, root[0], step)
            if die:
                request = request._replace(async_fn=worker_dies)
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            template = ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, ws))
            loaded = dc.load({"w": template}, path)["w"]
            summary = verify_checkpoint(path)  # every saved item has a checksum that holds
            return (float((loaded - (torch.arange(4.0) + 4 * rank + 100 * step)).abs().max()),
                    (summary.status, summary.checked == summary.items, summary.unrecorded),
                    _flipped_verdict(rank, path) if subset == "all" else None)
        return go

    upstream = subset != "all"
    results = {"first": _in_thread(save(0, False), worker, upstream)}
    if kill_rank is not None and not results["first"]["waiting"]:
        results["killed"] = _in_thread(save(1, rank == kill_rank), worker, upstream)
    process = worker()
    if process is not None and process.is_alive() and any(r["waiting"] for r in results.values()):
        process.kill()  # a stuck trainer would leave its worker behind
    return results
