"""Checksums recorded at save time, on megatron-core's torch_dist writer path.

Every ``dist_checkpointing.save`` with the torch_dist format goes through
``FileSystemWriterAsync``: its ``write_preloaded_data`` writes one bucket file, serializing
each item with torch's ``_write_item``, then fsyncs the file; it runs in a writer thread
(megatron-core 0.19; 0.16 with ``writer_threads``) or a forked process (plain 0.16),
possibly inside megatron-core's async worker.
The bytes exist only there, so that is where the checksum is taken (:mod:`.algorithms` says
which, :mod:`.hashing` how):

- ``_write_item`` (as ``filesystem_async`` calls it) checksums exactly the bytes the item puts
  into the file. Small items are serialized into memory first and hashed in one call (a
  Python tap on ``torch.save``'s ~40 small writes per item would cost more than writing a
  small tensor); larger ones pass through a tap that hashes each piece as it is written
  (:mod:`.hashing`), so no large item is copied or read twice. The checksum is in the
  item's ``WriteResult`` when ``_write_item`` returns, before the results leave the writer.
- megatron-core already gathers every rank's write results on the coordinator, which builds
  ``.metadata`` from them in ``finish``: the patched ``finish`` writes the record
  (:mod:`.record`) from the same results right after ``.metadata``, with the checksum of
  ``.metadata`` as written and of the ``common.pt`` this save wrote (:mod:`.file_writer`),
  so the two describe the same save by construction and no extra collective is needed.

torch.save also computes a CRC-32 of every record it writes (about half of the writer's CPU
time here: ``python benchmarks/bench_realistic_save.py``), which nothing ever checks:
``torch.load`` and megatron-core read records without it. The item's checksum replaces it: a
record this writer serializes *and* checksums is written without torch's CRC-32 (its zip
entries carry 0; zip tools report them as bad CRCs, torch and every megatron-core release load
them bitwise). ``torch.serialization.set_crc32_options`` is process-wide, so the switch is
scoped instead: ``get_crc32_options`` (which torch asks when it opens a record) answers False
only to the thread that is inside this writer's ``_write_item`` for an item whose checksum it
will record; every other thread, and every ``torch.save`` outside the writer, keeps the
user's setting. That holds wherever the writer runs: the trainer's thread (a synchronous
save), a forked writer process or its threads, the persistent worker. For tooling that checks
zip CRCs, :data:`KEEP_CRC32_ENV` set (``1``) when ``install()`` runs leaves torch's CRC-32 in
every record (the patch is not applied, ``installed()`` says why) at the cost of that CPU time
(``python benchmarks/bench_torch_crc32.py``).

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
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.storage import WriteResult

from megatron_ckpt_fixes.core.patching import Declared, Layer, Patch
from megatron_ckpt_fixes.activation import switched_on
from megatron_ckpt_fixes.core.entry_points import WRITE_ITEM, WRITER_FINISH
from megatron_ckpt_fixes.core.rehearsal import calls_during, torch_save_of_a_tensor
from megatron_ckpt_fixes.fixes.checksums.algorithms import DEFAULT
from megatron_ckpt_fixes.fixes.checksums.file_writer import files_at_finish
from megatron_ckpt_fixes.fixes.checksums.hashing import ItemTap, checksum_of
from megatron_ckpt_fixes.fixes.checksums.record import ChecksumRecord, remove_record, write_record

logger = logging.getLogger(__name__)

_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_WRITER = f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync"

#: Items up to this many bytes are serialized into memory and hashed in one call.
BUFFER_LIMIT = 64 << 10
#: ``1`` (or ``on``, ``yes``) when ``install()`` runs: the data files keep torch's zip CRC-32.
KEEP_CRC32_ENV = "MEGATRON_CKPT_FIXES_KEEP_CRC32"


#: Instance attribute of upstream's ``WriteResult`` that carries the item's checksum, as
#: ``(algorithm name, value)`` (builtins only), or None when none was taken.
CHECKSUM_ATTR = "checksum"


def with_checksum(result: WriteResult, checksum: tuple[str, int] | None) -> WriteResult:
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


def _nbytes(data: Any) -> int:
    if isinstance(data, io.BytesIO):
        return data.getbuffer().nbytes
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return BUFFER_LIMIT + 1  # unknown size: stream it rather than buffer it


def _write_all(stream: Any, view: memoryview) -> None:
    while view:
        view = view[stream.write(view):]


_record = threading.local()


def in_checksummed_record() -> bool:
    """Whether this thread is serializing a record whose checksum the writer records (torch's
    CRC-32 is off there)."""
    return getattr(_record, "checksummed", False)


@contextmanager
def _without_torch_crc32(transforms: Any) -> Iterator[None]:
    """torch's CRC-32 off for the records this thread serializes in the block, unless a
    stream transform (compression, ...) puts the bytes somewhere the checksum cannot vouch
    for."""
    if getattr(transforms, "extensions", ()):
        yield
        return
    outer = in_checksummed_record()
    _record.checksummed = True
    try:
        yield
    finally:
        _record.checksummed = outer


def crc32_unless_checksummed(original: Callable[[], bool]) -> Callable[[], bool]:
    """Wrap ``torch.serialization.get_crc32_options``: False inside this writer's checksummed
    records (this thread only), the user's setting everywhere else."""

    @functools.wraps(original)
    def get_crc32_options() -> bool:
        return False if in_checksummed_record() else original()

    return get_crc32_options


def crc32_kept() -> str | None:
    """Why torch's CRC-32 stays in the writer's records (the user asked), or None."""
    if switched_on(os.environ.get(KEEP_CRC32_ENV)):
        return f"{KEEP_CRC32_ENV} is set: the data files keep torch's zip CRC-32"
    return None


def checksummed_write_item(original: Callable[..., WriteResult]) -> Callable[..., WriteResult]:
    """Wrap torch's ``_write_item`` so its result carries the checksum of the bytes written
    (taken as the bytes pass)."""
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
        data = argument(args, kwargs, data_at, "data")
        transforms = (argument(args, kwargs, names.index("transforms"), "transforms")
                      if "transforms" in names else None)
        if _nbytes(data) <= BUFFER_LIMIT:
            buffer = io.BytesIO()
            new_args, new_kwargs = replaced(args, kwargs, stream_at, "stream", buffer)
            with _without_torch_crc32(transforms):
                result = original(*new_args, **new_kwargs)
            start = stream.tell()
            with buffer.getbuffer() as view:
                checksum, written = checksum_of(view), view.nbytes
                _write_all(stream, view)
            stream.flush()  # as torch's own write does per item (megatron fsyncs the file)
            info = dataclasses.replace(result.storage_data,
                                       offset=start + result.storage_data.offset)
            return with_checksum(WriteResult(result.index, result.size_in_bytes, info),
                                 (DEFAULT.name, checksum) if written == info.length else None)
        tap = ItemTap(stream)
        new_args, new_kwargs = replaced(args, kwargs, stream_at, "stream", tap)
        with _without_torch_crc32(transforms):
            result = original(*new_args, **new_kwargs)
        info = result.storage_data
        # bytes that went elsewhere (a transform): nothing to vouch for
        checksum = (DEFAULT.name, tap.hasher.value()) if tap.count == info.length else None
        return with_checksum(WriteResult(result.index, result.size_in_bytes, info), checksum)

    return _write_item


def record_of(results: Sequence[Sequence[WriteResult]],
              save_id: str | None) -> tuple[ChecksumRecord, int]:
    """The record of every rank's write results, and how many results had no checksum (of
    the algorithm this process records)."""
    checksums: dict[tuple[str, int], tuple[int, int]] = {}
    missing = 0
    for rank_results in results:
        for result in rank_results:
            checksum = getattr(result, CHECKSUM_ATTR, None)
            if checksum is None or checksum[0] != DEFAULT.name:
                missing += 1
                continue
            info = result.storage_data
            checksums[(info.relative_path, info.offset)] = (info.length, checksum[1])
    return ChecksumRecord(save_id, checksums, DEFAULT.name), missing


def recording_finish(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``FileSystemWriterAsync.finish`` (coordinator only): ``.metadata``, then the
    record (which covers ``.metadata`` as written)."""

    @functools.wraps(original)
    def finish(self: Any, metadata: Any, results: Sequence[Sequence[WriteResult]]) -> None:
        directory = os.fspath(self.checkpoint_dir)
        local = os.path.isdir(directory)
        if local:
            remove_record(directory)  # no reader judges the new .metadata by an old record
        original(self, metadata, results)
        if not local:
            logger.warning("checksums not recorded for %s: not a local directory", directory)
            return
        record, missing = record_of(results, self.save_id)
        if record.checksums:
            write_record(directory, record.with_files(files_at_finish(directory)))
        if missing:
            logger.warning(
                "%d of %d saved items of %s have no checksum: they were written by a "
                "process without the checksums patch; verify reports them as unchecked",
                missing, missing + len(record.checksums), directory)

    return finish


# -- what the patches rely on ------------------------------------------------------------------

def _crc32_problems() -> list[str]:
    """torch must ask ``torch.serialization.get_crc32_options`` when it opens a record for
    writing (watched while it saves a tensor)."""
    import torch.serialization as serialization

    if calls_during(serialization, "get_crc32_options", torch_save_of_a_tensor):
        return []
    return ["torch.save did not ask torch.serialization.get_crc32_options: the writer's "
            "records would keep torch's CRC-32"]


def _write_item_problems() -> list[str]:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    problems = []
    params = inspect.signature(filesystem_async._write_item).parameters
    problems += [f"torch's _write_item has no parameter {name!r}"
                 for name in ("stream", "data") if name not in params]
    fields = {f.name for f in dataclasses.fields(WriteResult)}
    problems += [f"WriteResult has no field {name!r}"
                 for name in ("index", "size_in_bytes", "storage_data") if name not in fields]
    if not problems:
        checksum = (DEFAULT.name, 1)
        sent = pickle.loads(pickle.dumps(with_checksum(WriteResult(None, 0, None), checksum)))
        if getattr(sent, CHECKSUM_ATTR, None) != checksum:
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


PATCHES: tuple[Declared, ...] = (
    Layer(
        name="checksums.write_item",
        entry=WRITE_ITEM,
        build=checksummed_write_item,
        reads=("torch.distributed.checkpoint.storage:WriteResult",
               f"{_WRITER}.write_preloaded_data"),
        probes=(_write_item_problems,),
        why="every saved item's bytes get a checksum (xxh3_64), taken where megatron-core "
            "writes them",
    ),
    Patch(
        name="checksums.torch_crc32",
        target="torch.serialization",
        attr="get_crc32_options",
        build=crc32_unless_checksummed,
        probes=(_crc32_problems,),
        not_needed=crc32_kept,
        why="the records the writer checksums skip torch's unchecked CRC-32 (this thread "
            "only; every other torch.save keeps the user's setting)",
    ),
    Layer(
        name="checksums.finish",
        entry=WRITER_FINISH,
        build=recording_finish,
        reads=("torch.distributed.checkpoint.filesystem:_FileSystemWriter.storage_meta",),
        probes=(_writer_problems,),
        why="the checksums of a save are recorded next to its .metadata, from the same "
            "write results",
    ),
)
