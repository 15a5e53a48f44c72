"""Checksums of the whole files a load reads besides the items: the common state, the
metadata, the checkpoint's config.

A resume reads more than tensor data: ``common.pt`` (megatron-core 0.16's common state: the
iteration, the optimizer's step and param groups, the scheduler, the arguments), torch DCP's
``.metadata`` (where every item lies: a changed offset reads another item's bytes, and the
item's checksum, keyed by offset, would not even be looked up) and ``metadata.json`` (the
backend). Each is covered by the checksum of its bytes as written (:mod:`.writer` reads each
file back right after it is written, before the record is finalized: the bytes in the file,
not a re-serialization of the object), kept in the record's ``whole_files``.

Every load checks a file's bytes before it parses them (:mod:`.reader`); a mismatch is one
line, like an item's: the file, its byte range, what was recorded and what was read.
megatron-core 0.19 and later save the common state as an item (``common_state``), covered
as every item is; their loads still read a ``common.pt`` of an older checkpoint.

Pure file I/O and logic, no process group, no megatron-core.
"""

from __future__ import annotations

import os

from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError
from megatron_ckpt_fixes.fixes.checksums.algorithms import DEFAULT, Algorithm, algorithm
from megatron_ckpt_fixes.fixes.checksums.record import ChecksumRecord

#: megatron-core 0.16's common state (``torch.save`` of the common state dict).
COMMON = "common.pt"
#: torch DCP's metadata (a pickle of every item's place).
METADATA = ".metadata"
#: megatron-core's checkpoint config (JSON: backend and version).
CONFIG = "metadata.json"
#: The files a record may cover, in the order a load reads them.
WHOLE_FILES = (CONFIG, METADATA, COMMON)


class FileChecksumError(MegatronCkptFixesError, ValueError):
    """The bytes a load read of a whole file (``common.pt``, ``.metadata``,
    ``metadata.json``) differ from the checksum recorded when it was written. Raised before
    the file is parsed; megatron-core's load (with ``load_errors``) makes it the error of
    every rank, as an item's."""


def checksum_of_bytes(data: bytes | memoryview, algo: Algorithm = DEFAULT) -> int:
    hasher = algo.new()
    hasher.update(data)
    return hasher.value()


def read_back(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(length, checksum)`` of the file's bytes as they are now (right after a writer
    wrote it); None when there is no such file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return len(data), checksum_of_bytes(data)


def belongs(record: ChecksumRecord, metadata: bytes | memoryview) -> bool:
    """Whether ``record`` is the record of the save whose ``.metadata`` bytes are
    ``metadata``, told without unpickling them: the record's save id (a new one per save,
    pickled as its UTF-8 bytes) must occur in them. A record an earlier save left (a later
    save without this feature kept it) is not used to judge the files, as it is not used
    for the items. A changed byte inside the save id itself reads as such a record: the
    load goes on unchecked, with every other byte of ``.metadata`` as saved."""
    return record.save_id is None or record.save_id.encode() in bytes(metadata)


def file_problem(record: ChecksumRecord, name: str, data: bytes | memoryview,
                 source: str = "the bytes read hold") -> str | None:
    """What is wrong with ``data``, read as the whole file ``name``, by the record; None
    when it matches or the record does not cover ``name``."""
    entry = record.whole_files.get(name)
    if entry is None:
        return None
    length, expected = entry
    where = f"{name} (bytes 0..{len(data)})"
    if len(data) != length:
        return f"{where}: the record says {length} bytes, the file has {len(data)}"
    algo = algorithm(record.algorithm)
    found = checksum_of_bytes(data, algo)
    if found != expected:
        return (f"{where}: checksum mismatch (recorded {algo.name} {algo.format(expected)}, "
                f"{source} {algo.format(found)})")
    return None


def check_file(record: ChecksumRecord | None, name: str, data: bytes | memoryview) -> None:
    """Raise :class:`FileChecksumError` when ``data`` is not the file ``name`` as recorded."""
    problem = None if record is None else file_problem(record, name, data)
    if problem is not None:
        raise FileChecksumError(problem)


def check_files(checkpoint_dir: str | os.PathLike,
                record: ChecksumRecord) -> tuple[int, dict[str, str]]:
    """Re-read every whole file the record covers that is there (for ``verify``; a missing
    one is named by the checks of what a load needs): how many were checked, and what is
    wrong with each file that does not match (one line each)."""
    problems, checked = {}, 0
    for name in sorted(record.whole_files):
        try:
            with open(os.path.join(checkpoint_dir, name), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        checked += 1
        problem = file_problem(record, name, data, source="the file holds")
        if problem is not None:
            problems[name] = problem
    return checked, problems
