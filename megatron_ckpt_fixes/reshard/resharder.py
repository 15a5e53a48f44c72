"""Value-aware resharding of a key -> slot table from N to M ranks.

Why by value: a lookup searches only the table of the rank that serves the raw id
(:mod:`.ownership`). So an entry must go to its id's owner and there get a slot in that
rank's range; its embedding and optimizer rows must follow it to the new slot. Routing by the
old slot (the upstream fix) puts entries where no lookup will look.

Input per rank: a :class:`SavedWindow`, a contiguous range ``[lo, hi)`` of the saved global
positions and the rows of the same range of saved slots, read by DCP so that the windows of
all ranks tile the saved table. No rank reads more than its window. Two phases:

A. each entry (old slot, id, metadata) goes to the rank whose window holds its row;
B. that rank sends the entry, now with its rows, to the owner of the id: first ids and
   metadata (one packed exchange), then each row column on its own, received straight into
   the owner's row tensors. An owner gives the i-th row that arrives the i-th slot of its
   range, so rows never move again; only the small id buffer is sorted.

Every check (bad slots, unsorted ids, duplicates, a taken miss slot, a full destination) is
agreed by all ranks before the first row is written, so a failure leaves the caller's tensors
untouched and raises the same :class:`~.errors.ReshardError` on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import agreement
from .errors import check_problems, problem, require_same
from .exchange import send_column, send_rows
from .ownership import BlockOwnership, KeyOwnership
from .table import MISS_ID, SlotRanges, TableShard

logger = logging.getLogger(__name__)


#: A row column of a window: the tensor, or a collective call that reads it when it is needed
#: (so only one wide column is in memory at a time).
RowSource = torch.Tensor | Callable[[], torch.Tensor]


@dataclass(frozen=True)
class SavedWindow:
    """Saved positions ``[start, start + n)`` of a table and the rows of saved slots
    ``[start, start + n)`` (same range: in the MCH layout a rank's positions and slots coincide).
    The resharder drops each row column from ``rows`` once it is sent, to free its memory;
    a column given as a callable is read only then (every rank calls them in name order)."""

    start: int
    ids: torch.Tensor
    slots: torch.Tensor
    metadata: Mapping[str, torch.Tensor] = field(default_factory=dict)
    rows: MutableMapping[str, RowSource] = field(default_factory=dict)


@dataclass(frozen=True)
class ReshardSpec:
    """Everything every rank must agree on before data moves.

    ``saved``: slot ranges at save time (from the checkpoint's metadata). ``target``: slot
    ranges of the current ranks. ``windows``: bounds of the saved range each current rank read
    (may be empty). ``score``: metadata column deciding eviction, lowest first (``None``: by id,
    highest first).
    """

    key: str
    saved: SlotRanges
    target: SlotRanges
    windows: tuple[int, ...]
    ownership: KeyOwnership = BlockOwnership()
    score: str | None = None


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
    """This rank's new table, its rows (by local slot), and the ids it had to evict."""

    table: TableShard
    rows: dict[str, torch.Tensor]
    evicted_ids: torch.Tensor
    report: ReshardReport


def _spec_problems(spec: ReshardSpec, rank: int, world_size: int) -> list[str]:
    """Shape errors of a spec: every rank finds the same ones (the spec is agreed)."""
    out = []
    w = spec.windows
    if spec.target.world_size != world_size:
        out.append(f"target has {spec.target.world_size} ranges for {world_size} ranks")
    if len(w) != world_size + 1 or w[0] != 0 or w[-1] != spec.saved.total or any(
            b < a for a, b in zip(w, w[1:])):
        out.append(f"read windows {w} do not tile the saved table [0, {spec.saved.total})")
    return [problem(spec.key, rank, cause) for cause in out]


def _segment_problems(key: str, rank: int, chunk: int, c_lo: int, c_hi: int, first: int,
                      ids: torch.Tensor, slots: torch.Tensor, kept_as_is: bool) -> list[str]:
    """Checks of saved positions ``first ...`` of saved rank ``chunk`` (serving
    ``[c_lo, c_hi)``): slots in range, the miss slot and the last position kept free, ids
    sorted and unique; with ``kept_as_is`` (a positional load keeps the free positions too)
    also every slot used once. Moving by value rebuilds the free positions, and phase A
    finds real ids sharing a slot across windows."""
    out = []
    real = ids != MISS_ID
    where = f"saved rank {chunk} (slots [{c_lo}, {c_hi}))"
    bad = (slots < c_lo) | (slots >= c_hi)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        out.append(problem(key, rank, f"{int(bad.sum())} out-of-range slots in {where}, e.g. id "
                                      f"{int(ids[i])} at position {first + i} maps to slot {int(slots[i])}"))
    elif kept_as_is:
        uses = torch.bincount(slots - c_lo)
        if bool((uses > 1).any()):
            out.append(problem(key, rank, f"saved slot {c_lo + int(uses.argmax())} of {where} is mapped "
                                          f"from {int(uses.max())} positions"))
    taken = real & (slots == c_hi - 1)
    if bool(taken.any()):
        out.append(problem(key, rank, f"id {int(ids[taken][0])} holds the reserved miss slot "
                                      f"{c_hi - 1} of {where}"))
    if first + ids.numel() == c_hi and bool(real[-1]):
        out.append(problem(key, rank, f"the reserved last position {c_hi - 1} of {where} holds id "
                                      f"{int(ids[-1])}, not the miss id"))
    unsorted = ids[1:] < ids[:-1]
    if bool(unsorted.any()):
        out.append(problem(key, rank, f"ids of {where} are not sorted at position "
                                      f"{first + int(unsorted.nonzero()[0]) + 1}"))
    twice = real[1:] & (ids[1:] == ids[:-1])
    if bool(twice.any()):
        out.append(problem(key, rank, f"id {int(ids[1:][twice][0])} appears twice in {where}"))
    return out


def _edge_problems(win: SavedWindow, spec: ReshardSpec, rank: int, group: Any) -> list[str]:
    """Sortedness across the cut between two read windows inside one saved rank's positions.

    Collective (one gather of each window's first and last id): without it a swap that
    straddles two windows would pass, and whether a checkpoint loads would depend on the
    world size that reads it. The rank left of a cut reports it, so every rank raises the
    same message.
    """
    n = int(win.ids.numel())
    edges = agreement.gather((int(win.ids[0]), int(win.ids[-1])) if n else None, group)
    hi = spec.windows[rank + 1]
    if not n or hi in spec.saved.bounds:
        return []
    nxt = next((e for e in edges[rank + 1:] if e is not None), None)
    if nxt is None or nxt[0] >= edges[rank][1]:
        return []
    return [problem(spec.key, rank, f"ids are not sorted at position {hi} (id {edges[rank][1]} "
                                    f"before id {nxt[0]})")]


def _window_problems(win: SavedWindow, spec: ReshardSpec, rank: int, world: int, positional: bool) -> list[str]:
    """Everything wrong with this rank's saved window that it can see alone."""
    key = spec.key
    n = int(win.ids.numel())
    lo, hi = spec.windows[rank], spec.windows[rank + 1]
    if win.ids.dtype != torch.int64 or win.slots.dtype != torch.int64:
        return [problem(key, rank, f"ids and slots must be int64, got {win.ids.dtype}, {win.slots.dtype}")]
    if win.start != lo or n != hi - lo:
        return [problem(key, rank, f"window holds [{win.start}, {win.start + n}), plan says [{lo}, {hi})")]
    loaded = [(name, col) for name, col in win.rows.items() if isinstance(col, torch.Tensor)]
    out = [problem(key, rank, f"column {name!r} has {col.shape[0]} rows, window has {n}")
           for name, col in [("slots", win.slots), *win.metadata.items(), *loaded]
           if col.shape[0] != n]
    if out or n == 0:
        return out
    if spec.score is not None and spec.score not in win.metadata:
        out.append(problem(key, rank, f"eviction score column {spec.score!r} not in metadata "
                                      f"{sorted(win.metadata)}"))
    for chunk in range(spec.saved.world_size):  # the saved ranks this window overlaps
        c_lo, c_hi = spec.saved.start(chunk), spec.saved.end(chunk)
        a, b = max(lo, c_lo), min(hi, c_hi)
        if a < b:
            out += _segment_problems(key, rank, chunk, c_lo, c_hi, a, win.ids[a - lo:b - lo],
                                     win.slots[a - lo:b - lo], positional)
    real = win.ids != MISS_ID
    owners = spec.ownership.owner(win.ids[real], world)
    wrong = (owners < 0) | (owners >= world)
    if bool(wrong.any()):
        out.append(problem(key, rank, f"ownership rule sends id {int(win.ids[real][wrong][0])} to rank "
                                      f"{int(owners[wrong][0])}, outside [0, {world})"))
    return out


def window_problems(win: SavedWindow, spec: ReshardSpec, rank: int, world: int,
                    out_rows: Mapping[str, torch.Tensor] | None = None, group: Any = None,
                    positional: bool = False) -> list[str]:
    """All checks of a saved window before anything moves (``positional``: for a load that
    keeps the saved positions as they are); a crash in a check is a problem too, not a hang.
    Collective (the cross-window sortedness check gathers window edges)."""
    try:
        out = _spec_problems(spec, rank, world) or _window_problems(win, spec, rank, world, positional)
        size = spec.target.size(rank) if spec.target.world_size == world else 0
        for name, base in (out_rows or {}).items():
            like = win.rows.get(name)
            if isinstance(like, torch.Tensor) and (base.shape[0] != size or base.shape[1:] != like.shape[1:]
                                                   or base.dtype != like.dtype):
                out.append(problem(spec.key, rank, f"output rows {name!r} are {tuple(base.shape)} "
                                                   f"{base.dtype}, need {size} rows like the saved ones"))
    except Exception as exc:  # noqa: BLE001 - reported on every rank by check_problems()
        out = [problem(spec.key, rank, f"validation failed: {type(exc).__name__}: {exc}")]
    return out + (_skip_edges(group) if out else _edge_problems(win, spec, rank, group))


def _skip_edges(group: Any) -> list[str]:
    """Take part in the edge gather without a window to report on (ranks stay in step)."""
    agreement.gather(None, group)
    return []


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


def _to_holders(win: SavedWindow, spec: ReshardSpec, meta_names: list[str], rank: int,
                group: Any) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Phase A: every real entry to the rank whose window holds its row. Returns, on the
    holder, the local row index, the id and the metadata of every entry it now holds, in
    increasing row order (so the later row gathers stream through memory)."""
    real = (win.ids != MISS_ID).nonzero().squeeze(1)
    slots = win.slots.index_select(0, real)
    holder = torch.searchsorted(torch.tensor(spec.windows[1:-1]), slots, right=True)
    got = send_rows([win.slots, win.ids, *(win.metadata[m] for m in meta_names)], holder, real, group)
    del real, slots, holder
    old, ids, *meta = got.columns
    del got
    local = old - win.start
    del old
    n = int(win.ids.numel())
    uses = torch.bincount(local, minlength=n)
    twice = uses > 1
    check_problems(spec.key, [problem(spec.key, rank, f"saved slot {win.start + int(twice.nonzero()[0])} "
                                                      f"is mapped from {int(uses.max())} ids")]
                   if bool(twice.any()) else [], group)
    del uses, twice
    entry_of_row = torch.full((n,), -1, dtype=torch.int64)
    entry_of_row[local] = torch.arange(int(local.numel()))
    rows_held = (entry_of_row >= 0).nonzero().squeeze(1)
    entries = entry_of_row.index_select(0, rows_held)
    return rows_held, ids.index_select(0, entries), [m.index_select(0, entries) for m in meta]


def reshard(win: SavedWindow, spec: ReshardSpec, *, out_rows: Mapping[str, torch.Tensor] | None = None,
            out_table: TableShard | None = None, group: Any = None) -> ReshardResult:
    """Move this rank's saved window to the value owners; return this rank's new table and rows.

    Collective over ``group``. ``out_rows`` (this rank's new ``[size, ...]`` row tensors, e.g.
    the live local embedding) and ``out_table`` (its id, slot and metadata buffers) are written
    in place, only after every check passed on every rank; slots no id takes keep their rows.
    Without them, new tensors are returned. Raises :class:`ReshardError` on every rank if any
    rank finds a problem.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    key = spec.key
    require_same(key, "the reshard spec and column names",
                 (spec, sorted(win.metadata), sorted(win.rows)), group)
    check_problems(key, window_problems(win, spec, rank, world, out_rows, group), group)
    meta_names = sorted(win.metadata)
    row_names = sorted(win.rows)

    # Phase A: entries to the holders of their rows.
    rows_held, ids, meta = _to_holders(win, spec, meta_names, rank, group)

    # Phase B1: ids and metadata to the owners, plus each new rank's miss row (id MISS_ID)
    # from the rank holding the saved miss slot of saved rank (j mod N).
    lo, hi = spec.windows[rank], spec.windows[rank + 1]
    miss_to = [j for j in range(world) if lo <= spec.saved.miss_slot(j % spec.saved.world_size) < hi]
    miss_rows = torch.tensor([spec.saved.miss_slot(j % spec.saved.world_size) - lo for j in miss_to],
                             dtype=torch.int64)
    dest = torch.cat([spec.ownership.owner(ids, world), torch.tensor(miss_to, dtype=torch.int64)])
    row_index = torch.cat([rows_held, miss_rows])
    ids = torch.cat([ids, torch.full((len(miss_to),), MISS_ID, dtype=torch.int64)])
    meta = [torch.cat([m, m.new_zeros((len(miss_to), *m.shape[1:]))]) for m in meta]
    got = send_rows([ids, *meta], dest, group=group)
    send_counts, recv_counts = got.send_counts, got.counts
    row_index = row_index.index_select(0, got.order)
    a_ids, *a_meta = got.columns
    del ids, meta, rows_held, dest, got

    # The owner's decisions: duplicates, what fits, which slot each arriving row gets.
    is_miss = a_ids == MISS_ID
    real = (~is_miss).nonzero().squeeze(1)
    order = real.index_select(0, torch.sort(a_ids.index_select(0, real), stable=True).indices)
    ids = a_ids.index_select(0, order)
    dup = ids[1:] == ids[:-1]
    check_problems(key, [problem(key, rank, f"id {int(ids[1:][dup][0])} appears {int(dup.sum()) + 1}+ "
                                            "times in the saved table")] if bool(dup.any()) else [], group)
    start, size = spec.target.start(rank), spec.target.size(rank)
    scores = a_meta[meta_names.index(spec.score)].index_select(0, order) if spec.score is not None else None
    keep = _keep_mask(ids, scores, size - 1)  # the last slot stays the miss slot
    arrived = int(a_ids.numel())
    miss_at = int(is_miss.nonzero()[0])  # exactly one: windows tile the saved table
    evicting = not bool(keep.all())
    # Slot (local) of each arriving row: its arrival index; the miss row swaps with whatever
    # arrived at the miss slot. With eviction, kept rows are compacted to the front instead.
    slot_of_arrival = torch.arange(arrived)
    if evicting:
        kept_arrivals = order[keep]
        slot_of_arrival = torch.full((arrived,), -1, dtype=torch.int64)
        slot_of_arrival[kept_arrivals] = torch.arange(int(kept_arrivals.numel()))
        slot_of_arrival[miss_at] = size - 1
    elif miss_at != size - 1 and arrived == size:
        slot_of_arrival[arrived - 1], slot_of_arrival[miss_at] = miss_at, size - 1
    else:
        slot_of_arrival[miss_at] = size - 1

    # The new table, before the rows move, so only what phase B2 needs stays in memory.
    table = _build_table(start, size, ids[keep], slot_of_arrival.index_select(0, order[keep]),
                         [m.index_select(0, order[keep]) for m in a_meta], meta_names, out_table)
    kept, evicted_ids = int(keep.sum()), ids[~keep]
    del a_ids, a_meta, is_miss, real, order, ids, scores, keep

    # Phase B2: the rows, one column at a time, into the output rows (checks are all done).
    rows: dict[str, torch.Tensor] = {}
    for name in row_names:
        source = win.rows.pop(name)
        col = source if isinstance(source, torch.Tensor) else source()
        out = out_rows[name] if out_rows is not None and name in out_rows else \
            col.new_zeros((size, *col.shape[1:]))
        direct = not evicting
        landing = out[:arrived] if direct else col.new_empty((arrived, *col.shape[1:]))
        send_column(col, row_index, send_counts, recv_counts, landing, group)
        del col, source
        if direct and miss_at != size - 1:  # the miss row to the miss slot (see above)
            miss_row = out[miss_at].clone()
            if arrived == size:
                out[miss_at] = out[size - 1]
            out[size - 1] = miss_row
        elif not direct:
            placed = slot_of_arrival >= 0
            out[slot_of_arrival[placed]] = landing[placed]
        del landing
        rows[name] = out

    evicted = int(evicted_ids.numel())
    totals = torch.tensor([evicted, kept], dtype=torch.int64)
    dist.all_reduce(totals, group=group)
    report = ReshardReport(key, rank, kept + evicted, kept, evicted, int(totals[0]), int(totals[1]))
    if report.evicted:
        logger.warning("reshard %s: rank %d evicted %d of %d ids (capacity %d)", key, rank,
                       report.evicted, report.received, size - 1)
    return ReshardResult(table, rows, evicted_ids, report)


def _build_table(start: int, size: int, kept_ids: torch.Tensor, kept_slots: torch.Tensor,
                 kept_meta: list[torch.Tensor], meta_names: list[str], out: TableShard | None) -> TableShard:
    """The MCH layout: kept ids (sorted) at their local slots, then the free slots in
    increasing order, which ends with the miss slot ``start + size - 1`` at the last position.
    Written into ``out``'s tensors when given."""
    k = int(kept_ids.numel())
    ids = out.ids if out is not None else torch.empty(size, dtype=torch.int64)
    ids[:k] = kept_ids
    ids[k:] = MISS_ID
    used = torch.zeros(size, dtype=torch.bool)
    used[kept_slots] = True
    slots = out.slots if out is not None else torch.empty(size, dtype=torch.int64)
    slots[:k] = kept_slots + start
    slots[k:] = (~used).nonzero().squeeze(1) + start
    metadata = {}
    for name, col in zip(meta_names, kept_meta):
        full = out.metadata[name] if out is not None else col.new_empty((size, *col.shape[1:]))
        full[:k] = col
        full[k:] = 0
        metadata[name] = full
    return TableShard(start, ids, slots, metadata)
