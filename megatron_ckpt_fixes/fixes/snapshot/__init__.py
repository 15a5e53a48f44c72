"""An asynchronous checkpoint is the state at the moment scheduling returns to the trainer.

megatron-core's torch_dist writer hands a save to a background writer as an ``AsyncRequest``
whose write buckets reference the tensors to write. A GPU tensor is copied to host memory by
the request's preload step before the trainer goes on; a CPU tensor is not (``preload_tensors``
calls ``tensor.to("cpu")``, which returns the same tensor, and the writer only clones views).
What the writer then reads depends on the path:

- the default caller (``TemporalAsyncCaller``) forks the writer: the child sees the parent's
  memory as it was at the fork (copy-on-write), except memory that is *shared* (a tensor
  that went through a torch multiprocessing queue once, a DataLoader's, ``share_memory_()``):
  the child reads the trainer's next steps there;
- the persistent worker (``AsyncCallsQueue(persistent=True)``, Megatron-LM's
  ``--use-persistent-ckpt-worker``, megatron-core 0.19+'s threaded writer inside it) receives
  the request through a multiprocessing queue: pickling moves each CPU tensor's storage into
  shared memory *in place*, the trainer's own tensors included, and the trainer is released
  as soon as the (no-op) preload ran, before anything is written. The next optimizer step is
  in the checkpoint, whole or in part.

The fix copies, on the trainer's side, every CPU tensor the writer could otherwise see change
into staging buffers (:mod:`.staging`; for a persistent worker one shared segment,
:mod:`.arena`, which crosses to the worker as one file descriptor where upstream's request
sends one per tensor), and hands the writer a request over the copies: all of them on the
persistent worker, the shared and pinned ones on the forked path (the others the fork
already freezes). The forked path copies before the fork; a persistent worker's copy runs
while the request is handed over, the worker waits for its end before it reads, and the
trainer returns from scheduling only after it (:mod:`.overlap`). The trainer's tensors are
then never pickled, so they never move into shared memory. GPU tensors keep upstream's
device-to-host copy (copied once, not twice). A request this module does not recognise (not
megatron-core's ``FileSystemWriterAsync``) is passed on unchanged, with a warning once.
Where a request keeps its tensors is a :class:`Layout` (:func:`mcore_layout` here;
nvidia-resiliency-ext's in :mod:`.nvrx`, the same copy).

The checksums feature hashes the items' bytes from the buffers the writer writes, after the
write: with the snapshot those buffers cannot change before the writer returns, so the
checksum is the checksum of the file's bytes (a torn save could not verify, a consistent one
cannot fail).

Whether upstream already snapshots is detected by behaviour: if its preload step returns a copy
of a CPU tensor (it runs before the trainer is released, on every path), the patch is not
applied and ``installed()`` says so.
"""

from __future__ import annotations

import functools
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.rehearsal import writer_save_call
from megatron_ckpt_fixes.fixes.snapshot.arena import with_exact_storages
from megatron_ckpt_fixes.fixes.snapshot.overlap import PendingCopy
from megatron_ckpt_fixes.fixes.snapshot.staging import POOL, Copies, SnapshotStats, StagingPool

__all__ = ["PATCHES", "POOL", "Layout", "Snapshot", "SnapshotStats", "begin_snapshot",
           "mcore_layout", "needs_copy", "snapshot_request", "snapshotting_schedule", "stats"]

logger = logging.getLogger(__name__)

_STRATEGIES = "megatron.core.dist_checkpointing.strategies"
_QUEUE = f"{_STRATEGIES}.async_utils:AsyncCallsQueue"
_WRITER = f"{_STRATEGIES}.filesystem_async:FileSystemWriterAsync"


def stats() -> SnapshotStats:
    """What this process's snapshots cost so far (time, bytes copied, staging memory)."""
    return POOL.stats


def needs_copy(tensor: torch.Tensor, forked: bool) -> bool:
    """Whether the writer could see ``tensor`` change after scheduling returns.

    GPU tensors: no, upstream's preload copies them to host memory before the trainer goes
    on. CPU tensors: yes for a persistent worker; on the forked path only memory the fork does
    not freeze (shared memory, and pinned memory, which CUDA keeps out of copy-on-write).
    """
    if tensor.device.type != "cpu":
        return False
    return not forked or tensor.is_shared() or tensor.is_pinned()


def _preload_tensors() -> Callable[..., Any]:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    return FileSystemWriterAsync.preload_tensors


@dataclass(frozen=True)
class Layout:
    """Where a kind of request keeps the tensors its writer will write."""

    tensors: list[torch.Tensor]
    #: the same request, writing the given tensors (same order) instead
    rebuild: Callable[[list[torch.Tensor]], Any]


def mcore_layout(request: Any) -> Layout | None:
    """The tensors of a request made by megatron-core's ``FileSystemWriterAsync``: its
    preload step is ``partial(preload_tensors, buckets, ...)``, and the same buckets are the
    writer function's second argument. None for any other request."""
    preload = getattr(request, "preload_fn", None)  # older request types have none
    if not (isinstance(preload, functools.partial) and preload.func is _preload_tensors()
            and preload.args and len(request.async_fn_args) > 1
            and request.async_fn_args[1] is preload.args[0]):
        return None
    buckets = preload.args[0]
    positions = [(b, i) for b, (_, _, (_, tensors)) in enumerate(buckets)
                 for i in range(len(tensors))]

    def rebuild(new: list[torch.Tensor]) -> Any:
        staged = dict(zip(positions, new))
        new_buckets = [(path, key, (bytes_data, [(item, staged[(b, i)])
                                                 for i, (item, _) in enumerate(tensors)]))
                       for b, (path, key, (bytes_data, tensors)) in enumerate(buckets)]
        args = list(request.async_fn_args)
        args[1] = new_buckets
        return request._replace(
            async_fn_args=type(request.async_fn_args)(args),
            preload_fn=functools.partial(preload.func, new_buckets, *preload.args[1:],
                                         **preload.keywords))

    return Layout([buckets[b][2][1][i][1] for b, i in positions], rebuild)


@dataclass(frozen=True)
class Snapshot:
    """A request that writes copies, and how to wait for the copy to be over."""

    request: Any
    #: returns once every copy is made (raises what the copy raised)
    wait: Callable[[], None]


def _done() -> None:
    """The copy of a snapshot made before its request left."""


def begin_snapshot(request: Any, forked: bool, pool: StagingPool = POOL,
                   layout: Callable[[Any], Layout | None] = mcore_layout) -> Snapshot:
    """``request`` writing copies (in ``pool``'s staging buffers) of every tensor the writer
    could see change; the buffers return to the pool at the request's first finalize step.
    The request itself when nothing needs a copy or ``layout`` does not recognise it.

    For a persistent worker (not ``forked``) the copy runs on a thread while the request is
    handed over (:mod:`.overlap`): the caller must :attr:`Snapshot.wait` before it returns to
    the trainer. A forked writer gets a request whose copies are made (the fork may happen
    before the copy could end)."""
    found = layout(request)
    if found is None:
        if getattr(request, "async_fn", None) is not None:
            _warn_unrecognised(request)
        return Snapshot(request, _done)
    positions = [i for i, tensor in enumerate(found.tensors) if needs_copy(tensor, forked)]
    if not positions:
        return Snapshot(request, _done)
    staging = pool.acquire(shared=not forked)
    sources = [found.tensors[i] for i in positions]
    targets = pool.targets(staging, sources)
    tensors = list(found.tensors)
    for i, target in zip(positions, targets):
        tensors[i] = target
    request = found.rebuild(tensors)
    copies = Copies.of(targets, sources)
    wait = _done
    if staging.shared:
        copying = PendingCopy(functools.partial(pool.fill, copies))
        request, wait = with_exact_storages(request, copying.reader), copying.wait
    else:
        pool.fill(copies)
    return Snapshot(request._replace(
        finalize_fns=[functools.partial(pool.release, staging), *request.finalize_fns]), wait)


def snapshot_request(request: Any, forked: bool, pool: StagingPool = POOL,
                     layout: Callable[[Any], Layout | None] = mcore_layout) -> Any:
    """:func:`begin_snapshot`'s request once its copy is over."""
    snap = begin_snapshot(request, forked, pool, layout)
    snap.wait()
    return snap.request


@functools.lru_cache(maxsize=None)
def _warn_unrecognised_once(kind: str) -> None:
    logger.warning("an asynchronous checkpoint request of an unknown kind (%s) is written "
                   "without a snapshot: its CPU tensors may hold later values", kind)


def _warn_unrecognised(request: Any) -> None:
    _warn_unrecognised_once(getattr(request.async_fn, "__qualname__", repr(request.async_fn)))


def snapshotting_schedule(layout: Callable[[Any], Layout | None], pool: StagingPool = POOL
                          ) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """A builder wrapping an ``AsyncCallsQueue.schedule_async_request`` whose requests have
    ``layout``: the request leaves with a snapshot."""

    def build(original: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(original)
        def schedule_async_request(self: Any, async_request: Any) -> int:
            forked = not getattr(self, "persistent", False)
            snap = begin_snapshot(async_request, forked, pool, layout)
            try:
                return original(self, snap.request)
            finally:
                snap.wait()

        return schedule_async_request

    return build


# -- detection and what the patch relies on ----------------------------------------------------

def upstream_snapshots() -> str | None:
    """Why no snapshot is needed (upstream's preload step copies a CPU tensor), or None."""
    source = torch.arange(4.0)
    bucket = [("probe", "probe", ([], [(None, source)]))]
    staged = _preload_tensors()(bucket, False)[0][2][1][0][1]
    if staged.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
        return ("megatron-core's preload step already copies CPU tensors before the trainer "
                "is released")
    return None


def _request_problems() -> list[str]:
    """A request megatron-core's writer makes is recognised (one is made for a small tensor),
    and the calls queue says whether its worker is persistent."""
    from megatron.core.dist_checkpointing.strategies.async_utils import (
        AsyncCallsQueue, AsyncRequest)

    problems = [f"AsyncRequest has no field {name!r}"
                for name in ("async_fn", "async_fn_args", "finalize_fns", "preload_fn")
                if name not in AsyncRequest._fields]
    if problems:
        return problems
    save, preload, args = writer_save_call(queue.Queue())
    if mcore_layout(AsyncRequest(save, args, [], preload_fn=preload)) is None:
        problems.append("a request of FileSystemWriterAsync.get_save_function_and_args no "
                        "longer stages its buckets with preload_tensors: its requests would "
                        "not be recognised")
    if [AsyncCallsQueue(persistent=p).persistent for p in (False, True)] != [False, True]:
        problems.append("AsyncCallsQueue no longer records whether its worker is persistent")
    return problems


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="snapshot.schedule_async_request",
        target=_QUEUE,
        attr="schedule_async_request",
        build=snapshotting_schedule(mcore_layout),
        reads=(f"{_WRITER}.preload_tensors", f"{_WRITER}.get_save_function_and_args"),
        probes=(_request_problems,),
        not_needed=upstream_snapshots,
        why="an asynchronous save writes the state at the moment scheduling returns: CPU "
            "tensors the writer could see change are copied into staging buffers first, "
            "and the trainer's own tensors never move into shared memory",
    ),
)
