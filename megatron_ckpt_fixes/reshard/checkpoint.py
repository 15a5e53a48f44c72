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
  id and its rows with it.

Both ways read into scratch tensors and run every check, agreed by all ranks, before the
first byte of the caller's tensors is written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards

from .. import agreement
from .errors import ReshardError, check_problems, problem, require_same
from .ownership import BlockOwnership, KeyOwnership
from .resharder import ReshardReport, ReshardSpec, SavedWindow, reshard, window_problems
from .table import MISS_ID, SlotRanges, TableShard, even_bounds

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


def _current_ranges(table: LocalTable, group: Any) -> SlotRanges:
    chunks = agreement.gather((table.start, table.size), group)
    return SlotRanges.from_chunks(table.name, chunks, "current layout")


def _agreed(name: str, what: str, compute: Any, group: Any) -> Any:
    """Run a local computation on every rank; agree on failure and on the result."""
    rank = dist.get_rank(group)
    try:
        value, problems = compute(), []
    except Exception as exc:  # noqa: BLE001 - raised on every rank by check_problems()
        value, problems = None, [problem(name, rank, f"{what}: {exc}")]
    check_problems(name, problems, group)
    require_same(name, what, value, group)
    return value


def _read(checkpoint_id: str, columns: Mapping[str, torch.Tensor], offset: int, total: int,
          group: Any) -> None:
    """One DCP load: saved rows ``[offset, offset + n)`` of every key into the given tensors."""
    dcp.load({k: sharded_rows(t, offset, total, group) for k, t in columns.items()},
             checkpoint_id=checkpoint_id, process_group=group)


def _scratch(col: Column, n: int) -> torch.Tensor:
    return torch.empty((n, *col.local.shape[1:]), dtype=col.local.dtype)


def load_table(checkpoint_id: str, table: LocalTable, *, ownership: KeyOwnership = BlockOwnership(),
               score: str | None = "counts", group: Any = None) -> ReshardReport:
    """Load ``table`` (this rank's live tensors, overwritten in place) from a checkpoint saved
    at any world size. Collective; every choice and every failure is agreed by all ranks, and
    a failure leaves every caller tensor untouched.

    ``ownership`` says which rank serves an id (the rule lookups route by); ``score`` names
    the metadata column that decides eviction (lowest first) when a rank receives more ids
    than it has slots (``None``: highest ids first).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    name = table.name
    saved = _agreed(name, "the saved layout",
                    lambda: saved_ranges(dcp.FileSystemReader(checkpoint_id).read_metadata(), table), group)
    target = _agreed(name, "the current layout", lambda: _current_ranges(table, group), group)
    spec = ReshardSpec(name, saved, target, saved.bounds if saved == target else even_bounds(saved.total, world),
                       ownership, score)
    lo, hi = spec.windows[rank], spec.windows[rank + 1]
    buffers = {c.key: _scratch(c, hi - lo) for c in table.buffers()}
    _read(checkpoint_id, buffers, lo, saved.total, group)

    def reader(col: Column) -> Any:  # one wide column in memory at a time (see SavedWindow)
        def read() -> torch.Tensor:
            rows = _scratch(col, hi - lo)
            _read(checkpoint_id, {col.key: rows}, lo, saved.total, group)
            return rows
        return read

    window = SavedWindow(lo, buffers[table.ids.key], buffers[table.slots.key],
                         {m: buffers[c.key] for m, c in table.metadata.items()},
                         {c.key: reader(c) for c in table.rows})
    if saved == target:
        problems = window_problems(window, spec, rank, world, group=group, positional=True)
        owners = spec.ownership.owner(window.ids[window.ids != MISS_ID], world) if not problems else None
        elsewhere = owners is not None and bool((owners != rank).any())
        moved = agreement.agree(elsewhere, None, f"loading table {name!r} by position", group)
        check_problems(name, problems, group)
        if not moved:
            for col in table.buffers():
                col.local.copy_(buffers[col.key])
            _read(checkpoint_id, {c.key: c.local for c in table.rows}, lo, saved.total, group)
            report = _positional_report(name, window.ids, rank, group)
            _log(name, saved, world, "by position", report)
            return report
        # Same layout, but some id sits on a rank that does not serve it: move by value.
    del buffers
    with torch.no_grad():
        result = reshard(window, spec, out_rows={c.key: c.local for c in table.rows},
                         out_table=TableShard(table.start, table.ids.local, table.slots.local,
                                              {m: c.local for m, c in table.metadata.items()}),
                         group=group)
    _log(name, saved, world, "by value", result.report)
    return result.report


def _positional_report(name: str, ids: torch.Tensor, rank: int, group: Any) -> ReshardReport:
    kept = int((ids != MISS_ID).sum())
    kept_total = torch.tensor([kept])
    dist.all_reduce(kept_total, group=group)
    return ReshardReport(name, rank, kept, kept, 0, 0, int(kept_total[0]))


def _log(name: str, saved: SlotRanges, world: int, how: str, report: ReshardReport) -> None:
    logger.info("load %s: %d -> %d ranks (%s), rank %d holds %d ids, evicted %d (all ranks: %d)",
                name, saved.world_size, world, how, report.rank, report.kept, report.evicted,
                report.evicted_total)
