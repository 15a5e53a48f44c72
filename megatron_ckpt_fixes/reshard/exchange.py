"""The one data movement primitive: send rows of several columns to chosen ranks.

All columns that travel together (ids, slots, every metadata column, embedding and
optimizer rows) go in one flat buffer of machine words, so a phase costs one
``all_to_all_single`` of counts and one of payload, whatever the number of columns. The
buffer holds one block per destination rank and, inside it, each column's rows contiguously
(column-major blocks): rows are gathered straight into place with ``index_select(out=...)``
and read back with plain contiguous copies; no strided per-row copies. Only
``all_to_all_single`` with uneven splits is needed; gloo implements it on torch 2.13.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..compat.device import collective_device

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _row_bytes(column: torch.Tensor) -> int:
    return math.prod(column.shape[1:]) * column.element_size()


def word_for(columns: Sequence[torch.Tensor]) -> torch.dtype:
    """The widest word that every column's row is a whole number of (int64 for int64 ids and
    float32 rows of even width), so the buffer moves words, not bytes."""
    return next(w for w in _WORDS if all(_row_bytes(c) % w.itemsize == 0 for c in columns))


def _as_words(column: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    n = column.shape[0]
    return column.contiguous().reshape(n, math.prod(column.shape[1:])).view(torch.uint8).view(word)


def pack_blocks(columns: Sequence[torch.Tensor], order: torch.Tensor, counts: Sequence[int]
                ) -> torch.Tensor:
    """Rows ``order`` of every column, cut into consecutive blocks of ``counts`` rows, each
    block laid out column after column. Returns the flat word buffer."""
    word = word_for(columns)
    parts = [_as_words(c, word) for c in columns]
    row_words = sum(p.shape[1] for p in parts)
    out = torch.empty(int(order.numel()) * row_words, dtype=word)
    pos = first = 0
    for n in counts:
        rows = order[first:first + n]
        for part in parts:
            width = part.shape[1]
            torch.index_select(part, 0, rows, out=out[pos:pos + n * width].view(n, width))
            pos += n * width
        first += n
    return out


def unpack_blocks(flat: torch.Tensor, counts: Sequence[int], like: Sequence[torch.Tensor]
                  ) -> list[torch.Tensor]:
    """Inverse of :func:`pack_blocks`: the columns (dtype and trailing shape of ``like``) with
    the blocks' rows concatenated in block order."""
    widths = [_row_bytes(c) // flat.element_size() for c in like]
    pieces: list[list[torch.Tensor]] = [[] for _ in like]
    pos = 0
    for n in counts:
        for i, width in enumerate(widths):
            pieces[i].append(flat[pos:pos + n * width].view(n, width))
            pos += n * width
    total = sum(counts)
    return [torch.cat(p).view(torch.uint8).view(ref.dtype).reshape((total,) + tuple(ref.shape[1:]))
            for p, ref in zip(pieces, like)]


@dataclass(frozen=True)
class Received:
    """Rows that arrived, grouped by sending rank in rank order; ``sources[i]`` sent row i."""

    columns: list[torch.Tensor]
    sources: torch.Tensor


def send_rows(columns: Sequence[torch.Tensor], dest: torch.Tensor, index: torch.Tensor | None = None,
              group: Any = None) -> Received:
    """Send row ``index[i]`` (default ``i``) of every column to rank ``dest[i]``. Collective.

    Rows keep their relative order per destination (stable). Memory: one send and one
    receive buffer, nothing global.
    """
    world = dist.get_world_size(group)
    device = collective_device(group)
    if bool((dest[1:] >= dest[:-1]).all()):  # already grouped (e.g. sorted ids, block owners)
        order = index if index is not None else torch.arange(int(dest.numel()))
    else:
        order = torch.argsort(dest, stable=True)
        order = order if index is None else index.index_select(0, order)
    send_counts = torch.bincount(dest, minlength=world)
    outgoing = pack_blocks(columns, order, send_counts.tolist()).to(device)
    row_words = sum(_row_bytes(c) for c in columns) // outgoing.element_size()
    recv_counts = torch.empty_like(send_counts, device=device)
    dist.all_to_all_single(recv_counts, send_counts.to(device), group=group)
    recv = recv_counts.tolist()
    incoming = torch.empty(sum(recv) * row_words, dtype=outgoing.dtype, device=device)
    dist.all_to_all_single(incoming, outgoing, output_split_sizes=[n * row_words for n in recv],
                           input_split_sizes=[n * row_words for n in send_counts.tolist()], group=group)
    del outgoing
    sources = torch.repeat_interleave(torch.arange(world), torch.tensor(recv))
    return Received(unpack_blocks(incoming.cpu(), recv, columns), sources)
