"""One key -> slot table through DCP: saved at N ranks, loaded at M ranks, moved by value.

The checkpoint holds the table as row-wise ``ShardedTensor`` s over one global slot space,
as TorchRec saves a sharded ``MCHManagedCollisionModule``: the sorted ids, the slot of each
position, metadata columns (``counts``, ``last_access_iter``, ...) and row tensors addressed
by global slot (the embedding weight, the optimizer's per-row state). Rank r's chunk of every
one of them starts at r's first slot. The saved layout (world size, per-rank slot ranges) is
read from the chunks in DCP's ``.metadata``, never from file names.

:func:`load_table` decides, with every rank, between two ways:

- same layout and every id already on the rank that serves it: read by position (the
  resumed state is bitwise the saved one, slots included);
- anything else: :func:`~.resharder.reshard` moves every entry to the rank that serves its
  id (with TorchRec's range routing, that rank reads its entries from the checkpoint
  itself), and that rank reads the entry's rows from the checkpoint.

Both ways read the saved ids and slots of whole saved ranks into scratch tensors and run
every check, agreed by all ranks, before the first byte of the caller's tensors is written.
Every read is rank-local and reads only the rows asked for, by byte range from the chunk's
record (:class:`~.saved_chunks.CheckpointRows`), so ranks read different ranges without a
collective per read; their failures are agreed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards

from megatron_ckpt_fixes.core import agreement
from megatron_ckpt_fixes.reshard.errors import ReshardError, problem, problems_error, run_agreed
from megatron_ckpt_fixes.reshard.exchange import carve
from megatron_ckpt_fixes.reshard.ownership import BlockOwnership, KeyOwnership
from megatron_ckpt_fixes.reshard.resharder import ReshardReport, reshard
from megatron_ckpt_fixes.reshard.saved_chunks import CheckpointRows, piece_bytes_for
from megatron_ckpt_fixes.reshard.saved_rows import SavedEntries
from megatron_ckpt_fixes.reshard.table import MISS_ID, SlotRanges, TableShard
from megatron_ckpt_fixes.reshard.window import (ReshardSpec, SavedWindow, read_windows,
    window_problems)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Column:
    """A checkpoint key and this rank's tensor for it (``[size, ...]``, written in place)."""

    key: str
    local: torch.Tensor


@dataclass(frozen=True)
class LocalTable:
    """This rank's part of one table: positions ``[start, start + size)`` of the sorted ids,
    their slots and metadata, and the rows of the slots ``[start, start + size)``."""

    name: str
    start: int
    ids: Column
    slots: Column
    metadata: Mapping[str, Column] = field(default_factory=dict)
    rows: Sequence[Column] = ()

    @property
    def size(self) -> int:
        return int(self.ids.local.shape[0])

    def buffers(self) -> list[Column]:
        return [self.ids, self.slots, *self.metadata.values()]


def sharded_rows(local: torch.Tensor, offset: int, total: int, group: Any = None) -> ShardedTensor:
    """A row-wise ``ShardedTensor``: this rank holds rows ``[offset, offset + len(local))`` of
    ``total``. A rank holding no rows passes an empty ``local``. Collective."""
    rank = dist.get_rank(group)
    shards = []
    if local.shape[0]:
        meta = ShardMetadata(shard_offsets=[offset] + [0] * (local.dim() - 1),
                             shard_sizes=list(local.shape), placement=f"rank:{rank}/{local.device}")
        shards = [Shard(local, meta)]
    return init_from_local_shards(shards, total, *local.shape[1:], process_group=group)


def table_state_dict(table: LocalTable, total: int, group: Any = None) -> dict[str, ShardedTensor]:
    """What to pass to ``dcp.save`` for a table that is not inside a TorchRec model."""
    return {c.key: sharded_rows(c.local, table.start, total, group)
            for c in (*table.buffers(), *table.rows)}


def _chunks(md: Any, key: str) -> list[tuple[int, int]]:
    return sorted((int(c.offsets[0]), int(c.sizes[0])) for c in md.chunks)


def saved_ranges(metadata: Any, table: LocalTable) -> SlotRanges:
    """The saved slot ranges, from the chunks of the ids in DCP's metadata; every buffer must
    be chunked like the ids, every row tensor must have one row per saved slot and the
    trailing shape and dtype of this rank's rows."""
    md = metadata.state_dict_metadata
    name, key = table.name, table.ids.key
    if key not in md:
        raise ReshardError(f"table {name!r}: {key!r} is not in the checkpoint")
    chunks = _chunks(md[key], key)
    ranges = SlotRanges.from_chunks(name, chunks, "saved layout")
    for col in table.buffers()[1:]:
        if col.key not in md or _chunks(md[col.key], col.key) != chunks:
            raise ReshardError(f"table {name!r}: {col.key!r} is missing from the checkpoint or "
                               f"chunked unlike {key!r}")
    for col in table.rows:
        entry = md.get(col.key)
        if entry is None or not hasattr(entry, "chunks"):
            raise ReshardError(f"table {name!r}: rows {col.key!r} are not in the checkpoint")
        want = (ranges.total, *col.local.shape[1:])
        if tuple(entry.size) != want or entry.properties.dtype != col.local.dtype:
            raise ReshardError(f"table {name!r}: rows {col.key!r} are saved as {tuple(entry.size)} "
                               f"{entry.properties.dtype}, this model needs {want} {col.local.dtype}")
    return ranges


def _row_bytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


@dataclass(frozen=True)
class _Window:
    """What one rank finds alone, before any collective: the saved layout and its read
    window of the table's ids and slots (or the problems it met)."""

    source: CheckpointRows | None = None
    saved: SlotRanges | None = None
    start: int = 0
    ids: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    arena: torch.Tensor | None = None
    problems: tuple[str, ...] = ()


def _read_window(checkpoint_id: str, table: LocalTable, rank: int, world: int) -> _Window:
    """Rank-local: the saved layout from the checkpoint's metadata and this rank's window of
    ids and slots (whole saved ranks, :func:`~.window.read_windows`: what the checks need;
    metadata is read where it is used); a failure becomes a problem."""
    step, source = "reading the metadata", None
    try:
        shard = sum(c.local.nbytes for c in (*table.buffers(), *table.rows))
        source = CheckpointRows(checkpoint_id, dcp.FileSystemReader(checkpoint_id).read_metadata(),
                                piece_bytes_for(shard))
        step = "the saved layout"
        saved = saved_ranges(source.metadata, table)
        windows = read_windows(saved, world)
        lo, hi = windows[rank], windows[rank + 1]
        step = "reading its window"
        # The buffer later holds the entries this rank serves (as many as it has slots,
        # unless it evicts): beside the window when they are exchanged, over it when this
        # rank reads them itself. Pages never written stay untouched.
        window = [(c.local.dtype, (hi - lo,)) for c in (table.ids, table.slots)]
        entries = (hi - lo + table.size) * sum(_row_bytes(c.local) for c in table.buffers())
        arena = torch.empty(max(sum(d.itemsize * n + 64 for d, (n,) in window), entries + 64 * len(table.buffers())),
                            dtype=torch.uint8)
        ids, slots = carve(arena, window)
        source.read(table.ids.key, lo, ids)
        source.read(table.slots.key, lo, slots)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException too; raised on every rank
        return _Window(source, problems=(problem(table.name, rank, f"{step}: {agreement.describe_error(exc)}"),))
    return _Window(source, saved, lo, ids, slots, arena)


def _layouts(name: str, facts: Sequence[tuple[int, int, tuple[int, ...] | None, tuple[str, ...]]]
             ) -> tuple[SlotRanges, SlotRanges]:
    """The saved and the current layout from every rank's ``(start, size, saved bounds,
    problems)``. Every rank decides on the same gathered facts, so every rank raises the same
    :class:`ReshardError` or none does."""
    reports = {rank: list(problems) for rank, (*_, problems) in enumerate(facts) if problems}
    if reports:
        raise problems_error(name, reports)
    saved = {bounds for _, _, bounds, _ in facts}
    if len(saved) > 1:
        differ = [rank for rank, (_, _, bounds, _) in enumerate(facts) if bounds != facts[0][2]]
        raise ReshardError(f"cannot reshard table {name!r}: ranks {differ} read another saved layout "
                           f"than rank 0: {facts[differ[0]][2]} against {facts[0][2]}")
    target = SlotRanges.from_chunks(name, [(start, size) for start, size, _, _ in facts], "current layout")
    return SlotRanges(facts[0][2]), target


def load_table(checkpoint_id: str, table: LocalTable, *, ownership: KeyOwnership = BlockOwnership(),
               score: str | None = "counts", group: Any = None) -> ReshardReport:
    """Load ``table`` (this rank's live tensors, overwritten in place) from a checkpoint saved
    at any world size. Collective; every choice and every failure is agreed by all ranks, and
    a failure leaves every caller tensor untouched (a read that fails while the rows are
    being written, after every check, is agreed too but leaves them partly written, as
    DCP's own load does).

    ``ownership`` says which rank serves an id (the rule lookups route by); ``score`` names
    the metadata column that decides eviction (lowest first) when a rank receives more ids
    than it has slots (``None``: highest ids first).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    name = table.name
    local = _read_window(checkpoint_id, table, rank, world)
    try:
        # One gather settles the layouts and every failure so far (each a barrier of its own otherwise).
        saved, target = _layouts(name, agreement.gather(
            (table.start, table.size, local.saved.bounds if local.saved else None, local.problems), group))
        with torch.no_grad():
            report, how = _load(local, table, ReshardSpec(name, saved, target, read_windows(saved, world), ownership,
                                                          score), rank, world, group)
    finally:
        if local.source is not None:
            local.source.close()
    _log(name, saved, world, how, report)
    return report


def _load(local: _Window, table: LocalTable, spec: ReshardSpec, rank: int, world: int, group: Any
          ) -> tuple[ReshardReport, str]:
    """The agreed load of a table whose layouts are settled: by position or by value."""
    name, source = table.name, local.source
    assert source is not None
    window = SavedWindow(local.start, local.ids, local.slots)
    metadata = {m: c.key for m, c in table.metadata.items()}
    if spec.saved == spec.target:
        problems, sent = window_problems(window, spec, rank, world, metadata_names=sorted(metadata))
        elsewhere = sent is not None and sent.elsewhere(rank)
        moved = agreement.agree(elsewhere, problems or None, f"loading table {name!r} by position", group,
                                raise_as=lambda _what, reports: problems_error(name, reports))
        if not moved:
            table.ids.local.copy_(window.ids)
            table.slots.local.copy_(window.slots)

            def read_in_place() -> None:
                for col in (*table.metadata.values(), *table.rows):
                    source.read(col.key, window.start, col.local)

            run_agreed(f"reading table {name!r}", read_in_place, group)
            return _positional_report(name, window.ids, rank, group), "by position"
        # Same layout, but some id sits on a rank that does not serve it: move by value.
    result = reshard(window, spec, source, {c.key: c.local for c in table.rows},
                     out_table=TableShard(table.start, table.ids.local, table.slots.local,
                                          {m: c.local for m, c in table.metadata.items()}),
                     scratch=local.arena, group=group,
                     entries=SavedEntries(source, table.ids.key, table.slots.key, metadata))
    return result.report, "by value"


def _positional_report(name: str, ids: torch.Tensor, rank: int, group: Any) -> ReshardReport:
    kept = int((ids != MISS_ID).sum())
    kept_total = torch.tensor([kept])
    dist.all_reduce(kept_total, group=group)
    return ReshardReport(name, rank, kept, kept, 0, 0, int(kept_total[0]))


def _log(name: str, saved: SlotRanges, world: int, how: str, report: ReshardReport) -> None:
    logger.info("load %s: %d -> %d ranks (%s), rank %d holds %d ids, evicted %d (all ranks: %d)",
                name, saved.world_size, world, how, report.rank, report.kept, report.evicted,
                report.evicted_total)
