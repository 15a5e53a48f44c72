"""Test-only: rewrite one saved chunk's record of a real DCP checkpoint, as another writer (or
damage) would leave it, and point the checkpoint's ``.metadata`` at the new record.

Used by tests/unit/test_saved_chunks.py (records that are not plain ``torch.save`` records)
and tests/functional/test_reshard_mch.py (a reshard through such a record).
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from ckpt_files import rerecord

#: ``(member name, member bytes) -> (new bytes, zip compression)`` for each member of a record.
Change = Callable[[str, bytes], tuple[bytes, int]]


def storage(ckpt: str, key: str, first_row: int = 0) -> tuple[object, object]:
    """The checkpoint's metadata and the storage index of ``key``'s chunk starting at ``first_row``."""
    metadata = dcp.FileSystemReader(ckpt).read_metadata()
    index = next(i for i in metadata.storage_data if i.fqn == key and int(i.offset[0]) == first_row)
    return metadata, index


def write_metadata(ckpt: str, metadata: object) -> None:
    """``.metadata`` as another writer would have written it (the record agrees)."""
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    rerecord(ckpt, ".metadata")


def rewrite_record(ckpt: str, key: str, change: Change, first_row: int = 0) -> None:
    """Rebuild the record of ``key``'s chunk at ``first_row`` with Python's zipfile,
    ``change`` applied to each member, append it to its file and point the metadata at it."""
    metadata, index = storage(ckpt, key, first_row)
    info = metadata.storage_data[index]
    path = os.path.join(ckpt, info.relative_path)
    with open(path, "rb") as f:
        f.seek(info.offset)
        record = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
    rebuilt = io.BytesIO()
    with zipfile.ZipFile(rebuilt, "w") as out:
        for member in record.infolist():
            data, how = change(member.filename, record.read(member))
            out.writestr(member.filename, data, compress_type=how)
    with open(path, "ab") as f:
        offset = f.seek(0, os.SEEK_END)
        f.write(rebuilt.getvalue())
    info.offset, info.length = offset, len(rebuilt.getvalue())
    write_metadata(ckpt, metadata)


def deflated(name: str, data: bytes) -> tuple[bytes, int]:
    """The storage member compressed (``torch.load`` reads it; its bytes are not the tensor's)."""
    return data, zipfile.ZIP_DEFLATED if "/data/" in name else zipfile.ZIP_STORED


def big_endian(name: str, data: bytes) -> tuple[bytes, int]:
    """A float32 record written big-endian (``torch.load`` swaps it back)."""
    if name.endswith("/byteorder"):
        return b"big", zipfile.ZIP_STORED
    if "/data/" in name:
        return torch.frombuffer(bytearray(data), dtype=torch.float32).numpy().byteswap().tobytes(), zipfile.ZIP_STORED
    return data, zipfile.ZIP_STORED
