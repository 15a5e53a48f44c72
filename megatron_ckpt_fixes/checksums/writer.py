"""Checksums recorded at save time, on megatron-core's torch_dist writer path.

Every ``dist_checkpointing.save`` with the torch_dist format goes through
``FileSystemWriterAsync``: its ``write_preloaded_data`` serializes each item with torch's
``_write_item`` into a bucket file, in a forked process (megatron-core 0.16) or a writer
thread (0.19), possibly inside megatron-core's async worker. The bytes exist only there, so
that is where the checksum is taken:

- ``_write_item`` (as ``filesystem_async`` calls it) computes the CRC-32 of exactly the bytes
  the item puts into the file and returns it in its ``WriteResult``. Small items are
  serialized into memory first and checksummed in one C call (a Python tap on ``torch.save``'s
  ~40 small writes per item would cost more than writing a small tensor); items above
  :data:`BUFFER_LIMIT` stream through a tap, so no large item is held in memory twice.
- megatron-core already gathers every rank's write results on the coordinator, which builds
  ``.metadata`` from them in ``finish``: the patched ``finish`` writes the record
  (:mod:`.record`) from the same results just before ``.metadata``, so the two describe the
  same save by construction and no extra collective is needed.

A checkpoint saved without this feature has no record and loads as before.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import logging
import os
import pickle
import tempfile
import zlib
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.storage import WriteResult

from .._patching import Patch
from .record import ChecksumRecord, remove_record, write_record

logger = logging.getLogger(__name__)

_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_WRITER = f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync"

#: Items up to this many bytes are serialized into memory and checksummed in one call.
BUFFER_LIMIT = 4 << 20


#: Instance attribute of upstream's ``WriteResult`` that carries the item's checksum.
CHECKSUM_ATTR = "crc32"


def with_checksum(result: WriteResult, checksum: int | None) -> WriteResult:
    """Upstream's own ``WriteResult``, carrying ``checksum`` (None: not taken) in its
    instance dict.

    Write results cross megatron-core's queues, among them a spawned multiprocessing
    manager that unpickles what every writer puts, one serving thread per client. A class
    of this package there would make the manager import this package while another thread
    imports torch's checkpoint modules for upstream's own results: CPython's per-module
    import locks then see a cycle and raise ``_DeadlockError``, the persistent checkpoint
    worker dies (megatron-core's own test_async_save at 8 ranks did). Pickle restores an
    instance dict without calling code of ours, so the manager imports exactly what it
    imports without the fixes.
    """
    object.__setattr__(result, CHECKSUM_ATTR, checksum)  # frozen dataclass: no setattr
    return result


class _Tap:
    """Forwards to the real stream; keeps the CRC-32 and count of every byte written."""

    __slots__ = ("raw", "crc", "count")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.crc = 0
        self.count = 0

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        written = self.raw.write(data)
        self.count += written
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def _nbytes(data: Any) -> int:
    if isinstance(data, io.BytesIO):
        return data.getbuffer().nbytes
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return BUFFER_LIMIT + 1  # unknown size: stream it rather than buffer it


def _write_all(stream: Any, view: memoryview) -> None:
    while view:
        view = view[stream.write(view):]


def checksummed_write_item(original: Callable[..., WriteResult]) -> Callable[..., WriteResult]:
    """Wrap torch's ``_write_item`` so its result carries the CRC-32 of the bytes written."""
    names = list(inspect.signature(original).parameters)
    stream_at, data_at = names.index("stream"), names.index("data")

    def argument(args: tuple, kwargs: dict, at: int, name: str) -> Any:
        return args[at] if at < len(args) else kwargs[name]

    def replaced(args: tuple, kwargs: dict, at: int, name: str, value: Any) -> tuple:
        if at < len(args):
            return (*args[:at], value, *args[at + 1:]), kwargs
        return args, {**kwargs, name: value}

    @functools.wraps(original)
    def _write_item(*args: Any, **kwargs: Any) -> WriteResult:
        stream = argument(args, kwargs, stream_at, "stream")
        if _nbytes(argument(args, kwargs, data_at, "data")) <= BUFFER_LIMIT:
            buffer = io.BytesIO()
            new_args, new_kwargs = replaced(args, kwargs, stream_at, "stream", buffer)
            result = original(*new_args, **new_kwargs)
            start = stream.tell()
            with buffer.getbuffer() as view:
                crc, written = zlib.crc32(view), view.nbytes
                _write_all(stream, view)
            stream.flush()  # as torch's own write does per item (megatron fsyncs the file)
            info = dataclasses.replace(result.storage_data,
                                       offset=start + result.storage_data.offset)
        else:
            tap = _Tap(stream)
            new_args, new_kwargs = replaced(args, kwargs, stream_at, "stream", tap)
            result = original(*new_args, **new_kwargs)
            info, crc, written = result.storage_data, tap.crc, tap.count
        return with_checksum(WriteResult(result.index, result.size_in_bytes, info),
                             crc if written == info.length else None)

    return _write_item


def record_of(results: Sequence[Sequence[WriteResult]],
              save_id: str | None) -> tuple[ChecksumRecord, int]:
    """The record of every rank's write results, and how many results had no checksum."""
    checksums: dict[tuple[str, int], tuple[int, int]] = {}
    missing = 0
    for rank_results in results:
        for result in rank_results:
            crc = getattr(result, CHECKSUM_ATTR, None)
            if crc is None:
                missing += 1
                continue
            info = result.storage_data
            checksums[(info.relative_path, info.offset)] = (info.length, crc)
    return ChecksumRecord(save_id, checksums), missing


def recording_finish(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``FileSystemWriterAsync.finish`` (coordinator only): record, then ``.metadata``."""

    @functools.wraps(original)
    def finish(self: Any, metadata: Any, results: Sequence[Sequence[WriteResult]]) -> None:
        directory = os.fspath(self.checkpoint_dir)
        if os.path.isdir(directory):
            record, missing = record_of(results, self.save_id)
            if record.checksums:
                write_record(directory, record)
            else:
                remove_record(directory)
            if missing:
                logger.warning(
                    "%d of %d saved items of %s have no checksum: they were written by a "
                    "process without the checksums patch; verify reports them as unchecked",
                    missing, missing + len(record.checksums), directory)
        else:
            logger.warning("checksums not recorded for %s: not a local directory", directory)
        return original(self, metadata, results)

    return finish


# -- what the patches rely on ------------------------------------------------------------------

def _write_item_problems() -> list[str]:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    problems = []
    params = inspect.signature(filesystem_async._write_item).parameters
    problems += [f"torch's _write_item has no parameter {name!r}"
                 for name in ("stream", "data") if name not in params]
    writer = inspect.unwrap(filesystem_async.FileSystemWriterAsync.write_preloaded_data)
    if "_write_item" not in writer.__code__.co_names:
        problems.append("FileSystemWriterAsync.write_preloaded_data no longer calls the "
                        "module's _write_item: checksums would never be taken")
    fields = {f.name for f in dataclasses.fields(WriteResult)}
    problems += [f"WriteResult has no field {name!r}"
                 for name in ("index", "size_in_bytes", "storage_data") if name not in fields]
    if not problems:
        sent = pickle.loads(pickle.dumps(with_checksum(WriteResult(None, 0, None), 1)))
        if getattr(sent, CHECKSUM_ATTR, None) != 1:
            problems.append("torch's WriteResult no longer carries an instance attribute "
                            "through pickle: checksums would be lost on the way")
    return problems


def _writer_problems() -> list[str]:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    with tempfile.TemporaryDirectory() as tmp:
        writer = FileSystemWriterAsync(tmp)
        problems = [f"a FileSystemWriterAsync has no attribute {a!r}"
                    for a in ("checkpoint_dir", "save_id") if not hasattr(writer, a)]
        if not problems and getattr(writer.storage_meta(), "save_id", None) != writer.save_id:
            problems.append("FileSystemWriterAsync.storage_meta() no longer records the "
                            "writer's save_id in .metadata")
    return problems


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="checksums.write_item",
        target=_FILESYSTEM_ASYNC,
        attr="_write_item",
        build=checksummed_write_item,
        reads=("torch.distributed.checkpoint.storage:WriteResult",
               f"{_WRITER}.write_preloaded_data"),
        probes=(_write_item_problems,),
        why="every saved item's bytes get a CRC-32, taken where megatron-core writes them",
    ),
    Patch(
        name="checksums.finish",
        target=_WRITER,
        attr="finish",
        build=recording_finish,
        reads=("torch.distributed.checkpoint.filesystem:_FileSystemWriter.storage_meta",),
        probes=(_writer_problems,),
        why="the checksums of a save are recorded next to its .metadata, from the same "
            "write results",
    ),
)
