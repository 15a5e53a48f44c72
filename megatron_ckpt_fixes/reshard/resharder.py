"""Value-aware resharding of a key -> slot table from N to M ranks.

Why by value: a lookup searches only the table of the rank that owns the raw id
(:mod:`.ownership`). So an entry must go to its id's owner, and there get a new slot in that
rank's range; its embedding and optimizer rows must follow it to the new slot. Routing by the
old slot (the upstream fix, :mod:`.upstream`) puts entries where no lookup will look.

Input per rank: a :class:`SavedWindow`, a contiguous range of the saved global positions
(and the rows of the same range of saved slots), read by DCP so that the windows of all ranks
tile the saved table. No rank reads more than its window. Three phases, each one
``all_to_all`` of packed rows (:mod:`.exchange`), each preceded by an agreement so that a
problem found on one rank is raised on all:

1. entries (id, old slot, metadata) go to the owner of their id;
2. each owner keeps what fits (evicting the lowest scores), assigns new slots and asks the
   rank holding each old slot's rows for them (old slot, new slot);
3. the row holders send the rows back in the order they were asked, so each requester
   knows the new slot of every row that arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import check_problems, problem, require_same
from .exchange import send_rows
from .ownership import BlockOwnership, KeyOwnership
from .table import MISS_ID, SlotRanges, TableShard

logger = logging.getLogger(__name__)

_ENTRY, _MISS_ROW = 0, 1  # kinds of row requests in phase 2


@dataclass(frozen=True)
class SavedWindow:
    """Saved positions ``[start, start + n)`` of a table and the rows of saved slots
    ``[start, start + n)`` (same range: in the MCH layout a rank's positions and slots coincide)."""

    start: int
    ids: torch.Tensor
    slots: torch.Tensor
    metadata: Mapping[str, torch.Tensor] = field(default_factory=dict)
    rows: Mapping[str, torch.Tensor] = field(default_factory=dict)


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


def _window_problems(win: SavedWindow, spec: ReshardSpec, rank: int, world: int) -> list[str]:
    """Everything wrong with this rank's saved window, checked before it is sent anywhere."""
    key = spec.key
    n = int(win.ids.numel())
    lo, hi = spec.windows[rank], spec.windows[rank + 1]
    if win.ids.dtype != torch.int64 or win.slots.dtype != torch.int64:
        return [problem(key, rank, f"ids and slots must be int64, got {win.ids.dtype}, {win.slots.dtype}")]
    if win.start != lo or n != hi - lo:
        return [problem(key, rank, f"window holds [{win.start}, {win.start + n}), plan says [{lo}, {hi})")]
    out = [problem(key, rank, f"column {name!r} has {col.shape[0]} rows, window has {n}")
           for name, col in [("slots", win.slots), *win.metadata.items(), *win.rows.items()]
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
                                     win.slots[a - lo:b - lo])
    real = win.ids != MISS_ID
    owners = spec.ownership.owner(win.ids[real], world)
    wrong = (owners < 0) | (owners >= world)
    if bool(wrong.any()):
        out.append(problem(key, rank, f"ownership rule sends id {int(win.ids[real][wrong][0])} to rank "
                                      f"{int(owners[wrong][0])}, outside [0, {world})"))
    return out


def _segment_problems(key: str, rank: int, chunk: int, c_lo: int, c_hi: int, first: int,
                      ids: torch.Tensor, slots: torch.Tensor) -> list[str]:
    """Checks of saved positions ``first ...`` of saved rank ``chunk`` (serving
    ``[c_lo, c_hi)``): slots in range, the miss slot and the last position kept free, sorted."""
    out = []
    real = ids != MISS_ID
    where = f"saved rank {chunk} (slots [{c_lo}, {c_hi}))"
    bad = real & ((slots < c_lo) | (slots >= c_hi))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        out.append(problem(key, rank, f"{int(bad.sum())} out-of-range slots in {where}, e.g. id "
                                      f"{int(ids[i])} at position {first + i} maps to slot {int(slots[i])}"))
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
    return out


def _local_problems(win: SavedWindow, spec: ReshardSpec, out_rows: Mapping[str, torch.Tensor] | None,
                    rank: int, world: int) -> list[str]:
    """All checks before the first exchange; a crash in a check is a problem too, not a hang."""
    try:
        out = _spec_problems(spec, rank, world) or _window_problems(win, spec, rank, world)
        if out:
            return out
        size = spec.target.size(rank)
        for name, base in (out_rows or {}).items():
            if name in win.rows and (base.shape[0] != size or base.shape[1:] != win.rows[name].shape[1:]
                                     or base.dtype != win.rows[name].dtype):
                out.append(problem(spec.key, rank, f"output rows {name!r} are {tuple(base.shape)} "
                                                   f"{base.dtype}, need {size} rows like the saved ones"))
        return out
    except Exception as exc:  # noqa: BLE001 - reported on every rank by check_problems()
        return [problem(spec.key, rank, f"validation failed: {type(exc).__name__}: {exc}")]


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


def reshard(win: SavedWindow, spec: ReshardSpec, *, out_rows: Mapping[str, torch.Tensor] | None = None,
            group: Any = None) -> ReshardResult:
    """Move this rank's saved window to the value owners; return this rank's new table and rows.

    Collective over ``group``. ``out_rows`` (this rank's new ``[size, ...]`` row tensors, e.g.
    the freshly initialised local embedding) are written in place; slots no id takes keep
    their values. Without them, new zero tensors are returned. Raises :class:`ReshardError`
    on every rank if any rank finds a problem.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    key = spec.key
    require_same(key, "the reshard spec and column names",
                (spec, sorted(win.metadata), sorted(win.rows)), group)
    check_problems(key, _local_problems(win, spec, out_rows, rank, world), group)

    # Phase 1: entries to the owner of their id.
    real = (win.ids != MISS_ID).nonzero().squeeze(1)
    meta_names = sorted(win.metadata)
    columns = [win.ids, win.slots, *(win.metadata[m] for m in meta_names)]
    got = send_rows(columns, spec.ownership.owner(win.ids[real], world), real, group)
    if bool((got.columns[0][1:] >= got.columns[0][:-1]).all()):  # runs arrived in order
        ids, old_slots, *meta = got.columns
    else:
        order = torch.argsort(got.columns[0], stable=True)
        ids, old_slots, *meta = (c.index_select(0, order) for c in got.columns)
    del got
    dup = ids[1:] == ids[:-1]
    check_problems(key, [problem(key, rank, f"id {int(ids[1:][dup][0])} appears {int(dup.sum()) + 1}+ times "
                                   "in the saved table")] if bool(dup.any()) else [], group)

    # Phase 2: keep what fits, give new slots, ask the row holders.
    start, size = spec.target.start(rank), spec.target.size(rank)
    scores = meta[meta_names.index(spec.score)] if spec.score is not None else None
    keep = _keep_mask(ids, scores, size - 1)  # the last slot stays the miss slot
    kept = int(keep.sum())
    new_slots = torch.full_like(ids, -1)
    new_slots[keep] = start + torch.arange(kept)
    miss_row = spec.saved.miss_slot(rank % spec.saved.world_size)
    # Evicted entries still ask (new slot -1, no row comes back), so the holder sees every
    # use of a saved slot and finds duplicates; the extra request fetches the miss row.
    req_old = torch.cat([old_slots, torch.tensor([miss_row])])
    req_new = torch.cat([new_slots, torch.tensor([spec.target.miss_slot(rank)])])
    req_kind = torch.cat([torch.full_like(ids, _ENTRY), torch.tensor([_MISS_ROW])])
    holder = torch.searchsorted(torch.tensor(spec.windows[1:-1]), req_old, right=True)
    asked = send_rows([req_old, req_new, req_kind], holder, group=group)
    a_old, a_new, a_kind = asked.columns
    uses = torch.bincount(a_old[a_kind == _ENTRY] - win.start, minlength=int(win.ids.numel()))
    check_problems(key, [problem(key, rank, f"saved slot {win.start + int(uses.argmax())} is mapped from "
                                   f"{int(uses.max())} ids")] if bool((uses > 1).any()) else [], group)
    del uses

    # Phase 3: rows back to their new slots, written straight into the output rows. A holder
    # answers each requester in the order it asked (stable sorts on both sides), so the new
    # slot of every arriving row is known here and does not travel.
    wanted = (a_new >= 0).nonzero().squeeze(1)
    row_names = sorted(win.rows)
    rows: dict[str, torch.Tensor] = {}
    if row_names:  # agreed: the column names are part of the agreed plan
        back = send_rows([win.rows[r] for r in row_names], asked.sources.index_select(0, wanted),
                         a_old.index_select(0, wanted) - win.start, group)
        del asked, a_old, a_new, a_kind
        arrival = req_new.index_select(0, torch.argsort(holder, stable=True))
        targets = arrival[arrival >= 0] - start
        for name, values in zip(row_names, back.columns):
            out = out_rows[name] if out_rows is not None and name in out_rows else \
                values.new_zeros((size,) + tuple(values.shape[1:]))
            out[targets] = values
            rows[name] = out

    table = _build_table(start, size, ids[keep], [m[keep] for m in meta], meta_names)
    totals = torch.tensor([int((~keep).sum()), kept], dtype=torch.int64)
    dist.all_reduce(totals, group=group)
    report = ReshardReport(key, rank, int(ids.numel()), kept, int((~keep).sum()),
                           int(totals[0]), int(totals[1]))
    if report.evicted:
        logger.warning("reshard %s: rank %d evicted %d of %d ids (capacity %d)", key, rank,
                       report.evicted, report.received, size - 1)
    return ReshardResult(table, rows, ids[~keep], report)


def _build_table(start: int, size: int, kept_ids: torch.Tensor, kept_meta: list[torch.Tensor],
                 meta_names: list[str]) -> TableShard:
    """The MCH layout: kept ids (sorted) at slots ``start + i``, then the free slots in order,
    which ends with the miss slot ``start + size - 1`` at the last position."""
    k = int(kept_ids.numel())
    ids = torch.full((size,), MISS_ID, dtype=torch.int64)
    ids[:k] = kept_ids
    slots = torch.arange(start, start + size, dtype=torch.int64)
    metadata = {}
    for name, col in zip(meta_names, kept_meta):
        full = col.new_zeros((size,) + tuple(col.shape[1:]))
        full[:k] = col
        metadata[name] = full
    return TableShard(start, ids, slots, metadata)
