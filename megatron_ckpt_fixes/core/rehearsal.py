"""Small real runs of upstream code, watched: what the patches' probes observe.

A patch often relies on upstream code calling something it replaces (megatron-core's writer
calling torch's ``_write_item``, torch opening a record through ``get_crc32_options``). A
probe checks that by running the upstream code on a tiny input in this process, with the
callee watched (:func:`calls_during`), instead of reading the caller's bytecode or source:
what is checked is what happens. Nothing here needs a process group; everything is restored
exactly, and the files go to a temporary directory.
"""

from __future__ import annotations

import contextlib
import io
import queue
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_MISSING = object()


@contextmanager
def replaced(owner: Any, attr: str, value: Any) -> Iterator[None]:
    """Within the block ``owner.attr`` is ``value``; restored exactly afterwards."""
    raw = vars(owner).get(attr, _MISSING)
    setattr(owner, attr, staticmethod(value) if isinstance(raw, staticmethod) else value)
    try:
        yield
    finally:
        if raw is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, raw)


@contextmanager
def watching(owner: Any, attr: str, replacement: Callable[..., Any] | None = None
             ) -> Iterator[list[tuple[tuple, dict]]]:
    """Within the block, each call of ``owner.attr`` is recorded (its arguments) and passed
    on (to ``replacement`` when given); the attribute is restored exactly afterwards."""
    target = replacement or getattr(owner, attr)
    calls: list[tuple[tuple, dict]] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return target(*args, **kwargs)

    with replaced(owner, attr, watched):
        yield calls


def as_rank_0() -> contextlib.AbstractContextManager:
    """Where no process group is initialized, ``torch.distributed.get_rank()`` answers 0
    within the block (upstream code asks it to name what it writes); with a group, the
    group's rank answers, and nothing is replaced (no other thread can see a false rank)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return contextlib.nullcontext()
    return replaced(dist, "get_rank", lambda *args, **kwargs: 0)


def calls_during(owner: Any, attr: str, action: Callable[[], Any]) -> bool:
    """Whether running ``action`` calls ``owner.attr`` (an action that fails is judged by
    what it called before it failed)."""
    with watching(owner, attr) as calls:
        try:
            action()
        except Exception:  # noqa: BLE001 - only whether the call happened matters
            pass
    return bool(calls)


def torch_save_of_a_tensor() -> None:
    """``torch.save`` of a small tensor into memory."""
    import torch

    torch.save(torch.arange(4.0), io.BytesIO())


def write_one_item() -> list[Any]:
    """megatron-core's ``FileSystemWriterAsync.write_preloaded_data`` writing one small
    tensor item into a temporary file; its write results."""
    import torch
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    item = WriteItem(MetadataIndex("rehearsal"), WriteItemType.TENSOR)
    results: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()
    done.put(0)  # the writer takes one token when it is done
    with tempfile.TemporaryDirectory() as directory:
        writer = FileSystemWriterAsync(directory)
        transforms = [writer.transforms] if hasattr(writer, "transforms") else []  # as it does
        bucket = (f"{directory}/rehearsal.distcp", "rehearsal", ([], [(item, torch.arange(4.0))]))
        returned = FileSystemWriterAsync.write_preloaded_data(transforms, 0, bucket, results,
                                                              done, False)
    outcome = returned if returned is not None else results.get_nowait()
    return outcome[1]


@contextmanager
def _failing_as_exceptions() -> Iterator[None]:
    """torch DCP's failure (a ``BaseException``) as a ``RuntimeError``, which probes catch."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        raise RuntimeError(f"torch DCP failed: {exc}") from exc


@contextmanager
def tiny_checkpoint() -> Iterator[str]:
    """torch DCP's own save of one small tensor (no process group) into a temporary
    directory, removed when the block ends: not at exit, which the processes multiprocessing
    forks never reach (each left one behind in the temporary folder). Nothing is copied
    ahead (``per_thread_copy_ahead=0``): on a GPU host torch's writer would otherwise open a
    CUDA stream, and with it a context on the current device, in every process that installs."""
    import torch
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory(prefix="mcf-rehearsal-") as directory:
        with _failing_as_exceptions():
            writer = dcp.FileSystemWriter(directory, per_thread_copy_ahead=0)
            dcp.save({"t": torch.arange(4.0)}, storage_writer=writer, no_dist=True)
        yield directory


def save_tiny_checkpoint() -> None:
    """:func:`tiny_checkpoint`'s save, its directory removed at once."""
    with tiny_checkpoint():
        pass


def load_tiny_checkpoint() -> None:
    """torch DCP's own load, through ``FileSystemReader``, of a checkpoint of one small
    tensor."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"t": torch.empty(4)}
    with tiny_checkpoint() as directory, _failing_as_exceptions():
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)


def metadata_reads() -> tuple[str, list[tuple[str, str]]]:
    """Where ``FileSystemReader`` says a checkpoint's metadata is (``_get_metadata_path``),
    and the files (path, mode) its ``read_metadata`` opens through its ``fs``."""
    from torch.distributed.checkpoint import FileSystemReader

    with tiny_checkpoint() as directory:
        reader = FileSystemReader(directory)
        with watching(reader.fs, "create_stream", reader.fs.create_stream) as calls:
            try:
                reader.read_metadata()
            except Exception:  # noqa: BLE001 - judged by what it opened
                pass
    return str(reader._get_metadata_path()), [(str(args[0]), str(args[1])) for args, _ in calls]


def writer_save_call(results_queue: Any) -> tuple[Any, Any, list[Any]]:
    """What megatron-core's ``FileSystemWriterAsync.get_save_function_and_args`` hands its
    strategy for one small tensor item and ``results_queue`` (:func:`as_rank_0`): the save
    function, the preload step and the function's arguments."""
    import torch
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    item = WriteItem(MetadataIndex("rehearsal"), WriteItemType.TENSOR)
    with tempfile.TemporaryDirectory() as directory:
        writer = FileSystemWriterAsync(directory)
        writer.write_buckets = [(f"{directory}/rehearsal.distcp", "rehearsal",
                                 ([], [(item, torch.arange(4.0))]))]
        writer.results_queue = results_queue
        with as_rank_0():
            save, preload, args = writer.get_save_function_and_args()
    return save, preload, list(args)


def results_read_by_the_writer() -> bool:
    """Whether ``FileSystemWriterAsync.retrieve_write_results`` reads the writer's own
    ``results_queue`` attribute."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    class Watched(queue.Queue):
        read = False

        def get_nowait(self) -> Any:
            Watched.read = True
            return RuntimeError("rehearsal")

        def get(self, *args: Any, **kwargs: Any) -> Any:
            return self.get_nowait()

    with tempfile.TemporaryDirectory() as directory:
        writer = FileSystemWriterAsync(directory)
        writer.write_buckets, writer.results_queue = [], Watched()
        try:
            writer.retrieve_write_results()
        except Exception:  # noqa: BLE001 - only whether it read the queue matters
            pass
    return Watched.read
