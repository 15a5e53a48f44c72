"""Where a saved chunk's bytes lie in a DCP checkpoint, checked against the record itself.

torch DCP's ``FileSystemWriter`` (torch 2.13 and 2.14; megatron-core's writers call its
``_write_item``) stores each tensor chunk as one ``torch.save`` record, written back to back
with the others in a ``.distcp`` file at the byte range the checkpoint's ``.metadata`` names
(``storage_data[MetadataIndex(key, offsets)]``: file, offset, length). A ``torch.save``
record is a zip archive: a pickle that says how the tensor lies in its storage, and the
storage as one zip member, stored uncompressed. So rows ``[a, b)`` of a chunk are
``b - a`` rows of bytes at a known offset of the file, and a rank can read only those.

That is what the record is today; nothing here assumes it. :func:`locate` asks torch's own
reader (``torch.load(..., map_location="meta")`` reads the pickle and no data; the storage's
offset in the record comes back as ``_checkpoint_offset``) and checks its answer against the
zip's own directory (Python's ``zipfile``) and the member's local header: a stored,
unencrypted member of the storage's size starting exactly there (``torch.load`` reports that
offset for a compressed member too); the tensor contiguous, of the dtype and shape the
metadata gives, in this machine's byte order; no stream transform (DCP's compression
extensions). Anything else raises :class:`NotPlainRecord` with the
reason; the reader then reads that chunk through DCP (:mod:`.saved_chunks`). CRC-32s are not
read: ``torch.load`` does not check them either, and the checksums feature verifies bytes.
"""

from __future__ import annotations

import io
import math
import os
import struct
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError

#: A zip local file header (APPNOTE 4.3.7): signature, version, flags, method, time, date,
#: CRC-32, compressed size, size, name length, extra length.
_LOCAL_HEADER = struct.Struct("<4sHHHHHLLLHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"
_ENCRYPTED = 0x1


class NotPlainRecord(MegatronCkptFixesError, ValueError):
    """A saved chunk is not a plain ``torch.save`` record whose rows can be read by byte range."""


@dataclass(frozen=True)
class RecordLayout:
    """Rows ``[first, first + rows)`` of a key lie as raw bytes, ``row_bytes`` per row and
    contiguous, from ``data_offset`` of the file ``path``."""

    path: str
    data_offset: int
    first: int
    rows: int
    row_bytes: int


class FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable stream of its own
    (positioned reads: the descriptor has no shared position to disturb)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise OSError(f"seek to {base + pos}, before the start of the record")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [memoryview(buffer).cast("B")[:n]], self._offset + self._pos)
        self._pos += got
        return got


def _member_data(record: FileSlice, info: zipfile.ZipInfo) -> int:
    """Where a member's bytes start in the record, from its local header (whose extra field,
    torch's alignment padding, differs from the central directory's)."""
    record.seek(info.header_offset)
    header = record.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        raise NotPlainRecord(f"zip member {info.filename!r}: local header cut off")
    signature, _version, flags, method, _t, _d, _crc, _csize, _size, name_len, extra_len = \
        _LOCAL_HEADER.unpack(header)
    if signature != _LOCAL_SIGNATURE:
        raise NotPlainRecord(f"zip member {info.filename!r}: no local header at {info.header_offset}")
    if method != zipfile.ZIP_STORED or info.compress_type != zipfile.ZIP_STORED:
        raise NotPlainRecord(f"zip member {info.filename!r} is compressed (method {method})")
    if flags & _ENCRYPTED or info.flag_bits & _ENCRYPTED:
        raise NotPlainRecord(f"zip member {info.filename!r} is encrypted")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def _byte_order(record: FileSlice, members: Sequence[zipfile.ZipInfo]) -> str:
    """The record's byte order (``torch.save`` writes a ``byteorder`` member; without one,
    ``torch.load`` reads little-endian)."""
    marks = [i for i in members if i.filename.rsplit("/", 1)[-1] == "byteorder"]
    if not marks:
        return "little"
    record.seek(_member_data(record, marks[0]))
    return record.read(marks[0].file_size).decode("ascii", "replace")


def _storage_member(record: FileSlice, members: Sequence[zipfile.ZipInfo], at: int, nbytes: int) -> None:
    """The zip's own directory must have one stored member of ``nbytes`` starting at ``at``."""
    storages = [i for i in members if "/data/" in i.filename]
    found = [i for i in storages if _member_data(record, i) == at]
    if len(storages) != 1 or not found:
        raise NotPlainRecord(f"expected one storage member starting at byte {at} of the record, found "
                             f"{[i.filename for i in storages]}")
    info = found[0]
    if info.file_size != nbytes or info.compress_size != nbytes:
        raise NotPlainRecord(f"storage member {info.filename!r} holds {info.compress_size} bytes "
                             f"({info.file_size} uncompressed), the tensor's storage {nbytes}")


def locate(path: str, fd: int, storage_info: Any, dtype: torch.dtype, shape: Sequence[int],
           first: int) -> RecordLayout:
    """Where the chunk that DCP's ``storage_info`` (``_StorageInfo``: relative path, offset,
    length) points at keeps its rows, for a chunk of ``dtype`` and ``shape`` whose rows start
    at ``first``; raises :class:`NotPlainRecord` with the reason when its bytes cannot be
    read by range as they are."""
    descriptors = getattr(storage_info, "transform_descriptors", None)
    if descriptors:
        raise NotPlainRecord(f"stored through the stream transforms {list(descriptors)}")
    offset, length = int(storage_info.offset), int(storage_info.length)
    size = os.fstat(fd).st_size
    if offset < 0 or offset + length > size:
        raise NotPlainRecord(f"bytes [{offset}, {offset + length}) lie beyond the end of {path} ({size} bytes)")
    record = FileSlice(fd, offset, length)
    try:
        with zipfile.ZipFile(record) as archive:
            members = archive.infolist()
    except Exception as exc:  # noqa: BLE001 - any parse failure means "not a plain record"
        raise NotPlainRecord(f"not a zip record ({type(exc).__name__}: {exc})") from exc
    # Before torch.load: a meta load of a big-endian record byte-swaps a meta storage, which
    # crashes the process (a segmentation fault in torch 2.13.0 and 2.14.1).
    order = _byte_order(record, members)
    if order != sys.byteorder:
        raise NotPlainRecord(f"stored {order}-endian, this machine is {sys.byteorder}-endian")
    try:
        record.seek(0)
        tensor = torch.load(record, map_location="meta", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any parse failure means "not a plain record"
        raise NotPlainRecord(f"not a torch.save record ({type(exc).__name__}: {exc})") from exc
    if type(tensor) is not torch.Tensor:
        raise NotPlainRecord(f"holds a {type(tensor).__name__}, not a plain tensor")
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise NotPlainRecord(f"holds {tensor.dtype} {tuple(tensor.shape)}, the metadata says {dtype} {tuple(shape)}")
    if not tensor.is_contiguous():
        raise NotPlainRecord(f"holds a non-contiguous tensor (stride {tensor.stride()})")
    storage = tensor.untyped_storage()
    at = getattr(storage, "_checkpoint_offset", None)
    if not isinstance(at, int):
        raise NotPlainRecord("torch.load(map_location='meta') gives no offset for the storage (_checkpoint_offset)")
    _storage_member(record, members, at, storage.nbytes())
    row_bytes = math.prod(shape[1:]) * tensor.element_size()
    if row_bytes == 0:
        raise NotPlainRecord(f"its rows hold no bytes (shape {tuple(shape)})")
    start = at + tensor.storage_offset() * tensor.element_size()
    if start + row_bytes * shape[0] > min(at + storage.nbytes(), length):
        raise NotPlainRecord("the tensor reaches beyond its storage member")
    return RecordLayout(path, offset + start, first, int(shape[0]), row_bytes)
