"""Check a checkpoint's recorded checksums before loading it, on every rank together.

``dist_checkpointing.load`` (like torch DCP) never checks the bytes it reads: a flipped bit
in tensor data loads as a different weight, silently. :func:`verify_checkpoint` re-reads
every item the record covers, each rank a share balanced by bytes (and every rank the few
whole files it covers: ``common.pt``, ``.metadata``, ``metadata.json``, :mod:`.files`), and agrees on the outcome
(:mod:`megatron_ckpt_fixes.core.agreement`): a mismatch found by any rank raises the same
:class:`ChecksumError` on every rank, naming each bad item's key, file and byte range, before
any rank starts loading. A checkpoint saved without checksums is not an error: the summary
says they are absent and the load goes on, unless the caller asked for the check
(``required=True``, scripts/train.py's ``--ckpt-verify-checksums``): then a checkpoint it
cannot check (no record, a record of another save, items without a checksum) fails closed.

Every load also checks the items it reads, as it reads them (:mod:`.reader`); this check
reads every item before the load, each rank a share, so a bad byte in an item this job will
not load (another rank's optimizer state, a layer a smaller model skips) is found too.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint import FileSystemReader

from megatron_ckpt_fixes.core.agreement import check, describe_failures, gather, rank_and_size
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError
from megatron_ckpt_fixes.fixes.checksums.files import check_files
from megatron_ckpt_fixes.fixes.checksums.record import (
    ChecksumSummary,
    check_items,
    items_of,
    read_record,
    record_status,
    share,
)


class ChecksumError(MegatronCkptFixesError, CheckpointingException):
    """A checkpoint's bytes differ from the checksums recorded when it was saved (or the
    record cannot be read). Raised identically on every rank; a ``CheckpointingException``
    like megatron-core's other "this checkpoint cannot be loaded" errors."""

    def __init__(self, what: str, errors: dict[int, Any]) -> None:
        self.what = what
        self.errors = errors
        super().__init__(describe_failures(what, errors))


def _check_share(checkpoint_dir: str, rank: int, world: int,
                 required: bool) -> tuple[ChecksumSummary, list[str]]:
    """This rank's part of the check: the summary, and what it found wrong (one line each)."""
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    record = read_record(checkpoint_dir)
    items = items_of(metadata)
    status = record_status(record, metadata)
    if status != "verified":
        summary = ChecksumSummary(status, len(items))
        return summary, [f"{summary}; the check was asked for"] if required else []
    assert record is not None
    mine = share(items, rank, world)
    mismatches, unrecorded = check_items(checkpoint_dir, mine, record)
    files, file_problems = check_files(checkpoint_dir, record)  # small: every rank
    problems = [str(m) for m in mismatches] + list(file_problems.values())
    if required:
        problems += [f"{item}: no checksum recorded; the check was asked for"
                     for item in unrecorded]
    return ChecksumSummary(status, len(items), len(mine) - len(unrecorded), len(unrecorded),
                           len(mismatches), record.algorithm, files,
                           len(file_problems)), problems


def verify_checkpoint(checkpoint_dir: str | os.PathLike, group: Any = None,
                      required: bool = False) -> ChecksumSummary:
    """Check the checksums of a torch_dist checkpoint; collective over ``group``.

    Every rank of ``group`` calls it with the same directory. Returns the summary of the
    whole check (the same on every rank); raises :class:`ChecksumError` on every rank if
    any rank found a mismatch or could not read the checkpoint's ``.metadata`` or record,
    and, with ``required``, if any item cannot be checked (no record, a record of another
    save, an item without a checksum): a check that was asked for fails closed.
    """
    directory = os.fspath(checkpoint_dir)
    rank, world = rank_and_size(group)
    summary, error = None, None
    try:
        summary, problems = _check_share(directory, rank, world, required)
        if problems:
            error = "\n    ".join(problems)
    except Exception as exc:  # noqa: BLE001 - reported on every rank by check()
        error = f"{type(exc).__name__}: {exc}"
    check(error, f"checking the checksums of {directory}", group, raise_as=ChecksumError)
    assert summary is not None
    counts = gather((summary.checked, summary.unrecorded), group)
    return dataclasses.replace(summary, checked=sum(c for c, _ in counts),
                               unrecorded=sum(u for _, u in counts))
