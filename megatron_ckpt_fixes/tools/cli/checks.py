"""Everything a load of a torch_dist checkpoint needs from its files, checked without loading.

Each check is a function returning :class:`Problem` s (empty: fine). :func:`verify` runs them
all; the order follows what a load touches:

1. ``.metadata`` can be read (:class:`Unverifiable` otherwise: nothing else can be checked);
2. every tensor's chunks tile its global shape: inside the shape, no overlap, full cover;
3. every chunk and object has a storage entry, pointing at a byte range inside an existing
   data file;
4. megatron-core's ``metadata.json`` (without it ``dist_checkpointing.load`` refuses the
   directory) names a backend the installed megatron-core loads, and the common state loads
   (``common.pt``, or the ``common_state`` object of megatron-core >= 0.19) — both through
   megatron-core's own functions, so the verdict is the installed version's;
5. every item's bytes, and the whole files ``common.pt``, ``.metadata`` and
   ``metadata.json``, match the checksums recorded at save time (this package's
   ``.checksums.json``), when there are any;
6. every file matches megatron-core's own integrity manifest (``integrity.json``, SHA-256
   per file, written by megatron-core >= 0.19 with ``verify_integrity=True``), when there is one.

Checks 1-3, 5 and 6 apply to any torch DCP checkpoint; 4 only to megatron-core's, which
a directory is when it has ``metadata.json`` or a common state (:func:`is_megatron`): a plain
torch DCP checkpoint needs no flag, and a megatron-core one that lost ``metadata.json`` still
gets the problem named.

A problem that lies in a data file (missing, cut short, bytes that differ from the record)
names the file and what is wrong with it, so that :mod:`.summary` can print one line per
damaged file instead of one per item (a truncated file of a real model breaks thousands).
Checks 5 and 6 read every byte; :mod:`.progress` shows how far they are.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from megatron_ckpt_fixes.fixes.checksums.files import METADATA, check_files
from megatron_ckpt_fixes.fixes.checksums.manifest import (
    MANIFEST,
    THREADS,
    Manifest,
    ManifestError,
    ManifestSummary,
    check_manifest,
)
from megatron_ckpt_fixes.fixes.checksums.record import (
    SIDECAR,
    ChecksumRecord,
    ChecksumSummary,
    Item,
    RecordError,
    check_items,
    items_of,
    read_record,
    record_status,
)
from megatron_ckpt_fixes.compat.detect import quiet
from megatron_ckpt_fixes.fixes.newer_checkpoint import newer_writer_reason
from megatron_ckpt_fixes.tools.cli.coverage import Coverage, coverage
from megatron_ckpt_fixes.tools.cli.locate import Unverifiable
from megatron_ckpt_fixes.tools.cli.progress import Advance, reading


#: Upstream causes can be pages long (torch.load's weights-only advice): one line is enough.
MAX_CAUSE = 240
#: Items checked against the record per call, by bytes: the progress moves at least this often.
BATCH_BYTES = 256 << 20
#: The key of megatron-core's common state inside ``.metadata`` (0.19 on; 0.16: ``common.pt``).
COMMON_STATE = "common_state"


@dataclass(frozen=True)
class Problem:
    """Something that stops the checkpoint from loading completely and correctly."""

    where: str  # a key, or the file the problem is in
    cause: str
    file: str | None = None  # the data file whose damage breaks this item
    damage: str | None = None  # what is wrong with that file (the same for its items)

    def __str__(self) -> str:
        return f"{self.where}: {self.cause}"


@dataclass
class Report:
    keys: int
    megatron: bool  # checked as megatron-core's (metadata.json, common state), or plain DCP
    problems: list[Problem] = field(default_factory=list)
    checksums: ChecksumSummary | None = None
    manifest: ManifestSummary | None = None
    file_items: dict[str, int] = field(default_factory=dict)  # data file -> items it holds
    coverage: Coverage | None = None  # what the byte checks covered (set by verify)

    def records(self) -> list[str]:
        """The kinds of record whose checksums were checked."""
        kinds = []
        if self.checksums is not None and self.checksums.status == "verified":
            kinds.append(f"{SIDECAR} ({self.checksums.algorithm} per item"
                         + (f" and per file, {self.checksums.files} file(s)"
                            if self.checksums.files else "") + ")")
        if self.manifest is not None:
            kinds.append(f"{MANIFEST} (megatron-core's, {self.manifest.algorithm} per file)")
        return kinds


def read_metadata(checkpoint_dir: str) -> Metadata:
    if not os.path.isdir(checkpoint_dir):
        raise Unverifiable(f"{checkpoint_dir}: no such directory")
    if not os.path.exists(os.path.join(checkpoint_dir, ".metadata")):
        raise Unverifiable(f"{checkpoint_dir}: no .metadata file: not a torch_dist checkpoint, "
                           "or its save did not finish")
    try:
        return FileSystemReader(checkpoint_dir).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same
        raise Unverifiable(f"{checkpoint_dir}/.metadata is unreadable: "
                           f"{type(exc).__name__}: {exc}"
                           f"{_metadata_checksum(checkpoint_dir)}") from exc


def _metadata_checksum(checkpoint_dir: str) -> str:
    """Why an unreadable ``.metadata`` is not what was saved, by the record (when it says)."""
    try:
        record = read_record(checkpoint_dir)
    except RecordError:
        return ""
    if record is None:
        return ""
    _, problems = check_files(checkpoint_dir, record)
    return f"; {problems[METADATA]}" if METADATA in problems else ""


def is_megatron(checkpoint_dir: str, metadata: Metadata) -> bool:
    """Whether the directory is megatron-core's: it has ``metadata.json``, or a common state
    (``common.pt``, or the ``common_state`` object of 0.19 on), which plain torch DCP never
    writes. A megatron-core checkpoint that lost ``metadata.json`` stays one."""
    return (os.path.exists(os.path.join(checkpoint_dir, "metadata.json"))
            or os.path.exists(os.path.join(checkpoint_dir, "common.pt"))
            or any(key.split("/")[0] == COMMON_STATE for key in metadata.state_dict_metadata))


@dataclass(frozen=True)
class DataFile:
    """A data file as ``.metadata`` needs it, and as it is on disk."""

    name: str
    size: int | None  # None: missing
    needs: int  # where its last entry ends
    items: int

    @property
    def short(self) -> bool:
        return self.size is None or self.size < self.needs

    @property
    def damage(self) -> str:
        if self.size is None:
            return "missing"
        return f"ends at {self.size} bytes, its entries need {self.needs}"


def data_files(metadata: Metadata, checkpoint_dir: str) -> dict[str, DataFile]:
    """Every data file ``.metadata`` names, with its size on disk: one ``stat`` per file,
    so ``inspect`` can flag a cut-short file without reading it."""
    needs: dict[str, int] = {}
    items: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        needs[name] = max(needs.get(name, 0), info.offset + info.length)
        items[name] = items.get(name, 0) + 1
    found = {}
    for name, end in needs.items():
        path = os.path.join(checkpoint_dir, name)
        found[name] = DataFile(name, os.path.getsize(path) if os.path.exists(path) else None,
                               end, items[name])
    return found


def _chunk(offset: Sequence[int] | None) -> str:
    return "" if offset is None else f" (chunk at {tuple(offset)})"


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in
               zip(a.offsets, a.sizes, b.offsets, b.sizes))


def tensor_problems(key: str, md: TensorStorageMetadata) -> list[Problem]:
    """The chunks of one tensor must lie inside its shape and cover it exactly once."""
    problems = []
    total = math.prod(md.size)
    covered = 0
    for chunk in md.chunks:
        if any(o < 0 or o + s > g for o, s, g in zip(chunk.offsets, chunk.sizes, md.size)):
            problems.append(Problem(key, f"chunk at {tuple(chunk.offsets)} of size "
                                         f"{tuple(chunk.sizes)} exceeds shape {tuple(md.size)}"))
        covered += math.prod(chunk.sizes)
    chunks = sorted(md.chunks, key=lambda c: tuple(c.offsets))
    for i, a in enumerate(chunks):
        for b in chunks[i + 1:]:
            if b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if _overlap(a, b):
                problems.append(Problem(key, f"chunks at {tuple(a.offsets)} and "
                                             f"{tuple(b.offsets)} overlap"))
    if covered != total and not problems:
        problems.append(Problem(key, f"chunks cover {covered} of {total} elements"))
    return problems


def storage_problems(metadata: Metadata, files: dict[str, DataFile]) -> list[Problem]:
    """Every chunk and object needs a storage entry inside an existing data file."""
    problems: list[Problem] = []
    storage = metadata.storage_data or {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            indices = [MetadataIndex(key, chunk.offsets) for chunk in md.chunks]
        else:
            assert isinstance(md, BytesStorageMetadata)
            indices = [MetadataIndex(key)]
        for index in indices:
            info = storage.get(index)
            if info is None:
                where = "" if index.offset is None else f" for chunk at {tuple(index.offset)}"
                problems.append(Problem(key, f"no storage entry{where}"))
                continue
            file = files[info.relative_path]
            if file.size is None:
                problems.append(Problem(key, f"data file {file.name} is missing"
                                             f"{_chunk(index.offset)}", file.name, file.damage))
            elif info.offset + info.length > file.size:
                problems.append(Problem(key, f"{file.name} ends at {file.size} bytes, its entry "
                                             f"needs {info.offset + info.length}"
                                             f"{_chunk(index.offset)}", file.name, file.damage))
    return problems


def megatron_problems(checkpoint_dir: str) -> list[Problem]:
    """megatron-core's own requirements: ``metadata.json`` and the common state, checked
    with the installed megatron-core's functions (the ones ``dist_checkpointing.load`` uses)."""
    with warnings.catch_warnings():  # megatron-core's import-time notes about TE/Apex
        warnings.simplefilter("ignore")
        from megatron.core.dist_checkpointing.core import maybe_load_config
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    with quiet("megatron.core"):
        try:
            config = maybe_load_config(checkpoint_dir)
        except Exception as exc:  # noqa: BLE001 - bad JSON or unknown fields alike
            return [Problem("metadata.json", f"unreadable: {type(exc).__name__}: {exc}")]
        if config is None:
            return [Problem("metadata.json", "missing: megatron-core's load refuses a "
                                             "directory without it (not a distributed "
                                             "checkpoint)")]
        if config.sharded_backend != "torch_dist":
            return [Problem("metadata.json", f"sharded backend {config.sharded_backend!r}: "
                                             "only torch_dist checkpoints are checked here")]
        try:
            load_common_state_dict(checkpoint_dir)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException included
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            newer = newer_writer_reason(checkpoint_dir)
            if newer is not None:
                return [Problem("common state", newer)]
            cause = " ".join(f"{type(exc).__name__}: {exc}".split())
            if len(cause) > MAX_CAUSE:
                cause = cause[:MAX_CAUSE - 3] + "..."
            if not os.path.exists(os.path.join(checkpoint_dir, "common.pt")):
                cause = f"common.pt is absent and megatron-core's load fails without it ({cause})"
            return [Problem("common state", f"cannot be loaded: {cause}")]
    return []


#: What a mismatch says about its file, by kind ("missing" and "short": storage_problems').
_DAMAGE = {"checksum": "bytes differ from the checksum record",
           "length": "the checksum record and .metadata disagree on item lengths"}


def _batches(items: Sequence[Item]) -> Iterator[list[Item]]:
    """Consecutive items of at most :data:`BATCH_BYTES` (at least one item each)."""
    batch: list[Item] = []
    size = 0
    for item in items:
        if batch and size + item.length > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item.length
    if batch:
        yield batch


def checksum_problems(metadata: Metadata, checkpoint_dir: str, record: ChecksumRecord | None,
                      advance: Advance = lambda n: None,
                      ) -> tuple[list[Problem], ChecksumSummary]:
    """Every item's bytes against the checksums recorded when it was saved; ``advance`` is
    told the bytes of each batch checked."""
    items = items_of(metadata)
    status = record_status(record, metadata)
    if status != "verified":
        return [], ChecksumSummary(status, len(items))
    assert record is not None
    mismatches, unrecorded = [], []
    for batch in _batches(items):
        found, missing = check_items(checkpoint_dir, batch, record)
        mismatches += found
        unrecorded += missing
        advance(sum(item.length for item in batch))
    problems = [Problem(m.item.key, f"{m.cause}, in {m.item.file} at bytes "
                                    f"{m.item.offset}..{m.item.offset + m.item.length}"
                                    f"{_chunk(m.item.chunk)}", m.item.file, _DAMAGE[m.kind])
                for m in mismatches
                if m.kind not in ("missing", "short")]  # storage_problems names those
    files, file_problems = check_files(checkpoint_dir, record)
    problems += [Problem("whole file", line) for line in file_problems.values()]
    return problems, ChecksumSummary(status, len(items), len(items) - len(unrecorded),
                                     len(unrecorded), len(mismatches), record.algorithm,
                                     files, len(file_problems))


@dataclass(frozen=True)
class Records:
    """The checkpoint's checksum record and megatron-core's manifest, each read once: the
    total to read is known before the reading starts. None: absent, or unreadable (then its
    ``*_error`` says why)."""

    checksums: ChecksumRecord | None
    checksums_error: Problem | None
    manifest: Manifest | None
    manifest_error: Problem | None

    @classmethod
    def read(cls, checkpoint_dir: str) -> Records:
        checksums = manifest = checksums_error = manifest_error = None
        try:
            checksums = read_record(checkpoint_dir)
        except RecordError as exc:
            checksums_error = Problem(SIDECAR, str(exc))
        try:
            manifest = Manifest.read(checkpoint_dir)
        except ManifestError as exc:
            manifest_error = Problem(MANIFEST, str(exc))
        return cls(checksums, checksums_error, manifest, manifest_error)

    def bytes_to_read(self, checkpoint_dir: str, metadata: Metadata) -> int:
        """What checks 5 and 6 read: every item of a record of this save, every manifest
        file."""
        total = 0
        if record_status(self.checksums, metadata) == "verified":
            total += sum(item.length for item in items_of(metadata))
        if self.manifest is not None:
            total += sum(_file_size(checkpoint_dir, name) for name in self.manifest.files)
        return total


def _file_size(checkpoint_dir: str, name: str) -> int:
    path = os.path.join(checkpoint_dir, name)
    return os.path.getsize(path) if os.path.isfile(path) else 0


def manifest_problems(checkpoint_dir: str, manifest: Manifest,
                      advance: Advance = lambda n: None,
                      ) -> tuple[list[Problem], ManifestSummary]:
    """Every file against megatron-core's integrity manifest, :data:`THREADS` files at a
    time (the threads ``check_manifest`` hashes on), ``advance`` told each group's bytes."""
    names = sorted(manifest.files)
    mismatches: list[tuple[str, str]] = []
    for start in range(0, len(names), THREADS):
        group = names[start:start + THREADS]
        found, _ = check_manifest(checkpoint_dir, Manifest(
            manifest.algorithm, {name: manifest.files[name] for name in group}))
        mismatches += found
        advance(sum(_file_size(checkpoint_dir, name) for name in group))
    return ([Problem(f"{MANIFEST}: {name}", cause) for name, cause in mismatches],
            ManifestSummary(manifest.algorithm, len(names), len(mismatches)))


def verify(checkpoint_dir: str, megatron: bool | None = None,
           progress: bool = False) -> Report:
    """Every reason the checkpoint would not load completely and correctly.

    Raises :class:`Unverifiable` when ``.metadata`` cannot be read. ``megatron=False`` checks
    a plain torch DCP checkpoint (no ``metadata.json``, no common state), ``True`` a
    megatron-core one; None tells them apart (:func:`is_megatron`). ``progress`` shows the
    bytes read on stderr (:mod:`.progress`).
    """
    metadata = read_metadata(checkpoint_dir)
    if megatron is None:
        megatron = is_megatron(checkpoint_dir, metadata)
    files = data_files(metadata, checkpoint_dir)
    report = Report(len(metadata.state_dict_metadata), megatron,
                    file_items={name: file.items for name, file in files.items()})
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            report.problems += tensor_problems(key, md)
    report.problems += storage_problems(metadata, files)
    if megatron:
        report.problems += megatron_problems(checkpoint_dir)
    records = Records.read(checkpoint_dir)
    report.problems += [p for p in (records.checksums_error, records.manifest_error) if p]
    total = records.bytes_to_read(checkpoint_dir, metadata)
    with reading(total, "verify", progress) as advance:
        if records.checksums_error is None:
            problems, report.checksums = checksum_problems(metadata, checkpoint_dir,
                                                           records.checksums, advance)
            report.problems += problems
        if records.manifest is not None:
            problems, report.manifest = manifest_problems(checkpoint_dir, records.manifest,
                                                          advance)
            report.problems += problems
    report.coverage = coverage(checkpoint_dir, metadata, records.checksums, records.manifest,
                               record_readable=records.checksums_error is None)
    return report
