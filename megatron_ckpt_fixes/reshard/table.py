"""Data model: slot ranges per rank, and one rank's key -> slot table in the MCH layout.

The layout is TorchRec's ``MCHManagedCollisionModule``: a rank serving global slots
``[start, end)`` keeps ``end - start`` positions. ``ids`` is sorted; real ids come first, the
rest hold ``MISS_ID`` (int64 max). ``slots[p]`` is the global slot of ``ids[p]``; over all
positions it is a permutation of ``[start, end)``. The last slot, ``end - 1``, is the miss
slot: every id that is not in the table is looked up there, so no real id may map to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from megatron_ckpt_fixes.reshard.errors import ReshardError

#: Raw id of an empty position (and of the reserved last position).
MISS_ID: int = torch.iinfo(torch.int64).max


def even_bounds(total: int, parts: int) -> tuple[int, ...]:
    """Bounds of ``total`` split into ``parts`` contiguous pieces differing by at most one
    (pieces may be empty when ``total < parts``)."""
    base, extra = divmod(total, parts)
    return tuple(r * base + min(r, extra) for r in range(parts + 1))


@dataclass(frozen=True)
class SlotRanges:
    """Contiguous global slot ranges, one per rank in rank order: rank r serves
    ``[bounds[r], bounds[r + 1])``. Uneven sizes are fine; gaps, overlaps and empty ranks are not."""

    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.bounds) < 2 or self.bounds[0] != 0:
            raise ValueError(f"slot ranges must start at 0 and cover >= 1 rank, got {self.bounds}")
        sizes = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
        if any(s < 1 for s in sizes):
            raise ValueError(f"every rank needs at least one slot (its miss slot), got sizes {sizes}")

    @classmethod
    def from_chunks(cls, key: str, chunks: Sequence[tuple[int, int]], what: str) -> "SlotRanges":
        """Build from per-rank ``(offset, size)`` chunks, in rank order.

        Raises :class:`ReshardError` naming the first gap, overlap or empty chunk: a position
        of one rank must never be read as another's.
        """
        bounds = [0]
        for rank, (offset, size) in enumerate(chunks):
            if size < 1:
                raise ReshardError(f"table {key!r}: {what} chunk of rank {rank} is empty "
                                   f"(offset {offset}); each rank needs its miss slot")
            if offset != bounds[-1]:
                kind = "gap" if offset > bounds[-1] else "overlap"
                raise ReshardError(
                    f"table {key!r}: {what} has a {kind} at rank {rank}: its chunk starts at "
                    f"{offset}, the previous rank ends at {bounds[-1]}")
            bounds.append(offset + size)
        return cls(tuple(bounds))

    @classmethod
    def even(cls, total: int, world_size: int) -> "SlotRanges":
        """``total`` split into ``world_size`` contiguous ranges differing by at most one."""
        return cls(even_bounds(total, world_size))

    @property
    def world_size(self) -> int:
        return len(self.bounds) - 1

    @property
    def total(self) -> int:
        return self.bounds[-1]

    def start(self, rank: int) -> int:
        return self.bounds[rank]

    def end(self, rank: int) -> int:
        return self.bounds[rank + 1]

    def size(self, rank: int) -> int:
        return self.bounds[rank + 1] - self.bounds[rank]

    def miss_slot(self, rank: int) -> int:
        return self.bounds[rank + 1] - 1


@dataclass(frozen=True)
class TableShard:
    """One rank's table: the MCH buffers as plain tensors (see the module docstring)."""

    start: int
    ids: torch.Tensor
    slots: torch.Tensor
    metadata: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @property
    def miss_slot(self) -> int:
        return self.start + self.size - 1

    def lookup(self, query: torch.Tensor) -> torch.Tensor:
        """Global slot of each raw id, exactly as TorchRec's ``_mch_remap`` computes it."""
        pos = torch.searchsorted(self.ids[:-1], query)
        found = self.ids[pos] == query
        return torch.where(found, self.slots[pos], torch.full_like(query, self.miss_slot))

    def problems(self, key: str, rank: int) -> list[str]:
        """Every way this shard breaks the layout; empty when it is valid."""
        out: list[str] = []
        where = f"table {key!r}, rank {rank}"
        n = self.size
        if n < 1:
            return [f"{where}: empty table (the miss position is missing)"]
        for name, col in self.metadata.items():
            if col.shape[0] != n:
                out.append(f"{where}: metadata {name!r} has {col.shape[0]} rows, table has {n}")
        if bool((self.ids[1:] < self.ids[:-1]).any()):
            out.append(f"{where}: ids are not sorted")
        if int(self.ids[-1]) != MISS_ID:
            out.append(f"{where}: last position holds id {int(self.ids[-1])}, not the miss id")
        end = self.start + n
        bad = (self.slots < self.start) | (self.slots >= end)
        if bool(bad.any()):
            out.append(f"{where}: {int(bad.sum())} slots outside [{self.start}, {end}), e.g. "
                       f"{int(self.slots[bad][0])}")
        elif bool((torch.bincount(self.slots - self.start, minlength=n) > 1).any()):
            out.append(f"{where}: duplicate slots")
        real = self.ids != MISS_ID
        if bool((self.slots[real] == self.miss_slot).any()):
            out.append(f"{where}: a real id maps to the reserved miss slot {self.miss_slot}")
        real_ids = self.ids[real]
        if bool((real_ids[1:] == real_ids[:-1]).any()):
            out.append(f"{where}: duplicate ids")
        return out
