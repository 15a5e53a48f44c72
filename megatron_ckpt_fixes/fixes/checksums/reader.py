"""Every load checks the bytes it reads against the checksums recorded when they were saved.

torch DCP's ``FileSystemReader.read_data`` (megatron-core's ``torch_dist`` loads go through
it, also through megatron-core's ``CachedMetadataFileSystemReader``) reads each storage
item's byte range and deserializes it (``torch.load`` for a tensor chunk, ``BytesIO`` for
an object); nothing compares those bytes with what was written, so a flipped byte loads as
a different weight. The read is the check's opportunity: it costs no extra read.

- ``set_up_storage_reader`` (once per load, with the checkpoint's ``.metadata``) reads the
  record (:mod:`.record`) through the reader's own file system; a record that names another
  save, or none, means the load goes on unchecked, with one info line on rank 0.
- ``_slice_file`` (once per item read) reads an item that has a checksum whole, into memory
  (one buffer per load, reused), hashes exactly that buffer with the record's algorithm and hands the *same* buffer to the
  deserializer: the bytes checked are the bytes loaded, whatever the file holds before or
  after (a re-read could see other bytes than the ones deserialized). A mismatch raises
  :class:`ItemChecksumError` naming the key, the file and the byte range; torch DCP turns it
  into its ``CheckpointException`` and megatron-core's load, with ``load_errors``, into one
  agreed error naming every failing rank. An item without a checksum takes upstream's path.

The price: one hash of each item (``xxh3_64``: GB/s per core), one in-memory copy of its
bytes, and a buffer as large as the largest item, for the length of the load
(``benchmarks/bench_verified_load.py``).
"""

from __future__ import annotations

import functools
import io
import logging
from dataclasses import dataclass
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.rehearsal import calls_during, load_tiny_checkpoint
from megatron_ckpt_fixes.core.agreement import rank_and_size
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError
from megatron_ckpt_fixes.fixes.checksums.algorithms import algorithm
from megatron_ckpt_fixes.fixes.checksums.record import (SIDECAR, ChecksumRecord, Item, judge,
    read_record, record_status)

logger = logging.getLogger(__name__)

_READER = "torch.distributed.checkpoint.filesystem:FileSystemReader"
#: The reader's instance attribute holding what this load checks (:class:`LoadChecks`).
_CHECKS_ATTR = "_mcf_checksums"
#: The reader's instance attribute holding the buffer items are read into.
_BUFFER_ATTR = "_mcf_read_buffer"


class ItemChecksumError(MegatronCkptFixesError, ValueError):
    """The bytes a load read for a saved item differ from the checksum recorded when it was
    saved (or the item is shorter than recorded). Raised by the rank that read them; the
    load's own machinery (torch DCP's ``CheckpointException``, megatron-core's load with
    ``load_errors``) makes it the error of every rank."""


@dataclass(frozen=True)
class LoadChecks:
    """What one load checks: the record of the checkpoint's save (None: nothing)."""

    record: ChecksumRecord | None
    status: str


def record_of_reader(reader: Any) -> ChecksumRecord | None:
    """The record of the checkpoint ``reader`` reads, through its own file system; None when
    it has none. Raises :class:`.record.RecordError` (unreadable, or not its own checksum).
    torch's local file system: :func:`.record.read_record` (parsed once per load)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    if type(reader.fs) is FileSystem:
        return read_record(reader.path)
    path = reader.fs.concat_path(reader.path, SIDECAR)
    if not reader.fs.exists(path):
        return None
    with reader.fs.create_stream(path, "rb") as stream:
        return ChecksumRecord.from_json(stream.read().decode())


def reading_record(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``FileSystemReader.set_up_storage_reader``: the load's record, read once."""

    @functools.wraps(original)
    def set_up_storage_reader(self: Any, metadata: Any, *args: Any, **kwargs: Any) -> None:
        original(self, metadata, *args, **kwargs)
        record = record_of_reader(self)
        status = record_status(record, metadata)
        if status != "verified" and rank_and_size()[0] == 0:
            logger.info("loading %s without checking its bytes: %s", self.path,
                        "no checksum record (saved without the checksums feature)"
                        if status == "absent" else
                        f"{SIDECAR} belongs to another save of this directory")
        self.__dict__[_CHECKS_ATTR] = LoadChecks(record if status == "verified" else None,
                                                 status)

    return set_up_storage_reader


def _item_of(reader: Any, sinfo: Any) -> Item:
    """The saved item ``.metadata`` puts at ``sinfo`` (for the error message)."""
    for index, info in reader.storage_data.items():
        if info.relative_path == sinfo.relative_path and info.offset == sinfo.offset:
            chunk = None if index.offset is None else tuple(int(o) for o in index.offset)
            return Item(index.fqn, chunk, sinfo.relative_path, sinfo.offset, sinfo.length)
    return Item("?", None, sinfo.relative_path, sinfo.offset, sinfo.length)


def checked_slice(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``FileSystemReader._slice_file``: an item with a checksum is read once, checked,
    and served from that buffer."""

    @functools.wraps(original)
    def _slice_file(self: Any, file: Any, sinfo: Any) -> Any:
        checks: LoadChecks | None = self.__dict__.get(_CHECKS_ATTR)
        record = None if checks is None else checks.record
        entry = None if record is None else record.checksums.get((sinfo.relative_path,
                                                                  sinfo.offset))
        if entry is None:
            return original(self, file, sinfo)
        data = _read_range(self, file, sinfo.offset, sinfo.length if entry[0] == sinfo.length
                           else 0)
        hasher = algorithm(record.algorithm).new()
        hasher.update(data)
        mismatch = judge(_item_of(self, sinfo), entry, hasher.value(), len(data),
                         record.algorithm, source="the bytes read hold")
        if mismatch is not None:
            raise ItemChecksumError(str(mismatch))
        return _BufferView(data)  # what is deserialized is what was hashed

    return _slice_file


def _read_range(reader: Any, file: Any, offset: int, length: int) -> memoryview:
    """``length`` bytes at ``offset`` (fewer at the end of the file), read into the reader's
    buffer: one buffer per load, grown to the largest item and reused (a fresh allocation per
    item would make the kernel zero every page of it again). Safe to reuse: torch.load copies
    a tensor's bytes into a storage of its own, and an object's bytes are copied out."""
    buffer: bytearray = reader.__dict__.get(_BUFFER_ATTR, bytearray())
    if len(buffer) < length:
        buffer = reader.__dict__[_BUFFER_ATTR] = bytearray(length)
    view, done = memoryview(buffer)[:length], 0
    file.seek(offset)
    while done < length:
        n = file.readinto(view[done:])
        if not n:
            break
        done += n
    return view[:done]


class _BufferView(io.RawIOBase):
    """A read-only, seekable file over bytes in memory, without copying them (``BytesIO``
    copies a buffer it is given)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._data[self._pos:self._pos + len(buffer)]
        memoryview(buffer).cast("B")[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def read(self, size: int = -1) -> bytes:
        end = len(self._data) if size is None or size < 0 else self._pos + size
        chunk = bytes(self._data[self._pos:end])
        self._pos += len(chunk)
        return chunk


def _read_data_problems() -> list[str]:
    """torch's reader must read every item through ``_slice_file`` (watched while it loads a
    checkpoint)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if calls_during(FileSystemReader, "_slice_file", load_tiny_checkpoint):
        return []
    return ["FileSystemReader.read_data did not read an item through _slice_file: the items "
            "it reads would go unchecked"]


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="checksums.read_setup",
        target=_READER,
        attr="set_up_storage_reader",
        build=reading_record,
        reads=(f"{_READER}.read_data",),
        why="a load reads the checksum record of the checkpoint it loads",
    ),
    Patch(
        name="checksums.read_item",
        target=_READER,
        attr="_slice_file",
        build=checked_slice,
        reads=(f"{_READER}.read_data",),
        probes=(_read_data_problems,),
        why="every item a load reads is checked against its recorded checksum, on the bytes "
            "it deserializes (no extra read); a mismatch fails the load",
    ),
)
