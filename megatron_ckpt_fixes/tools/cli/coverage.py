"""What ``verify`` checked, and what it could not: its OK says which, ``--strict`` refuses gaps.

An OK that reads as "will load" while the bytes were never compared with anything (a
checkpoint saved without a checksum record) misleads: ``verify`` said ``57 keys, OK``
where ``--ckpt-verify-checksums`` refused the same checkpoint. The layout
(chunks, storage entries, data file sizes) is always checked; the bytes only where a record
covers them: this package's ``.checksums.json`` per item and per whole file, megatron-core's
``integrity.json`` per file. Whether a model's keys are in the checkpoint is never known
from the files: that is the pre-flight's question (:mod:`megatron_ckpt_fixes.tools.preflight`).

Pure: counts from the records already read, and which whole files exist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import Metadata

from megatron_ckpt_fixes.fixes.checksums.files import WHOLE_FILES
from megatron_ckpt_fixes.fixes.checksums.manifest import MANIFEST, Manifest
from megatron_ckpt_fixes.fixes.checksums.record import (SIDECAR, ChecksumRecord, items_of,
    record_status)

#: Why a record did not check an item's bytes, by the record's status.
_WHY = {"absent": f"no checksum record: {SIDECAR} missing, saved without the checksums feature",
        "stale": f"{SIDECAR} belongs to another save of this directory",
        "verified": f"no checksum in {SIDECAR}"}


@dataclass(frozen=True)
class Coverage:
    items: int  # items .metadata lists
    items_checked: int  # by the checksum record
    files_checked: int  # whole files, by the checksum record
    manifest_files: int  # files, by megatron-core's integrity manifest
    unchecked_items: int  # items no record covers
    unchecked_files: tuple[str, ...]  # whole files there that no record covers
    why: str  # why the checksum record did not cover the unchecked items

    def checked(self) -> str:
        """``checked: the layout of N item(s), the bytes of N item(s) and M file(s) ...;
        keys not compared with a model``."""
        parts = []
        if self.items_checked or self.files_checked:
            parts.append(f"the bytes of {self.items_checked} item(s) and {self.files_checked} "
                         f"file(s) by {SIDECAR}")
        if self.manifest_files:
            parts.append(f"{self.manifest_files} file(s) by {MANIFEST}")
        return (f"checked: the layout of {self.items} item(s), "
                f"{', '.join(parts) or 'not their bytes (no record of them)'}; keys not "
                "compared with a model")

    def unchecked(self) -> str | None:
        """What no record covers, in one phrase; None when every byte was checked."""
        parts = []
        if self.unchecked_items:
            parts.append(f"the bytes of {self.unchecked_items} item(s) ({self.why})")
        if self.unchecked_files:
            parts.append(f"{len(self.unchecked_files)} whole file(s) "
                         f"({', '.join(self.unchecked_files)})")
        return " and ".join(parts) or None


def coverage(checkpoint_dir: str, metadata: Metadata, record: ChecksumRecord | None,
             manifest: Manifest | None, record_readable: bool = True) -> Coverage:
    """What the records read cover of this checkpoint (an unreadable record covers nothing)."""
    status = record_status(record, metadata) if record_readable else "unreadable"
    covered = record if status == "verified" else None
    by_manifest = set(manifest.files) if manifest is not None else set()
    items = items_of(metadata)
    recorded = set(covered.checksums) if covered is not None else set()
    unchecked = [i for i in items
                 if (i.file, i.offset) not in recorded and i.file not in by_manifest]
    present = [name for name in WHOLE_FILES
               if os.path.isfile(os.path.join(checkpoint_dir, name))]
    whole = set(covered.whole_files) if covered is not None else set()
    return Coverage(
        items=len(items),
        items_checked=sum((i.file, i.offset) in recorded for i in items),
        files_checked=sum(name in whole for name in present),
        manifest_files=len(by_manifest),
        unchecked_items=len(unchecked),
        unchecked_files=tuple(n for n in present if n not in whole and n not in by_manifest),
        why=_WHY.get(status, f"{SIDECAR} is unreadable"))
