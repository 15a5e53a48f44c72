"""The checksum record of one checkpoint: what is recorded, where it lives, how it is checked.

A torch_dist checkpoint's ``.metadata`` maps every saved item (a tensor chunk or an object) to
a byte range of a data file. The record adds the CRC-32 of each such byte range, keyed by file
and offset, in a sidecar next to ``.metadata`` (:data:`SIDECAR`). The checkpoint itself stays
exactly what megatron-core and torch write and read: any loader, with or without this
package, loads it, and a checkpoint saved without a record loads as before.

The record names the save it belongs to (``.metadata``'s ``storage_meta.save_id``, a new id
for every save), so a sidecar left behind by an earlier save of the same directory is never
used to judge another save's bytes.

Everything here is pure file I/O (no process group, no megatron-core): ``verify`` and the
collective check before a load (:mod:`.load`) share it.
"""

from __future__ import annotations

import heapq
import json
import os
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

#: The sidecar's file name, inside the checkpoint directory (hidden, like ``.metadata``).
SIDECAR = ".checksums.json"
FORMAT = "megatron-ckpt-fixes/checksums"
VERSION = 1
ALGORITHM = "crc32"
#: Bytes read at a time when checking a range, so a multi-GB item never sits in memory whole.
READ_CHUNK = 64 << 20


class RecordError(ValueError):
    """The sidecar exists but cannot be read as a checksum record."""


@dataclass(frozen=True)
class ChecksumRecord:
    """The CRC-32 of every byte range one save wrote: ``(file, offset) -> (length, crc32)``."""

    save_id: str | None
    checksums: dict[tuple[str, int], tuple[int, int]]

    def to_json(self) -> str:
        """Columns per file (offsets, lengths, CRC-32s): a 100k-item record serializes in
        tens of milliseconds on the coordinator, inside the save's finalize."""
        files: dict[str, tuple[list[int], list[int], list[int]]] = {}
        for (file, offset), (length, crc) in self.checksums.items():
            columns = files.setdefault(file, ([], [], []))
            columns[0].append(offset)
            columns[1].append(length)
            columns[2].append(crc)
        return json.dumps({"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM,
                           "save_id": self.save_id,
                           "files": {file: {"offset": o, "length": n, "crc32": c}
                                     for file, (o, n, c) in sorted(files.items())}},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ChecksumRecord:
        try:
            doc = json.loads(text)
            if doc.get("format") != FORMAT or doc.get("algorithm") != ALGORITHM:
                raise ValueError(f"not a {ALGORITHM} record of {FORMAT}")
            if doc.get("version") != VERSION:
                raise ValueError(f"record version {doc.get('version')}, this package reads "
                                 f"{VERSION}")
            checksums = {}
            for file, columns in doc["files"].items():
                offsets, lengths, crcs = columns["offset"], columns["length"], columns["crc32"]
                if not len(offsets) == len(lengths) == len(crcs):
                    raise ValueError(f"columns of {file} differ in length")
                checksums.update(((file, int(o)), (int(n), int(c)))
                                 for o, n, c in zip(offsets, lengths, crcs))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RecordError(f"{SIDECAR} is unreadable: {exc}") from exc
        return cls(doc.get("save_id"), checksums)


def write_record(checkpoint_dir: str | os.PathLike, record: ChecksumRecord) -> None:
    """Write the sidecar atomically (a reader sees the old record or the new one, whole)."""
    path = os.path.join(checkpoint_dir, SIDECAR)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(record.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_record(checkpoint_dir: str | os.PathLike) -> None:
    """Drop a sidecar an earlier save left (this save recorded nothing)."""
    try:
        os.remove(os.path.join(checkpoint_dir, SIDECAR))
    except FileNotFoundError:
        pass


def read_record(checkpoint_dir: str | os.PathLike) -> ChecksumRecord | None:
    """The checkpoint's record; None when it has none. Raises :class:`RecordError`."""
    try:
        with open(os.path.join(checkpoint_dir, SIDECAR)) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    return ChecksumRecord.from_json(text)


def save_id_of(metadata: Metadata) -> str | None:
    storage_meta = getattr(metadata, "storage_meta", None)
    return getattr(storage_meta, "save_id", None)


def crc32_of_range(path: str, offset: int, length: int) -> tuple[int, int]:
    """``(crc32, bytes read)`` of ``length`` bytes at ``offset`` (fewer if the file is short)."""
    crc, done = 0, 0
    with open(path, "rb") as f:
        f.seek(offset)
        while done < length:
            chunk = f.read(min(READ_CHUNK, length - done))
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            done += len(chunk)
    return crc, done


@dataclass(frozen=True)
class Item:
    """One saved item where ``.metadata`` puts it."""

    key: str
    chunk: tuple[int, ...] | None  # global offset of a tensor chunk; None for an object
    file: str
    offset: int
    length: int

    def __str__(self) -> str:
        what = f"{self.key!r}" if self.chunk is None else f"{self.key!r} chunk at {self.chunk}"
        return f"{what} in {self.file} (bytes {self.offset}..{self.offset + self.length})"


def items_of(metadata: Metadata) -> list[Item]:
    """Every storage entry of ``.metadata``, in file order (the same list on every rank)."""
    items = []
    for index, info in (metadata.storage_data or {}).items():
        assert isinstance(index, MetadataIndex)
        chunk = None if index.offset is None else tuple(int(o) for o in index.offset)
        items.append(Item(index.fqn, chunk, info.relative_path, info.offset, info.length))
    return sorted(items, key=lambda i: (i.file, i.offset, i.key))


@dataclass(frozen=True)
class Mismatch:
    """An item whose bytes do not match its record. ``kind``: ``"checksum"``, ``"length"``
    (record and ``.metadata`` disagree), ``"missing"`` or ``"short"`` (the file)."""

    item: Item
    cause: str
    kind: str = "checksum"

    def __str__(self) -> str:
        return f"{self.item}: {self.cause}"


def check_items(checkpoint_dir: str | os.PathLike, items: Iterable[Item],
                record: ChecksumRecord) -> tuple[list[Mismatch], list[Item]]:
    """Re-read each item's bytes and compare with the record.

    Returns the mismatches and the items the record has no checksum for.
    """
    mismatches, unrecorded = [], []
    for item in items:
        entry = record.checksums.get((item.file, item.offset))
        if entry is None:
            unrecorded.append(item)
            continue
        length, expected = entry
        if length != item.length:
            mismatches.append(Mismatch(item, f"the record says {length} bytes, .metadata "
                                             f"{item.length}", "length"))
            continue
        path = os.path.join(checkpoint_dir, item.file)
        if not os.path.exists(path):
            mismatches.append(Mismatch(item, f"{item.file} is missing", "missing"))
            continue
        found, read = crc32_of_range(path, item.offset, item.length)
        if read != item.length:
            mismatches.append(Mismatch(item, f"{item.file} ends {item.length - read} bytes "
                                             "early", "short"))
        elif found != expected:
            mismatches.append(Mismatch(item, f"checksum mismatch (recorded crc32 "
                                             f"{expected:08x}, the file holds {found:08x})"))
    return mismatches, unrecorded


@dataclass(frozen=True)
class ChecksumSummary:
    """What checking a checkpoint's checksums found (on this rank, for a collective check).

    ``status``: ``"verified"`` (every item with a checksum matched), ``"absent"`` (saved
    without checksums) or ``"stale"`` (the sidecar belongs to another save of the directory).
    """

    status: str
    items: int
    checked: int = 0
    unrecorded: int = 0
    mismatched: int = 0

    def __str__(self) -> str:
        if self.status == "absent":
            return f"absent ({SIDECAR} missing: saved without the checksums feature)"
        if self.status == "stale":
            return (f"not checked ({SIDECAR} belongs to another save of this directory, "
                    "not to its .metadata)")
        text = f"{self.checked - self.mismatched} of {self.items} item(s) match their checksums"
        if self.mismatched:
            text += f", {self.mismatched} do not"
        if self.unrecorded:
            text += f"; {self.unrecorded} have no checksum"
        return text


def record_status(record: ChecksumRecord | None, metadata: Metadata) -> str:
    if record is None:
        return "absent"
    return "verified" if record.save_id == save_id_of(metadata) else "stale"


def share(items: Sequence[Item], rank: int, world: int) -> list[Item]:
    """This rank's part of the items for a collective check: balanced by bytes (largest
    first, each to the least loaded rank), the same split on every rank."""
    loads = [(0, r) for r in range(world)]  # a heap of (bytes assigned, rank)
    mine = []
    for item in sorted(items, key=lambda i: (-i.length, i.file, i.offset)):
        load, owner = heapq.heappop(loads)
        heapq.heappush(loads, (load + item.length, owner))
        if owner == rank:
            mine.append(item)
    return mine
