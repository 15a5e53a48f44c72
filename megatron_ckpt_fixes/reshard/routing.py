"""Where the real entries of a read window go, and in which order they leave.

A read window holds whole saved ranks, and a valid saved rank keeps its real ids sorted in a
prefix of its positions (checked before routing). When the ownership routes by contiguous
id ranges (:class:`~.ownership.RangeOwnership`: TorchRec's row-wise bucketization,
``BlockOwnership``), the ids of a prefix that go to one rank are one contiguous part of it:
a binary search per rank finds each part, nothing is computed per id, and the parts are
already grouped by destination, as ``all_to_all`` wants them; and since each part is one run
of a saved rank's positions, the rank it goes to can read it from the checkpoint itself
(:attr:`Route.cuts`), with no exchange at all. Otherwise the owner of every id is computed
and the exchange groups the entries (:func:`~.exchange.send_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_ckpt_fixes.reshard.ownership import KeyOwnership, RangeOwnership


@dataclass(frozen=True)
class Route:
    """The real entries of a window in sending order: the window's positions ``span`` (one
    saved rank, grouped already: nothing to copy) or ``parts`` (``(start, end)`` runs of
    positions, :attr:`index`); then either ``counts`` per destination rank (grouped already)
    or ``dest`` per entry (to be grouped). With range routing, ``cuts``
    holds, per saved rank of the window in order, the window positions where each rank's
    part starts and the last one ends (``world + 1`` each)."""

    span: slice | None
    parts: tuple[tuple[int, int], ...] | None
    counts: list[int] | None
    dest: torch.Tensor | None
    cuts: tuple[tuple[int, ...], ...] | None = None

    @property
    def index(self) -> torch.Tensor | None:
        """The window positions in sending order (``None`` for a ``span``); built on demand,
        as a rank that reads its entries itself never needs it."""
        return None if self.parts is None else _positions(self.parts)

    def take(self, column: torch.Tensor) -> torch.Tensor:
        """The real rows of a window column in sending order (a view for a ``span``)."""
        return column[self.span] if self.span is not None else column.index_select(0, self.index)

    def elsewhere(self, rank: int) -> bool:
        """Whether some entry goes to another rank than ``rank``."""
        if self.counts is not None:
            return any(n for r, n in enumerate(self.counts) if r != rank)
        return bool((self.dest != rank).any())


def _positions(parts: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in parts] or [torch.empty(0, dtype=torch.int64)])


def _by_ranges(ids: torch.Tensor, prefixes: Sequence[tuple[int, int]], cuts: Sequence[int],
               world: int) -> Route | None:
    """The route when every prefix lies inside the cuts: its part for rank r is where the
    sorted ids fall in ``[cuts[r], cuts[r + 1])``. ``None`` when some id lies outside."""
    parts: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # per rank, window order
    bounds = torch.tensor(cuts, dtype=torch.int64)
    positions = []
    for a, k in prefixes:
        if k and not (cuts[0] <= int(ids[a]) and int(ids[a + k - 1]) < cuts[-1]):
            return None
        at = (a + torch.searchsorted(ids[a:a + k], bounds)).tolist()
        positions.append(tuple(at))
        for r in range(world):
            if at[r] < at[r + 1]:
                parts[r].append((at[r], at[r + 1]))
    order = [part for per_rank in parts for part in per_rank]
    counts = [sum(b - a for a, b in per_rank) for per_rank in parts]
    contiguous = all(order[i][1] == order[i + 1][0] for i in range(len(order) - 1))
    if len(prefixes) == 1 and contiguous:
        a, k = prefixes[0]
        return Route(slice(a, a + k), None, counts, None, tuple(positions))
    return Route(None, tuple(order), counts, None, tuple(positions))


def route(ids: torch.Tensor, prefixes: Sequence[tuple[int, int]], ownership: KeyOwnership,
          world: int) -> Route:
    """How the real ids of a window (``(offset, count)`` per saved rank, sorted) are sent."""
    cuts = ownership.cuts(world) if isinstance(ownership, RangeOwnership) else None
    found = _by_ranges(ids, prefixes, cuts, world) if cuts is not None else None
    if found is not None:
        return found
    if len(prefixes) == 1:
        a, k = prefixes[0]
        return Route(slice(a, a + k), None, None, ownership.owner(ids[a:a + k], world))
    parts = tuple((a, a + k) for a, k in prefixes)
    return Route(None, parts, None, ownership.owner(ids.index_select(0, _positions(parts)), world))
