"""The same snapshot for nvidia-resiliency-ext's asynchronous save (``--async-strategy nvrx``).

megatron-core 0.19+ hands ``--async-save`` to nvidia-resiliency-ext by default; its
``checkpointing.async_ckpt`` has its own writer and ``AsyncCallsQueue`` with megatron-core's
design, and the same hole: CPU tensors are cloned only when they are views, its persistent
worker (the default) receives the request through a multiprocessing queue (moving the
trainer's tensors into shared memory) and releases the trainer before writing. Run on CPU
ranks it writes the next step's values into every tensor, as megatron-core's does.

Only the layout differs: the preload step is ``partial(preload_tensors, (checkpoint_dir,
(identifier, (separation_hint, cached_tensor_data, uncached_tensor_data, byte_io_data,
thread_count, storage_plan))), ...)`` and CPU tensors travel, every save, in
``uncached_tensor_data`` (``(items, tensors)``; ``cached_tensor_data`` holds device tensors,
which the preload step copies to the host). :func:`nvrx_layout` finds them; the copy, the
staging buffers and their release are the package's (:func:`~megatron_ckpt_fixes.fixes.snapshot.snapshot_request`).

A feature of another system (``megatron_ckpt_fixes.SYSTEMS``): applied when
nvidia-resiliency-ext is first imported, never where it is not installed (``installed()``
says so). Whether nvidia-resiliency-ext already snapshots is asked of its preload step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.fixes.snapshot import Layout, snapshotting_schedule

_ASYNC_CKPT = "nvidia_resiliency_ext.checkpointing.async_ckpt"
_QUEUE = f"{_ASYNC_CKPT}.core:AsyncCallsQueue"
_WRITER = f"{_ASYNC_CKPT}.filesystem_async:FileSystemWriterAsync"


def _preload_tensors() -> Callable[..., Any]:
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
        FileSystemWriterAsync)

    return FileSystemWriterAsync.preload_tensors


def nvrx_layout(request: Any) -> Layout | None:
    """The CPU-side tensors of a request made by nvidia-resiliency-ext's writer (its
    ``uncached_tensor_data``), or None for any other request."""
    preload = getattr(request, "preload_fn", None)
    if not (isinstance(preload, functools.partial) and preload.func is _preload_tensors()
            and preload.args):
        return None
    checkpoint_dir, (identifier, structure) = preload.args[0]
    hint, cached, uncached, byte_io, threads, plan = structure
    items, tensors = uncached if uncached is not None else ([], [])

    def rebuild(new: list[torch.Tensor]) -> Any:
        data = (checkpoint_dir, (identifier, (hint, cached, (items, list(new)), byte_io,
                                              threads, plan)))
        return request._replace(preload_fn=functools.partial(
            preload.func, data, *preload.args[1:], **preload.keywords))

    return Layout(list(tensors), rebuild)


def nvrx_snapshots() -> str | None:
    """Why no snapshot is needed (nvidia-resiliency-ext's preload step copies a CPU
    tensor), or None."""
    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    source = torch.arange(4.0)
    item = WriteItem(MetadataIndex("probe"), WriteItemType.TENSOR)
    data = ("probe", (None, (None, None, ([item], [source]), None, 1, _StoragePrefix("p"))))
    staged = _preload_tensors()(data, False)[0][2][1][0][1]
    if staged.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
        return ("nvidia-resiliency-ext's preload step already copies CPU tensors before the "
                "trainer is released")
    return None


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="snapshot.nvrx.schedule_async_request",
        target=_QUEUE,
        attr="schedule_async_request",
        build=snapshotting_schedule(nvrx_layout),
        reads=(f"{_WRITER}.preload_tensors",),
        not_needed=nvrx_snapshots,
        why="nvidia-resiliency-ext's asynchronous save writes the state at the moment "
            "scheduling returns, like megatron-core's (the same staging buffers)",
    ),
)
