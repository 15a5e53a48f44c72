"""The checksum record of one checkpoint: what is recorded, where it lives, how it is checked.

A torch_dist checkpoint's ``.metadata`` maps every saved item (a tensor chunk or an object) to
a byte range of a data file. The record adds the checksum of each such byte range, keyed by
file and offset, in a sidecar next to ``.metadata`` (:data:`SIDECAR`), and names its algorithm
(:mod:`.algorithms`). The checkpoint itself stays exactly what megatron-core and torch write
and read: any loader, with or without this package, loads it, and a checkpoint saved without
a record loads as before.

The record names the save it belongs to (``.metadata``'s ``storage_meta.save_id``, a new id
for every save), so a sidecar left behind by an earlier save of the same directory is never
used to judge another save's bytes.

It also holds the checksum of each whole file a load reads besides the items
(``whole_files``: ``common.pt``, ``.metadata``, ``metadata.json``; :mod:`.files`), and its own
checksum (``digest``, over its canonical form: the JSON with sorted keys and no ``digest``),
so a changed byte in the record is an error naming the record, never a false item mismatch
or a pass. A record without ``whole_files`` and ``digest`` (written before they existed)
still reads, its items checked as before; one with ``whole_files`` must carry its digest,
and a key the reader does not know is refused (a changed byte in a key name is no pass).

Everything here is pure file I/O (no process group, no megatron-core): ``verify`` and the
collective check before a load (:mod:`.load`) share it.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from megatron_ckpt_fixes.fixes.checksums.algorithms import (DEFAULT, algorithm, checksum_of_range,
    read_buffer)

#: The sidecar's file name, inside the checkpoint directory (hidden, like ``.metadata``).
SIDECAR = ".checksums.json"
FORMAT = "megatron-ckpt-fixes/checksums"
#: Version 2: any algorithm, hexadecimal values in a ``checksum`` column. Version 1 (read,
#: no longer written): CRC-32 only, integers in a ``crc32`` column.
VERSION = 2


#: The record's top-level keys (any other is a changed byte, or a newer writer's record).
_KEYS = frozenset({"format", "version", "algorithm", "save_id", "files", "whole_files",
                   "digest"})


class RecordError(ValueError):
    """The sidecar exists but cannot be read as a checksum record (or does not match its own
    checksum)."""


def canonical(doc: dict) -> bytes:
    """What the record's own checksum covers: the document without ``digest``, keys sorted,
    no spaces (the same bytes whatever order a writer put the keys in)."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _own_checksum(doc: dict, name: str) -> str:
    algo = algorithm(name)
    hasher = algo.new()
    hasher.update(canonical(doc))
    return algo.format(hasher.value())


def _check_own_checksum(doc: dict) -> None:
    unknown = set(doc) - _KEYS
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)}")
    recorded = doc.get("digest")
    if recorded is None:
        if "whole_files" in doc:
            raise ValueError("it holds file checksums but no checksum of its own")
        return  # written before records carried one
    found = _own_checksum(doc, doc.get("algorithm"))
    if recorded != found:
        raise ValueError(f"it does not match its own checksum (recorded {recorded}, its "
                         f"content hashes to {found}): it was changed after it was written")


def _columns_v1(doc: dict, columns: dict) -> list[int]:
    if doc.get("algorithm") != "crc32":
        raise ValueError("a version 1 record holds crc32 values only")
    return [int(c) for c in columns["crc32"]]


def _columns_v2(doc: dict, columns: dict) -> list[int]:
    return [int(c, 16) for c in columns["checksum"]]


_READERS = {1: _columns_v1, 2: _columns_v2}


@dataclass(frozen=True)
class ChecksumRecord:
    """The checksum of every byte range one save wrote: ``(file, offset) -> (length,
    checksum)``, all of one ``algorithm`` (a name in :data:`.algorithms.ALGORITHMS`)."""

    save_id: str | None
    checksums: dict[tuple[str, int], tuple[int, int]]
    algorithm: str = DEFAULT.name
    #: ``name -> (length, checksum)`` of each whole file covered (:mod:`.files`).
    whole_files: dict[str, tuple[int, int]] = field(default_factory=dict)

    def to_json(self) -> str:
        """Columns per file (offsets, lengths, checksums): a 100k-item record serializes in
        tens of milliseconds on the coordinator, inside the save's finalize. Written in its
        canonical form, its own checksum appended."""
        fmt = algorithm(self.algorithm).format
        files: dict[str, tuple[list[int], list[int], list[str]]] = {}
        for (file, offset), (length, value) in self.checksums.items():
            columns = files.setdefault(file, ([], [], []))
            columns[0].append(offset)
            columns[1].append(length)
            columns[2].append(fmt(value))
        doc = {"format": FORMAT, "version": VERSION, "algorithm": self.algorithm,
               "save_id": self.save_id,
               "files": {file: {"offset": o, "length": n, "checksum": c}
                         for file, (o, n, c) in sorted(files.items())},
               "whole_files": {name: {"length": n, "checksum": fmt(v)}
                               for name, (n, v) in sorted(self.whole_files.items())}}
        body = canonical(doc).decode()
        return f'{body[:-1]},"digest":"{_own_checksum(doc, self.algorithm)}"}}'

    def with_files(self, files: dict[str, tuple[int, int]]) -> ChecksumRecord:
        """This record, also covering the whole files ``name -> (length, checksum)``."""
        return dataclasses.replace(self, whole_files={**self.whole_files, **files})

    @classmethod
    def from_json(cls, text: str) -> ChecksumRecord:
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"not a record of {FORMAT}")
            read = _READERS.get(doc.get("version"))
            if read is None:
                raise ValueError(f"record version {doc.get('version')}, this package reads "
                                 f"{', '.join(map(str, _READERS))}")
            name = algorithm(doc.get("algorithm")).name
            _check_own_checksum(doc)
            whole_files = {file: (int(entry["length"]), int(entry["checksum"], 16))
                           for file, entry in doc.get("whole_files", {}).items()}
            checksums = {}
            for file, columns in doc["files"].items():
                offsets, lengths, values = columns["offset"], columns["length"], read(doc, columns)
                if not len(offsets) == len(lengths) == len(values):
                    raise ValueError(f"columns of {file} differ in length")
                checksums.update(((file, int(o)), (int(n), v))
                                 for o, n, v in zip(offsets, lengths, values))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RecordError(f"{SIDECAR} is unreadable: {exc}") from exc
        return cls(doc.get("save_id"), checksums, name, whole_files)


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


#: The last record read: ``(path, (inode, size, mtime)) -> record``. One load reads the
#: record for each file it checks (``metadata.json``, ``.metadata`` several times, the items):
#: a 100k-item record takes about 0.4 s to parse and check here, once. Every write replaces
#: the file (a new inode), and a change in place changes its mtime.
_last_read: dict[str, tuple[tuple[int, int, int], ChecksumRecord]] = {}


def read_record(checkpoint_dir: str | os.PathLike) -> ChecksumRecord | None:
    """The checkpoint's record; None when it has none. Raises :class:`RecordError`."""
    path = os.path.realpath(os.path.join(checkpoint_dir, SIDECAR))
    try:
        with open(path) as f:
            stat = os.fstat(f.fileno())
            stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            cached = _last_read.get(path)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            text = f.read()
    except FileNotFoundError:
        return None
    record = ChecksumRecord.from_json(text)
    _last_read.clear()
    _last_read[path] = (stamp, record)
    return record


def save_id_of(metadata: Metadata) -> str | None:
    storage_meta = getattr(metadata, "storage_meta", None)
    return getattr(storage_meta, "save_id", None)


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


def judge(item: Item, entry: tuple[int, int], found: int, read: int, algorithm_name: str,
          source: str = "the file holds") -> Mismatch | None:
    """Compare what was read of ``item`` (``read`` bytes hashing to ``found``) with its
    record ``entry`` (length, checksum of ``algorithm_name``); None when they match.
    ``source`` names where ``found`` comes from, for the message."""
    length, expected = entry
    if length != item.length:
        return Mismatch(item, f"the record says {length} bytes, .metadata {item.length}",
                        "length")
    if read != item.length:
        return Mismatch(item, f"{item.file} ends {item.length - read} bytes early", "short")
    if found != expected:
        algo = algorithm(algorithm_name)
        return Mismatch(item, f"checksum mismatch (recorded {algo.name} "
                              f"{algo.format(expected)}, {source} {algo.format(found)})")
    return None


def check_items(checkpoint_dir: str | os.PathLike, items: Iterable[Item],
                record: ChecksumRecord) -> tuple[list[Mismatch], list[Item]]:
    """Re-read each item's bytes and compare with the record.

    Returns the mismatches and the items the record has no checksum for.
    """
    algo = algorithm(record.algorithm)
    items = list(items)
    buffer = read_buffer(max((i.length for i in items), default=0))
    mismatches, unrecorded = [], []
    for item in items:
        entry = record.checksums.get((item.file, item.offset))
        if entry is None:
            unrecorded.append(item)
            continue
        path = os.path.join(checkpoint_dir, item.file)
        if entry[0] == item.length and not os.path.exists(path):
            mismatch: Mismatch | None = Mismatch(item, f"{item.file} is missing", "missing")
        elif entry[0] != item.length:
            mismatch = judge(item, entry, 0, 0, record.algorithm)
        else:
            found, read = checksum_of_range(path, item.offset, item.length, algo, buffer)
            mismatch = judge(item, entry, found, read, record.algorithm)
        if mismatch is not None:
            mismatches.append(mismatch)
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
    algorithm: str | None = None  # the record's, when it was read
    files: int = 0  # whole files checked (common.pt, .metadata, metadata.json: .files)
    files_mismatched: int = 0

    def __str__(self) -> str:
        if self.status == "absent":
            return f"absent ({SIDECAR} missing: saved without the checksums feature)"
        if self.status == "stale":
            return (f"not checked ({SIDECAR} belongs to another save of this directory, "
                    "not to its .metadata)")
        text = (f"{self.checked - self.mismatched} of {self.items} item(s) match their "
                f"{self.algorithm} checksums")
        if self.mismatched:
            text += f", {self.mismatched} do not"
        if self.unrecorded:
            text += f"; {self.unrecorded} have no checksum"
        if self.files:
            text += (f"; {self.files - self.files_mismatched} of {self.files} whole file(s) "
                     "(common state, metadata) match")
            if self.files_mismatched:
                text += f", {self.files_mismatched} do not"
        return text


def record_status(record: ChecksumRecord | None, metadata: Metadata) -> str:
    if record is None:
        return "absent"
    return "verified" if record.save_id == save_id_of(metadata) else "stale"


def share(items: Sequence[Item], rank: int, world: int) -> list[Item]:
    """This rank's part of the items for a collective check: balanced by bytes (largest
    first, each to the least loaded rank), the same split on every rank; in file order, so
    each rank reads its files front to back."""
    loads = [(0, r) for r in range(world)]  # a heap of (bytes assigned, rank)
    mine = []
    for item in sorted(items, key=lambda i: (-i.length, i.file, i.offset)):
        load, owner = heapq.heappop(loads)
        heapq.heappush(loads, (load + item.length, owner))
        if owner == rank:
            mine.append(item)
    return sorted(mine, key=lambda i: (i.file, i.offset))
