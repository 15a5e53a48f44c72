"""A read window: the saved positions one rank reads, and what they must satisfy.

Each rank reads the ids, saved slots and metadata of whole saved ranks
(:func:`read_windows`), so every check of a saved rank's positions runs on one rank and is
exact whatever the world size that reads the checkpoint: slots in range and each used once,
ids sorted and unique with the real ones first, the last position and the miss slot kept
free. The checks are rank-local; :mod:`.errors` agrees on their outcome. A window that
passes also says where its entries go (:mod:`.routing`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from megatron_ckpt_fixes.reshard.errors import problem
from megatron_ckpt_fixes.reshard.ownership import BlockOwnership, KeyOwnership
from megatron_ckpt_fixes.reshard.routing import Route, route
from megatron_ckpt_fixes.reshard.saved_rows import SavedRows
from megatron_ckpt_fixes.reshard.table import MISS_ID, SlotRanges


@dataclass(frozen=True)
class SavedWindow:
    """Saved positions ``[start, start + n)`` of a table: ids, their saved (global) slots and
    metadata columns. The rows live in :class:`~.saved_rows.SavedRows`."""

    start: int
    ids: torch.Tensor
    slots: torch.Tensor
    metadata: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ReshardSpec:
    """Everything every rank must agree on before data moves.

    ``saved``: slot ranges at save time (from the checkpoint's metadata). ``target``: slot
    ranges of the current ranks. ``windows``: bounds of the saved range each current rank read
    (may be empty), at saved ranks' bounds (:func:`read_windows`). ``score``: metadata column deciding eviction, lowest first (``None``: by id,
    highest first).
    """

    key: str
    saved: SlotRanges
    target: SlotRanges
    windows: tuple[int, ...]
    ownership: KeyOwnership = BlockOwnership()
    score: str | None = None


def read_windows(saved: SlotRanges, world: int) -> tuple[int, ...]:
    """The saved positions each of ``world`` ranks reads: whole saved ranks only, saved rank c
    to rank ``c * world // N`` (contiguous, spread evenly; with the same layout rank r
    reads saved rank r). Every check of a saved rank's positions then runs on one rank and
    is exact (sortedness, each slot once), whatever the world size that reads it."""
    n = saved.world_size
    return tuple(saved.bounds[sum(1 for c in range(n) if c * world // n < r)] for r in range(world + 1))


def _spec_problems(spec: ReshardSpec, rank: int, world_size: int) -> list[str]:
    """Shape errors of a spec: every rank finds the same ones (the spec is agreed)."""
    out = []
    w = spec.windows
    if spec.target.world_size != world_size:
        out.append(f"target has {spec.target.world_size} ranges for {world_size} ranks")
    if len(w) != world_size + 1 or w[0] != 0 or w[-1] != spec.saved.total or any(
            b < a for a, b in zip(w, w[1:])):
        out.append(f"read windows {w} do not tile the saved table [0, {spec.saved.total})")
    elif not set(w) <= set(spec.saved.bounds):
        out.append(f"read windows {w} cut a saved rank's positions (saved bounds {spec.saved.bounds})")
    return [problem(spec.key, rank, cause) for cause in out]


def _saved_rank_problems(key: str, rank: int, chunk: int, c_lo: int, ids: torch.Tensor,
                         slots: torch.Tensor) -> tuple[list[str], int]:
    """Checks of the positions of saved rank ``chunk`` (serving ``[c_lo, c_lo + n)``): every
    slot in range and used once, ids sorted and unique, real ids first, the last position
    and the miss slot kept free. Returns the problems and the number of real ids.

    A valid saved rank is checked in a few passes without temporaries of its size: sorted
    ids put the real ones in a prefix. Only a failed check looks further, for the message.
    """
    n = int(ids.numel())
    c_hi = c_lo + n
    where = f"saved rank {chunk} (slots [{c_lo}, {c_hi}))"
    k = int(torch.searchsorted(ids, MISS_ID))  # where the misses start if the ids are sorted
    well_formed = (k < n and (k == 0 or int(ids[k - 1]) != MISS_ID) and bool((ids[k:] == MISS_ID).all())
                   and (k < 2 or bool((ids[1:k] > ids[:k - 1]).all())))
    out = [] if well_formed else _ids_problems(key, rank, where, c_lo, ids)
    low, high = (int(v) for v in torch.aminmax(slots))
    if low < c_lo or high >= c_hi:
        bad = (slots < c_lo) | (slots >= c_hi)
        i = int(bad.nonzero()[0])
        out.append(problem(key, rank, f"{int(bad.sum())} out-of-range slots in {where}, e.g. id "
                                      f"{int(ids[i])} at position {c_lo + i} maps to slot {int(slots[i])}"))
    else:  # n slots in a range of n: all distinct iff every one is hit (a mask, not counts)
        local = slots - c_lo
        hit = torch.zeros(n, dtype=torch.bool)
        hit[local] = True
        if not bool(hit.all()):
            uses = torch.bincount(local, minlength=n)
            out.append(problem(key, rank, f"saved slot {c_lo + int(uses.argmax())} of {where} is mapped "
                                          f"from {int(uses.max())} positions"))
    taken = (slots[:k] == c_hi - 1) if well_formed else (ids != MISS_ID) & (slots == c_hi - 1)
    if bool(taken.any()):
        out.append(problem(key, rank, f"id {int(ids[:taken.numel()][taken][0])} holds the reserved miss "
                                      f"slot {c_hi - 1} of {where}"))
    return out, k


def _ids_problems(key: str, rank: int, where: str, c_lo: int, ids: torch.Tensor) -> list[str]:
    """What is wrong with the ids of a saved rank that failed the quick check."""
    out = []
    real = ids != MISS_ID
    if bool(real[-1]):
        out.append(problem(key, rank, f"the reserved last position {c_lo + ids.numel() - 1} of {where} holds "
                                      f"id {int(ids[-1])}, not the miss id"))
    unsorted = ids[1:] < ids[:-1]
    if bool(unsorted.any()):
        out.append(problem(key, rank, f"ids of {where} are not sorted at position "
                                      f"{c_lo + int(unsorted.nonzero()[0]) + 1}"))
    twice = real[1:] & (ids[1:] == ids[:-1])
    if bool(twice.any()):
        out.append(problem(key, rank, f"id {int(ids[1:][twice][0])} appears twice in {where}"))
    return out


def _window_problems(win: SavedWindow, spec: ReshardSpec, rank: int, world: int, metadata_names: Sequence[str]
                     ) -> tuple[list[str], Route | None]:
    """Everything wrong with this rank's saved window, and where its real entries are and
    who serves them (``None`` when the window is unusable)."""
    key = spec.key
    n = int(win.ids.numel())
    lo, hi = spec.windows[rank], spec.windows[rank + 1]
    if win.ids.dtype != torch.int64 or win.slots.dtype != torch.int64:
        return [problem(key, rank, f"ids and slots must be int64, got {win.ids.dtype}, {win.slots.dtype}")], None
    if win.start != lo or n != hi - lo:
        return [problem(key, rank, f"window holds [{win.start}, {win.start + n}), plan says [{lo}, {hi})")], None
    out = [problem(key, rank, f"column {name!r} has {col.shape[0]} rows, window has {n}")
           for name, col in [("slots", win.slots), *win.metadata.items()] if col.shape[0] != n]
    if out:
        return out, None
    if spec.score is not None and spec.score not in metadata_names:
        out.append(problem(key, rank, f"eviction score column {spec.score!r} not in metadata "
                                      f"{sorted(metadata_names)}"))
    prefixes = []
    for chunk in range(spec.saved.world_size):  # the saved ranks this window holds
        c_lo, c_hi = spec.saved.start(chunk), spec.saved.end(chunk)
        if lo <= c_lo and c_hi <= hi:
            found, k = _saved_rank_problems(key, rank, chunk, c_lo, win.ids[c_lo - lo:c_hi - lo],
                                            win.slots[c_lo - lo:c_hi - lo])
            out += found
            prefixes.append((c_lo - lo, k))
    if out:
        return out, None
    sent = route(win.ids, prefixes, spec.ownership, world)
    if sent.dest is not None:
        wrong = (sent.dest < 0) | (sent.dest >= world)
        if bool(wrong.any()):
            out.append(problem(key, rank, f"ownership rule sends id {int(sent.take(win.ids)[wrong][0])} to "
                                          f"rank {int(sent.dest[wrong][0])}, outside [0, {world})"))
    return out, sent


def _rows_problems(spec: ReshardSpec, rank: int, world: int, rows: SavedRows,
                   out_rows: Mapping[str, torch.Tensor]) -> list[str]:
    """Each output row tensor must have this rank's target size and the saved rows' format."""
    out = []
    size = spec.target.size(rank) if spec.target.world_size == world else 0
    for name, base in out_rows.items():
        dtype, shape = rows.row_format(name)
        if base.shape[0] != size or tuple(base.shape[1:]) != shape or base.dtype != dtype:
            out.append(problem(spec.key, rank, f"output rows {name!r} are {tuple(base.shape)} {base.dtype}, "
                                               f"need {size} rows of {shape} {dtype} like the saved ones"))
    return out


def window_problems(win: SavedWindow, spec: ReshardSpec, rank: int, world: int,
                    rows: SavedRows | None = None, out_rows: Mapping[str, torch.Tensor] | None = None,
                    metadata_names: Sequence[str] | None = None) -> tuple[list[str], Route | None]:
    """All checks of a saved window before anything moves, and where its real entries are
    and who serves them (see :func:`_window_problems`). ``metadata_names``: the table's
    metadata columns when the window does not hold them (they are read elsewhere; default:
    the window's). Rank-local; a crash in a check is a problem too, to be agreed
    (:func:`~.errors.check_problems`), not a hang."""
    real = None
    try:
        out = _spec_problems(spec, rank, world)
        if not out:
            names = sorted(win.metadata) if metadata_names is None else metadata_names
            out, real = _window_problems(win, spec, rank, world, names)
        if rows is not None and out_rows is not None:
            out += _rows_problems(spec, rank, world, rows, out_rows)
    except Exception as exc:  # noqa: BLE001 - reported on every rank by check_problems()
        out = [problem(spec.key, rank, f"validation failed: {type(exc).__name__}: {exc}")]
    return out, real
