"""Checksums of every saved item and of every other file a load reads: recorded at save time,
checked by ``verify`` and at load.

Reading order: :mod:`.algorithms` (which hash, and why) -> :mod:`.record` (what is recorded,
where, how it is checked) -> :mod:`.hashing` (hashing each piece as it is written) ->
:mod:`.writer` (where the bytes are: megatron-core's torch_dist writer; the save's
patches) -> :mod:`.reader` (every load checks the bytes it reads; the load's patches) ->
:mod:`.files` (the whole files a load reads besides the items: ``common.pt``, ``.metadata``,
``metadata.json``), :mod:`.file_writer` and :mod:`.file_reader` (their checksums at save,
their checks at load) -> :mod:`.load` (the collective check of every item before a load).
:mod:`.manifest` reads and checks megatron-core's own integrity manifest (``integrity.json``),
for ``verify``.

    megatron_ckpt_fixes.install()                 # "checksums" is a default feature
    dist_checkpointing.save(sharded, ckpt_dir)    # writes ckpt_dir/.checksums.json too
    dist_checkpointing.load(template, ckpt_dir)   # checks each item it reads; fails on a
                                                  # mismatch, on every rank
    verify_checkpoint(ckpt_dir, required=True)    # every item, before a load, every rank;
                                                  # ChecksumError (also without a record)

:mod:`.load` imports megatron-core, so it is imported on first use: ``verify`` of a plain DCP
checkpoint and ``inspect`` stay free of it.
"""

from typing import Any

from megatron_ckpt_fixes.fixes.checksums import file_reader, file_writer, reader, writer
from megatron_ckpt_fixes.fixes.checksums.record import SIDECAR, ChecksumSummary, read_record

PATCHES = writer.PATCHES + file_writer.PATCHES + reader.PATCHES + file_reader.PATCHES

__all__ = ["PATCHES", "SIDECAR", "ChecksumError", "ChecksumSummary", "read_record",
           "verify_checkpoint"]


def __getattr__(name: str) -> Any:
    if name in ("ChecksumError", "verify_checkpoint"):
        from megatron_ckpt_fixes.fixes.checksums import load

        return getattr(load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
