"""The checksum record's part of the pre-flight: present, of this save, covering what is asked.

Only metadata: the record itself, and the whole files it covers (``metadata.json``,
``.metadata``, ``common.pt``: the small files every load reads first, :mod:`megatron_ckpt_fixes.fixes.checksums.files`)
re-hashed against it. No item's bytes are read here: that is the collective check that
follows under ``--ckpt-verify-checksums`` (:mod:`megatron_ckpt_fixes.fixes.checksums.load`), or the load itself.

Required (``--ckpt-verify-checksums``): a record must exist and belong to this save, and
every item of the requested keys must have a checksum, as :func:`..checksums.load.verify_checkpoint`
requires. Not required: only what the load itself would refuse (an unreadable record, a whole
file or an item length that differs from it).
"""

from __future__ import annotations

import os
from collections.abc import Collection

from torch.distributed.checkpoint.metadata import Metadata

from megatron_ckpt_fixes.fixes.checksums.files import check_files
from megatron_ckpt_fixes.fixes.checksums.record import (
    SIDECAR,
    ChecksumSummary,
    RecordError,
    items_of,
    read_record,
    record_status,
)
from megatron_ckpt_fixes.tools.preflight.compare import RECORD, Finding


def record_findings(checkpoint_dir: str | os.PathLike, metadata: Metadata,
                    keys: Collection[str], required: bool) -> tuple[str, int, list[Finding]]:
    """``(status, whole files checked, findings)`` of the record for a load of ``keys``;
    ``status`` as :func:`..checksums.record.record_status` (``"unreadable"`` too)."""
    try:
        record = read_record(checkpoint_dir)
    except RecordError as exc:
        return "unreadable", 0, [Finding(SIDECAR, str(exc), RECORD)]
    items = [item for item in items_of(metadata) if item.key in keys]
    status = record_status(record, metadata)
    if status != "verified":
        if not required:
            return status, 0, []
        text = f"checksum record: {ChecksumSummary(status, len(items))}; the check was asked for"
        return status, 0, [Finding(SIDECAR, text, RECORD)]
    assert record is not None
    files, problems = check_files(checkpoint_dir, record)
    found = [Finding(name, problem, RECORD) for name, problem in problems.items()]
    unrecorded = 0
    for item in items:
        entry = record.checksums.get((item.file, item.offset))
        if entry is None:
            unrecorded += 1
        elif entry[0] != item.length:
            found.append(Finding(item.key, f"{item}: the record says {entry[0]} bytes, "
                                           f".metadata {item.length}", RECORD))
    if required and unrecorded:
        found.append(Finding(SIDECAR, f"checksum record: {unrecorded} requested item(s) have "
                                      "no checksum; the check was asked for", RECORD))
    return status, files, found
