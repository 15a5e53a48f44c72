"""Data movement: send rows of tensors to chosen ranks with ``all_to_all_single``.

Two shapes of exchange, both moving raw bytes as machine words that every backend can
exchange (int64, int32 or uint8: gloo and NCCL have no int16, so a bf16 row of odd width
travels as bytes, never as int16):

- :func:`send_rows`: small columns that travel together (ids, slots, metadata) in one flat
  buffer, one block per destination and, inside it, each column's rows contiguously; one
  ``all_to_all_single`` of counts and one of payload, whatever the number of columns.
- :func:`send_column`: one wide column (embedding rows, optimizer state) whose rows are
  gathered into a send buffer and received straight into the caller's tensor, so the big
  columns cost one send buffer at a time and no unpacking copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..compat.device import collective_device

#: Word types every backend can move (gloo and NCCL have no int16).
_WORDS = (torch.int64, torch.int32, torch.uint8)
_COUNTING_SORT_MAX_WORLD = 16


def _row_bytes(column: torch.Tensor) -> int:
    return math.prod(column.shape[1:]) * column.element_size()


def word_for(columns: Sequence[torch.Tensor]) -> torch.dtype:
    """The widest word that every column's row is a whole number of (int64 for int64 ids and
    float32 rows of even width, uint8 for a bf16 row of odd width)."""
    return next(w for w in _WORDS if all(_row_bytes(c) % w.itemsize == 0 for c in columns))


def as_words(column: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """A contiguous column as ``[rows, words]`` of ``word`` (a view when it is contiguous)."""
    n = column.shape[0]
    return column.contiguous().reshape(n, math.prod(column.shape[1:])).view(torch.uint8).view(word)


def pack_blocks(columns: Sequence[torch.Tensor], order: torch.Tensor, counts: Sequence[int]
                ) -> torch.Tensor:
    """Rows ``order`` of every column, cut into consecutive blocks of ``counts`` rows, each
    block laid out column after column. Returns the flat word buffer."""
    word = word_for(columns)
    parts = [as_words(c, word) for c in columns]
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
    """Rows that arrived, grouped by sending rank in rank order; ``counts[s]`` came from rank s.
    ``order`` and ``send_counts`` say what this rank sent (reused by :func:`send_column`)."""

    columns: list[torch.Tensor]
    counts: list[int]
    order: torch.Tensor
    send_counts: list[int]


def grouping(dest: torch.Tensor, world: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``index`` (default all) reordered so that destinations are grouped in rank order,
    keeping the given order inside each group. A counting sort (one pass per rank) for the
    usual small worlds: 3-4x faster than a stable sort of the int64 destinations."""
    if bool((dest[1:] >= dest[:-1]).all()):  # already grouped (e.g. sorted ids, block owners)
        order = torch.arange(int(dest.numel()))
    elif world <= _COUNTING_SORT_MAX_WORLD:
        order = torch.cat([(dest == r).nonzero().squeeze(1) for r in range(world)])
    else:
        order = torch.sort(dest, stable=True).indices
    return order if index is None else index.index_select(0, order)


def send_rows(columns: Sequence[torch.Tensor], dest: torch.Tensor, index: torch.Tensor | None = None,
              group: Any = None) -> Received:
    """Send row ``index[i]`` (default ``i``) of every column to rank ``dest[i]``. Collective.

    Rows keep their relative order per destination (stable). Memory: one send and one
    receive buffer, nothing global.
    """
    world = dist.get_world_size(group)
    device = collective_device(group)
    order = grouping(dest, world, index)
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
    return Received(unpack_blocks(incoming.cpu(), recv, columns), recv, order, send_counts.tolist())


def send_column(column: torch.Tensor, order: torch.Tensor, send_counts: Sequence[int],
                recv_counts: Sequence[int], out: torch.Tensor, group: Any = None) -> None:
    """Send rows ``order`` of ``column`` (blocks of ``send_counts`` rows per rank) and write the
    ``sum(recv_counts)`` rows that arrive, in rank order, into ``out`` (rows of ``column``'s
    shape and dtype). Collective; the counts are the ones an earlier exchange agreed."""
    word = word_for([column])
    width = _row_bytes(column) // word.itemsize
    device = collective_device(group)
    outgoing = torch.index_select(as_words(column, word), 0, order).reshape(-1).to(device)
    direct = out.is_contiguous() and out.device == device
    incoming = as_words(out, word).reshape(-1) if direct else \
        torch.empty(out.shape[0] * width, dtype=word, device=device)
    dist.all_to_all_single(incoming, outgoing, output_split_sizes=[n * width for n in recv_counts],
                           input_split_sizes=[n * width for n in send_counts], group=group)
    if not direct:
        out.copy_(incoming.cpu().view(torch.uint8).view(out.dtype).reshape(out.shape))
