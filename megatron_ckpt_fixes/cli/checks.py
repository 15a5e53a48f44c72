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
5. every item's bytes match the checksums recorded at save time (this package's
   ``.checksums.json``), when there are any;
6. every file matches megatron-core's own integrity manifest (``integrity.json``, SHA-256
   per file, written by megatron-core >= 0.19 with ``verify_integrity=True``), when there is one.

Checks 1-3, 5 and 6 apply to any torch DCP checkpoint; 4 only to megatron-core's.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..checksums.manifest import (
    MANIFEST,
    Manifest,
    ManifestError,
    ManifestSummary,
    check_manifest,
)
from ..checksums.record import (
    SIDECAR,
    ChecksumSummary,
    RecordError,
    check_items,
    items_of,
    read_record,
    record_status,
)
from ..compat.detect import quiet
from ..newer_checkpoint import newer_writer_reason
from .locate import Unverifiable


#: Upstream causes can be pages long (torch.load's weights-only advice): one line is enough.
MAX_CAUSE = 240


@dataclass(frozen=True)
class Problem:
    """Something that stops the checkpoint from loading completely and correctly."""

    where: str  # a key, or the file the problem is in
    cause: str

    def __str__(self) -> str:
        return f"{self.where}: {self.cause}"


@dataclass
class Report:
    keys: int
    problems: list[Problem] = field(default_factory=list)
    checksums: ChecksumSummary | None = None
    manifest: ManifestSummary | None = None

    def records(self) -> list[str]:
        """The kinds of record whose checksums were checked."""
        kinds = []
        if self.checksums is not None and self.checksums.status == "verified":
            kinds.append(f"{SIDECAR} ({self.checksums.algorithm} per item)")
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
                           f"{type(exc).__name__}: {exc}") from exc


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


def storage_problems(metadata: Metadata, checkpoint_dir: str) -> list[Problem]:
    """Every chunk and object needs a storage entry inside an existing data file."""
    problems: list[Problem] = []
    storage = metadata.storage_data or {}
    sizes: dict[str, int | None] = {}
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
            if info.relative_path not in sizes:
                path = os.path.join(checkpoint_dir, info.relative_path)
                sizes[info.relative_path] = os.path.getsize(path) if os.path.exists(path) else None
            size = sizes[info.relative_path]
            if size is None:
                problems.append(Problem(key, f"data file {info.relative_path} is missing"))
            elif info.offset + info.length > size:
                problems.append(Problem(key, f"{info.relative_path} ends at {size} bytes, "
                                             f"its entry needs {info.offset + info.length}"))
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


def checksum_problems(metadata: Metadata,
                      checkpoint_dir: str) -> tuple[list[Problem], ChecksumSummary | None]:
    """Every item's bytes against the checksums recorded when it was saved."""
    try:
        record = read_record(checkpoint_dir)
    except RecordError as exc:
        return [Problem(SIDECAR, str(exc))], None
    items = items_of(metadata)
    status = record_status(record, metadata)
    if status != "verified":
        return [], ChecksumSummary(status, len(items))
    assert record is not None
    mismatches, unrecorded = check_items(checkpoint_dir, items, record)
    problems = [Problem(m.item.key, f"{m.cause}, in {m.item.file} at bytes "
                                    f"{m.item.offset}..{m.item.offset + m.item.length}"
                                    + ("" if m.item.chunk is None else
                                       f" (chunk at {m.item.chunk})"))
                for m in mismatches
                if m.kind not in ("missing", "short")]  # storage_problems names those
    return problems, ChecksumSummary(status, len(items), len(items) - len(unrecorded),
                                     len(unrecorded), len(mismatches), record.algorithm)


def manifest_problems(checkpoint_dir: str) -> tuple[list[Problem], ManifestSummary | None]:
    """Every file against megatron-core's integrity manifest, when the checkpoint has one."""
    try:
        manifest = Manifest.read(checkpoint_dir)
    except ManifestError as exc:
        return [Problem(MANIFEST, str(exc))], None
    if manifest is None:
        return [], None
    mismatches, summary = check_manifest(checkpoint_dir, manifest)
    return [Problem(f"{MANIFEST}: {name}", cause) for name, cause in mismatches], summary


def verify(checkpoint_dir: str, megatron: bool = True) -> Report:
    """Every reason the checkpoint would not load completely and correctly.

    Raises :class:`Unverifiable` when ``.metadata`` cannot be read. ``megatron=False`` checks
    a plain torch DCP checkpoint (no ``metadata.json``, no common state).
    """
    metadata = read_metadata(checkpoint_dir)
    report = Report(len(metadata.state_dict_metadata))
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            report.problems += tensor_problems(key, md)
    report.problems += storage_problems(metadata, checkpoint_dir)
    if megatron:
        report.problems += megatron_problems(checkpoint_dir)
    problems, report.checksums = checksum_problems(metadata, checkpoint_dir)
    report.problems += problems
    problems, report.manifest = manifest_problems(checkpoint_dir)
    report.problems += problems
    return report
