"""Value-aware resharding of a key -> slot table from N to M ranks.

Why by value: a lookup searches only the table of the rank that serves the raw id
(:mod:`.ownership`). So an entry must go to its id's owner and there get a slot in that
rank's range; its embedding and optimizer rows must follow it to the new slot. Routing by the
old slot (the upstream fix) puts entries where no lookup will look.

Input per rank: a :class:`~.window.SavedWindow`, the saved positions (ids, their saved
slots, metadata) of whole saved ranks, the windows of all ranks tiling the saved table; and
:class:`~.saved_rows.SavedRows`, from which any rank reads any saved rows. Steps:

1. every check of the window (:mod:`.window`), agreed by all ranks;
2. each real entry (saved slot, id, metadata) goes to the rank that serves its id
   (:mod:`.routing`). With range routing (TorchRec's) and the entries readable by every rank
   (:class:`~.saved_rows.SavedEntries`), that rank reads them itself: they are one run of
   positions of each saved rank, and no entry is sent. Otherwise in one exchange: one
   all_to_all per column, started together;
3. the owner refuses duplicate ids (ids that met from different saved ranks) and evicts
   what does not fit. The kept entries of one saved rank arrived together (saved position
   order); they take the next run of local slots in the order of their saved slots. Ids
   that arrive sorted (block routing: TorchRec's) stay sorted, so nothing is sorted then;
4. rows do not travel: the owner gathers the saved rows of its entries, one column and one
   saved rank at a time, in increasing order, straight into one run of its row tensors
   (:meth:`~.saved_rows.SavedRows.gather`: from a checkpoint, only those rows' bytes). Its
   miss slot gets the saved miss row of the saved rank it took most entries from.

Every check (bad slots, unsorted ids, duplicates, a taken miss slot, a full destination) is
agreed by all ranks before the first row is written, so a failure leaves the caller's tensors
untouched and raises the same :class:`~.errors.ReshardError` on every rank.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_ckpt_fixes.core import agreement
from megatron_ckpt_fixes.compat.device import collective_device
from megatron_ckpt_fixes.reshard.errors import check_problems, problem, require_same, run_agreed
from megatron_ckpt_fixes.reshard.exchange import carve, send_grouped, send_rows
from megatron_ckpt_fixes.reshard.routing import Route
from megatron_ckpt_fixes.reshard.saved_rows import SavedEntries, SavedRows
from megatron_ckpt_fixes.reshard.table import MISS_ID, SlotRanges, TableShard
from megatron_ckpt_fixes.reshard.window import ReshardSpec, SavedWindow, window_problems

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReshardReport:
    """What happened to the entries of one table on one rank (``*_total``: all ranks)."""

    key: str
    rank: int
    received: int
    kept: int
    evicted: int
    evicted_total: int
    kept_total: int


@dataclass(frozen=True)
class ReshardResult:
    """This rank's new table, its rows (the ``out_rows`` given), and the ids it had to evict."""

    table: TableShard
    rows: Mapping[str, torch.Tensor]
    evicted_ids: torch.Tensor
    report: ReshardReport


def _keep_mask(ids: torch.Tensor, scores: torch.Tensor | None, capacity: int) -> torch.Tensor:
    """Which of the (id-sorted) entries stay: the ``capacity`` highest scores, ties to lower ids."""
    n = int(ids.numel())
    keep = torch.ones(n, dtype=torch.bool)
    if n <= capacity:
        return keep
    if scores is None:
        keep[capacity:] = False
        return keep
    order = torch.sort(scores, descending=True, stable=True).indices  # stable: lower id first
    keep[order[capacity:]] = False
    return keep


def _take(column: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Rows ``index`` of ``column``; the column itself for ``None`` (the identity, not copied)."""
    return column if index is None else column.index_select(0, index)


@dataclass(frozen=True)
class _Arrived:
    """The entries this rank serves now, in the order they arrived: saved position order
    (senders in rank order, their windows in position order, each block kept in order)."""

    old: torch.Tensor  # saved global slot
    ids: torch.Tensor
    meta: list[torch.Tensor]


def _after(buffer: torch.Tensor | None, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The part of a byte buffer after the given tensors where they lie in it (all of it
    when none does): memory that is free while they are in use."""
    if buffer is None:
        return None
    base, size = buffer.data_ptr(), buffer.numel()
    end = max((t.data_ptr() + t.nbytes - base for t in tensors if base <= t.data_ptr() < base + size), default=0)
    return buffer[min(-(-end // 64) * 64, size):]


def _column(source: SavedRows, key: str, start: int, n: int) -> torch.Tensor:
    """Saved positions ``[start, start + n)`` of one column, as saved."""
    dtype, shape = source.row_format(key)
    out = torch.empty((n, *shape), dtype=dtype)
    source.read(key, start, out)
    return out


def _to_owners(win: SavedWindow, sent: Route, meta_names: Sequence[str], scratch: torch.Tensor | None,
               group: Any, entries: SavedEntries | None) -> _Arrived:
    """Step 2: every real entry of the window to the rank that serves its id, received into
    ``scratch`` beside the window when it fits. A window without its metadata columns
    reads them from ``entries`` first."""
    if entries is not None and meta_names and not win.metadata:
        n = int(win.ids.numel())
        win = dataclasses.replace(win, metadata={m: _column(entries.source, entries.metadata[m], win.start, n)
                                                 for m in meta_names})
    columns = [win.slots, win.ids, *(win.metadata[m] for m in meta_names)]
    into = _after(scratch, columns)
    if sent.span is not None:
        columns = [c[sent.span] for c in columns]
    if sent.counts is not None:
        got = send_grouped(columns, sent.counts, sent.index, group, into)
    else:
        got = send_rows(columns, sent.dest, sent.index, group, into)
    old, ids, *meta = got.columns
    return _Arrived(old, ids, meta)


def _read_own(cuts: Sequence[Sequence[Sequence[int]]], rank: int, entries: SavedEntries,
              meta_names: Sequence[str], scratch: torch.Tensor | None) -> _Arrived:
    """Step 2 without an exchange, for range routing: the entries this rank serves are
    positions ``[at[rank], at[rank + 1])`` of each saved rank (``cuts``: every rank's window,
    in rank order, and each saved rank in it, in order: the saved positions where each
    rank's part starts). Read in that order, they arrive as the exchange would deliver them
    (senders in rank order, their windows in position order), into ``scratch`` when they fit."""
    spans = [(at[rank], at[rank + 1]) for window in cuts for at in window if at[rank] < at[rank + 1]]
    n = sum(b - a for a, b in spans)
    source = entries.source
    keys = [entries.slots, entries.ids, *(entries.metadata[m] for m in meta_names)]
    columns = carve(scratch, [(dtype, (n, *shape)) for dtype, shape in map(source.row_format, keys)])
    for key, column in zip(keys, columns):
        at = 0
        for a, b in spans:
            source.read(key, a, column[at:at + b - a])
            at += b - a
    old, ids, *meta = columns
    return _Arrived(old, ids, meta)


@dataclass(frozen=True)
class _Run:
    """Kept entries ``first .. end-1`` (in arrival order) came from saved rank ``chunk``; they
    take local slots ``first .. end-1`` in the order of their saved slots, so their rows are
    ``chunk rows[rows]`` (``rows``: local saved slots, increasing: the read streams)."""

    chunk: int
    first: int
    end: int
    rows: torch.Tensor


def _runs(old: torch.Tensor, saved: SlotRanges, slot_of_kept: torch.Tensor) -> list[_Run]:
    """Cut the kept entries (arrival order, saved slots ``old``, overwritten with their
    slots local to their saved rank) into one run per saved rank and write each entry's
    local slot into ``slot_of_kept``. A saved position's slot lies in its saved rank's
    range (checked) and entries arrive in position order, so the entries of a saved rank
    are contiguous; inside a run, saved slots are distinct (checked), so marking them in a
    mask of the saved rank's size sorts them in one pass, and the running count of the mask
    is each one's rank."""
    n = int(old.numel())
    # "old[i] >= bound" is monotone in i, so each run's end is a binary search (no pass).
    ends = [bisect.bisect_left(range(n), True, key=lambda i, b=b: int(old[i]) >= b) for b in saved.bounds[1:-1]]
    runs = []
    for c, (first, end) in enumerate(zip([0, *ends], [*ends, n])):
        if first == end:
            continue
        local = old[first:end].sub_(saved.start(c))  # in place: no temporary of the run's size
        used = torch.zeros(saved.size(c), dtype=torch.bool)
        used[local] = True
        torch.add(used.cumsum(0, dtype=torch.int32).index_select(0, local), first - 1, out=slot_of_kept[first:end])
        runs.append(_Run(c, first, end, used.nonzero().squeeze(1)))
    return runs


@dataclass(frozen=True)
class _Placement:
    """The owner's decisions: the table's kept entries by id (``ids``, their local ``slots``,
    ``meta``), where their rows come from (``runs``), the evicted ids."""

    ids: torch.Tensor
    slots: torch.Tensor
    meta: list[torch.Tensor]
    runs: list[_Run]
    evicted_ids: torch.Tensor


def _place(arrived: _Arrived, spec: ReshardSpec, rank: int, meta_names: Sequence[str], group: Any
           ) -> _Placement:
    """Step 3: refuse duplicate ids (agreed), evict what does not fit, assign local slots.
    Consumes ``arrived.old`` (:func:`_runs` reuses its memory)."""
    key, ids = spec.key, arrived.ids
    by_id = None if bool((ids[1:] > ids[:-1]).all()) else torch.sort(ids, stable=True).indices
    sorted_ids = _take(ids, by_id)
    dup = sorted_ids[1:] == sorted_ids[:-1] if by_id is not None else None
    check_problems(key, [problem(key, rank, f"id {int(sorted_ids[1:][dup][0])} appears {int(dup.sum()) + 1}+ "
                                            "times in the saved table")]
                   if dup is not None and bool(dup.any()) else [], group)
    n, capacity = int(ids.numel()), spec.target.size(rank) - 1  # the last slot stays the miss slot
    if n <= capacity:  # everything is kept: kept position = arrival index
        slot_of_kept = torch.empty(n, dtype=torch.int64)
        runs = _runs(arrived.old, spec.saved, slot_of_kept)
        return _Placement(sorted_ids, _take(slot_of_kept, by_id), [_take(m, by_id) for m in arrived.meta],
                          runs, sorted_ids[:0])
    scores = _take(arrived.meta[meta_names.index(spec.score)], by_id) if spec.score is not None else None
    keep = _keep_mask(sorted_ids, scores, capacity)
    kept_by_id = (torch.arange(n) if by_id is None else by_id)[keep]  # arrival index of each kept entry
    kept_at = torch.full((n,), -1, dtype=torch.int64)  # kept position of each arrival
    kept_arrivals = kept_by_id.sort().values
    kept_at[kept_arrivals] = torch.arange(int(kept_arrivals.numel()))
    slot_of_kept = torch.empty(int(kept_arrivals.numel()), dtype=torch.int64)
    runs = _runs(arrived.old.index_select(0, kept_arrivals), spec.saved, slot_of_kept)
    return _Placement(sorted_ids[keep], slot_of_kept.index_select(0, kept_at.index_select(0, kept_by_id)),
                      [m.index_select(0, kept_by_id) for m in arrived.meta], runs, sorted_ids[~keep])


def _read_rows(runs: Sequence[_Run], spec: ReshardSpec, rows: SavedRows, out_rows: Mapping[str, torch.Tensor],
               rank: int) -> None:
    """Step 4, rank-local: every kept entry's rows into the output rows, one column and one
    saved rank at a time, each run's rows in increasing order (from a checkpoint: only their
    bytes). The last slot, the miss slot, gets the saved miss row of the saved rank this rank
    took most entries from (the rank that served most of its ids; without entries, saved
    rank ``rank mod N``), so no rank waits for another."""
    saved = spec.saved
    miss_from = max(runs, key=lambda run: (run.end - run.first, -run.chunk)).chunk if runs else \
        rank % saved.world_size
    for name in sorted(out_rows):
        out = out_rows[name]
        for run in runs:
            rows.gather(name, saved.start(run.chunk), run.rows, out[run.first:run.end])
        rows.read(name, saved.miss_slot(miss_from), out[-1:])


def reshard(win: SavedWindow, spec: ReshardSpec, rows: SavedRows, out_rows: Mapping[str, torch.Tensor], *,
            out_table: TableShard | None = None, scratch: torch.Tensor | None = None,
            group: Any = None, entries: SavedEntries | None = None) -> ReshardResult:
    """Move this rank's saved window to the value owners; write this rank's new table and rows.

    Collective over ``group``. ``rows``: where any rank reads the saved rows. ``out_rows``
    (this rank's new ``[size, ...]`` row tensors, e.g. the live local embedding, by column
    name) and ``out_table`` (its id, slot and metadata buffers; new tensors when ``None``) are
    written in place, only after every check passed on every rank; slots no id takes keep
    their rows. ``entries``: where every rank can read any saved positions of the table's
    buffers; with range routing each rank then reads the entries it serves itself instead of
    an exchange, and the window needs no metadata columns (its ids and slots are checked).
    ``scratch``: a byte buffer for the entries that arrive (beside the window where the
    window lies in it; from its start when they are read, as the window is no longer read
    then), e.g. the one the window was read into: pages touched once cost less than fresh
    ones. Raises :class:`ReshardError` on every rank if any rank finds a problem.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    key = spec.key
    meta_names = sorted(win.metadata) if entries is None else sorted(entries.metadata)
    problems, sent = window_problems(win, spec, rank, world, rows, out_rows, meta_names)
    reads = None if entries is None else (entries.ids, entries.slots, sorted(entries.metadata.items()))
    require_same(key, "the reshard spec and column names", (spec, meta_names, sorted(out_rows), reads), group,
                 problems)

    cuts = None
    if entries is not None:  # every rank decides on the same gathered routes
        mine = None if sent.cuts is None else [[win.start + p for p in at] for at in sent.cuts]
        gathered = agreement.gather(mine, group)
        cuts = gathered if all(c is not None for c in gathered) else None
    if cuts is not None:
        del sent
        arrived = _read_own(cuts, rank, entries, meta_names, scratch)
    else:
        arrived = _to_owners(win, sent, meta_names, scratch, group, entries)
        del sent
    placed = _place(arrived, spec, rank, meta_names, group)
    received, kept, evicted = int(arrived.ids.numel()), int(placed.ids.numel()), int(placed.evicted_ids.numel())
    del arrived
    totals = torch.tensor([evicted, kept], dtype=torch.int64, device=collective_device(group))
    summed = dist.all_reduce(totals, group=group, async_op=True)  # for the report: no barrier of its own
    start, size = spec.target.start(rank), spec.target.size(rank)
    table = _build_table(start, size, placed, meta_names, out_table)

    # Step 4 (every check has passed). A failed read is agreed, so every rank raises it.
    run_agreed(f"reading the saved rows of table {key!r}",
               lambda: _read_rows(placed.runs, spec, rows, out_rows, rank), group)
    summed.wait()
    report = ReshardReport(key, rank, received, kept, evicted, int(totals[0]), int(totals[1]))
    if evicted:
        logger.warning("reshard %s: rank %d evicted %d of %d ids (capacity %d)", key, rank, evicted,
                       received, size - 1)
    return ReshardResult(table, out_rows, placed.evicted_ids, report)


def _build_table(start: int, size: int, placed: _Placement, meta_names: Sequence[str],
                 out: TableShard | None) -> TableShard:
    """The MCH layout: kept ids (sorted) at their local slots ``0 .. k-1`` (in some order),
    then the free slots ``k .. size-1`` in increasing order, which ends with the miss slot
    ``start + size - 1`` at the last position. Written into ``out``'s tensors when given."""
    k = int(placed.ids.numel())
    ids = out.ids if out is not None else torch.empty(size, dtype=torch.int64)
    ids[:k] = placed.ids
    ids[k:] = MISS_ID
    slots = out.slots if out is not None else torch.empty(size, dtype=torch.int64)
    torch.add(placed.slots, start, out=slots[:k])
    torch.arange(start + k, start + size, out=slots[k:])
    metadata = {}
    for name, col in zip(meta_names, placed.meta):
        full = out.metadata[name] if out is not None else col.new_empty((size, *col.shape[1:]))
        full[:k] = col
        full[k:] = 0
        metadata[name] = full
    return TableShard(start, ids, slots, metadata)
