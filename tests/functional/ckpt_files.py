"""Surgery on a saved torch_dist checkpoint's files, for tests of what verify and loads see."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata


def read_metadata(ckpt: Path) -> Metadata:
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)


def write_metadata(ckpt: Path, metadata: Metadata) -> None:
    """``.metadata`` as another writer would have written it (the record agrees)."""
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    rerecord(ckpt, ".metadata")


def rerecord(ckpt: str | os.PathLike, name: str) -> None:
    """Surgery on a whole file stands for a save that wrote it so: the checksum record, where
    it covers the file, takes the file's new bytes (a changed byte is then not the news)."""
    from megatron_ckpt_fixes.fixes.checksums.files import read_back
    from megatron_ckpt_fixes.fixes.checksums.record import read_record, write_record

    record = read_record(ckpt)
    if record is not None and name in record.whole_files:
        write_record(ckpt, record.with_files({name: read_back(os.path.join(ckpt, name))}))


def storage_entry(ckpt: Path, key: str, chunk: tuple[int, ...] | None = None):
    """The ``_StorageInfo`` of one saved item (a tensor chunk by its global offset)."""
    for index, info in read_metadata(ckpt).storage_data.items():
        offset = None if index.offset is None else tuple(index.offset)
        if index.fqn == key and (chunk is None or offset == chunk):
            return info
    raise KeyError((key, chunk))


def flip_tensor_byte(ckpt: Path, key: str, chunk: tuple[int, ...]) -> str:
    """Flip one byte inside the raw data of a saved tensor chunk: the item's bytes are a
    ``torch.save`` archive, so the chunk's values are read from it and their exact bytes
    located, and the flip lands in tensor data, not in a zip header (a load still succeeds).
    Returns the data file's name."""
    info = storage_entry(ckpt, key, chunk)
    path = ckpt / info.relative_path
    with open(path, "r+b") as f:
        f.seek(info.offset)
        item = f.read(info.length)
        values = torch.load(io.BytesIO(item), weights_only=True)
        at = item.find(values.contiguous().numpy().tobytes())
        assert at >= 0, f"the bytes of {key} are not stored raw in {path}"
        f.seek(info.offset + at + values.numel() * values.element_size() // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    return info.relative_path


def change_bytes(path: str | os.PathLike, old: bytes, new: bytes, after: bytes = b"") -> None:
    """Replace the first ``old`` (after the first ``after``) in the file by ``new``, in place:
    a changed byte a load would otherwise read as saved."""
    data = Path(path).read_bytes()
    at = data.index(old, data.index(after) if after else 0)
    Path(path).write_bytes(data[:at] + new + data[at + len(old):])
