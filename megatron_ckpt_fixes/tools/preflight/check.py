"""The collective pre-flight: every rank checks its own template, every rank gets one verdict.

A load template differs per rank (each rank asks for its own chunks, its own optimizer
state), so a check of rank 0's template alone passes a checkpoint that fails on another
rank. Each rank compares its requests (:func:`requests_of`) with the checkpoint's
``.metadata`` (:mod:`.compare`) and the checksum record (:mod:`.records`), then one
agreement (:func:`megatron_ckpt_fixes.core.agreement.check`) makes any rank's finding the same
error on every rank, before any rank reads tensor data.

The error keeps the class the load (or the check under ``--ckpt-verify-checksums``) would
raise for the same cause, judged by the lowest failing rank's first finding, as
:mod:`megatron_ckpt_fixes.fixes.load_errors` does for a failed load:

- a missing key, a key saved as the other kind, a shape or chunk that does not match: torch
  DCP's ``CheckpointException`` (what megatron-core 0.16 and 0.19 raise for these, wrapped in
  :class:`~megatron_ckpt_fixes.fixes.load_errors.CheckpointLoadError`);
- a lossy cast: megatron-core's ``CheckpointingException`` (what the load's own pre-read
  refusal raises, :mod:`megatron_ckpt_fixes.fixes.load_casts`);
- a record that is absent when required, unreadable, of another save, or that a whole file
  does not match: :class:`~megatron_ckpt_fixes.fixes.checksums.load.ChecksumError`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import CheckpointException, FileSystemReader

from megatron_ckpt_fixes.core.agreement import check, gather, rank_and_size
from megatron_ckpt_fixes.fixes.checksums.files import FileChecksumError
from megatron_ckpt_fixes.fixes.checksums.load import ChecksumError
from megatron_ckpt_fixes.fixes.checksums.record import RecordError
from megatron_ckpt_fixes.fixes.load_errors import load_error_type
from megatron_ckpt_fixes.tools.preflight.compare import (CAST, LOAD, RECORD, Finding, Request,
    findings, summary)
from megatron_ckpt_fixes.tools.preflight.records import record_findings

logger = logging.getLogger(__name__)


def requests_of(sharded_state_dict: Any) -> Iterator[Request]:
    """What megatron-core's load of ``sharded_state_dict`` looks up in ``.metadata``: each
    ``ShardedTensor`` by key (a ``ShardedTensorFactory``'s too, as the load builds them),
    each ``ShardedObject`` by its unique key; common (plain) values are not in ``.metadata``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensorFactory):
            yield from requests_of(value.build())
        elif isinstance(value, ShardedTensor):
            size = (1,) * value.prepend_axis_num + tuple(value.local_shape)
            yield Request(value.key, tuple(value.global_shape), value.dtype,
                          tuple(value.global_offset), size, value.allow_shape_mismatch)
        elif isinstance(value, ShardedObject):
            yield Request(value.unique_key)


@dataclass(frozen=True)
class LoadableReport:
    """What the pre-flight found: the checkpoint holds every entry each rank asks for, with
    its shape, chunk and a dtype that holds it; ``record``: the checksum record's status
    (``"verified"``: this save's, ``files`` whole files matched it; ``"absent"``,
    ``"stale"``: none, or another save's, which only a required check refuses)."""

    checkpoint_dir: str
    requested: tuple[int, ...]  # entries asked for, per rank
    record: str
    files: int

    def __str__(self) -> str:
        text = (f"will load: {sum(self.requested)} requested entries on {len(self.requested)} "
                "rank(s) are in the checkpoint with their shapes, chunks and dtypes")
        if self.record == "verified":
            return text + (f"; the checksum record is this save's ({self.files} whole file(s) "
                           "match it)")
        return text + f"; checksum record: {self.record} (not required)"


def _findings(sharded_state_dict: Any, directory: str,
              checksums_required: bool) -> tuple[int, str, int, list[Finding]]:
    """This rank's requests counted, the record's status and files, and what is wrong."""
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except (FileChecksumError, RecordError) as exc:
        return 0, "unreadable", 0, [Finding(".metadata", str(exc), RECORD)]
    requests = list(requests_of(sharded_state_dict))
    found = findings(requests, metadata.state_dict_metadata)
    status, files, record = record_findings(directory, metadata, {r.key for r in requests},
                                            checksums_required)
    return len(requests), status, files, record + found


def _error(directory: str, what: str, reports: dict[int, tuple[str, str]]) -> BaseException:
    """The error every rank raises: the class of the lowest failing rank's first finding."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    kind = reports[min(reports)][0]
    if kind == RECORD:
        return ChecksumError(what, {rank: text for rank, (_kind, text) in reports.items()})
    causes = {rank: f"pre-flight: {text}" for rank, (_kind, text) in reports.items()}
    upstream = CheckpointingException if kind == CAST else CheckpointException
    return load_error_type(upstream)(directory, causes, {})


def check_loadable(sharded_state_dict: Any, checkpoint_dir: str | os.PathLike,
                   process_group: Any = None, *,
                   checksums_required: bool = False) -> LoadableReport:
    """Will ``dist_checkpointing.load(sharded_state_dict, checkpoint_dir)`` load? Collective
    over ``process_group``: every rank calls it with its own template; reads ``.metadata``,
    the checksum record and the whole files it covers, never tensor data.

    Raises the same error on every rank, one line per failing rank naming the key and the
    cause (see the module docstring for its class). ``checksums_required``
    (``--ckpt-verify-checksums``): a checkpoint whose requested items cannot be checked (no
    record, another save's, an item without a checksum) fails too.
    """
    directory = os.fspath(checkpoint_dir)
    requested, status, files, error = 0, "absent", 0, None
    try:
        requested, status, files, found = _findings(sharded_state_dict, directory,
                                                     checksums_required)
        if found:
            error = (found[0].kind, summary(found))
    except Exception as exc:  # noqa: BLE001 - the load would fail too: agreed below
        error = (LOAD, f"{type(exc).__name__}: {exc}")
    check(error, f"the pre-flight of {directory}", process_group,
          raise_as=functools.partial(_error, directory))
    report = LoadableReport(directory, tuple(gather(requested, process_group)), status, files)
    if rank_and_size(process_group)[0] == 0:
        logger.debug("pre-flight of %s: %s", directory, report)
    return report
