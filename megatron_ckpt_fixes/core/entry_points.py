"""The upstream attributes that more than one feature wraps, each patched once.

Each is an :class:`~.patching.EntryPoint`: one patch, whose replacement runs the layers of
the installed features in the order written here (outermost first). The order is what the
features rely on; ``install()`` refuses a layer that is not listed.
"""

from __future__ import annotations

from megatron_ckpt_fixes.core.patching import EntryPoint
from megatron_ckpt_fixes.core.rehearsal import calls_during, write_one_item

_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_WRITER = f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync"


def _write_item_problems() -> list[str]:
    """megatron-core's writer must call the module's ``_write_item`` for each item (watched
    while it writes one)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if calls_during(filesystem_async, "_write_item", write_one_item):
        return []
    return ["FileSystemWriterAsync.write_preloaded_data did not call the module's _write_item "
            "when it wrote an item: nothing of it would be seen"]


#: torch's ``_write_item`` as megatron-core's file writer calls it, once per item. The
#: checksum is taken inside; the write-back hint goes outside it, on the file itself (the
#: checksum's small items are written to the file after torch's serialization into memory).
WRITE_ITEM = EntryPoint(
    name="entry.write_item",
    target=_FILESYSTEM_ASYNC,
    attr="_write_item",
    layers=("writeback.write_item", "checksums.write_item"),
    probes=(_write_item_problems,),
)

#: The coordinator's ``.metadata`` write. The checksum record is written right after
#: ``.metadata``; a failure of either is held for the agreed outcome, so that hold is outside.
WRITER_FINISH = EntryPoint(
    name="entry.writer_finish",
    target=_WRITER,
    attr="finish",
    layers=("writer_failures.outcome.finish", "checksums.finish"),
)

#: megatron-core 0.16's forked bucket writers. The watch of forked writers is outside the
#: threads that replace them, so it sees whether any process was forked at all.
WRITE_BUCKETS = EntryPoint(
    name="entry.write_buckets",
    target=_WRITER,
    attr="write_preloaded_data_multiproc",
    layers=("writer_failures.processes.multiproc", "writer_threads.buckets"),
)
